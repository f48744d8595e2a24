"""Bad input, fuzzed, on `vllm serve` (issue 53): seeded-random requests with junk
headers and body fields against kvadmit's servers; every request must be served or
answered with a 4xx (a 400 that kvadmit gives naming the field), never a 5xx, and the
engine must live through it.

    flock /tmp/kvadmit-engine.lock python bench/fuzz_serve.py [--requests 2000] [--seed 0]

Two servers of the tiny CPU model, one after the other, each with flows, a gateway
secret (KVADMIT_GATEWAY_SECRET) and trusted_proxies (127.0.0.2, from which a quarter
of the requests come: the client binds that loopback address):

- "token-ids": --skip-tokenizer-init (token-id prompts, where kvadmit's vocabulary check
  is all that stands between a bad id and the engine), untrusted_fields auto (which
  resolves to ignore); /v1/completions only.
- "tokenizer": the model's tokenizer, untrusted_fields refuse, priority scheduling
  with queue_order priority; /v1/completions and /v1/chat/completions.

Each request (`make_request`, from its own seeded generator): half stream; small
max_tokens, now and then a junk one; a token-id or chat prompt, now and then a junk one;
junk priority; vllm_xargs with kvadmit's fields (valid values, or wrong types, huge
numbers, NaN written as the JSON token NaN, unicode, 64 KiB strings), or not an object;
the gateway headers (valid or junk), the secret (right or wrong), X-Forwarded-For,
Forwarded, X-Real-IP and X-Session-ID junk, 64 KiB and latin-1 header values, repeated
headers; a few bodies that are not JSON at all.

Checked (`check_answer`, `end_checks`): no 5xx (a status, or an error event in a
stream); every 400 that kvadmit gives (its message starts "kvadmit:") names the field;
every request answered; at the end the server process alive, /health 200 with
kvadmit's state ok, no kvadmit internal error, no request waiting, KV usage 0. A 5xx
is sent again to stock vLLM (its own scheduler, none of kvadmit's plugin or patches):
where that answers 5xx too, it is vLLM's own, kept apart (`vllm_server_errors`) and
not held against kvadmit. Saved to bench/results/fuzz_serve.json (--name): the command,
counts per status (a kvadmit refusal with its reason), every 5xx, unnamed 400 and
request without an answer, with its request."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import httpx
import kvadmit
import kvadmit_patches
from _common import save
from fuzz_requests import FIELD_NAMES, PROXY, SECRET, Request, make_request

from kvadmit.bench.serve.server import free_port, scrape_metrics
from kvadmit.request_fields import FLAT_PREFIX, KEY
from kvadmit.trust import SECRET_ENV
from kvadmit.vllm.serve import launch_command, small_engine_flags
from kvadmit.vllm.tiny_model import build_tiny_llama

FLOWS = {"gold": {"weight": 4, "max_queued_requests": 4}, "7": {"weight": 2}}
# Names a kvadmit 400 may give for what it refused (the schema's fields as a client spells
# them, and the request's own integers and prompt that kvadmit checks).
NAMEABLE = ([FLAT_PREFIX + n for n in FIELD_NAMES] + [f"{KEY}.{n}" for n in FIELD_NAMES]
            + ["priority", "max_tokens", "prompt_token_ids", "session_id", "extra_args",
               "vllm_xargs.", "prompt "])


# Stock vLLM, to tell whose a 5xx is: its own scheduler, and no vLLM plugin loaded (so
# none of kvadmit's patches: VLLM_PLUGINS allows only the plugins it names).
STOCK_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
STOCK_ENV = {"VLLM_PLUGINS": "none-kvadmit-fuzz"}


@dataclass(frozen=True)
class Setup:
    label: str
    tokenizer: bool
    routes: tuple
    config: dict
    flags: tuple = ()

    def command(self, model: str, port: int, stock: bool = False) -> list[str]:
        """Its `vllm serve`; `stock`: vLLM's own scheduler (with STOCK_ENV: nothing of
        kvadmit's loaded)."""
        return launch_command(model, port, *([] if self.tokenizer else ["--skip-tokenizer-init"]),
                              *small_engine_flags(64, 512, 8), "--seed", "0", *self.flags,
                              *(["--scheduler-cls", STOCK_SCHEDULER] if stock else
                                ["--additional-config", json.dumps({"kvadmit": self.config})]))


SETUPS = (
    Setup("token-ids", False, ("/v1/completions",),
          {"flows": FLOWS, "trusted_proxies": [PROXY], "max_queued_requests": 16}),
    Setup("tokenizer", True, ("/v1/completions", "/v1/chat/completions"),
          {"flows": FLOWS, "trusted_proxies": [PROXY], "untrusted_fields": "refuse",
           "queue_order": "priority", "max_queued_requests": 16},
          ("--scheduling-policy", "priority")),
)


# -- the checks ----------------------------------------------------------------------
def error_message(text: str) -> str:
    """The message of vLLM's error body ({"error": {"message": ...}}), else the text."""
    try:
        doc = json.loads(text)
    except ValueError:
        return text
    error = doc.get("error") if isinstance(doc, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", text))
    return str(error) if error is not None else text


def names_a_field(message: str) -> bool:
    return any(n in message for n in NAMEABLE) or "unknown kvadmit field '" in message


def check_answer(status: int, text: str, stream_codes: list) -> str | None:
    """What is wrong with one answer (None: nothing): a 5xx (its status, or an error
    event of a stream), or a 400 kvadmit gave without naming the field."""
    if status >= 500 or any(isinstance(c, int) and c >= 500 for c in stream_codes):
        return "5xx"
    message = error_message(text)
    if status == 400 and message.startswith("kvadmit:") and not names_a_field(message):
        return "kvadmit 400 naming no field"
    return None


def stream_error_code(line: str):
    """The code of a stream's error event (`data: {"error": {..., "code": 500}}`), else
    None."""
    if not line.startswith("data:") or '"error"' not in line:
        return None
    try:
        doc = json.loads(line[5:])
    except ValueError:
        return None
    error = doc.get("error") if isinstance(doc, dict) else None
    return error.get("code", "?") if isinstance(error, dict) else None


async def send(client: httpx.AsyncClient, base: str, req: Request) -> dict:
    """Sends one request; its outcome: status, whether kvadmit answered, stream error
    codes, the problem (check_answer) and the answer's start."""
    out = {"index": req.index, "status": None, "kvadmit": False, "stream_codes": [],
           "problem": None}
    try:
        async with client.stream("POST", base + req.route, headers=req.headers,
                                 content=req.body) as r:
            out["status"] = r.status_code
            if r.status_code == 200 and req.stream:
                text = ""
                async for line in r.aiter_lines():
                    code = stream_error_code(line)
                    if code is not None:
                        text = line[5:].strip()
                        out["stream_codes"].append(code)
            else:
                text = (await r.aread()).decode("utf-8", "replace")
    except httpx.LocalProtocolError as e:         # the client would not send it: not a test
        out.update(status="unsent", problem=None, answer=str(e)[:200])
        return out
    except httpx.HTTPError as e:
        out.update(status=f"no answer ({type(e).__name__})", problem="no answer",
                   answer=str(e)[:500])
        return out
    message = error_message(text)
    # kvadmit's refusal reason ("kvadmit:<reason>: ..."), False where kvadmit did not answer
    out["kvadmit"] = message.startswith("kvadmit:") and message.split(":")[1]
    out["problem"] = check_answer(r.status_code, text, out["stream_codes"])
    if out["problem"] or r.status_code != 200 or out["stream_codes"]:
        out["answer"] = text[:500]
    return out


def healthy(base: str) -> tuple[int | str, str | None]:
    """/health's status and its x-kvadmit-state header."""
    try:
        with urllib.request.urlopen(base + "/health", timeout=10) as r:
            return r.status, r.headers.get("x-kvadmit-state")
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("x-kvadmit-state")
    except OSError as e:
        return f"no answer ({type(e).__name__})", None


async def drive(base: str, requests: list[Request], concurrency: int = 8,
                every: int = 100) -> list[dict]:
    """Sends the requests, `concurrency` at a time (each from its source address);
    a progress line every `every` answers, /health checked with it: the run stops early
    if the server no longer answers 200."""
    limits = httpx.Limits(max_connections=concurrency)
    clients = {src: httpx.AsyncClient(timeout=120, limits=limits,
                                      transport=httpx.AsyncHTTPTransport(local_address=src,
                                                                         limits=limits))
               for src in {r.source for r in requests}}
    outcomes, gate, dead = [], asyncio.Semaphore(concurrency), []
    t0 = time.time()

    async def one(req):
        async with gate:
            if dead:
                return
            o = await send(clients[req.source], base, req)
            outcomes.append(o)
            if len(outcomes) % every == 0:
                health = await asyncio.to_thread(healthy, base)
                print(f"  {len(outcomes)}/{len(requests)} in {time.time() - t0:.0f} s: "
                      f"{count_statuses(outcomes)}, /health {health[0]}", flush=True)
                if health[0] != 200:
                    dead.append(health)
    try:
        await asyncio.gather(*(one(r) for r in requests))
    finally:
        for c in clients.values():
            await c.aclose()
    return sorted(outcomes, key=lambda o: o["index"])


def count_statuses(outcomes: list[dict]) -> dict:
    out: dict[str, int] = {}
    for o in outcomes:
        key = str(o["status"]) + (f" kvadmit:{o['kvadmit']}" if o["kvadmit"] else "")
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def end_checks(base: str, proc: subprocess.Popen, timeout: float = 60) -> dict:
    """At the end: the process alive, /health 200 with kvadmit's state ok, and, once
    nothing runs or waits, KV usage 0 and no kvadmit internal error."""
    deadline = time.time() + timeout
    while True:
        try:
            m = scrape_metrics(base)
        except OSError:               # no /metrics: a dead server, reported below
            m = {}
            if proc.poll() is not None:
                break
        idle = (m.get("vllm:num_requests_running", 1) == 0
                and m.get("vllm:num_requests_waiting", 1) == 0
                and m.get("kvadmit_waiting_requests", 0) == 0
                and m.get("vllm:kv_cache_usage_perc", 1) == 0)
        if idle or time.time() > deadline:
            break
        time.sleep(1)
    status, state = healthy(base)
    out = {"alive": proc.poll() is None, "health": status, "kvadmit_state": state,
           "kv_usage_at_idle": m.get("vllm:kv_cache_usage_perc"),
           "waiting_at_idle": m.get("kvadmit_waiting_requests"),
           "internal_errors": sum(v for k, v in m.items()
                                  if k.startswith("kvadmit_internal_errors_total")),
           "kvadmit_admitted": m.get("kvadmit_admitted_total"),
           "kvadmit_invalid": sum(v for k, v in m.items() if k.startswith("kvadmit_rejected_total")
                                  and 'reason="invalid"' in k)}
    out["ok"] = (out["alive"] and status == 200 and state == "ok"
                 and out["kv_usage_at_idle"] == 0 and not out["waiting_at_idle"]
                 and out["internal_errors"] == 0)
    return out


PATCHES = pathlib.Path(__file__).resolve().parents[1] / "patches"    # kvadmit_patches, editable
PREFIX = re.compile(r"^(\([^)]*pid=\d+\) )?((DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                    r"\d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] )?")


def tracebacks(log: pathlib.Path) -> list[dict]:
    """The server log's tracebacks, one row per distinct final line: how many, and the
    kvadmit files among their frames (none: vLLM's own)."""
    rows: dict[str, dict] = {}
    # vLLM's processes and logger prefix lines: "(APIServer pid=7) WARNING 12-07 13:54:56 [f.py:3] "
    lines = [PREFIX.sub("", ln) for ln in log.read_text(errors="replace").splitlines()]
    i = 0
    while i < len(lines):
        if "Traceback (most recent call last)" not in lines[i]:
            i += 1
            continue
        j, frames = i + 1, []
        while j < len(lines) and lines[j].startswith((" ", "\t")):
            if lines[j].strip().startswith("File "):
                frames.append(lines[j].strip().split('"')[1])
            j += 1
        last = lines[j].strip() if j < len(lines) else "?"
        ours = sorted({f for f in frames if "kvadmit" in f or f.startswith(str(PATCHES))})
        row = rows.setdefault(last[:300], {"exception": last[:300], "count": 0,
                                           "kvadmit_frames": ours})
        row["count"] += 1
        i = j
    return list(rows.values())


# -- a run -----------------------------------------------------------------------------
def start(setup: Setup, model: str, log: pathlib.Path, stock: bool = False,
          timeout: float = 600):
    """Starts `setup`'s server (the gateway secret in its environment; `stock`: vLLM
    alone); (its process, base URL) once /health answers."""
    port = free_port()
    env = dict(os.environ, **{SECRET_ENV: SECRET}, **(STOCK_ENV if stock else {}))
    with open(log, "w") as f:
        proc = subprocess.Popen(setup.command(model, port, stock), stdout=f,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base, deadline = f"http://127.0.0.1:{port}", time.time() + timeout
    while healthy(base)[0] != 200:
        if proc.poll() is not None or time.time() > deadline:
            stop(proc)
            raise RuntimeError(f"vllm serve ({setup.label}) did not come up; see {log}")
        time.sleep(1)
    return proc, base


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def on_stock_vllm(setup: Setup, model: str, requests: list[Request], log: pathlib.Path) -> dict:
    """Index -> outcome of each request sent again, one at a time, to stock vLLM
    (`Setup.command`): a 5xx there too is vLLM's own. /health is checked after each: once
    it fails, the rest are not sent (they stay kvadmit's)."""
    proc, base = start(setup, model, log, stock=True)
    try:
        outcomes = asyncio.run(drive(base, requests, concurrency=1, every=1))
    finally:
        stop(proc)
    return {o["index"]: o for o in outcomes}


def run_setup(setup: Setup, model: str, indices: range, seed: int, log: pathlib.Path,
              concurrency: int = 8) -> dict:
    """Requests `indices` of the run with `seed` against one fresh server of `setup`: its
    counts per status, the problems (each with its request; a 5xx also sent to stock
    vLLM, and kept apart as vLLM's when it answers 5xx too), the end checks and the
    log's tracebacks."""
    t0 = time.time()
    proc, base = start(setup, model, log)
    started = time.time() - t0
    requests = [make_request(seed, i, setup.routes, model) for i in indices]
    try:
        outcomes = asyncio.run(drive(base, requests, concurrency))
        end = end_checks(base, proc)
    finally:
        stop(proc)
    by_index = {r.index: r for r in requests}
    problems = [{**o, "request": by_index[o["index"]].record()} for o in outcomes if o["problem"]]
    errors = [p for p in problems if p["problem"] == "5xx"]
    stock = on_stock_vllm(setup, model, [by_index[p["index"]] for p in errors],
                          log.with_suffix(".stock.log")) if errors else {}
    for p in errors:
        p["stock_vllm"] = {k: stock.get(p["index"], {}).get(k)
                           for k in ("status", "stream_codes", "answer")}
    vllms = [p for p in errors if stock.get(p["index"], {}).get("problem") == "5xx"]
    return {"setup": setup.label, "config": setup.config, "flags": list(setup.flags),
            "tokenizer": setup.tokenizer, "routes": list(setup.routes),
            "requests": len(requests), "answered": len(outcomes),
            "statuses": count_statuses(outcomes),
            "streams": sum(r.stream for r in requests),
            "server_errors": [p for p in errors if p not in vllms],
            "vllm_server_errors": vllms,
            "unnamed_400s": [p for p in problems if p["problem"] == "kvadmit 400 naming no field"],
            "no_answer": [p for p in problems if p["problem"] == "no answer"],
            "end": end, "tracebacks": tracebacks(log),
            "start_s": round(started, 1), "wall_s": round(time.time() - t0, 1), "log": str(log)}


def passed(result: dict) -> bool:
    return (result["answered"] == result["requests"] and not result["server_errors"]
            and not result["unnamed_400s"] and not result["no_answer"] and result["end"]["ok"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000, help="in all, split between the servers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--name", default="fuzz_serve", help="saved as bench/results/NAME.json")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.time()
    model = str(build_tiny_llama(tempfile.mkdtemp(prefix="kvadmit-fuzz-model-")))
    logs = pathlib.Path(tempfile.mkdtemp(prefix="kvadmit-fuzz-"))
    share = args.requests // len(SETUPS)
    results = []
    for k, setup in enumerate(SETUPS):
        n = share if k < len(SETUPS) - 1 else args.requests - share * k
        print(f"{setup.label}: {n} requests (log {logs / setup.label}.log)", flush=True)
        results.append(run_setup(setup, model, range(k * share, k * share + n), args.seed,
                                 logs / f"{setup.label}.log", args.concurrency))
        r = results[-1]
        print(f"{setup.label}: {r['statuses']}; 5xx {len(r['server_errors'])} (and vLLM's own "
              f"{len(r['vllm_server_errors'])}), unnamed 400 "
              f"{len(r['unnamed_400s'])}, no answer {len(r['no_answer'])}; end {r['end']}",
              flush=True)
        for p in r["server_errors"] + r["vllm_server_errors"] + r["unnamed_400s"] + r["no_answer"]:
            owner = " (vLLM's: stock vLLM too)" if p in r["vllm_server_errors"] else ""
            print(f"  {p['problem']}{owner}: request {p['index']} ({p['request']['route']}, stream "
                  f"{p['request']['stream']}): {p['status']} {p.get('answer', '')[:300]!r}")
    totals: dict[str, int] = {}
    for r in results:
        for k, v in r["statuses"].items():
            totals[k] = totals.get(k, 0) + v
    out = {"requests": args.requests, "seed": args.seed, "concurrency": args.concurrency,
           "statuses": dict(sorted(totals.items())),
           "server_errors": sum(len(r["server_errors"]) for r in results),
           "vllm_server_errors": sum(len(r["vllm_server_errors"]) for r in results),
           "engine_deaths": sum(not (r["end"]["alive"] and r["end"]["health"] == 200)
                                for r in results),
           "passed": all(passed(r) for r in results), "wall_s": round(time.time() - t0, 1),
           # where the servers' kvadmit came from (PYTHONPATH may put another copy first)
           "kvadmit_files": [kvadmit.__file__, kvadmit_patches.__file__],
           "servers": results}
    print(f"{args.requests} requests in {out['wall_s']:.0f} s: {out['statuses']}; "
          f"5xx {out['server_errors']} (vLLM's own {out['vllm_server_errors']}), "
          f"engine deaths {out['engine_deaths']}; "
          f"{'passed' if out['passed'] else 'FAILED'}")
    if not args.no_save:
        print(f"saved {save(args.name, out)}")
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

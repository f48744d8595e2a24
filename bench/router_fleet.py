"""Three `vllm serve` instances behind vLLM's own router (vllm-router) or HAProxy,
driven past saturation with streaming and non-streaming requests.

Each setup is a fleet of identical instances (the tiny model on vLLM's CPU build,
a small KV pool) behind one front:

- `vllm-cap/*`: stock vLLM with its own `--max-num-queued-reqs`, sized by vLLM's
  documented rule (max_num_seqs + the queue depth wanted: here what one instance
  serves within the TTFT target at the measured capacity);
- `kvadmit/*`: kvadmit's default plus the one setting a user states, the TTFT
  target, as `max_queue_delay_s` = half of it (`kvadmit.bench.serve.configs.queue_delay_for`);
- `*/router-defaults`: `vllm-router` with nothing but its worker list (policy
  cache_aware, breaker on, 5 attempts 50 ms apart x1.5); kvadmit answers overload
  with its default status, 429 (vllm-router retries a 429 on another worker like a
  503 but does not count it against the worker's breaker; until issue 44 the default
  was 503, which opened the breakers: docs/router.md's recorded run);
- `*/recipe`: the documented recipe (docs/router.md): `--policy power_of_two
  --worker-startup-check-interval 1` (the router polls each worker's `GET /get_load`
  every second), kvadmit on its default 429 as well (the same instances as
  `kvadmit/router-defaults`);
- `*/haproxy`: HAProxy round robin, `retry-on 503` with redispatch; kvadmit set to
  `overload_status: 503` (HAProxy's `retry-on` cannot name 429).

Load: Poisson arrivals at `--load` times the fleet's measured capacity (a closed
loop of instances x max_num_seqs clients on stock vLLM), half of them streaming;
the requests are the Azure conversation trace's first ones, lengths scaled by 1/4
(a 2k-context model's onto the tiny model's 512 tokens), each with its real output length as max_tokens. Every
setup gets the same requests at the same times. Clients do not retry: what the
front does is what is measured.

Each request ends as served (200, complete), refused (an HTTP error status before
any output: kvadmit's or vLLM's refusal, or the router's own), or lost (anything
else a client sees: a connection error, an error inside a 200 stream, a cut
stream). Goodput: requests served within TTFT <= --ttft and TPOT <= --tpot
(non-streaming: the whole latency within ttft + tpot x (tokens - 1)), over all
requests sent. Breaker trips: vllm-router's `vllm_router_cb_state_transitions_total
{to="open"}`.

    python bench/router_fleet.py [--load 2] [--duration 40] [--out bench/results/router_fleet.json]
    python bench/router_fleet.py --show bench/results/router_fleet.json    # the Markdown table

Needs vllm-router (`pip install vllm-router==0.1.17`), haproxy (Debian) for the
HAProxy setups, and vLLM's CPU build.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from haproxy_pair import HAPROXY_CFG, free_port  # noqa: E402  (the same HAProxy recipe)
from kvadmit.simulate.run import save_json  # noqa: E402
from kvadmit.bench.serve.configs import VLLM_SCHEDULER, queue_delay_for  # noqa: E402
from kvadmit.vllm.serve import launch_command, small_engine_flags  # noqa: E402

POOL_BLOCKS = 96           # --num-gpu-blocks-override: 3,072 tokens, ~8 requests
TRACE_CONTEXT = 2048       # lengths scaled by MAX_MODEL_LEN / this: prompts ~290, outputs ~53
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 8
RECIPE_FLAGS = ("--policy", "power_of_two", "--worker-startup-check-interval", "1")


@dataclass(frozen=True)
class Setup:
    name: str
    engine: str                     # "kvadmit" or "vllm-cap"
    front: str                      # "vllm-router" or "haproxy"
    router_flags: tuple = ()
    kvadmit: dict = field(default_factory=dict)

    def server_key(self) -> str:
        return json.dumps([self.engine, self.kvadmit], sort_keys=True)


def setups(ttft_s: float, names: list[str] | None = None) -> list[Setup]:
    kv = {"max_queue_delay_s": queue_delay_for(ttft_s)}
    all_setups = [
        Setup("vllm-cap/router-defaults", "vllm-cap", "vllm-router"),
        Setup("vllm-cap/recipe", "vllm-cap", "vllm-router", RECIPE_FLAGS),
        Setup("vllm-cap/haproxy", "vllm-cap", "haproxy"),
        Setup("kvadmit/router-defaults", "kvadmit", "vllm-router", (), kv),
        Setup("kvadmit/haproxy", "kvadmit", "haproxy", (), {**kv, "overload_status": 503}),
        Setup("kvadmit/recipe", "kvadmit", "vllm-router", RECIPE_FLAGS, kv),
    ]
    if not names:
        return all_setups
    known = {s.name: s for s in all_setups}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"router_fleet: unknown setup {unknown[0]!r}; known: {', '.join(known)}")
    return [known[n] for n in names]


def serve_command(model_dir: str, port: int, setup: Setup, queued_cap: int) -> list[str]:
    engine = ["--skip-tokenizer-init", *small_engine_flags(POOL_BLOCKS, MAX_MODEL_LEN, MAX_NUM_SEQS)]
    if setup.engine == "kvadmit":
        return launch_command(model_dir, port, *engine, "--additional-config",
                              json.dumps({"kvadmit": setup.kvadmit}))
    return launch_command(model_dir, port, *engine, "--scheduler-cls", VLLM_SCHEDULER,
                          *(["--max-num-queued-reqs", str(queued_cap)] if queued_cap else []))


def wait_http(url: str, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited (rc {proc.returncode})")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            if time.time() > deadline:
                raise RuntimeError(f"{what}: no answer at {url} in {timeout:.0f} s")
            time.sleep(0.5)


class Instances:
    """N `vllm serve` instances of one setup's engine config; a context manager."""

    def __init__(self, model_dir: str, setup: Setup, n: int, queued_cap: int, workdir: str):
        self.procs, self.bases, self.logs = [], [], []
        for i in range(n):
            port = free_port()
            log = os.path.join(workdir, f"{setup.engine}-{i}.log")
            with open(log, "w") as f:
                self.procs.append(subprocess.Popen(
                    serve_command(model_dir, port, setup, queued_cap), stdout=f,
                    stderr=subprocess.STDOUT, env={k: v for k, v in os.environ.items()
                                                   if k != "PROMETHEUS_MULTIPROC_DIR"}))
            self.bases.append(f"http://127.0.0.1:{port}")
            self.logs.append(log)

    def __enter__(self):
        try:
            for base, proc, log in zip(self.bases, self.procs, self.logs):
                wait_http(base + "/health", proc, f"vllm serve (log {log})")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        stop(self.procs)


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


class Front:
    """vllm-router or HAProxy in front of `bases`; a context manager."""
    label = "the front"
    settle_s = 2.0          # vllm-router: its first /get_load poll and health checks

    def __init__(self, setup: Setup, bases: list[str], workdir: str):
        self.port = free_port()
        self.metrics_port = None
        log = open(os.path.join(workdir, f"{setup.front}.log"), "w")
        if setup.front == "vllm-router":
            self.metrics_port = free_port()
            exe = shutil.which("vllm-router") or os.path.join(os.path.dirname(sys.executable),
                                                              "vllm-router")
            cmd = [exe, "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *bases,
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
                   "--log-level", "warning", *setup.router_flags]
        else:
            servers = "\n".join(f"    server s{i} {b[len('http://'):]} check inter 1s"
                                for i, b in enumerate(bases))
            cfg = os.path.join(workdir, "haproxy.cfg")
            with open(cfg, "w") as f:
                f.write(HAPROXY_CFG.format(port=self.port, servers=servers))
            cmd = [shutil.which("haproxy") or "haproxy", "-db", "-f", cfg]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        try:
            wait_http(self.url + "/health", self.proc, self.label, 60)
            time.sleep(self.settle_s)
        except BaseException:
            stop([self.proc])
            raise
        return self

    def __exit__(self, *exc):
        stop([self.proc])

    def breaker_trips(self) -> int | None:
        if self.metrics_port is None:
            return None
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                      timeout=10).read().decode()
        return int(sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                       if ln.startswith("vllm_router_cb_state_transitions_total")
                       and 'to="open"' in ln))


def served_by_instance(bases: list[str]) -> list[int]:
    out = []
    for base in bases:
        text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        # finished with a stop or its length: not the aborts (kvadmit's refusals among them)
        out.append(int(sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                           if ln.startswith("vllm:request_success_total")
                           and ('finished_reason="length"' in ln or 'finished_reason="stop"' in ln))))
    return out


# -- the load -----------------------------------------------------------------

@dataclass
class Outcome:
    kind: str                          # served | refused | lost
    stream: bool
    status: int = 0
    detail: str = ""
    retry_after: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    tokens: int = 0


def workload(trace: str, n: int, rate: float, seed: int):
    """(arrival s, prompt ids, max_tokens, stream) for n requests, Poisson at `rate`."""
    from kvadmit.bench.vllm import azure_workload
    reqs = azure_workload(trace, n, MAX_MODEL_LEN, cap=2048, seed=seed, trace_context=TRACE_CONTEXT)
    rng = random.Random(seed)
    t, out = 0.0, []
    for i, r in enumerate(reqs):
        out.append((t, list(r.prompt_token_ids), r.output_tokens, i % 2 == 0))
        t += rng.expovariate(rate)
    return out


async def send(client, url: str, model: str, prompt, max_tokens: int, stream: bool) -> Outcome:
    import httpx
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    t0 = time.perf_counter()
    try:
        if not stream:
            r = await client.post(url + "/v1/completions", json=body)
            latency = time.perf_counter() - t0
            if r.status_code == 200:
                tokens = r.json()["usage"]["completion_tokens"]
                return Outcome("served", False, 200, latency_s=latency, tokens=tokens)
            return refused(r.status_code, r.text, r.headers, False)
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return refused(r.status_code, (await r.aread()).decode(errors="replace"),
                               r.headers, True)
            ttft, tokens, done, error = None, 0, False, None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    error = str(event["error"].get("message", event["error"]))[:160]
                    continue
                # one event per token (n = 1); the text is empty without a tokenizer
                if event.get("choices"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    tokens += 1
            latency = time.perf_counter() - t0
            if error is not None or not done:
                return Outcome("lost", True, 200, error or "stream cut", latency_s=latency)
            return Outcome("served", True, 200, ttft_s=ttft, latency_s=latency, tokens=tokens)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        return Outcome("lost", stream, 0, f"{type(e).__name__}: {e}"[:160])


def refused(status: int, text: str, headers, stream: bool) -> Outcome:
    if status in (400, 429, 503):
        try:
            message = str(json.loads(text)["error"]["message"])
        except (ValueError, KeyError, TypeError):
            message = text
        return Outcome("refused", stream, status, message[:160], headers.get("retry-after"))
    return Outcome("lost", stream, status, text[:160])


async def drive(url: str, model: str, requests, timeout: float = 300) -> list[Outcome]:
    import httpx
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = time.perf_counter()

        async def at(t, prompt, max_tokens, stream):
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            return await send(client, url, model, prompt, max_tokens, stream)

        return await asyncio.gather(*(at(*r) for r in requests))


async def closed_loop(url: str, model: str, requests, clients: int, seconds: float) -> float:
    """Requests per second a fleet completes with `clients` back-to-back clients."""
    import httpx
    done = 0
    async with httpx.AsyncClient(timeout=300) as client:
        end = time.perf_counter() + seconds
        it = iter(requests * 100)

        async def worker():
            nonlocal done
            while time.perf_counter() < end:
                _, prompt, max_tokens, _ = next(it)
                if (await send(client, url, model, prompt, max_tokens, False)).kind == "served":
                    done += 1
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return done / (time.perf_counter() - t0)


def summary(outcomes: list[Outcome], ttft_s: float, tpot_s: float) -> dict:
    def good(o: Outcome) -> bool:
        if o.kind != "served":
            return False
        if o.stream:
            tpot = (o.latency_s - o.ttft_s) / max(1, o.tokens - 1)
            return o.ttft_s <= ttft_s and tpot <= tpot_s
        return o.latency_s <= ttft_s + tpot_s * max(0, o.tokens - 1)

    refused = [o for o in outcomes if o.kind == "refused"]
    by_status: dict[str, int] = {}
    for o in refused:
        source = o.detail.split(":", 2)[1] if o.detail.startswith("kvadmit:") else "other"
        key = f"{o.status} {'kvadmit:' + source if source != 'other' else o.detail[:40]}"
        by_status[key] = by_status.get(key, 0) + 1
    ttfts = sorted(o.ttft_s for o in outcomes if o.kind == "served" and o.stream)
    return {
        "requests": len(outcomes),
        "served": sum(o.kind == "served" for o in outcomes),
        "refused": len(refused),
        "lost": sum(o.kind == "lost" for o in outcomes),
        "good": sum(good(o) for o in outcomes),
        "goodput": sum(good(o) for o in outcomes) / max(1, len(outcomes)),
        "retryable_without_retry_after": sum(o.status in (429, 503) and o.retry_after is None
                                             for o in refused),
        "refusals": dict(sorted(by_status.items())),
        "lost_examples": sorted({o.detail for o in outcomes if o.kind == "lost"})[:5],
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
    }


def run_setup(model_dir: str, setup: Setup, instances: Instances, requests, workdir: str,
              ttft_s: float, tpot_s: float) -> dict:
    before = served_by_instance(instances.bases)
    with Front(setup, instances.bases, workdir) as front:
        t0 = time.perf_counter()
        outcomes = asyncio.run(drive(front.url, model_dir, requests))
        wall = time.perf_counter() - t0
        trips = front.breaker_trips()
    time.sleep(1.0)
    after = served_by_instance(instances.bases)
    row = {"setup": setup.name, "wall_s": round(wall, 1), "breaker_trips": trips,
           "served_per_instance": [a - b for a, b in zip(after, before)],
           **summary(outcomes, ttft_s, tpot_s)}
    return row


def print_row(row: dict) -> None:
    trips = "-" if row["breaker_trips"] is None else row["breaker_trips"]
    print(f"{row['setup']:<26} served {row['served']:>4}  refused {row['refused']:>4}  "
          f"lost {row['lost']:>3}  trips {trips:>2}  goodput {row['goodput']:.2f}  "
          f"per instance {row['served_per_instance']}  ({row['wall_s']} s)", flush=True)


def markdown(out: dict) -> str:
    """The recorded rows as the Markdown table docs/router.md and the README show."""
    lines = ["| setup | served | refused (status) | lost | breaker trips | goodput | TTFT p50 / p99 (s) | served per instance |",
             "|---|---|---|---|---|---|---|---|"]
    for r in out["rows"]:
        statuses = sorted({k.split(" ", 1)[0] for k in r["refusals"]})
        trips = "-" if r["breaker_trips"] is None else r["breaker_trips"]
        ttft = (f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}" if r["ttft_p50_s"] is not None
                else "-")
        lines.append(f"| {r['setup']} | {r['served']} | {r['refused']} ({', '.join(statuses)}) | "
                     f"{r['lost']} | {trips} | {r['goodput']:.3f} | {ttft} | "
                     f"{' / '.join(map(str, r['served_per_instance']))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["--show"] and len(given) == 2:
        with open(given[1]) as f:
            print(markdown(json.load(f)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--load", type=float, default=2.0, help="offered load x measured capacity")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    ap.add_argument("--ttft", type=float, default=2.0, help="TTFT target, s")
    ap.add_argument("--tpot", type=float, default=0.1, help="TPOT target, s")
    ap.add_argument("--capacity", type=float, default=None,
                    help="the fleet's capacity in req/s (default: measured on stock vLLM)")
    ap.add_argument("--setups", nargs="*", help="setup names (default: all)")
    ap.add_argument("--trace", default="azure2023_conv",
                    help="an Azure conversation trace: a bundled name or a CSV path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default=None, help="save the rows as JSON here")
    args = ap.parse_args(argv)
    from kvadmit.vllm.tiny_model import DEFAULT_DIR, build_tiny_llama
    model_dir = str(build_tiny_llama(args.model_dir or DEFAULT_DIR))
    trace = args.trace
    chosen = setups(args.ttft, args.setups)
    if any(s.front == "haproxy" for s in chosen) and not shutil.which("haproxy"):
        print("router_fleet: haproxy is not installed; its setups are left out", file=sys.stderr)
        chosen = [s for s in chosen if s.front != "haproxy"]
    workdir = tempfile.mkdtemp(prefix="kvadmit-router-fleet-")
    print(f"logs: {workdir}", flush=True)
    capacity = args.capacity
    probe = workload(trace, 400, 1.0, args.seed)
    queued_cap = None
    rows = []
    for key in dict.fromkeys(s.server_key() for s in chosen):
        group = [s for s in chosen if s.server_key() == key]
        if capacity is None:
            with Instances(model_dir, Setup("capacity", "vllm-cap", "vllm-router"),
                           args.instances, 0, workdir) as inst, \
                    Front(Setup("capacity", "vllm-cap", "vllm-router", ("--policy", "round_robin")),
                          inst.bases, workdir) as front:
                capacity = asyncio.run(closed_loop(front.url, model_dir, probe,
                                                   args.instances * MAX_NUM_SEQS, 20.0))
            print(f"fleet capacity: {capacity:.2f} req/s", flush=True)
        # vLLM's rule: max_num_seqs plus the queue depth wanted (one instance's share of
        # the capacity over the TTFT target).
        queued_cap = MAX_NUM_SEQS + max(1, round(capacity / args.instances * args.ttft))
        rate = args.load * capacity
        requests = workload(trace, max(10, round(rate * args.duration)), rate, args.seed)
        with Instances(model_dir, group[0], args.instances, queued_cap, workdir) as inst:
            for s in group:
                row = run_setup(model_dir, s, inst, requests, workdir, args.ttft, args.tpot)
                rows.append(row)
                print_row(row)
    out = {"command": "python bench/router_fleet.py " + " ".join(argv or sys.argv[1:]),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores ({platform.node()})",
           "capacity_req_s": capacity, "load": args.load, "ttft_s": args.ttft, "tpot_s": args.tpot,
           "vllm_max_num_queued_reqs": queued_cap, "instances": args.instances,
           "max_num_seqs": MAX_NUM_SEQS, "pool_blocks": POOL_BLOCKS, "rows": rows}
    if args.out:
        save_json(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

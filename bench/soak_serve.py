"""The overload soak on `vllm serve`: minutes of Poisson arrivals past capacity, with
refusals before the first byte, flows, TTLs, streaming and cancellations mixed in;
then every request must have an answer, the server's memory must not grow, and every
KV block must be back at idle.

    python bench/soak_serve.py [--minutes 5] [--load 1.5] [--engine-cpus 1] [--seed 0]

One kvadmit server (the tiny CPU model, 48 blocks of 32 tokens) with
`{"max_queued_requests": 12, "max_queue_age_s": 30, "flows": {"a": {"weight": 2}},
"trusted_proxies": ["127.0.0.2"]}` and a gateway secret (KVADMIT_GATEWAY_SECRET): the
trust boundary on.
Capacity (requests a second) is measured first, closed-loop, because this machine's
speed changes from day to day. Each request: a prompt of 16-200 tokens and 16-96
output tokens (ignore_eos); half stream; one in ten is a client that reads one chunk
and goes away; flow a or b (GIE's x-gateway-inference-fairness-id), half of them from
"the gateway" (with the secret), the other half from clients (their flow ignored and
counted as untrusted); one in four with llm-d's TTL header, 2 s (x-llm-d-inference-ttl:
2s: short enough that some expire in the queue under load; `expired` answers counted
apart from the other refusals). Reported: answers by kind, any 5xx
other than the overload status, RSS of the server's processes (at idle before, every
30 s, at the end; growth counted from the first minute, once allocators and caches
have warmed up, and from the start), and KV blocks in use at idle. Saved to bench/results/soak_serve.json.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import random
import sys
import tempfile
import threading
import time

import httpx
from _common import save

from kvadmit.bench.serve.configs import parse_config
from kvadmit.bench.serve.server import Engine, Server
from kvadmit.vllm.tiny_model import build_tiny_llama

CONFIG = {"max_queued_requests": 12, "max_queue_age_s": 30, "flows": {"a": {"weight": 2}},
          "trusted_proxies": ["127.0.0.2"]}
SECRET = "soak-gateway-secret"
TTL = "2s"


def rss_by_process(pid: int) -> dict[str, float]:
    """Resident memory of the server and every process under it, MiB, by name(pid)."""
    import psutil
    out = {}
    for p in [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True):
        try:
            out[f"{p.name()}({p.pid})"] = p.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return out


def rss_mb(pid: int) -> float:
    return sum(rss_by_process(pid).values())


def one_request(base: str, model: str, rng: random.Random, i: int) -> str:
    """Sends request i; its outcome: ok, cancelled, refused (a kvadmit refusal, as a
    status or in the stream), or "status N" / "error ..." for anything else."""
    prompt = [(i * 31 + j) % 997 + 3 for j in range(rng.randint(16, 200))]
    body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(16, 96),
            "ignore_eos": True}
    headers = {"x-gateway-inference-fairness-id": rng.choice("ab")}
    if rng.random() < 0.5:
        headers["x-kvadmit-gateway-secret"] = SECRET
    if rng.random() < 0.25:
        headers["x-llm-d-inference-ttl"] = TTL
    stream, cancel = rng.random() < 0.5, rng.random() < 0.1
    url = base + "/v1/completions"
    try:
        if not (stream or cancel):
            r = httpx.post(url, json=body, headers=headers, timeout=600)
            if r.status_code == 200:
                return "ok"
            return refusal(r.text, r.status_code)
        with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers,
                          timeout=600) as r:
            if r.status_code != 200:
                return refusal(r.read().decode(errors="replace"), r.status_code)
            for line in r.iter_lines():
                if cancel and line.startswith("data:"):
                    return "cancelled"            # the client goes away mid-answer
                if "kvadmit:" in line:
                    return refusal(line, 200)
                if line.strip() == "data: [DONE]":
                    return "ok"
            return "error: stream ended without [DONE]"
    except httpx.HTTPError as e:
        return f"error {type(e).__name__}"


def refusal(text: str, status: int) -> str:
    """A kvadmit refusal's outcome (expired apart), or "status N"."""
    if "kvadmit:expired" in text:
        return "expired"
    return "refused" if "kvadmit:" in text else f"status {status}"


def capacity(base: str, model: str, n: int = 96, concurrency: int = 32) -> float:
    """Requests a second the server completes closed-loop (the soak's mix), with twice
    max_num_seqs in flight so the engine's batch is full."""
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        outcomes = list(pool.map(lambda i: one_request(base, model, random.Random(i), i),
                                 range(10**6, 10**6 + n)))
    return sum(o in ("ok", "cancelled") for o in outcomes) / (time.time() - t0)


def wait_idle(server: Server, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        if (m.get("vllm:num_requests_running", 1) == 0 and m.get("vllm:num_requests_waiting", 1) == 0
                and m.get("kvadmit_waiting_requests", 0) == 0) or time.time() > deadline:
            return m
        time.sleep(1)


def soak(server: Server, model: str, rate: float, seconds: float, seed: int) -> dict:
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    lock = threading.Lock()
    futures = []
    rss = []

    def run(i):
        o = one_request(server.base, model, random.Random(seed * 10**6 + i), i)
        with lock:
            outcomes[o] = outcomes.get(o, 0) + 1

    t0, i, next_t, next_print = time.time(), 0, 0.0, 30.0
    with concurrent.futures.ThreadPoolExecutor(256) as pool:
        while next_t < seconds:
            time.sleep(max(0.0, t0 + next_t - time.time()))
            futures.append(pool.submit(run, i))
            i += 1
            next_t += rng.expovariate(rate)
            if next_t >= next_print:
                rss.append((round(next_t), rss_by_process(server.proc.pid)))
                with lock:
                    print(f"  {next_t:5.0f} s: {i} sent, {dict(sorted(outcomes.items()))}, "
                          f"RSS {sum(rss[-1][1].values()):.0f} MiB", flush=True)
                next_print += 30.0
        for f in futures:
            f.result()
    return {"sent": i, "outcomes": dict(sorted(outcomes.items())), "rss_mb": rss}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--load", type=float, default=1.5, help="arrival rate / measured capacity")
    ap.add_argument("--engine-cpus", default="1", help="CPUs for the engine core and worker")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    model = str(build_tiny_llama(tempfile.mkdtemp(prefix="kvadmit-soak-model-")))
    cfg = parse_config("soak=" + json.dumps(CONFIG), 0, 0.0)
    log = pathlib.Path(tempfile.mkdtemp(prefix="kvadmit-soak-")) / "serve.log"
    server = Server(cfg, model, Engine(num_blocks=49), log,
                    engine_cpus=tuple(int(c) for c in args.engine_cpus.split(",") if c),
                    env={"KVADMIT_GATEWAY_SECRET": SECRET})
    server.start()
    try:
        server.wait_ready(600)
        cap = capacity(server.base, model)
        rate = args.load * cap
        print(f"capacity {cap:.2f} requests/s; soaking {args.minutes:g} min at {rate:.2f}/s "
              f"(log {log})", flush=True)
        wait_idle(server)
        rss_start = rss_mb(server.proc.pid)
        run = soak(server, model, rate, args.minutes * 60, args.seed)
        idle = wait_idle(server)
        rss_end = rss_mb(server.proc.pid)
    finally:
        server.stop()
    outcomes = run["outcomes"]
    unexpected = {k: v for k, v in outcomes.items()
                  if k not in ("ok", "cancelled", "refused", "expired")}
    warm = sum(run["rss_mb"][1][1].values()) if len(run["rss_mb"]) > 1 else rss_start
    out = {
        "config": CONFIG, "load": args.load, "capacity_rps": cap, "rate_rps": rate,
        "minutes": args.minutes, "seed": args.seed, **run,
        "answered": sum(outcomes.values()), "unexpected": unexpected,
        "rss_start_mb": rss_start, "rss_end_mb": rss_end,
        "rss_growth": rss_end / rss_start - 1,
        # from the soak's first minute (allocators and caches warmed up) to its end
        "rss_growth_after_1_min": rss_end / warm - 1,
        "kv_usage_at_idle": idle.get("vllm:kv_cache_usage_perc"),
        "waiting_at_idle": idle.get("kvadmit_waiting_requests"),
        "kvadmit_rejected": {k: v for k, v in idle.items() if k.startswith("kvadmit_rejected")},
        "untrusted_fields": {k: v for k, v in idle.items()
                             if k.startswith("kvadmit_untrusted_fields_total")},
    }
    print(f"sent {run['sent']}, answered {out['answered']}: {outcomes}; unexpected {unexpected}; "
          f"RSS {rss_start:.0f} -> {rss_end:.0f} MiB ({out['rss_growth']:+.1%}; "
          f"{out['rss_growth_after_1_min']:+.1%} after the first minute); "
          f"KV at idle {out['kv_usage_at_idle']}")
    if not args.no_save:
        print(f"saved {save('soak_serve', out)}")
    ok = (not unexpected and out["answered"] == run["sent"] and out["kv_usage_at_idle"] == 0
          and out["rss_growth_after_1_min"] < 0.05 and outcomes.get("expired", 0) > 0
          and out["untrusted_fields"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

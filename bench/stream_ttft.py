"""What refusing streams before their first byte costs an admitted stream: its TTFT.

Two `vllm serve` instances with kvadmit's default run side by side, identical but
for `KVADMIT_STREAM_REFUSAL`: `status` (the default: the handler waits for a
stream's first event before the response starts, so a refusal can be an HTTP
status) and `event` (the old way: headers at once, a refusal as an error event in
a 200 stream). One client sends streaming completions one at a time, alternating
between the two, and times the first token (the first event with text) and the
headers. Nothing is refused here: this is the cost to admitted streams.

    python bench/stream_ttft.py [--requests 200] [--out bench/results/stream_ttft.json]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from router_fleet import Setup, free_port, serve_command, stop, wait_http  # noqa: E402
from kvadmit.simulate.run import save_json  # noqa: E402


def one(client, base: str, model: str, seed: int) -> tuple[float, float]:
    """(seconds to the response headers, seconds to the first token)."""
    body = {"model": model, "prompt": [(seed * 7919 + i) % 997 + 3 for i in range(64)],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    with client.stream("POST", base + "/v1/completions", json=body) as r:
        headers = time.perf_counter() - t0
        assert r.status_code == 200, r.status_code
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text":"' in line.replace(" ", ""):
                return headers, time.perf_counter() - t0
    raise RuntimeError("no token in the stream")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv=None) -> int:
    import httpx
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="per mode")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from kvadmit.vllm.tiny_model import DEFAULT_DIR, build_tiny_llama
    model = str(build_tiny_llama(args.model_dir or DEFAULT_DIR))
    workdir = tempfile.mkdtemp(prefix="kvadmit-stream-ttft-")
    setup = Setup("kvadmit", "kvadmit", "none")
    procs, bases = [], {}
    for mode in ("status", "event"):
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        env["KVADMIT_STREAM_REFUSAL"] = mode
        with open(os.path.join(workdir, f"{mode}.log"), "w") as log:
            procs.append(subprocess.Popen(serve_command(model, port, setup, 0), stdout=log,
                                          stderr=subprocess.STDOUT, env=env))
        bases[mode] = f"http://127.0.0.1:{port}"
    times = {m: {"headers": [], "ttft": []} for m in bases}
    try:
        for mode, proc in zip(bases, procs):
            wait_http(bases[mode] + "/health", proc, f"vllm serve ({mode}, logs {workdir})")
        with httpx.Client(timeout=60) as client:
            for i in range(10):                              # warm-up, not counted
                for mode in bases:
                    one(client, bases[mode], model, i)
            for i in range(args.requests):
                for mode in (("status", "event") if i % 2 == 0 else ("event", "status")):
                    h, t = one(client, bases[mode], model, 100 + i)
                    times[mode]["headers"].append(h)
                    times[mode]["ttft"].append(t)
    finally:
        stop(procs)
    out = {"command": "python bench/stream_ttft.py " + " ".join(argv or sys.argv[1:]),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "requests_per_mode": args.requests, "modes": {}}
    for mode, t in times.items():
        out["modes"][mode] = {f"{k}_{q}_ms": round(1000 * pct(v, p), 2)
                              for k, v in t.items() for q, p in (("p50", 0.5), ("p99", 0.99))}
        out["modes"][mode]["ttft_mean_ms"] = round(1000 * statistics.fmean(t["ttft"]), 2)
    s, e = out["modes"]["status"], out["modes"]["event"]
    out["added_ttft_ms"] = {q: round(s[f"ttft_{q}_ms"] - e[f"ttft_{q}_ms"], 2) for q in ("p50", "p99")}
    for mode, row in out["modes"].items():
        print(f"{mode:>6}: TTFT p50 {row['ttft_p50_ms']} ms, p99 {row['ttft_p99_ms']} ms; "
              f"headers p50 {row['headers_p50_ms']} ms")
    print(f"added TTFT (status - event): p50 {out['added_ttft_ms']['p50']} ms, "
          f"p99 {out['added_ttft_ms']['p99']} ms")
    if args.out:
        save_json(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

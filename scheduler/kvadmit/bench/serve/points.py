"""The runs of `kvadmit bench serve`: one point (one `vllm bench serve` run against a
server, its numbers and refusals), and the sweep of points over loads, repeats and
servers."""
from __future__ import annotations

import http
import json
import pathlib
import random
import sys
import time
from typing import Callable

from kvadmit.bench.serve.loadgen import run_client
from kvadmit.bench.serve.server import Server


def _status(error: str) -> str:
    """The HTTP status of a failed request from vLLM's client error text: its reason
    phrase for a non-200 answer, "200" for a stream that carried no token (a refusal
    inside the stream), "client" for anything else (a connection error)."""
    if not error:
        return "ok"
    if error.startswith("Never received a valid chunk"):
        return "200"
    for s in http.HTTPStatus:
        if error.strip() == s.phrase:
            return str(s.value)
    return "client"


def refusal_counts(before: dict, after: dict) -> dict[str, int]:
    """kvadmit_rejected_total by reason, after - before."""
    out = {}
    for k, v in after.items():
        if k.startswith("kvadmit_rejected_total{"):
            reason = k.split('reason="', 1)[1].split('"', 1)[0]
            d = int(round(v - before.get(k, 0.0)))
            if d:
                out[reason] = out.get(reason, 0) + d
    return out


RECOMPUTED = "kvadmit_bench_recomputed_tokens_total"     # kvadmit.bench.serve.recompute


def recompute_counts(before: dict, after: dict) -> dict:
    """A point's prefill, from the server's counters after - before (RFC #54644's
    measure: recompute as a share of all the prefill computed):

        fresh      = vllm:prompt_tokens_total - vllm:prompt_tokens_cached_total
                     (vLLM's: each request's prompt once, at its first scheduling,
                     less its prefix-cache hits; never a prefill after a preemption)
        recomputed = kvadmit_bench_recomputed_tokens_total (the bench's scheduler:
                     positions computed again below what a request had computed when
                     preempted; vLLM counts none, kvadmit.bench.serve.recompute)
        prefill    = fresh + recomputed
        share      = recomputed / prefill (None for no prefill)

    A request cancelled before its first token has its partial prefill in no count.
    Without the bench's counter (a server not started by `kvadmit bench serve`) all
    three are None."""
    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    if RECOMPUTED not in after:
        return {"prefill_tokens": None, "recomputed_tokens": None, "recompute_share": None}
    recomputed = int(round(delta(RECOMPUTED)))
    fresh = int(round(delta("vllm:prompt_tokens_total") - delta("vllm:prompt_tokens_cached_total")))
    prefill = fresh + recomputed
    return {"prefill_tokens": prefill, "recomputed_tokens": recomputed,
            "recompute_share": recomputed / prefill if prefill > 0 else None}


def wait_idle(server: Server, timeout: float = 300) -> dict:
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        if (m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0
                and m.get("kvadmit_waiting_requests", 0) == 0):
            return m
        if time.time() > deadline:
            raise RuntimeError(f"{server.config.label}: still busy {timeout:.0f} s after a run")
        time.sleep(0.5)


def run_point(server: Server, dataset: list[str], rate: float, burstiness: float, seed: int,
              n: int, slo: tuple[float, float], out_dir: pathlib.Path, tag: str,
              expect: list[int] | int | None = None) -> dict:
    """One `vllm bench serve` run against `server`; returns the row of numbers.
    `expect`: each request's output length (a list in the dataset's order, or one
    length for all); `wrong_length` counts the served requests that did not match."""
    before = wait_idle(server)
    name = f"{tag}.json"
    argv = ["--base-url", server.base, "--model", server.model, "--num-prompts", str(n),
            "--request-rate", "inf" if rate == float("inf") else f"{rate:.4f}",
            "--burstiness", str(burstiness), "--seed", str(seed), "--temperature", "0",
            "--goodput", f"ttft:{slo[0] * 1e3:g}", f"tpot:{slo[1] * 1e3:g}",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(out_dir),
            "--result-filename", name, "--disable-tqdm", *dataset]
    t0 = time.perf_counter()
    run_client(argv, server.log, tag)
    wall = time.perf_counter() - t0
    res = json.loads((out_dir / name).read_text())
    after = wait_idle(server)
    statuses: dict[str, int] = {}
    for e in res.get("errors", []):
        s = _status(e or "")
        if s != "ok":
            statuses[s] = statuses.get(s, 0) + 1
    good = int(round(res["request_goodput"] * res["duration"])) if res.get("request_goodput") else 0
    lens, errors = res.get("output_lens", []), res.get("errors", [])
    want = [expect] * len(lens) if isinstance(expect, int) else expect
    wrong = (None if want is None else
             sum(1 for got, w, e in zip(lens, want, errors) if not e and got != w))
    return {
        "config": server.config.label, "rate_rps": rate, "seed": seed, "requests": n,
        "completed": res["completed"], "failed": res["failed"], "good": good,
        "goodput": good / n, "goodput_rps": res.get("request_goodput") or 0.0,
        "preemptions": int(round(after.get("vllm:num_preemptions_total", 0.0)
                                 - before.get("vllm:num_preemptions_total", 0.0))),
        **recompute_counts(before, after), "input_tokens": res.get("total_input_tokens"),
        "refused_by_reason": refusal_counts(before, after), "failed_by_status": statuses,
        "output_tokens": res["total_output_tokens"], "output_tok_per_s": res["output_throughput"],
        "request_throughput": res["request_throughput"], "duration_s": res["duration"],
        "ttft_p50_ms": res.get("p50_ttft_ms"), "ttft_p99_ms": res.get("p99_ttft_ms"),
        "tpot_p50_ms": res.get("p50_tpot_ms"), "tpot_p99_ms": res.get("p99_tpot_ms"),
        "max_concurrent_requests": res.get("max_concurrent_requests"),
        "wrong_length": wrong,
        "client_wall_s": wall,
    }


# ---------------------------------------------------------------------------
# The sweep

def rotated(items: list, k: int) -> list:
    k %= max(1, len(items))
    return items[k:] + items[:k]


def sweep(servers: list[Server], dataset: list[str], n: int, capacity: float,
          loads: list[float], repeats: int, burstiness: float, slo: tuple[float, float],
          seed: int, out_dir: pathlib.Path, tag: str,
          expect: list[int] | int | None = None) -> list[dict]:
    """Every (repeat, load) point on every server at one capacity: the paired sweep
    with a new arrival seed per repeat (seed * 1000 + repeat), loads shuffled by it and
    servers rotated per point; the same arrival seed for every server at a point."""
    return paired_sweep(servers, dataset, n, lambda _: capacity, loads,
                        [seed * 1000 + rep for rep in range(repeats)], burstiness, slo,
                        out_dir, tag, expect)


def paired_sweep(servers: list[Server], dataset: list[str], n: int,
                 capacity_of: Callable[[int], float], loads: list[float], seeds: list[int],
                 burstiness: float, slo: tuple[float, float], out_dir: pathlib.Path, tag: str,
                 expect: list[int] | int | None = None) -> list[dict]:
    """The paired protocol: per seed, the capacity that seed measures now
    (`capacity_of(seed)`: the machine's speed moves from day to day and within one), then
    every load (in an order shuffled by the seed) on every server back to back, at that
    seed's capacity and with its arrivals. Each row carries its seed and capacity, so a
    config's numbers are compared with the reference's of the same seed."""
    rows = []
    total = len(seeds) * len(loads) * len(servers)
    t0 = time.perf_counter()
    k = 0
    for i, seed in enumerate(seeds):
        capacity = capacity_of(seed)
        print(f"{tag} seed {seed}: capacity {capacity:.2f} req/s", file=sys.stderr, flush=True)
        order = list(loads)
        random.Random(seed).shuffle(order)
        for j, load in enumerate(order):
            for server in rotated(servers, i * len(loads) + j):
                k += 1
                row = run_point(server, dataset, load * capacity, burstiness, seed, n, slo, out_dir,
                                f"{tag}-{server.config.label}-x{load:g}-s{seed}", expect)
                row.update(load=load, repeat=i, capacity_rps=capacity)
                rows.append(row)
                print(f"{tag} [{k}/{total}] seed {seed} {server.config.label} x{load:g}: goodput "
                      f"{row['goodput']:.2f}, TTFT p99 {row['ttft_p99_ms'] or 0:.0f} ms, "
                      f"{row['preemptions']} preemptions (recompute {_share(row['recompute_share'])} "
                      f"of prefill), {row['failed']} failed; {time.perf_counter() - t0:.0f} s elapsed",
                      file=sys.stderr, flush=True)
    return rows


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"

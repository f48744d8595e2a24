"""What kvadmit's per-step overhead does to the online TTFT tail (issue 54, item 4).

Two measurements (and the cost of one metrics update), each printed and saved (bench/results/step_overhead_tail.json):

1. The overhead: vLLM's real V1 scheduler in-process (kvadmit.vllm.inprocess, no
   model, fake outputs) with 16 running requests, the online bench's batch: the mean
   wall time of one schedule() + update_from_output() round for vLLM's own scheduler
   and for kvadmit's empty config, alternated `--rounds` times (the difference is
   kvadmit's cost per step), beside the step time the CPU fit gives such a step (16
   decodes over about 3000 tokens of context: a few ms).
2. Its effect, modelled: the online bench's workload and engine (`kvadmit bench
   serve`: the Azure conversation trace scaled to max_model_len 1536, its real output
   lengths and the scaled 2048 cap; 48 blocks of 32 tokens, max_num_seqs 16, a
   2048-token budget) on the native engine with the CPU fit, Poisson arrivals at
   0.5x-2x the capacity measured on vLLM's rule, five seeds paired. kvadmit's default
   runs with each step `--overheads` seconds longer than vLLM's (its scheduler's time:
   on the CPU the engine core and the scheduler share one core). Per load: the median
   of the per-seed ratios to vLLM's default (TTFT p99, tokens/s) and the worst seed's.

3. The model's fidelity: at the rates of the recorded paired online run
   (bench/results/vllm_serve_paired.json), the simulator's tokens/s and TTFT p99 beside
   the real ones.

    python bench/step_overhead_tail.py [--rounds 5] [--overheads 0 5e-5 1e-4 1.5e-4]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import random
import statistics
import sys
import time

from _common import save
from bench_vllm_schedule import time_steps

from kvadmit.config import AdmissionConfig
from kvadmit.simulate.engine import EngineShape, run_native
from kvadmit.simulate.metrics import Slo, summarize
from kvadmit.simulate.run import capacity_rps
from kvadmit.simulate.steptime import CPU_TINY
from kvadmit.simulate.workload import Workload

RUNNING = 16
LOADS = (0.5, 1.0, 1.5, 2.0)
SEEDS = range(5)
SHAPE = EngineShape(num_blocks=48, block_size=32, max_model_len=1536, max_num_seqs=16,
                    max_num_batched_tokens=2048)


def overhead(rounds: int) -> dict:
    from kvadmit.vllm.tiny_model import build_tiny_llama
    model_dir = str(build_tiny_llama("/tmp/kvadmit-bench-tiny-llama"))
    vllm, ours = [], []
    for _ in range(rounds):                   # alternated: the machine's speed drifts
        vllm.append(time_steps(model_dir, RUNNING, None, 40))
        ours.append(time_steps(model_dir, RUNNING, {}, 40))
    diff = [b - a for a, b in zip(vllm, ours)]
    step_ms = CPU_TINY.step_s(RUNNING, 3000) * 1e3
    return {"running": RUNNING, "vllm_us": vllm, "kvadmit_default_us": ours,
            "overhead_us_median": statistics.median(diff),
            "cpu_fit_step_ms": step_ms,
            "overhead_share_of_step": statistics.median(diff) / 1e3 / step_ms}


def metrics_update_us(n: int = 2000) -> float:
    """µs of one update of kvadmit's Prometheus series in multiprocess mode (as in
    `vllm serve`: each write goes to a shared file) with RUNNING requests running and
    nothing changed between updates, what most steps see."""
    import os
    import tempfile
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kvadmit-prom-")
    from kvadmit import AdmissionCore
    from kvadmit.arrival import ArrivalRecord
    from kvadmit.vllm.metrics import process_metrics
    metrics = process_metrics()
    core = AdmissionCore(AdmissionConfig(policy="peak"), 200, 16, 0)
    for _ in range(RUNNING):
        core.admit(core.arrive(ArrivalRecord(8, 40), now=0.0).slot, 0.0)
    metrics.update(core.stats())
    t0 = time.perf_counter()
    for _ in range(n):
        metrics.update(core.stats())
    return (time.perf_counter() - t0) / n * 1e6


def workload(seed: int, rate: float, base: Workload) -> Workload:
    rng, t, arrivals = random.Random(seed), 0.0, []
    for _ in base.prompt_tokens:
        t += rng.expovariate(rate)
        arrivals.append(t)
    return dataclasses.replace(base, arrival_s=arrivals)


def modelled(overheads: list[float]) -> list[dict]:
    base = _serve_workload()
    capacity = capacity_rps(base, SHAPE, CPU_TINY, sample=len(base))
    slo, rows = Slo(2.0, 0.05), []
    for load in LOADS:
        runs = {seed: workload(seed, load * capacity, base) for seed in SEEDS}
        ref = {s: summarize(*_run(w, AdmissionConfig(policy="overcommit", victim="lifo"), CPU_TINY), slo)
               for s, w in runs.items()}
        for extra in overheads:
            step = dataclasses.replace(CPU_TINY, a=CPU_TINY.a + extra)
            ours = {s: summarize(*_run(w, AdmissionConfig(), step), slo) for s, w in runs.items()}
            row = {"load": load, "overhead_s": extra, "capacity_rps": capacity}
            for key, higher in (("ttft_p99_s", False), ("throughput_tok_s", True)):
                per = [ours[s][key] / ref[s][key] for s in SEEDS]
                row[key] = {"median": statistics.median(per), "worst": min(per) if higher else max(per)}
            rows.append(row)
            print(f"load {load:3g}x, +{extra * 1e6:4.0f} us a step: TTFT p99 "
                  f"{row['ttft_p99_s']['median']:.2f}x (worst {row['ttft_p99_s']['worst']:.2f}x), "
                  f"tokens/s {row['throughput_tok_s']['median']:.3f}x "
                  f"(worst {row['throughput_tok_s']['worst']:.3f}x)", flush=True)
    return rows


def fidelity(online: pathlib.Path) -> list[dict]:
    """The model against a recorded paired online run (`kvadmit bench serve --seeds`):
    at each load's median offered rate, the simulator's median tokens/s and TTFT p99
    over the five seeds (CPU fit, no overhead) beside the real medians, per config."""
    sec = json.loads(online.read_text())["sections"][0]
    base = _serve_workload()
    configs = {"vllm-default": AdmissionConfig(policy="overcommit", victim="lifo"),
               "kvadmit-default": AdmissionConfig()}
    out = []
    for s in sec["summary"]:
        rate = statistics.median(r["rate_rps"] for r in sec["rows"]
                                 if (r["config"], r["load"]) == (s["config"], s["load"]))
        sims = [summarize(*_run(workload(seed, rate, base), configs[s["config"]], CPU_TINY),
                          Slo(2.0, 0.05)) for seed in SEEDS]
        row = {"config": s["config"], "load": s["load"], "rate_rps": rate,
               "real_tok_s": s["output_tok_per_s"],
               "sim_tok_s": statistics.median(x["throughput_tok_s"] for x in sims),
               "real_ttft_p99_ms": s["ttft_p99_ms"],
               "sim_ttft_p99_ms": statistics.median(x["ttft_p99_s"] for x in sims) * 1e3}
        out.append(row)
        print(f"{row['config']:16} {row['load']:3g}x ({rate:5.1f} req/s): tokens/s real "
              f"{row['real_tok_s']:6.0f}, model {row['sim_tok_s']:6.0f}; TTFT p99 real "
              f"{row['real_ttft_p99_ms']:6.0f} ms, model {row['sim_ttft_p99_ms']:6.0f} ms", flush=True)
    return out


def _serve_workload() -> Workload:
    from kvadmit.bench.vllm import as_burst, azure_workload
    return as_burst(azure_workload("azure2023_conv", 320, SHAPE.max_model_len, 2048), "serve")


def _run(w: Workload, config: AdmissionConfig, step) -> tuple:
    raw = run_native(w, config, SHAPE, step)
    return raw.per_request, raw.totals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--overheads", type=float, nargs="+", default=[0.0, 5e-5, 1e-4, 1.5e-4])
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    over = overhead(args.rounds)
    print(f"{RUNNING} running: vLLM {statistics.median(over['vllm_us']):.0f} us a step, kvadmit's "
          f"default {statistics.median(over['kvadmit_default_us']):.0f} us: +{over['overhead_us_median']:.0f} us, "
          f"{over['overhead_share_of_step']:.1%} of the {over['cpu_fit_step_ms']:.2f} ms step the CPU "
          f"fit gives", flush=True)
    over["metrics_update_multiprocess_us"] = metrics_update_us()
    print(f"one update of kvadmit's metrics in multiprocess mode: "
          f"{over['metrics_update_multiprocess_us']:.1f} us", flush=True)
    rows = modelled(args.overheads)
    online = pathlib.Path(__file__).parent / "results" / "vllm_serve_paired.json"
    check = fidelity(online) if online.exists() else []
    if not args.no_save:
        print(f"saved {save('step_overhead_tail', {'overhead': over, 'modelled': rows, 'fidelity': check})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The default config (auto) on randomly drawn workloads it was not designed on.

Draws bursts (Azure slices at random offsets, contexts 512-2048, pools 1-8
contexts, max_tokens: context left, 2048 scaled, 2x or exactly the real length)
on the tiny CPU engine's shape, and open-loop workloads (Poisson, Gamma-burst,
Azure slices, mixed interactive/batch at 0.7-2x capacity) on the h100-8b model
with 1/4 to 1/32 of its KV pool; runs vLLM's default, vLLM's --watermark 0.05
and kvadmit's default on each (native engine model) and prints, per draw, the
preemptions, steps or goodput, and the default's modelled time against vLLM's.

    python bench/bench_default_robustness.py [--seed 1] [--bursts 25] [--open-loop 16]
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import random

from _common import save

from kvadmit.simulate.engine import EngineShape
from kvadmit.simulate.metrics import Slo
from kvadmit.simulate.policies import parse_policy
from kvadmit.simulate.scorecard import AZURE, Case, azure_burst, open_loop, run_cell, tiny_shape
from kvadmit.simulate.steptime import CPU_TINY, get_preset
from kvadmit.simulate.workload import from_trace, mixed, synthetic

ROWS = ["vllm-default", "vllm-watermark=0.05", "default={}"]


def draw_burst(rng: random.Random, azure) -> tuple[str, Case]:
    ctx = rng.choice([512, 1024, 2048])
    start = rng.randrange(0, 19000 - 512)
    n = rng.choice([64, 128, 256, 512])
    caps = rng.choice(["context", "cap", "real", "2xreal"])
    w = azure_burst(azure, start, n, "real" if caps == "2xreal" else caps, "burst", ctx)
    if caps == "2xreal":
        w = dataclasses.replace(w, max_tokens=[min(ctx - p, 2 * o)
                                               for p, o in zip(w.prompt_tokens, w.output_tokens)])
    blocks = int(ctx // 32 * rng.choice([1, 1.5, 2, 4, 8]))
    return (f"burst ctx {ctx} requests {start}+{n} caps {caps} blocks {blocks}",
            Case("burst", "", w, tiny_shape(blocks, ctx), CPU_TINY))


def draw_open_loop(rng: random.Random, azure) -> tuple[str, Case]:
    h100 = get_preset("h100-8b")
    frac = rng.choice([4, 8, 16, 32])
    shape = EngineShape(num_blocks=h100.num_blocks // frac, block_size=16, max_model_len=8192,
                        max_num_seqs=1024, max_num_batched_tokens=8192)
    kind = rng.choice(["poisson", "gamma", "azure", "mixed"])
    load = rng.choice([0.7, 1.0, 1.3, 2.0])
    seed = rng.randrange(1000)
    if kind == "azure":
        start = rng.randrange(0, 15000)
        full = from_trace(azure, limit=start + 1500, max_tokens_rule=rng.choice(["cap", "context"]))
        w = dataclasses.replace(full, arrival_s=full.arrival_s[start:], prompt_tokens=full.prompt_tokens[start:],
                                output_tokens=full.output_tokens[start:], max_tokens=full.max_tokens[start:])
    elif kind == "mixed":
        w = mixed(1500, 10.0, seed=seed)
    else:
        w = synthetic(1500, 10.0, seed=seed, burst_cv=1.0 if kind == "poisson" else rng.choice([2.0, 4.0, 8.0]),
                      output_sigma=rng.choice([0.5, 1.2, 2.0]))
    return (f"{kind} seed {seed} pool 1/{frac} load {load}",
            Case("open", "", open_loop(w, shape, h100, load), shape, h100, Slo(2.0, 0.1)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bursts", type=int, default=25)
    ap.add_argument("--open-loop", type=int, default=16)
    ap.add_argument("--traces", default=None,
                    help=f"a folder with {AZURE} (default: the copy bundled in the package)")
    args = ap.parse_args()
    azure = "azure2023_conv" if args.traces is None else pathlib.Path(args.traces) / AZURE
    rng = random.Random(args.seed)
    specs = [parse_policy(r) for r in ROWS]
    draws = ([draw_burst(rng, azure) for _ in range(args.bursts)] +
             [draw_open_loop(rng, azure) for _ in range(args.open_loop)])
    rows = []
    print(f"{'workload':52} {'vLLM pre/steps|goodput':>24} {'wm 0.05':>16} {'default':>16} {'time':>6}")
    for what, case in draws:
        cells = {s.name: run_cell(case, s) for s in specs}
        v, wm, d = cells["vllm-default"], cells["vllm-watermark=0.05"], cells["default"]
        burst = case.step is CPU_TINY

        def fmt(c):
            return f"{c['preemptions']}/{c['steps']}" if burst else f"{c['preemptions']}/{c['goodput'] * 100:.0f}%"
        ratio = d["makespan_s"] / v["makespan_s"]
        print(f"{what:52} {fmt(v):>24} {fmt(wm):>16} {fmt(d):>16} {ratio:6.3f}", flush=True)
        rows.append({"workload": what, "cells": cells, "time_vs_vllm": ratio,
                     "steps_vs_vllm": d["steps"] / v["steps"]})
    worst_time = max(r["time_vs_vllm"] for r in rows)
    worst_steps = max(r["steps_vs_vllm"] for r in rows if r["workload"].startswith("burst"))
    print(f"\nworst modelled time vs vLLM: {worst_time:.3f}; worst burst steps vs vLLM: {worst_steps:.3f}; "
          f"preemptions: default {sum(r['cells']['default']['preemptions'] for r in rows)}, "
          f"vLLM {sum(r['cells']['vllm-default']['preemptions'] for r in rows)}, "
          f"watermark 0.05 {sum(r['cells']['vllm-watermark=0.05']['preemptions'] for r in rows)}")
    save("default_robustness", {"seed": args.seed, "rows": rows})


if __name__ == "__main__":
    main()

"""How `--engine native` scales: the Azure 2023 conversation trace replayed back to
back (x1, x5, x52: 19k, 97k, 1.0M requests) at 1.0x and 1.5x the H100-8B preset's
capacity, vLLM's rule and kvadmit's adaptive policy. Wall time covers the engine
run only (building the workload is printed apart). Saves bench/results/simulate_scale.json.

    python bench/bench_simulate_scale.py [--trace azure2023_conv]
"""
from __future__ import annotations

import argparse
import time

from _common import save

from kvadmit.config import AdmissionConfig
from kvadmit.simulate import EngineShape, at_load, capacity_rps, from_trace, get_preset, run_native


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="azure2023_conv",
                    help="a trace path or a bundled trace's name (default: the bundled Azure trace)")
    ap.add_argument("--repeats", type=int, nargs="+", default=[1, 5, 52])
    ap.add_argument("--loads", type=float, nargs="+", default=[1.0, 1.5])
    args = ap.parse_args()
    step = get_preset("h100-8b")
    shape = EngineShape(num_blocks=step.num_blocks, block_size=step.block_size,
                        max_model_len=step.max_model_len)
    rows = []
    print(f"{'requests':>9} {'load':>5} {'policy':>12} {'build s':>8} {'run s':>7} {'steps':>9} "
          f"{'preempt':>8} {'finished':>9} {'rejected':>8}")
    for rep in args.repeats:
        t = time.perf_counter()
        base = from_trace(args.trace, max_tokens_rule="context", repeat=rep)
        cap = capacity_rps(base, shape, step)
        build = time.perf_counter() - t
        for load in args.loads:
            w = at_load(base, load, cap)
            for name, cfg in (("vllm-default", AdmissionConfig(policy="overcommit", victim="lifo")),
                              ("adaptive", AdmissionConfig(policy="adaptive"))):
                raw = run_native(w, cfg, shape, step)
                tot = raw.totals
                rows.append({"requests": len(w), "load": load, "policy": name, "build_s": build,
                             "run_s": raw.wall_s, "steps": tot.steps,
                             "preemptions": tot.preemptions, "finished": tot.finished,
                             "rejected": tot.rejected})
                print(f"{len(w):9d} {load:5.2f} {name:>12} {build:8.2f} {raw.wall_s:7.2f} "
                      f"{tot.steps:9d} {tot.preemptions:8d} {tot.finished:9d} "
                      f"{tot.rejected:8d}", flush=True)
    path = save("simulate_scale", {"trace": args.trace, "preset": step.as_dict(), "rows": rows})
    print(f"saved {path}")


if __name__ == "__main__":
    main()

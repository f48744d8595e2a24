"""An adapter's per-step cost through the core's port: step + step_done.

What the vLLM and SGLang adapters pay the core every scheduler step, without an
engine: `CorePort.step(StepReport)` (the core's step sequence: the previous
step's time, cache signals, every running request's progress, the blocks in use,
the victim order back) and `step_done`, with 32, 512 and 4096 running requests,
for peak, auto (shared-prefix counting on) and adaptive. The best of three
repeats, microseconds per step; the lists the adapter builds each step are
counted too (the adapters build them).

    python bench/bench_bridge_step.py [--steps 300]
"""
from __future__ import annotations

import argparse
import random
import sys
import time

from _common import save

from kvadmit import AdmissionConfig, AdmissionCore
from kvadmit.arrival import ArrivalRecord
from kvadmit.port import CorePort, StepReport

POLICIES = ("peak", "auto", "adaptive")


def time_steps(policy: str, n: int, steps: int, repeats: int = 3) -> float:
    rng = random.Random(0)
    reqs = [(rng.randint(64, 2048), rng.randint(64, 1024)) for _ in range(n)]
    num_blocks = sum(-(-(p + m) // 16) for p, m in reqs) + 1024
    core = AdmissionCore(AdmissionConfig(policy=policy), num_blocks, 16, 0)
    bridge = CorePort(core, counts_shared_prefix=policy == "auto")
    slots, prompts, gen = [], [], []
    for i, (p, m) in enumerate(reqs):
        arrival = bridge.arrive(i, None, lambda p=p, m=m: ArrivalRecord(p, m), 0.0)
        core.admit(arrival.slot, 0.0)
        slots.append(arrival.slot)
        prompts.append(p)
        gen.append(rng.randint(1, m // 2))
    now, best = 0.0, float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            gen = [g + 1 for g in gen]
            computed = [p + g - 1 for p, g in zip(prompts, gen)]
            now += 0.01
            bridge.step(StepReport(now=now, used_blocks=num_blocks // 2, slots=slots,
                                   computed=computed, generated=gen))
            bridge.step_done(n, sum(computed), now)
        best = min(best, (time.perf_counter() - t0) / steps * 1e6)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--running", type=int, nargs="+", default=[32, 512, 4096])
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'running':>7} " + " ".join(f"{p + ' us/step':>17}" for p in POLICIES))
    for n in args.running:
        row = {"running": n, **{f"{p}_us": time_steps(p, n, args.steps) for p in POLICIES}}
        rows.append(row)
        print(f"{n:7d} " + " ".join(f"{row[p + '_us']:17.1f}" for p in POLICIES), flush=True)
    if not args.no_save:
        print(f"saved {save('bridge_step', {'steps': args.steps, 'rows': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

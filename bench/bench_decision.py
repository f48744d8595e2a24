"""Core decision time per engine step with 32, 512 and 4096 running requests.

One step is what an engine adapter asks of the core every scheduler step:
report every running request's progress (update_many), ask for the next
admissible waiting request (next_admissible: the policy check, including the
KV-curve rebuild for peak/adaptive), pick a victim, advance the step.

    python bench/bench_decision.py [--steps 200]
"""
from __future__ import annotations

import argparse
import random
import sys
import time

from _common import save

from kvadmit import POLICIES, AdmissionConfig, AdmissionCore
from kvadmit.arrival import ArrivalRecord


def build(policy: str, n_running: int, seed: int = 0):
    rng = random.Random(seed)
    block_size = 16
    reqs = [(rng.randint(64, 2048), rng.randint(64, 1024)) for _ in range(n_running)]
    num_blocks = sum(-(-(p + m) // block_size) for p, m in reqs) + 1024
    core = AdmissionCore(AdmissionConfig(policy=policy), num_blocks, block_size, 0)
    slots, prompts, gen = [], [], []
    for p, m in reqs:
        s = core.arrive(ArrivalRecord(p, m), now=0.0).slot
        core.admit(s, 0.0)
        slots.append(s)
        prompts.append(p)
        gen.append(rng.randint(1, m // 2))
    for _ in range(64):
        core.arrive(ArrivalRecord(rng.randint(64, 2048), rng.randint(64, 1024)), now=0.0)
    if policy == "adaptive":  # give the length model samples so it predicts
        for _ in range(256):
            s = core.arrive(ArrivalRecord(16, 2048), now=0.0).slot
            core.admit(s, 0.0)
            g = rng.randint(50, 600)
            core.update(s, 16 + g - 1, g)
            core.finish(s, 0.0)
    return core, slots, prompts, gen, num_blocks


def time_steps(policy: str, n_running: int, steps: int) -> dict:
    core, slots, prompts, gen, num_blocks = build(policy, n_running)
    free = num_blocks // 4
    parts = {"update_many": 0.0, "next_admissible": 0.0, "victim": 0.0, "on_step": 0.0}
    for _ in range(steps):
        gen = [g + 1 for g in gen]
        computed = [p + g - 1 for p, g in zip(prompts, gen)]
        t0 = time.perf_counter()
        core.update_many(slots, computed, gen)
        t1 = time.perf_counter()
        core.next_admissible(free)
        t2 = time.perf_counter()
        core.victim()
        t3 = time.perf_counter()
        core.on_step(0.0)
        t4 = time.perf_counter()
        parts["update_many"] += t1 - t0
        parts["next_admissible"] += t2 - t1
        parts["victim"] += t3 - t2
        parts["on_step"] += t4 - t3
    us = {k: v / steps * 1e6 for k, v in parts.items()}
    us["total"] = sum(us.values())
    return us


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--running", type=int, nargs="+", default=[32, 512, 4096])
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'policy':11} {'running':>7} {'update_many':>12} {'next_admiss.':>12} "
          f"{'victim':>8} {'on_step':>8} {'total us':>9}")
    for n in args.running:
        for policy in POLICIES:
            us = time_steps(policy, n, args.steps)
            rows.append({"policy": policy, "running": n, "us_per_step": us})
            print(f"{policy:11} {n:7d} {us['update_many']:12.1f} {us['next_admissible']:12.1f} "
                  f"{us['victim']:8.1f} {us['on_step']:8.1f} {us['total']:9.1f}")
    if not args.no_save:
        print(f"saved {save('decision', {'steps': args.steps, 'rows': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

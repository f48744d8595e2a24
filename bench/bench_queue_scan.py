"""next_admissible with a deep queue behind a held head, as a loaded server sees it.

A pool of 26,674 blocks of 16 tokens (h100-8b) is filled from a queue of 3,000
requests until the head is held for capacity (about 680 running, 2,300 waiting);
then each step is one on_step() and one next_admissible(). With head-of-line
bypass (auto's default, adaptive and peak given bypass 1000/256), the scan tries
up to 256 requests behind the head, each a peak computation over the running set,
unless a refused curve earlier in the scan already covers it.

    python bench/bench_queue_scan.py [--steps 50]
"""
from __future__ import annotations

import argparse
import random
import sys
import time

from _common import save

from kvadmit import AdmissionConfig, AdmissionCore
from kvadmit.arrival import ArrivalRecord

BYPASS = {"head_of_line": "bypass", "max_bypass": 1000, "bypass_lookahead": 256}
CONFIGS = {"auto": {}, "adaptive+bypass": {"policy": "adaptive", **BYPASS},
           "peak+bypass": {"policy": "peak", **BYPASS}, "peak": {"policy": "peak"}}


def filled_core(settings: dict, seed: int = 0) -> AdmissionCore:
    rng = random.Random(seed)
    core = AdmissionCore(AdmissionConfig.from_dict(settings), 26674, 16, 8192)
    for _ in range(3000):
        core.arrive(ArrivalRecord(rng.randint(64, 1024), rng.randint(64, 1024)), now=0.0)
    while (s := core.next_admissible(1 << 40)) >= 0:
        core.admit(s, 0.0)
    return core


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'config':16} {'running':>7} {'waiting':>7} {'us/next_admissible':>19}")
    for name, settings in CONFIGS.items():
        core = filled_core(settings)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            core.on_step(0.0)
            core.next_admissible(1 << 40)
        us = (time.perf_counter() - t0) / args.steps * 1e6
        rows.append({"config": name, "running": core.num_running, "waiting": core.num_waiting,
                     "us_per_next_admissible": us})
        print(f"{name:16} {core.num_running:7d} {core.num_waiting:7d} {us:19.1f}")
    if not args.no_save:
        print(f"saved {save('queue_scan', {'steps': args.steps, 'rows': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""vLLM's own scheduling time per step against kvadmit's, in-process.

vLLM's real V1 scheduler (kvadmit.vllm.inprocess: no model, fake outputs) with
32, 512 and 4096 running requests: mean wall time of one schedule() +
update_from_output() round for vLLM's scheduler and for kvadmit's (policy
`peak`, `adaptive`, and the empty config `{}`: auto, whose pause plan runs every
step), in the same process. The difference is kvadmit's cost.

    python bench/bench_vllm_schedule.py [--steps 30]
"""
from __future__ import annotations

import argparse
import sys
import time

from _common import save

from kvadmit.vllm import Scheduler
from kvadmit.vllm.inprocess import InProcessEngine
from kvadmit.vllm.tiny_model import build_tiny_llama


def time_steps(model_dir: str, n: int, kvadmit: dict | None, steps: int) -> float:
    eng = InProcessEngine(model_dir, scheduler_cls=Scheduler if kvadmit is not None else None,
                          additional_config={"kvadmit": kvadmit} if kvadmit is not None else None,
                          num_blocks=n * 4 + 64, block_size=32, max_model_len=1024,
                          max_num_seqs=n, max_num_batched_tokens=max(2048, n * 17))
    for i in range(n):
        eng.add([3 + i % 900] * 16, 100)   # worst case 4 blocks each: all fit, all run
    while len(eng.scheduler.running) < n:   # prefill everything first
        eng.step()
    eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    return (time.perf_counter() - t0) / steps * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="measured steps (< 80: requests must not finish)")
    ap.add_argument("--running", type=int, nargs="+", default=[32, 512, 4096])
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args(argv)
    model_dir = str(build_tiny_llama("/tmp/kvadmit-bench-tiny-llama"))
    rows = []
    print(f"{'running':>7} {'vLLM us/step':>13} {'peak us/step':>13} {'adaptive us/step':>17} "
          f"{'{} us/step':>10}")
    for n in args.running:
        row = {"running": n,
               "vllm_us": time_steps(model_dir, n, None, args.steps),
               "peak_us": time_steps(model_dir, n, {"policy": "peak"}, args.steps),
               "adaptive_us": time_steps(model_dir, n, {"policy": "adaptive"}, args.steps),
               "auto_us": time_steps(model_dir, n, {}, args.steps)}
        rows.append(row)
        print(f"{n:7d} {row['vllm_us']:13.0f} {row['peak_us']:13.0f} {row['adaptive_us']:17.0f} "
              f"{row['auto_us']:10.0f}", flush=True)
    if not args.no_save:
        print(f"saved {save('vllm_schedule', {'steps': args.steps, 'rows': rows})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

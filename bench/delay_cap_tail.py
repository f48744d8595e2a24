"""Served TTFT under max_queue_delay_s on the native engine, with the online bench's
workload and engine shape (`kvadmit bench serve`: the Azure conversation trace scaled
to max_model_len 1536, 48 blocks of 32 tokens, max_num_seqs 16, 2048-token budget),
Poisson arrivals at 1x, 1.5x and 2x the measured capacity. Per config: served, refused,
TTFT p50/p90/p99/max, the requests over 2 s and their mean prompt, and the share of
all requests served within 2 s. Deterministic.

    python bench/delay_cap_tail.py [N] ['{"NAME": {kvadmit keys}, ...}']

Default configs: the empty config and max_queue_delay_s 1 and 2 (docs/results.md, "Why
the delay cap missed its target before").
"""
import json
import random
import statistics
import sys

from kvadmit.config import AdmissionConfig
from kvadmit.simulate.engine import EngineShape, run_native
from kvadmit.simulate.run import capacity_rps
from kvadmit.simulate.steptime import get_preset
from kvadmit.simulate.workload import Workload
from kvadmit.bench.vllm import azure_workload

DEFAULT = {"auto": {}, "delay1": {"max_queue_delay_s": 1}, "delay2": {"max_queue_delay_s": 2}}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    configs = json.loads(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT
    rows = list(azure_workload("azure2023_conv", n, 1536, 2048, 0))
    prompts = [len(r.prompt_token_ids) for r in rows]
    base = Workload(name="azure", arrival_s=[i * 0.01 for i in range(n)], prompt_tokens=prompts,
                    output_tokens=[r.output_tokens for r in rows],
                    max_tokens=[r.max_tokens for r in rows])
    shape = EngineShape(num_blocks=48, block_size=32, max_model_len=1536, max_num_seqs=16,
                        max_num_batched_tokens=2048)
    step = get_preset("cpu-tiny")
    cap = capacity_rps(base, shape, step)
    print(f"capacity {cap:.2f} req/s; mean prompt {statistics.mean(prompts):.0f} tokens")
    for load in (1.0, 1.5, 2.0):
        rng, t, arrivals = random.Random(1), 0.0, []
        for _ in range(n):
            arrivals.append(t)
            t += rng.expovariate(load * cap)
        w = Workload(name="azure", arrival_s=arrivals, prompt_tokens=base.prompt_tokens,
                     output_tokens=base.output_tokens, max_tokens=base.max_tokens)
        for name, keys in configs.items():
            pr = run_native(w, AdmissionConfig.from_dict(keys), shape, step).per_request
            served = [(f - a, p) for a, f, p in zip(pr["arrival_s"], pr["first_token_s"], prompts)
                      if f >= 0]
            ttft = sorted(x for x, _ in served)
            late = [p for x, p in served if x > 2.0]
            q = lambda x: ttft[min(len(ttft) - 1, int(x * len(ttft)))]  # noqa: E731
            print(f"load {load:g} {name}: served {len(ttft)}, refused "
                  f"{sum(1 for r in pr['rejected'] if r)}; TTFT p50 {q(.5):.2f} p90 {q(.9):.2f} "
                  f"p99 {q(.99):.2f} max {ttft[-1]:.2f} s; over 2 s: {len(late)} (mean prompt "
                  f"{statistics.mean(late) if late else 0:.0f}); within 2 s: "
                  f"{sum(1 for x in ttft if x <= 2) / n:.3f} of all")


if __name__ == "__main__":
    main()

"""Every admission policy on a trace sample in the lockstep-decode model.

The model is a test oracle (tests/oracle/lockstep.py: the model under which
reserve and peak guarantee no preemption), not an engine: no step times, no
chunked prefill, no token budget. This script reproduces the recorded table
(bench/results/lockstep_azure2000.json, docs/results.md); to compare policies on
a trace with time, use `kvadmit simulate --trace ...`.

    python bench/lockstep_compare.py --trace azure2023_conv --requests 2000 \
        --policies overcommit reserve peak predict adaptive --json bench/results/lockstep_azure2000.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

# The oracle lives with the tests it serves.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

from oracle.lockstep import Request, run_lockstep  # noqa: E402

from kvadmit import POLICIES  # noqa: E402
from kvadmit.config import AdmissionConfig, ConfigError  # noqa: E402


def compare(args: argparse.Namespace) -> int:
    from kvadmit.simulate.run import progress_line
    from kvadmit.traces import load_trace, max_tokens_for, scale_rate

    base = AdmissionConfig.from_json(args.config) if args.config else AdmissionConfig()
    trace = scale_rate(load_trace(args.trace, limit=args.requests), args.rate)
    reqs = []
    for r in trace:
        # Requests over max_model_len stay in: the core refuses them (context_length).
        m = max_tokens_for(r, args.max_tokens_rule, args.max_tokens, args.max_model_len)
        reqs.append(Request(int(r.arrival_s * 1000 / args.step_ms), r.prompt_tokens, m,
                            r.output_tokens))
    print(f"{len(reqs)} requests from {args.trace} at x{args.rate} rate; max_tokens rule "
          f"'{args.max_tokens_rule}' (cap {args.max_tokens}); pool {args.num_blocks} blocks x "
          f"{args.block_size} tokens; max_model_len {args.max_model_len}; 1 step = {args.step_ms} ms")
    rows = []
    for policy in args.policies:
        cfg = base.replace(policy=policy)
        t0 = time.perf_counter()
        prog = progress_line(policy)
        res = run_lockstep(cfg, reqs, args.num_blocks, args.block_size, args.max_model_len,
                           progress=lambda step, r: prog(r.finished + sum(r.rejected.values()),
                                                         len(reqs)))
        prog(None, None)
        rows.append({"policy": policy, "wall_s": time.perf_counter() - t0, **vars(res)})
    print(f"{'policy':11} {'steps':>8} {'preempt':>8} {'recomputed':>11} {'mean run':>9} "
          f"{'finished':>9} {'rejected':>9} {'wall s':>7}")
    for r in rows:
        print(f"{r['policy']:11} {r['steps']:8d} {r['preemptions']:8d} {r['recomputed_tokens']:11d} "
              f"{r['mean_running']:9.1f} {r['finished']:9d} {sum(r['rejected'].values()):9d} "
              f"{r['wall_s']:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)
        print(f"saved {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True, help="an Azure .csv or Mooncake .jsonl trace, or a "
                   "bundled one by name (azure2023_conv, mooncake_conversation)")
    p.add_argument("--requests", type=int, default=2000, help="first N requests of the trace")
    p.add_argument("--rate", type=float, default=1.0, help="arrival-rate multiplier")
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-tokens", type=int, default=2048, help="max_tokens cap given to requests")
    p.add_argument("--max-tokens-rule", choices=("cap", "context"), default="cap")
    p.add_argument("--step-ms", type=float, default=25.0, help="wall time of one step, for arrivals")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--config", help="JSON with other AdmissionConfig keys")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    try:
        return compare(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"lockstep_compare: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

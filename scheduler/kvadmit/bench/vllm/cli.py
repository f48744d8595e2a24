"""Real vLLM engine, same workload, vLLM's scheduler against each kvadmit policy.

The command line of `kvadmit bench vllm` (and `python -m kvadmit.bench.vllm`): its
flags, where the JSON, chart and engine log go, and the run (one workload, or --suite).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

import torch

from kvadmit.bench.vllm import run
from kvadmit.bench.vllm.configs import (CONFIG_DOCS, QUEUED_DOC, BenchConfig, BenchEngine,
                                        default_configs, parse_config, split_configs)
from kvadmit.bench.vllm.output import plot, print_table, save_json
from kvadmit.bench.vllm.run import run_configs, warm_up
from kvadmit.bench.vllm.suite import SUITE, SUITE_CONFIGS, run_suite
from kvadmit.bench.vllm.workload import DEFAULT_TRACE, build_workload
from kvadmit.vllm.engine_log import engine_log, say
from kvadmit.vllm.tiny_model import DEFAULT_DIR

def _use_inline_engine_core() -> None:
    """vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): an engine
    starts in seconds instead of spawning two Python processes (~40 s on 2 busy cores).
    The scheduler, model runner and outputs are the same code; only the front end and
    the engine core no longer overlap, so wall times are longer."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    torch.set_num_threads(1)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    args.argv = argv
    configs = _checked_configs(ap, args)
    if args.inline_engine_core if args.inline_engine_core is not None else args.suite:
        _use_inline_engine_core()
    _resolve_outputs(args)
    run.restart_clock()
    with engine_log(args.log):
        return _run(args, argv, configs)


def build_parser() -> argparse.ArgumentParser:
    """`kvadmit bench vllm`'s flags."""
    ap = argparse.ArgumentParser(
        prog="kvadmit bench vllm", description=__doc__.splitlines()[0],
        epilog="Configs: " + "; ".join(f"{k}: {v}" for k, v in CONFIG_DOCS.items()) +
               "; vllm-watermark=F: vLLM's --watermark F (admissions keep that share of the pool "
               "free); vllm-active=N: vLLM's --max-num-active-seqs N; vllm-queued=N: "
               + QUEUED_DOC.format("N") + "; NAME=JSON: kvadmit with those AdmissionConfig keys.")
    ap.add_argument("--suite", action="store_true",
                    help="a fixed set of workloads (azure-cap, azure-real, equal-burst, loose-pool), "
                         "each with vllm-default, vLLM's watermarks 0.01/0.05/0.1, kvadmit-default "
                         "and peak, beside the simulator's native engine on the same requests; "
                         "saves bench/results/vllm_cpu_suite.json")
    ap.add_argument("--cases", nargs="+", default=None, metavar="NAME",
                    help=f"--suite: only these workloads (of {', '.join(c.name for c in SUITE)})")
    ap.add_argument("--workload", choices=("synthetic", "azure"), default="azure")
    ap.add_argument("--trace", default=None,
                    help="the Azure trace: a path to its CSV (optionally .gz) or a bundled trace's "
                         f"name (default: {DEFAULT_TRACE}, the copy shipped in the package)")
    ap.add_argument("--requests", type=int, default=None,
                    help="requests in the workload (default 256; --suite: each workload's own)")
    ap.add_argument("--num-blocks", type=int, default=33)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="vLLM's token budget per step (default: vLLM's; --suite: 2048, the "
                         "simulator's tiny-engine shape)")
    ap.add_argument("--max-tokens", type=int, default=2048,
                    help="the cap requests carry (azure: scaled like the lengths)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="every request runs to max_tokens (no early stop)")
    ap.add_argument("--caps", choices=("cap", "real"), default="cap",
                    help="max_tokens each request carries: the (scaled) cap, or its real output "
                         "length (a client that knows it: what peak and reserve assume)")
    ap.add_argument("--configs", nargs="+", default=None, metavar="CONFIG",
                    help="configs to run, separated by spaces or commas (default: "
                         f"{', '.join(default_configs())}; --suite: {', '.join(SUITE_CONFIGS)}); also "
                         "vllm-watermark=F, vllm-active=N, vllm-queued=N, or NAME=JSON for a "
                         "kvadmit config (see below)")
    ap.add_argument("--order", choices=("shuffle", "given", "reverse"), default="shuffle",
                    help="the order the configs' engines run in (rows print in the given order); "
                         "shuffle: a permutation seeded by --seed (per workload in --suite)")
    ap.add_argument("--seed", type=int, default=0, help="seed of --order shuffle")
    ap.add_argument("--warmup", type=int, default=16, metavar="N",
                    help="requests of one discarded warm-up engine run first (0: none)")
    ap.add_argument("--inline-engine-core", action=argparse.BooleanOptionalAction, default=None,
                    help="run vLLM's engine core in this process (engines start in seconds; "
                         "default with --suite) instead of its own processes (vLLM's default)")
    ap.add_argument("--model-dir", default=str(DEFAULT_DIR),
                    help="where the tiny random-weight Llama is built (if missing)")
    ap.add_argument("--model", default=None,
                    help="use this local model instead of the tiny one (its eos id must be 2 "
                         "for real-length stops, or pass --ignore-eos)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--json", default=None,
                    help="write the rows here ('' to skip; default "
                         "bench/results/vllm_cpu_{workload}.json, --suite: vllm_cpu_suite.json)")
    ap.add_argument("--plot", default="bench/results/vllm_cpu_{workload}.png",
                    help="write a PNG comparison here ('' to skip; not with --suite)")
    ap.add_argument("--keep-tokens", action="store_true", help="keep token ids in the JSON")
    ap.add_argument("--log", default=None,
                    help="where vLLM's engine output goes (its INFO logs, progress bars; the "
                         "terminal shows one line per engine, the table, and each distinct "
                         "warning or error once). Default: beside the JSON, .log for .json (a "
                         "temporary file without a JSON); '' lets vLLM print to the terminal")
    return ap


def _checked_configs(ap: argparse.ArgumentParser, args) -> list[BenchConfig]:
    """--configs (or the defaults) parsed, and --cases checked; a bad one is the
    parser's error (exit 2, naming it)."""
    try:
        configs = [parse_config(c) for c in
                   split_configs(args.configs or (SUITE_CONFIGS if args.suite else default_configs()))]
        if args.cases and not args.suite:
            raise ValueError("--cases needs --suite")
        unknown = set(args.cases or ()) - {c.name for c in SUITE}
        if unknown:
            raise ValueError(f"--cases {', '.join(sorted(unknown))}: not one of "
                             f"{', '.join(c.name for c in SUITE)}")
    except ValueError as e:
        ap.error(str(e))
    return configs


def _resolve_outputs(args) -> None:
    """Where the JSON, the chart and vLLM's engine log go (the defaults filled in)."""
    if args.suite:
        args.json = "bench/results/vllm_cpu_suite.json" if args.json is None else args.json
    else:
        args.json = (args.json if args.json is not None else "bench/results/vllm_cpu_{workload}.json")
        args.json = args.json.format(workload=args.workload) if args.json else None
        args.plot = args.plot.format(workload=args.workload) if args.plot else None
    if args.log is None:
        import tempfile
        args.log = (str(pathlib.Path(args.json).with_suffix(".log")) if args.json else
                    str(pathlib.Path(tempfile.gettempdir()) /
                        f"kvadmit-bench-vllm-{'suite' if args.suite else args.workload}.log"))


def _run(args, argv: list[str], configs: list[BenchConfig]) -> int:
    from kvadmit.vllm.tiny_model import build_tiny_llama
    model_dir = args.model or str(build_tiny_llama(args.model_dir))
    if args.suite:
        out = run_suite(args, model_dir, configs)
        if args.json:
            save_json(args.json, out, args)
        return 0

    stop_early = not args.ignore_eos
    engine = BenchEngine(args.num_blocks, args.block_size, args.max_model_len, args.max_num_seqs,
                         args.max_num_batched_tokens, args.dtype)
    workload, source = build_workload(args.workload, args.requests or 256, args.max_model_len,
                                      args.max_tokens, args.caps, stop_early, args.trace)
    say(f"workload: {source}; pool {args.num_blocks} blocks x {args.block_size}; "
        f"max_model_len {args.max_model_len}", flush=True)
    warm_up(model_dir, workload, engine, stop_early, args.warmup)
    rows = run_configs(configs, model_dir, workload, engine, stop_early, args.order, args.seed)
    print_table(rows)
    if not args.keep_tokens:
        for r in rows:
            r.pop("tokens")
    if args.json:
        save_json(args.json, {"command": " ".join(["kvadmit", "bench", "vllm", *argv]),
                          "workload": source, "configs": {c.label: c.doc for c in configs},
                          "rows": rows}, args)
    if args.plot:
        plot(rows, args.plot, source)
        say(f"saved {args.plot}")
    return 0

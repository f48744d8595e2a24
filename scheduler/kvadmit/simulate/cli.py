"""`kvadmit simulate`: compare admission policies on a workload, on a virtual clock.

    kvadmit simulate --trace azure2023_conv --preset h100-8b --load 1.5
    kvadmit simulate --trace azure2023_conv --preset h100-8b \\
        --sweep 0.5 0.75 1 1.25 1.5 2 --plot bench/results/sim_azure_cliff.png
    kvadmit simulate --synthetic agents --requests 2000 --prefix-caching --rate 2
"""
from __future__ import annotations

import argparse
import math
import time

from kvadmit.config import AdmissionConfig
from kvadmit.simulate.engine import EngineShape
from kvadmit.simulate.metrics import Slo
from kvadmit.simulate.policies import BUILTIN, DEFAULT_POLICIES, parse_policy
from kvadmit.simulate.run import (at_load, capacity_rps, compare, load_entry, offered_rps, pyplot,
                                  recorded_command, save_figure, save_json)
from kvadmit.simulate.steptime import PRESETS, StepTimeModel, get_preset
from kvadmit.simulate.workload import KV_HOLDS, agent_sessions, from_trace, mixed, synthetic


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="replay a workload through each policy on a virtual clock",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="an Azure .csv or Mooncake .jsonl trace (optionally .gz), or "
                     "a bundled one by name: azure2023_conv, mooncake_conversation")
    src.add_argument("--synthetic", choices=("poisson", "gamma", "agents", "mixed"),
                     help="generated workload (gamma: bursty arrivals, cv --burst-cv; mixed: "
                     "interactive + batch requests with their own SLOs)")
    p.add_argument("--requests", type=int, help="trace: first N requests; synthetic: N requests "
                   "(agents: N sessions); default: whole trace / 2000")
    p.add_argument("--repeat", type=int, default=1, help="trace: replay it back to back N times")
    p.add_argument("--rate", type=float, help="trace: arrival-rate multiplier (default 1); "
                   "synthetic: requests (sessions) per second (default 10)")
    p.add_argument("--load", type=float, help="offered load as a multiple of the engine's "
                   "capacity (overrides --rate; see kvadmit.simulate.run.capacity_rps)")
    p.add_argument("--sweep", type=float, nargs="+", metavar="LOAD",
                   help="run every policy at each of these loads (multiples of capacity)")
    p.add_argument("--burst-cv", type=float, default=3.0, help="gamma: inter-arrival CV")
    p.add_argument("--interactive-share", type=float, default=0.7, help="mixed: interactive share")
    p.add_argument("--turns", type=float, default=8.0, help="agents: mean turns a session")
    p.add_argument("--tool-wait", type=float, default=2.0, help="agents: mean tool wait, seconds")
    p.add_argument("--kv-hold", choices=KV_HOLDS, default="none",
                   help="agents: the kv_hold_s clients send (done: a session's last turn says it "
                   "is done, kvadmit evicts its KV first; docs/slo-agents.md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens-rule", choices=("cap", "context"), default="context",
                   help="traces: max_tokens = the cap, or min(cap, context left)")
    p.add_argument("--max-tokens", type=int, default=2048, help="max_tokens cap")
    p.add_argument("--engine", choices=("native", "vllm"), default="native")
    p.add_argument("--model-dir", help="--engine vllm: tiny model dir (built there if missing)")
    p.add_argument("--preset", default="h100-8b", choices=sorted(PRESETS),
                   help="step-time model and KV pool (kvadmit.simulate.steptime)")
    p.add_argument("--step-time", type=float, nargs=3, metavar=("A", "B", "C"),
                   help="your own T = A + B*tokens + C*context (seconds)")
    p.add_argument("--num-blocks", type=int, help="KV pool (default: the preset's)")
    p.add_argument("--block-size", type=int, help="default: the preset's")
    p.add_argument("--max-model-len", type=int, help="default: the preset's")
    p.add_argument("--max-num-seqs", type=int, default=1024,
                   help="vLLM 0.32's default on 80 GB+ GPUs")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--prefix-caching", action="store_true",
                   help="reuse KV of shared prefixes (Mooncake hash_ids, agent sessions)")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="vLLM's --scheduling-policy: priority orders the queue by each "
                   "request's priority (the workload's column; mixed: interactive 0, batch 1) "
                   "and preempts the least important first, for every row")
    p.add_argument("--policies", nargs="+", metavar="POLICY",
                   help=f"built-in ({', '.join(BUILTIN)}) or NAME=JSON with kvadmit keys "
                   f"(default: all built-in; with --instances: vllm-default and auto)")
    p.add_argument("--config", help="JSON of kvadmit keys applied to kvadmit's policies "
                   "(peak, adaptive, oracle, custom), e.g. queue caps")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO, seconds")
    p.add_argument("--slo-tpot", type=float, default=0.1, help="TPOT SLO, seconds")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--plot", help="write a PNG here (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    from kvadmit.simulate.fleet_cli import add_fleet_arguments
    add_fleet_arguments(p)
    p.set_defaults(fn=cmd_simulate)


def build_workload(args, shape: EngineShape):
    max_model_len = shape.max_model_len
    if args.trace:
        return from_trace(args.trace, limit=args.requests, rate=1.0,
                          max_tokens_rule=args.max_tokens_rule, max_tokens_cap=args.max_tokens,
                          max_model_len=max_model_len, repeat=args.repeat)
    n = args.requests or 2000
    rate = args.rate or 10.0
    if args.synthetic == "agents":
        return agent_sessions(n, rate, seed=args.seed, max_tokens_cap=args.max_tokens,
                              max_model_len=max_model_len, block_tokens=shape.block_size,
                              turns_mean=args.turns, tool_wait_mean_s=args.tool_wait,
                              kv_hold=args.kv_hold)
    if args.synthetic == "mixed":
        return mixed(n, rate, seed=args.seed, interactive_share=args.interactive_share,
                     max_tokens_cap=args.max_tokens, max_model_len=max_model_len)
    return synthetic(n, rate, seed=args.seed, burst_cv=1.0 if args.synthetic == "poisson" else args.burst_cv,
                     max_tokens_cap=args.max_tokens, max_model_len=max_model_len)


def _fmt_row(r: dict, width: int = 16) -> str:
    rej = sum(r["rejected"].values())
    return (f"{r['policy']:{width}} {r['goodput'] * 100:7.1f}% {r['throughput_tok_s']:9.0f} "
            f"{r['ttft_p50_s']:8.2f} {r['ttft_p99_s']:8.2f} {r['tpot_p50_s'] * 1e3:7.1f} "
            f"{r['tpot_p99_s'] * 1e3:7.1f} {r['preemptions']:8d} {r['recomputed_tokens']:10d} "
            f"{rej:7d} {r['kv_util_mean'] * 100:5.1f}% {r['kv_util_peak'] * 100:5.1f}% "
            f"{r['prefix_hit_rate'] * 100:5.1f}% {r['wall_s']:6.1f}")


def _header(width: int) -> str:
    return (f"{'policy':{width}} {'goodput':>8} {'tok/s':>9} {'TTFTp50':>8} {'TTFTp99':>8} "
            f"{'TPOTp50':>7} {'TPOTp99':>7} {'preempt':>8} {'recompute':>10} {'reject':>7} "
            f"{'KVmean':>6} {'KVpeak':>6} {'hit':>6} {'wall':>6}\n"
            f"{'':{width}} {'':>8} {'':>9} {'s':>8} {'s':>8} {'ms':>7} {'ms':>7}")


def print_table(title: str, rows: list[dict]) -> None:
    width = max([16] + [len(r["policy"]) for r in rows])
    print(title)
    print(_header(width))
    for r in rows:
        print(_fmt_row(r, width))


def cmd_simulate(args: argparse.Namespace) -> int:
    step = get_preset(args.preset)
    if args.step_time:
        step = StepTimeModel(*args.step_time, name="custom", num_blocks=step.num_blocks,
                             block_size=step.block_size, max_model_len=step.max_model_len)
    shape = EngineShape(
        num_blocks=args.num_blocks or step.num_blocks, block_size=args.block_size or step.block_size,
        max_model_len=args.max_model_len or step.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        chunked_prefill=not args.no_chunked_prefill, prefix_caching=args.prefix_caching,
        scheduling_policy=args.scheduling_policy)
    base = AdmissionConfig.from_json(args.config) if args.config else AdmissionConfig()
    if args.instances is not None:
        from kvadmit.simulate.fleet_cli import check_fleet_args
        check_fleet_args(args)
    policies = [parse_policy(p) for p in args.policies or DEFAULT_POLICIES]
    slo = Slo(args.slo_ttft, args.slo_tpot)
    model_dir = None
    if args.engine == "vllm":
        from kvadmit.vllm.tiny_model import DEFAULT_DIR, build_tiny_llama
        model_dir = str(build_tiny_llama(args.model_dir or DEFAULT_DIR))
    workload = build_workload(args, shape)
    if args.trace and args.rate and not (args.load or args.sweep):
        workload = workload.scaled(args.rate)
    print(f"workload: {workload.description}")
    print(f"engine: {args.engine}; step time: {step.name} (a={step.a * 1e3:.3g} ms, "
          f"b={step.b * 1e6:.3g} us/token, c={step.c * 1e9:.3g} ns/context token); KV pool "
          f"{shape.num_blocks} blocks x {shape.block_size} tokens; max_model_len "
          f"{shape.max_model_len}; max_num_seqs {shape.max_num_seqs}; token budget "
          f"{shape.max_num_batched_tokens}{'' if shape.chunked_prefill else ', no chunked prefill'}"
          f"{', prefix caching' if shape.prefix_caching else ''}"
          f"{', priority scheduling' if shape.scheduling_policy == 'priority' else ''}")
    if workload.ttft_slo_s is not None:
        print("SLO: each request's own TTFT and TPOT targets; goodput = share of all requests "
              "meeting both")
    else:
        print(f"SLO: TTFT <= {slo.ttft_s:g} s and TPOT <= {slo.tpot_s * 1e3:g} ms (also the targets "
              f"kvadmit's slo_guard sees); goodput = share of all requests meeting both")
    if args.instances is not None:
        from kvadmit.simulate.fleet_cli import cmd_fleet
        return cmd_fleet(args, workload, shape, step, base, slo, model_dir)
    cap = None
    if args.load or args.sweep:
        cap = capacity_rps(workload, shape, step)
        print(f"capacity (saturated, vLLM's rule, native engine): {cap:.2f} req/s; "
              f"the workload offers {offered_rps(workload):.2f} req/s as given")
    out = {"command": recorded_command(),
           "workload": workload.description, "engine": args.engine, "step_time": step.as_dict(),
           "shape": shape.__dict__, "slo": slo.__dict__, "capacity_rps": cap,
           "policies": {p.name: p.doc for p in policies}, "runs": []}
    series = None
    loads = args.sweep or [args.load] if (args.sweep or args.load) else [None]
    t_all = time.perf_counter()
    for load in loads:
        w = at_load(workload, load, cap) if load is not None else workload
        rows, raws = compare(w, policies, args.engine, shape, step, base, slo, model_dir,
                             show_progress=not args.quiet)
        title = f"\nload {load:g}x capacity ({offered_rps(w):.2f} req/s)" if load is not None else ""
        print_table(title, rows)
        out["runs"].append(load_entry(load, w, rows))
        if series is None or (load is not None and abs(load - 1.5) < abs(series[0] - 1.5)):
            series = (load if load is not None else math.nan,
                      {k: r.timeline for k, r in raws.items()}, shape.num_blocks)
    print(f"\n{len(loads) * len(policies)} runs in {time.perf_counter() - t_all:.1f} s")
    if args.json:
        save_json(out, args.json)
    if args.plot:
        plot(out, series, args.plot)
    return 0


def plot(out: dict, series, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    sweep = len(out["runs"]) > 1
    load, timelines, nblocks = series
    hits = any(tl.get("prefix_query_tokens") and tl["prefix_query_tokens"][-1] > 0
               for tl in timelines.values())
    n = 2 + sweep + hits
    fig, axes = plt.subplots(1, n, figsize=(5.8 * n, 4.5))
    ax = list(axes)
    if sweep:
        a = ax.pop(0)
        names = [r["policy"] for r in out["runs"][0]["rows"]]
        for name in names:
            xs = [run["load"] for run in out["runs"]]
            ys = [next(r for r in run["rows"] if r["policy"] == name)["goodput"] * 100
                  for run in out["runs"]]
            a.plot(xs, ys, marker="o", label=name)
        a.set_xlabel("offered load (x capacity)")
        a.set_ylabel("goodput (% of requests meeting the SLO)")
        a.set_title("goodput vs load")
        a.legend(fontsize=8)
    for name, tl in timelines.items():
        t0 = tl["t"][0] if tl["t"] else 0.0
        ts = [t - t0 for t in tl["t"]]
        ax[0].plot(ts, [u / nblocks * 100 for u in tl["used_blocks"]], label=name, lw=0.8)
        ax[1].plot(ts, tl["preemptions"], label=name, lw=0.8)
        if hits:
            # hit rate over a sliding window of 10 samples
            h, q = tl["prefix_hit_tokens"], tl["prefix_query_tokens"]
            rate = [(h[i] - h[max(0, i - 10)]) / (q[i] - q[max(0, i - 10)]) * 100
                    if q[i] > q[max(0, i - 10)] else float("nan") for i in range(len(q))]
            ax[2].plot(ts, rate, label=name, lw=0.8)
    lab = f" (load {load:g}x)" if load == load else ""
    ax[0].set_title("KV utilization" + lab)
    ax[0].set_xlabel("virtual time (s)")
    ax[0].set_ylabel("% of blocks used")
    ax[1].set_title("preemptions so far" + lab)
    ax[1].set_xlabel("virtual time (s)")
    ax[1].legend(fontsize=8)
    if hits:
        ax[2].set_title("prefix hit rate" + lab)
        ax[2].set_xlabel("virtual time (s)")
        ax[2].set_ylabel("% of prompt tokens from cache")
    fig.suptitle(out["workload"], fontsize=9)
    save_figure(fig, path)

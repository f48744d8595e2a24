"""`kvadmit simulate --instances N --router NAME`: a fleet behind a router.

    kvadmit simulate --trace azure2023_conv --preset h100-8b \\
        --instances 8 --router gie headroom --policies vllm-default auto --load 1.5
    kvadmit simulate --trace azure2023_conv --instances 8 \\
        --sweep 0.5 1 1.5 --plot bench/results/fleet_azure.png --json bench/results/fleet_azure.json

Every policy in --policies is a fleet of N instances of it (--instance-policies:
one fleet with a policy per instance), behind each router in --router; --load
and --sweep are multiples of the fleet's capacity (N x one engine's).
"""
from __future__ import annotations

import argparse
import time

from kvadmit.config import AdmissionConfig
from kvadmit.simulate.engine import EngineShape
from kvadmit.simulate.fleet import (MAX_INSTANCES, FleetSetup, check_open_loop, run_fleet,
                                    summarize_fleet)
from kvadmit.simulate.metrics import Slo
from kvadmit.simulate.policies import parse_policy
from kvadmit.simulate.routers import ROUTERS
from kvadmit.simulate.run import (at_load, capacity_rps, load_entry, offered_rps, progress_line, pyplot,
                                  recorded_command, save_figure, save_json)
from kvadmit.simulate.steptime import StepTimeModel
from kvadmit.simulate.workload import Workload

FLEET_POLICIES = ["vllm-default", "auto"]


def add_fleet_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fleet (kvadmit.simulate.fleet)")
    g.add_argument("--instances", type=int, metavar="N",
                   help=f"simulate N engines behind a router (1..{MAX_INSTANCES})")
    g.add_argument("--router", nargs="+", metavar="NAME",
                   help=f"routers to compare: {', '.join(ROUTERS)} (default: all; prefix only "
                   f"for workloads with prefix ids)")
    g.add_argument("--instance-policies", nargs="+", metavar="POLICY",
                   help="one policy per instance (a mixed fleet), instead of --policies")
    g.add_argument("--scrape-interval", type=float, default=0.2, metavar="S",
                   help="seconds between the router's scrapes of the instances' signals "
                   "(their staleness; default 0.2, GIE's staleness bound)")
    g.add_argument("--max-retries", type=int, default=3,
                   help="retries a client makes after a retryable refusal (default 3)")
    g.add_argument("--retry-backoff", type=float, default=1.0, metavar="S",
                   help="a client's wait after a refusal without Retry-After (default 1 s)")
    g.add_argument("--busy-threshold", type=float, default=0.9,
                   help="dynamo: share of the KV pool in active blocks that makes an instance busy")


def check_fleet_args(args: argparse.Namespace) -> None:
    """Bad fleet flags fail before anything is loaded, naming the flag and its limit."""
    if not 1 <= args.instances <= MAX_INSTANCES:
        raise ValueError(f"--instances {args.instances}: must be in [1, {MAX_INSTANCES}]")
    for r in args.router or []:
        if r not in ROUTERS:
            raise ValueError(f"--router {r!r}: must be one of {', '.join(ROUTERS)}")
    if args.instance_policies is not None:
        if len(args.instance_policies) != args.instances:
            raise ValueError(f"--instance-policies: {len(args.instance_policies)} given, expected "
                             f"one per instance (--instances {args.instances})")
        if args.policies:
            raise ValueError("--instance-policies and --policies: give one or the other")
    for p in (args.policies or []) + (args.instance_policies or []):
        parse_policy(p)
    setup(args, [parse_policy("auto")] * args.instances, "gie")   # checks the numbers


def setup(args, policies, router: str) -> FleetSetup:
    return FleetSetup(tuple(policies), router, scrape_interval_s=args.scrape_interval,
                      max_retries=args.max_retries, retry_backoff_s=args.retry_backoff,
                      busy_threshold=args.busy_threshold, seed=args.seed)


def fleets(args) -> list[list]:
    if args.instance_policies:
        return [[parse_policy(p) for p in args.instance_policies]]
    return [[parse_policy(p)] * args.instances for p in (args.policies or FLEET_POLICIES)]


def routers_for(args, workload: Workload) -> list[str]:
    if args.router:
        return list(args.router)
    return [r for r in ROUTERS if r != "prefix" or workload.hash_ids is not None]


HEADER = (f"{'policy':16} {'router':14} {'goodput':>8} {'tok/s':>9} {'TTFTp50':>8} {'TTFTp99':>8} "
          f"{'TPOTp50':>7} {'TPOTp99':>7} {'preempt':>8} {'refused':>8} {'retries':>8} "
          f"{'imbal':>6} {'wall':>6}")


def fmt_row(r: dict) -> str:
    return (f"{r['policy']:16} {r['router']:14} {r['goodput'] * 100:7.1f}% {r['throughput_tok_s']:9.0f} "
            f"{r['ttft_p50_s']:8.2f} {r['ttft_p99_s']:8.2f} {r['tpot_p50_s'] * 1e3:7.1f} "
            f"{r['tpot_p99_s'] * 1e3:7.1f} {r['preemptions']:8d} {sum(r['rejected'].values()):8d} "
            f"{r['retries']:8d} {r['imbalance']:6.2f} {r['wall_s']:6.1f}")


def vllm_instances(workload: Workload, step: StepTimeModel, base: AdmissionConfig,
                   model_dir: str):
    """`run_fleet`'s make_engine for --engine vllm: each instance vLLM's V1 scheduler
    in-process on the virtual clock (vLLM's own for a vllm-* policy, else kvadmit's)."""
    from kvadmit.simulate.vllm_engine import VllmEngine

    def make_engine(policy, shape):
        return VllmEngine(None if policy.vllm_own else policy.config(base), shape, step,
                          model_dir, workload.sample_interval_s(),
                          hash_block_tokens=workload.hash_block_tokens)
    return make_engine


def cmd_fleet(args, workload: Workload, shape: EngineShape, step: StepTimeModel,
              base: AdmissionConfig, slo: Slo, model_dir: str | None = None) -> int:
    check_open_loop(workload)          # before the capacity runs, not after
    n = args.instances
    routers = routers_for(args, workload)
    configs = fleets(args)
    print(f"fleet: {n} instances of {'vLLM' if model_dir else 'the native engine model'}; routers {', '.join(routers)}; scrape every "
          f"{args.scrape_interval:g} s; clients retry a refusal up to {args.max_retries} times "
          f"(after its Retry-After, else {args.retry_backoff:g} s)")
    cap = None
    if args.load or args.sweep:
        cap = n * capacity_rps(workload, shape, step)
        print(f"fleet capacity: {cap:.2f} req/s ({n} x one engine's, saturated under vLLM's rule); "
              f"the workload offers {offered_rps(workload):.2f} req/s as given")
    out = {"command": recorded_command(),
           "workload": workload.description, "instances": n, "step_time": step.as_dict(),
           "shape": shape.__dict__, "slo": slo.__dict__, "capacity_rps": cap,
           "scrape_interval_s": args.scrape_interval, "max_retries": args.max_retries,
           "retry_backoff_s": args.retry_backoff, "busy_threshold": args.busy_threshold,
           "routers": routers, "runs": []}
    loads = args.sweep or ([args.load] if args.load else [None])
    t_all = time.perf_counter()
    for load in loads:
        w = at_load(workload, load, cap) if load is not None else workload
        if load is not None:
            print(f"\nload {load:g}x fleet capacity ({offered_rps(w):.2f} req/s)")
        print(HEADER)
        rows = []
        for policies in configs:
            for router in routers:
                fs = setup(args, policies, router)
                prog = None if args.quiet else progress_line(f"{fs.label} / {router}", "arrivals routed")
                make = vllm_instances(w, step, base, model_dir) if model_dir else None
                run = run_fleet(w, fs, shape, step, base, slo, progress=prog, make_engine=make)
                if prog:
                    prog(None, None)
                row = {"policy": fs.label, "router": router, "wall_s": run.wall_s,
                       **summarize_fleet(run, w, slo)}
                rows.append(row)
                print(fmt_row(row), flush=True)
        out["runs"].append(load_entry(load, w, rows))
    print(f"\n{len(loads) * len(configs) * len(routers)} fleet runs in "
          f"{time.perf_counter() - t_all:.1f} s")
    if args.json:
        save_json(out, args.json)
    if args.plot:
        plot(out, args.plot)
    return 0


def plot(out: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = out["runs"]
    xs = [r["load"] if r["load"] is not None else i for i, r in enumerate(runs)]
    keys = [(r["policy"], r["router"]) for r in runs[0]["rows"]]
    fig, ax = plt.subplots(1, 3, figsize=(17, 4.8))
    for key in keys:
        pick = [next(x for x in run["rows"] if (x["policy"], x["router"]) == key) for run in runs]
        label = f"{key[0]} / {key[1]}"
        ax[0].plot(xs, [p["goodput"] * 100 for p in pick], marker="o", label=label)
        ax[1].plot(xs, [p["ttft_p99_s"] for p in pick], marker="o", label=label)
        ax[2].plot(xs, [p["tpot_p99_s"] * 1e3 for p in pick], marker="o", label=label)
    for a, title, unit in zip(ax, ("goodput", "TTFT p99", "TPOT p99"),
                              ("% of requests meeting the SLO", "s", "ms")):
        a.set_xlabel("offered load (x fleet capacity)")
        a.set_ylabel(unit)
        a.set_title(title)
    ax[1].set_yscale("log")
    ax[0].legend(fontsize=7)
    fig.suptitle(f"{out['instances']} instances: {out['workload']}", fontsize=9)
    save_figure(fig, path)

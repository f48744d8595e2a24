"""`kvadmit bench serve`: the online benchmark. Goodput against load, past saturation,
on `vllm serve`, driven by vLLM's own load generator (`vllm bench serve`).

The command line (its flags, checked before any server starts) and the run: the
capacity first, then the trace's sweep and, with --fixed-length, the fixed-length one;
then the JSON and the chart. What it measures and how: kvadmit.bench.serve.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import signal
import sys
import tempfile
import time

from kvadmit.bench.serve.configs import (DEFAULT_CONFIGS, ServeConfig, counting,
                                         documented_queue_cap, parse_config, queue_delay_for)
from kvadmit.bench.serve.loadgen import client_main, trace_rows
from kvadmit.bench.serve.points import paired_sweep, run_point, sweep
from kvadmit.bench.serve.report import (goal_figures, machine, paired_ratios, plot, print_paired,
                                        print_table, summarize)
from kvadmit.bench.serve.server import Engine, Server

DEFAULT_TRACE = "azure2023_conv"          # bundled with the package (kvadmit.traces.BUNDLED)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvadmit bench serve", description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Configs: vllm-default (vLLM's own scheduler); vllm-queued[=N] (vLLM's "
               "--max-num-queued-reqs; without N: vLLM's documented rule, max_num_seqs plus "
               "the queue depth drained within the TTFT target, capacity x --ttft-ms); "
               "vllm-watermark=F (vLLM's --watermark); kvadmit-default (the empty config); "
               "kvadmit-delay[=S] (max_queue_delay_s, default half the TTFT target); NAME=JSON "
               "(kvadmit's keys).\n\n`kvadmit bench serve client [vllm bench serve flags]` runs "
               "vLLM's own client (the CPU build's `vllm` command does not start).")
    from kvadmit.traces import BUNDLED_HELP
    ap.add_argument("--trace", default=DEFAULT_TRACE,
                    help=f"the Azure conversation trace: {BUNDLED_HELP} (default {DEFAULT_TRACE})")
    ap.add_argument("--requests", type=int, default=200, help="requests per point")
    ap.add_argument("--load", type=float, nargs="+", default=[0.25, 0.5, 0.8, 1.0, 1.5, 2.0],
                    help="offered loads, as multiples of the measured capacity")
    ap.add_argument("--capacity", type=float, default=None,
                    help="req/s to scale --load by (default: measured, a burst on vllm-default)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each point")
    ap.add_argument("--seeds", type=int, default=None, metavar="N",
                    help="the paired protocol instead of --repeats: N seeds (from --seed), each "
                         "measuring its own capacity and running every config back to back at "
                         "each load; prints each config's per-seed ratios to vllm-default, their "
                         "median and the worst seed")
    ap.add_argument("--burstiness", type=float, default=1.0,
                    help="vllm bench serve --burstiness: 1 Poisson, < 1 burstier")
    ap.add_argument("--ttft-ms", type=float, default=2000.0, help="goodput's TTFT target")
    ap.add_argument("--tpot-ms", type=float, default=50.0, help="goodput's TPOT target")
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), metavar="CONFIG")
    ap.add_argument("--fixed-length", type=int, default=None, metavar="N",
                    help="also a sweep of vLLM's random dataset with --random-output-len N "
                         "--ignore-eos, on the same configs")
    ap.add_argument("--fixed-input-len", type=int, default=128,
                    help="--random-input-len of the fixed-length sweep")
    ap.add_argument("--num-blocks", type=int, default=Engine.num_blocks,
                    help="--num-gpu-blocks-override (one of them is vLLM's null block)")
    ap.add_argument("--block-size", type=int, default=Engine.block_size)
    ap.add_argument("--max-model-len", type=int, default=Engine.max_model_len,
                    help="also scales the trace's lengths (max_model_len / 8192)")
    ap.add_argument("--max-num-seqs", type=int, default=Engine.max_num_seqs)
    ap.add_argument("--max-num-batched-tokens", type=int, default=Engine.max_num_batched_tokens)
    ap.add_argument("--max-tokens", type=int, default=2048,
                    help="the cap requests carry as max_tokens (scaled like the lengths)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", default=None, help="where the tiny model is built")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--engine-cpus", type=int, nargs="*", default=[], metavar="CPU",
                    help="bind each server's engine core and worker to these CPUs (on a "
                         "machine of 2-4 cores: 0, so the API server and the client are not "
                         "left beside the engine core's busy loop)")
    ap.add_argument("--json", default="bench/results/vllm_serve_cpu.json", help="'' to skip")
    ap.add_argument("--plot", default="bench/results/vllm_serve_cpu.png", help="'' to skip")
    ap.add_argument("--log", default=None,
                    help="vLLM's server and client output (default: beside --json, .log)")
    return ap


def _check(args) -> None:
    if args.seeds is not None and args.seeds < 1:
        raise ValueError(f"--seeds={args.seeds}: must be >= 1")
    if args.seeds is not None and "vllm-default" not in args.configs:
        raise ValueError("--seeds pairs every config with vllm-default: add it to --configs")
    for name in ("requests", "repeats", "num_blocks", "block_size", "max_model_len",
                 "max_num_seqs", "max_num_batched_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if (args.num_blocks - 1) * args.block_size < args.max_model_len:
        raise ValueError(f"--num-blocks={args.num_blocks} x --block-size={args.block_size}: "
                         f"{args.num_blocks - 1} usable blocks hold "
                         f"{(args.num_blocks - 1) * args.block_size} tokens, fewer than "
                         f"--max-model-len={args.max_model_len} (vLLM refuses to start)")
    if not all(x > 0 for x in args.load):
        raise ValueError(f"--load {args.load}: every load must be > 0")
    if args.capacity is not None and not args.capacity > 0:
        raise ValueError(f"--capacity={args.capacity}: must be > 0")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness={args.burstiness}: must be > 0")
    if not (args.ttft_ms > 0 and args.tpot_ms > 0):
        raise ValueError("--ttft-ms and --tpot-ms must be > 0")
    if args.fixed_length is not None and args.fixed_length < 1:
        raise ValueError(f"--fixed-length={args.fixed_length}: must be >= 1")


def _parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags, checked (config names and the trace too) before any server starts."""
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        _check(args)
        for c in args.configs:
            parse_config(c, 1, 1.0)
        from kvadmit.traces import trace_path
        if not trace_path(args.trace).exists():
            raise FileNotFoundError(f"--trace {args.trace}: not found")
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    return args


def _log_path(args) -> pathlib.Path:
    """vLLM's output: --log, else beside --json, else in the temp folder (emptied)."""
    log = pathlib.Path(args.log or (pathlib.Path(args.json).with_suffix(".log") if args.json
                                    else pathlib.Path(tempfile.gettempdir()) / "kvadmit-serve.log"))
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    return log


class ServeBench:
    """One `kvadmit bench serve` run: its servers, the sections it measures, its output."""

    def __init__(self, args: argparse.Namespace, argv: list[str]):
        from kvadmit.vllm.tiny_model import DEFAULT_DIR, build_tiny_llama
        self.args = args
        self.model = str(build_tiny_llama(args.model_dir or DEFAULT_DIR))
        self.engine = Engine(args.num_blocks, args.block_size, args.max_model_len,
                             args.max_num_seqs, args.max_num_batched_tokens)
        self.slo = (args.ttft_ms / 1e3, args.tpot_ms / 1e3)
        self.log = _log_path(args)
        self.work = pathlib.Path(tempfile.mkdtemp(prefix="kvadmit-bench-serve-"))
        rows = trace_rows(args.trace, args.requests, args.max_model_len, args.max_tokens,
                          args.seed)
        self.real = [r["output_tokens"] for r in rows]
        data = self.work / "trace.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        self.trace_set = ["--dataset-name", "custom", "--dataset-path", str(data),
                          "--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle"]
        self.t0 = time.perf_counter()
        self.servers: list[Server] = []
        self.by_label: dict[str, Server] = {}
        self.cap_n = 1
        self.out = {"command": " ".join(["kvadmit", "bench", "serve", *argv]),
                    "machine": machine(), "engine": self.engine.__dict__,
                    "engine_cpus": list(args.engine_cpus),
                    "slo_ms": {"ttft": args.ttft_ms, "tpot": args.tpot_ms},
                    "burstiness": args.burstiness, "trace": args.trace,
                    "requests": args.requests, "log": str(self.log), "sections": []}

    def _progress(self, what: str) -> None:
        print(f"{what} ({time.perf_counter() - self.t0:.0f} s)", file=sys.stderr, flush=True)

    def _server(self, label: str, config: ServeConfig, wait: bool) -> Server:
        """The server of a config, started once; its scheduler counts what it recomputes."""
        if label not in self.by_label:
            self.by_label[label] = Server(counting(config), self.model, self.engine, self.log,
                                          engine_cpus=tuple(self.args.engine_cpus))
            self.servers.append(self.by_label[label])
            self.by_label[label].start()
            if wait:
                self.by_label[label].wait_ready(self.args.startup_timeout)
        return self.by_label[label]

    def capacity(self) -> float:
        """vLLM's default first, alone: the capacity every load is a multiple of."""
        base = self._server("vllm-default", parse_config("vllm-default", 1, 1.0), wait=True)
        self._progress("vllm-default server up")
        capacity = self.args.capacity
        if capacity is None:
            row = run_point(base, self.trace_set, float("inf"), 1.0, self.args.seed,
                            self.args.requests, self.slo, self.work, "capacity", self.real)
            capacity = row["request_throughput"]
            self.out["capacity_run"] = row
        how = "given" if self.args.capacity else "measured: all requests at once on vllm-default"
        print(f"capacity: {capacity:.2f} req/s ({how})", flush=True)
        return capacity

    def trace_section(self, capacity: float) -> None:
        """Every config on the trace, at every load."""
        args = self.args
        self.cap_n = documented_queue_cap(args.max_num_seqs, capacity, self.slo[0])
        configs = [parse_config(c, self.cap_n, queue_delay_for(self.slo[0])) for c in args.configs]
        for c in configs:
            self._server(c.label, c, wait=False)
        for s in self.servers:
            s.wait_ready(args.startup_timeout)
        self._progress(f"{len(self.servers)} servers up")
        self.labels = labels = [c.label for c in configs]
        self._warm_up(labels)
        rows = self._sweep(self.trace_set, capacity, "trace", self.real)
        summary = summarize(rows)
        title = (f"Azure conversation trace, {args.requests} requests, real stops "
                 f"(max_tokens {args.max_tokens} scaled); capacity {capacity:.2f} req/s; "
                 f"SLO TTFT <= {args.ttft_ms:g} ms, TPOT <= {args.tpot_ms:g} ms")
        print_table(summary, title, labels)
        goals = goal_figures(summary)
        print(f"goal figures (ratios of medians, per load): {json.dumps(goals)}", flush=True)
        self.out["sections"].append({
            "name": "trace", "title": title, "capacity_rps": capacity, "configs": labels,
            "real_output_tokens": sum(self.real), "config_docs": {c.label: c.doc for c in configs},
            "queue_cap_rule": f"max_num_seqs {args.max_num_seqs} + capacity x TTFT target = "
                              f"{self.cap_n}",
            "rows": rows, "summary": summary, "goals": goals, **self._paired(rows)})

    def _warm_up(self, labels: list[str]) -> None:
        """The capacity burst once on every server that has not run it, discarded: vLLM's
        default measured the capacity with it, and no server starts the sweep cold (an
        admission policy learns output lengths from the requests it finishes)."""
        for label in labels:
            if label == "vllm-default" and "capacity_run" in self.out:
                continue
            run_point(self.by_label[label], self.trace_set, float("inf"), 1.0, self.args.seed,
                      self.args.requests, self.slo, self.work, f"warm-up-{label}", self.real)
        self._progress("every server has run the capacity burst once (a warm-up)")

    def _sweep(self, dataset: list[str], capacity: float, tag: str, expect) -> list[dict]:
        """The section's runs: --repeats at one capacity, or (--seeds) the paired
        protocol, each seed after the first measuring its own capacity on vllm-default."""
        args = self.args
        servers = [self.by_label[x] for x in self.labels]
        if args.seeds is None:
            return sweep(servers, dataset, args.requests, capacity, args.load, args.repeats,
                         args.burstiness, self.slo, args.seed, self.work, tag, expect)

        def capacity_of(seed: int) -> float:
            if seed == args.seed or args.capacity is not None:
                return capacity
            return run_point(self.by_label["vllm-default"], dataset, float("inf"), 1.0, seed,
                             args.requests, self.slo, self.work, f"{tag}-capacity-s{seed}",
                             expect)["request_throughput"]
        seeds = list(range(args.seed, args.seed + args.seeds))
        return paired_sweep(servers, dataset, args.requests, capacity_of, args.load, seeds,
                            args.burstiness, self.slo, self.work, tag, expect)

    def _paired(self, rows: list[dict]) -> dict:
        """With --seeds: the paired ratios, printed, and each seed's capacity."""
        if self.args.seeds is None:
            return {}
        ratios = paired_ratios(rows)
        print_paired(ratios)
        return {"paired": ratios,
                "capacity_by_seed": {str(r["seed"]): r["capacity_rps"] for r in rows}}

    def fixed_section(self) -> None:
        """vLLM's random dataset at a fixed output length (--ignore-eos), on the trace
        sweep's configs (their servers are up)."""
        args = self.args
        fixed = ["--dataset-name", "random", "--random-input-len", str(args.fixed_input_len),
                 "--random-output-len", str(args.fixed_length), "--ignore-eos"]
        fcap = run_point(self.by_label["vllm-default"], fixed, float("inf"), 1.0, args.seed,
                         args.requests, self.slo, self.work, "fixed-capacity", args.fixed_length)
        capacity = fcap["request_throughput"]
        print(f"fixed-length capacity: {capacity:.2f} req/s", flush=True)
        rows = self._sweep(fixed, capacity, "fixed", args.fixed_length)
        summary = summarize(rows)
        title = (f"vLLM's random dataset, input {args.fixed_input_len}, output "
                 f"{args.fixed_length} --ignore-eos; capacity {capacity:.2f} req/s")
        print_table(summary, title, self.labels)
        goals = goal_figures(summary)
        print(f"goal figures: {json.dumps(goals)}", flush=True)
        self.out["sections"].append({
            "name": "fixed-length", "title": title, "capacity_rps": capacity,
            "capacity_run": fcap, "configs": self.labels,
            "real_output_tokens": args.fixed_length * args.requests,
            "rows": rows, "summary": summary, "goals": goals, **self._paired(rows)})

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def save(self) -> None:
        out, args = self.out, self.args
        out["wall_s"] = time.perf_counter() - self.t0
        print(f"\n{sum(len(s['rows']) for s in out['sections'])} runs on {len(self.servers)} "
              f"servers in {out['wall_s']:.0f} s; vLLM's logs: {self.log}", flush=True)
        if args.json:
            pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            pathlib.Path(args.json).write_text(json.dumps(out, indent=2))
            print(f"saved {args.json}")
        if args.plot:
            plot(out["sections"], args.plot, f"kvadmit bench serve on {machine()['cpus']} CPUs: "
                 f"{out['command']}")
            print(f"saved {args.plot}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["client"]:
        return client_main(argv[1:])
    args = _parse_args(argv)
    bench = ServeBench(args, argv)
    print(f"kvadmit bench serve: {args.requests} requests from {args.trace} (lengths x"
          f"{args.max_model_len / 8192:g}, real stops), pool {args.num_blocks} blocks x "
          f"{args.block_size}; vLLM's output goes to {bench.log}", flush=True)
    # a SIGTERM (timeout, CI) still stops the servers: they run in their own sessions
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        bench.trace_section(bench.capacity())
        if args.fixed_length:
            bench.fixed_section()
    finally:
        bench.stop()
        signal.signal(signal.SIGTERM, previous)
    bench.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())

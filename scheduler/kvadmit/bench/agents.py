"""`kvadmit bench agents`: agent sessions on `vllm serve` (issue 43, item 1).

N agent sessions start together and talk to one `vllm serve` of the tiny model over
HTTP (`/v1/completions`, token-id prompts, streamed). Each session runs turns of:
generate (`--output-tokens`, `ignore_eos`), a tool wait (exponential, mean
`--tool-wait`), the tool's output (`--tool-tokens` new tokens) appended, generate
again. Every prompt is the whole context so far: a system prefix all sessions share,
the session's task, then each turn's generated tokens (the ids the server returned)
and tool output, so the context grows and each turn can reuse its session's cached
prefix. A session names itself with vLLM's `X-Session-ID` header (vLLM's
`Request.session_id`, which kvadmit takes as its session: the configs here configure
no flows, so every client's session is honoured, docs/trust-and-failure.md). The workload (tasks,
tool outputs, tool waits) is drawn from `--seed`: the same for every config.

The configs run one after another, each on a fresh server (prefix caching on), its
engine core and worker bound to `--engine-cpus` and this client to the other CPUs.
While a config runs, the server's /metrics is sampled every `--sample-s` seconds
(vLLM's own counters): KV usage (`vllm:kv_cache_usage_perc`), prefix-cache queries
and hits (`vllm:prefix_cache_{queries,hits}_total`: prompt tokens looked up and
found at each request's first admission; vLLM 0.32 keeps a preempted request's
re-admission apart and does not export it), preemptions
(`vllm:num_preemptions_total`), running and waiting requests, and kvadmit's window
where it runs. Recomputed prompt tokens = the prompt tokens the engine prefilled at
first admissions (queries - hits) minus what an unbounded prefix cache would
prefill (the shared prefix once, then per turn the tokens past the last full block
of the KV the session already computed: its earlier prompt and outputs, less the
last output token, whose KV is never computed): context the cache had and lost.
The re-prefills after preemptions are not in it (no counter has them); the
preemptions are counted apart. Per turn: TTFT (sent to first token), turn latency (sent to last token);
the longest wait is the largest TTFT of any turn (a turn waits there to be let in).
The makespan is from the start to the last turn's end; the middle phase is from the
sample where 20% of all turns are done to the one where 80% are.

    kvadmit bench agents                      # the issue's run: 96 sessions x 6 turns
    kvadmit bench agents --sessions 8 --turns 3 --configs vllm-default kvadmit-default

The summary, the table, the goal figures and the chart: kvadmit.bench.agents_report.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from kvadmit.bench.serve.configs import VLLM_SCHEDULER, ServeConfig, parse_config
from kvadmit.bench.serve.server import Engine, Server, scrape_metrics
from kvadmit.simulate.workload import KV_HOLDS
from kvadmit.vllm.serve import small_engine_flags

DEFAULT_CONFIGS = ("vllm-default", "vllm-seqs=8", "kvadmit-default",
                   'kvadmit-window={"agent_window": true}', "vllm-bound")
# vllm-bound: vLLM's default on a pool that never evicts, the bound for eviction order
# (agents_report's gap_closed reads it); this many blocks hold every context
BOUND_BLOCKS = 16384
# vLLM's series sampled (summed over labels), and kvadmit's window where it runs
SERIES = {"kv_usage": "vllm:kv_cache_usage_perc", "queries": "vllm:prefix_cache_queries_total",
          "hits": "vllm:prefix_cache_hits_total", "preemptions": "vllm:num_preemptions_total",
          "running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
          "agent_window": "kvadmit_agent_window", "active_sessions": "kvadmit_active_sessions",
          "window_exits": "kvadmit_agent_window_exits_total",
          "window_overdue": "kvadmit_agent_window_overdue_total"}
# taken relative to the run's start
COUNTERS = ("queries", "hits", "preemptions", "window_exits", "window_overdue")


@dataclass(frozen=True)
class AgentEngine(Engine):
    """The bench's engine: prefix caching on, token-id prompts (no tokenizer);
    max_num_seqs 128 is vLLM's own default for `vllm serve` on CPU."""
    num_blocks: int = 65
    max_num_seqs: int = 128

    def flags(self) -> list[str]:
        return [*small_engine_flags(self.num_blocks, self.max_model_len, self.max_num_seqs,
                                    self.block_size),
                "--max-num-batched-tokens", str(self.max_num_batched_tokens), "--seed", "0",
                "--enable-prefix-caching", "--skip-tokenizer-init"]


@dataclass(frozen=True)
class AgentWorkload:
    sessions: int = 96
    turns: int = 6
    system_tokens: int = 256
    task_tokens: int = 64
    output_tokens: int = 32
    tool_tokens: int = 48
    tool_wait_s: float = 1.0
    seed: int = 0
    kv_hold: str = "none"                   # "done": a session's last turn sends kv_hold_s 0
    vocab: tuple[int, int] = (7, 1024)      # the tiny model's non-special ids

    def longest_context(self) -> int:
        return (self.system_tokens + self.task_tokens + self.turns * self.output_tokens
                + (self.turns - 1) * self.tool_tokens)

    def ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(*self.vocab) for _ in range(n)]

    def system_prefix(self) -> list[int]:
        return self.ids(random.Random(f"system-{self.seed}"), self.system_tokens)


def ideal_prefill(prompt_len: int, reusable: int, block: int) -> int:
    """Prompt tokens an unbounded prefix cache prefills: hits are whole blocks of the
    KV computed before (`reusable` tokens), at most prompt_len - 1 (vLLM computes at
    least the last prompt token)."""
    hit = min(reusable // block, (prompt_len - 1) // block) * block
    return prompt_len - hit


def parse_agent_config(text: str) -> ServeConfig:
    """vllm-seqs=N (vLLM's scheduler with --max-num-seqs N), vllm-bound (vLLM's
    scheduler on a pool that never evicts), else a `kvadmit bench serve` config:
    vllm-default, kvadmit-default, NAME=JSON (kvadmit's keys), ..."""
    name, sep, value = text.partition("=")
    if text == "vllm-bound":
        # after the engine's flags, so this pool size is the one vLLM takes
        return ServeConfig("vllm-bound", ("--scheduler-cls", VLLM_SCHEDULER,
                                          "--num-gpu-blocks-override", str(BOUND_BLOCKS)),
                           f"vLLM's own scheduler on {BOUND_BLOCKS} blocks: nothing is evicted "
                           f"(the bound)", "vllm")
    if name == "vllm-seqs" and sep:
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"config {text}: {value!r} is not an integer") from None
        if n < 1:
            raise ValueError(f"config {text}: must be >= 1")
        return ServeConfig(f"vllm-seqs={n}", ("--scheduler-cls", VLLM_SCHEDULER,
                                              "--max-num-seqs", str(n)),
                           f"vLLM's own scheduler with --max-num-seqs {n}", "vllm")
    return parse_config(text, 1, 1.0)


async def _generate(http, base: str, model: str, prompt: list[int], max_tokens: int,
                    headers: dict, xargs: dict | None = None) -> tuple[list[int], float]:
    """One streamed completion: the generated ids and when the first came."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "return_token_ids": True}
    if xargs:
        body["vllm_xargs"] = xargs
    out: list[int] = []
    first = None
    async with http.post(base + "/v1/completions", json=body, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk or not chunk.get("choices"):
                raise RuntimeError(f"error in stream: {line[:300]}")
            ids = chunk["choices"][0].get("token_ids") or []
            if ids and first is None:
                first = time.perf_counter()
            out.extend(ids)
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return out, first


async def _session(http, base: str, model: str, wl: AgentWorkload, i: int, system: list[int],
                   block: int, t0: float, turns: list[dict]) -> None:
    """Session i's turns; each appends its record to `turns` (a failed turn ends it).
    Its requests name it in X-Session-ID."""
    headers = {"X-Session-ID": f"agent-{i}"}
    rng = random.Random(f"session-{wl.seed}-{i}")
    context = system + wl.ids(rng, wl.task_tokens)
    reusable = wl.system_tokens                  # the shared prefix
    for k in range(wl.turns):
        if k:
            await asyncio.sleep(rng.expovariate(1 / wl.tool_wait_s) if wl.tool_wait_s > 0 else 0)
            context = context + wl.ids(rng, wl.tool_tokens)
        sent = time.perf_counter()
        rec = {"session": i, "turn": k, "prompt_tokens": len(context), "sent_s": sent - t0,
               "ideal_prefill": ideal_prefill(len(context), reusable, block)}
        try:
            # the last turn says the session is done (kv_hold_s 0): its KV may go first
            done = wl.kv_hold == "done" and k == wl.turns - 1
            out, first = await _generate(http, base, model, context, wl.output_tokens,
                                         headers, {"kvadmit_kv_hold_s": 0} if done else None)
        except Exception as e:           # noqa: BLE001 (a lost turn is recorded, not raised)
            turns.append({**rec, "error": f"{type(e).__name__}: {e}"[:300]})
            return
        end = time.perf_counter()
        turns.append({**rec, "output_tokens": len(out), "ttft_s": first - sent,
                      "latency_s": end - sent, "first_s": first - t0, "end_s": end - t0})
        reusable = len(context) + len(out) - 1
        context = context + out


def _point(m: dict[str, float], base: dict[str, float], t: float) -> dict:
    p = {"t": round(t, 3)}
    for key, name in SERIES.items():
        value = _summed(m, name)
        if value is not None:
            p[key] = value - (_summed(base, name) or 0.0) if key in COUNTERS else value
    return p


def _summed(m: dict[str, float], name: str) -> float | None:
    """A series by name, summed over its labels (scrape_metrics keeps kvadmit's by
    full name); None where the server has none."""
    if name in m:
        return m[name]
    labelled = [v for k, v in m.items() if k.startswith(name + "{")]
    return sum(labelled) if labelled else None


async def _sample(base_url: str, t0: float, every: float, base: dict, series: list[dict],
                  turns: list[dict], stop: asyncio.Event, progress) -> None:
    """/metrics every `every` s until `stop` (and once more after it); a progress line
    every ~5 s."""
    last_line = 0.0
    while True:
        try:
            m = await asyncio.to_thread(scrape_metrics, base_url, 10)
            series.append(_point(m, base, time.perf_counter() - t0))
        except OSError:
            pass                                  # one missed sample
        if series and series[-1]["t"] - last_line >= 5:
            last_line = series[-1]["t"]
            p = series[-1]
            hit = p["hits"] / p["queries"] if p.get("queries") else float("nan")
            progress(f"{sum('end_s' in r for r in turns)} turns done, KV "
                     f"{p.get('kv_usage', 0):.0%}, hit rate {hit:.2f}, "
                     f"{p.get('preemptions', 0):.0f} preemptions")
        if stop.is_set():
            return
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


async def drive(base_url: str, model: str, wl: AgentWorkload, block: int, sample_s: float,
                timeout_s: float, progress) -> dict:
    """Every session at once against the server; the turns, the series, the makespan."""
    import aiohttp

    turns: list[dict] = []
    series: list[dict] = []
    system = wl.system_prefix()
    base = await asyncio.to_thread(scrape_metrics, base_url, 30)
    stop = asyncio.Event()
    t0 = time.perf_counter()
    sampler = asyncio.create_task(_sample(base_url, t0, sample_s, base, series, turns, stop,
                                          progress))
    timeout = aiohttp.ClientTimeout(total=None, sock_read=max(timeout_s, 60))
    timed_out = False
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as http:
        tasks = [asyncio.create_task(_session(http, base_url, model, wl, i, system, block, t0,
                                              turns)) for i in range(wl.sessions)]
        done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for t in pending:
            t.cancel()
        timed_out = bool(pending)
        await asyncio.gather(*pending, return_exceptions=True)
    ends = [r["end_s"] for r in turns if "end_s" in r]
    makespan = max(ends) if ends else time.perf_counter() - t0
    await asyncio.sleep(min(1.0, 2 * sample_s))       # the last counters reach /metrics
    stop.set()
    await sampler
    return {"turns": sorted(turns, key=lambda r: (r["session"], r["turn"])), "series": series,
            "makespan_s": makespan, "timed_out": timed_out}


def _warm_up(base: str, model: str) -> None:
    """One request outside the run (the first steps of a fresh engine are slow); its
    counters are subtracted with the rest of the baseline."""
    import urllib.request
    body = {"model": model, "prompt": list(range(1000, 1016)), "max_tokens": 4,
            "ignore_eos": True, "temperature": 0}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    urllib.request.urlopen(req, timeout=300).read()


def run_config(config: ServeConfig, args, engine: AgentEngine, wl: AgentWorkload, model: str,
               log: pathlib.Path, progress) -> dict:
    """One config: a fresh server, the sessions against it, the server stopped."""
    everyone = os.sched_getaffinity(0)
    server = Server(config, model, engine, log, engine_cpus=tuple(args.engine_cpus))
    server.start()
    try:
        server.wait_ready(args.startup_timeout)
        _warm_up(server.base, model)
        client = everyone - set(args.engine_cpus) or everyone
        os.sched_setaffinity(0, client)      # this client off the engine's CPUs
        progress(f"server up (engine on CPUs {args.engine_cpus or 'any'}, client on "
                 f"{sorted(client)}); {wl.sessions} sessions start")
        run = asyncio.run(drive(server.base, model, wl, engine.block_size, args.sample_s,
                                args.run_timeout, progress))
    finally:
        os.sched_setaffinity(0, everyone)
        server.stop()
    return {"config": config.label, "doc": config.doc, "flags": list(config.flags), **run}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvadmit bench agents", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Configs: vllm-default; vllm-seqs=N (vLLM's scheduler, "
                                        "--max-num-seqs N); kvadmit-default (the empty config); "
                                        "NAME=JSON (kvadmit's keys, e.g. "
                                        "'kvadmit-window={\"agent_window\": true}').")
    wl, eng = AgentWorkload(), AgentEngine()
    for flag, default, kind, what in (
            ("--sessions", wl.sessions, int, "agent sessions, all starting together"),
            ("--turns", wl.turns, int, "turns per session"),
            ("--system-tokens", wl.system_tokens, int, "the system prefix every session shares"),
            ("--task-tokens", wl.task_tokens, int, "each session's task, after the prefix"),
            ("--output-tokens", wl.output_tokens, int, "tokens generated per turn (ignore_eos)"),
            ("--tool-tokens", wl.tool_tokens, int, "the tool output appended after each turn"),
            ("--tool-wait", wl.tool_wait_s, float, "mean tool wait, s (exponential; 0: none)"),
            ("--seed", wl.seed, int, "the workload's seed"),
            ("--num-blocks", eng.num_blocks, int, "KV pool blocks (one is vLLM's null block)"),
            ("--block-size", eng.block_size, int, "tokens per block"),
            ("--max-model-len", eng.max_model_len, int, "vLLM's --max-model-len"),
            ("--max-num-seqs", eng.max_num_seqs, int, "every server's (vllm-seqs=N overrides)"),
            ("--max-num-batched-tokens", eng.max_num_batched_tokens, int, "vLLM's token budget"),
            ("--sample-s", 0.5, float, "seconds between /metrics samples"),
            ("--run-timeout", 1800.0, float, "a config's run is cut after this many s"),
            ("--startup-timeout", 600.0, float, "seconds a server may take to start")):
        ap.add_argument(flag, type=kind, default=default, help=f"{what} (default {default})")
    ap.add_argument("--kv-hold", choices=KV_HOLDS, default=wl.kv_hold,
                    help="done: each session's last turn sends kv_hold_s 0 (kvadmit evicts a done "
                    "session's KV first under native_allocator; docs/slo-agents.md)")
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), metavar="CONFIG")
    first = min(os.sched_getaffinity(0))
    ap.add_argument("--engine-cpus", type=int, nargs="*", metavar="CPU",
                    default=[first] if len(os.sched_getaffinity(0)) > 1 else [],
                    help="bind each server's engine core and worker to these CPUs; the client "
                         f"runs on the others (default: [{first}] on a machine of 2+ CPUs)")
    ap.add_argument("--model-dir", default=None, help="where the tiny model is built")
    ap.add_argument("--json", default="bench/results/agents_serve.json", help="'' to skip")
    ap.add_argument("--plot", default="bench/results/agents_serve.png", help="'' to skip")
    ap.add_argument("--log", default=None, help="vLLM's output (default: beside --json, .log)")
    return ap


def _parse_args(argv: list[str]) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    wl = workload(args)
    try:
        for name in ("sessions", "turns", "output_tokens", "num_blocks", "block_size",
                     "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
        if min(args.system_tokens, args.task_tokens, args.tool_tokens, args.tool_wait) < 0:
            raise ValueError("token counts and --tool-wait must be >= 0")
        if args.system_tokens + args.task_tokens < 1:
            raise ValueError("--system-tokens + --task-tokens must be >= 1")
        if not (args.sample_s > 0 and args.run_timeout > 0):
            raise ValueError("--sample-s and --run-timeout must be > 0")
        if wl.longest_context() > args.max_model_len:
            raise ValueError(f"the last turn's context ({wl.longest_context()} tokens) is over "
                             f"--max-model-len {args.max_model_len}")
        if (args.num_blocks - 1) * args.block_size < args.max_model_len:
            raise ValueError(f"{args.num_blocks - 1} usable blocks of {args.block_size} hold "
                             f"fewer than --max-model-len tokens (vLLM refuses to start)")
        bad = set(args.engine_cpus) - os.sched_getaffinity(0)
        if bad:
            raise ValueError(f"--engine-cpus: CPU {sorted(bad)} is not usable here")
        for c in args.configs:
            parse_agent_config(c)
    except ValueError as e:
        ap.error(str(e))
    return args


def workload(args) -> AgentWorkload:
    return AgentWorkload(args.sessions, args.turns, args.system_tokens, args.task_tokens,
                         args.output_tokens, args.tool_tokens, args.tool_wait, args.seed,
                         args.kv_hold)


def main(argv: list[str] | None = None) -> int:
    from kvadmit.bench.agents_report import goal_figures, print_table, save, summarize
    from kvadmit.bench.serve.report import machine
    from kvadmit.vllm.tiny_model import DEFAULT_DIR, build_tiny_llama

    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(argv)
    wl = workload(args)
    engine = AgentEngine(args.num_blocks, args.block_size, args.max_model_len, args.max_num_seqs,
                         args.max_num_batched_tokens)
    model = str(build_tiny_llama(args.model_dir or DEFAULT_DIR))
    log = pathlib.Path(args.log or (pathlib.Path(args.json).with_suffix(".log") if args.json
                                    else pathlib.Path(tempfile.gettempdir()) / "kvadmit-agents.log"))
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    t_start = time.perf_counter()
    out = {"command": " ".join(["kvadmit", "bench", "agents", *argv]), "machine": machine(),
           "date": time.strftime("%Y-%m-%d %H:%M %Z"), "engine": asdict(engine),
           "engine_cpus": args.engine_cpus, "workload": asdict(wl), "sample_s": args.sample_s,
           "log": str(log), "configs": []}
    print(f"kvadmit bench agents: {wl.sessions} sessions x {wl.turns} turns, pool "
          f"{args.num_blocks} blocks x {args.block_size}; vLLM's output goes to {log}", flush=True)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # servers stop
    try:
        for text in args.configs:
            config = parse_agent_config(text)

            def progress(what, label=config.label):
                print(f"[{label}] {what} ({time.perf_counter() - t_start:.0f} s)",
                      file=sys.stderr, flush=True)
            run = run_config(config, args, engine, wl, model, log, progress)
            run["summary"] = summarize(run, wl, engine.block_size)
            progress(f"done: {json.dumps(run['summary'])}")
            out["configs"].append(run)
    finally:
        signal.signal(signal.SIGTERM, previous)
    out["goals"] = goal_figures([c["summary"] for c in out["configs"]])
    out["wall_s"] = time.perf_counter() - t_start
    print_table([c["summary"] for c in out["configs"]], wl)
    print(f"goal figures: {json.dumps(out['goals'])}", flush=True)
    save(out, args.json, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

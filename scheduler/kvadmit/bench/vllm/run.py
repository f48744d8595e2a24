"""One engine per configuration: `run_one` runs vLLM's `LLM.generate` on the workload
and returns its row of numbers; `run_configs` runs every configuration, in a rotated
order, after a discarded warm-up engine."""
from __future__ import annotations

import os
import pathlib
import random
import time

from kvadmit.bench.vllm.configs import BenchConfig, BenchEngine
from kvadmit.bench.vllm.hooks import COUNTS_ENV, EXPECT_ENV
from kvadmit.bench.vllm.stop_at import STOP_AT_KEY, StopAtLength
from kvadmit.bench.vllm.workload import BenchRequest
from kvadmit.vllm.engine_log import say


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _metric(metrics, name):
    for m in metrics:
        if m.name == name:
            return m
    return None


def run_one(label: str, model_dir: str, workload: list[BenchRequest], engine: BenchEngine,
            kvadmit: dict | None, stop_early: bool, engine_args: dict | None = None) -> dict:
    """One engine, one generate call; returns the row of numbers for `label`.
    ``engine_args``: further vLLM engine arguments (its own knobs)."""
    import tempfile
    counts = pathlib.Path(tempfile.mkstemp(prefix="kvadmit-bench-")[1])
    os.environ[COUNTS_ENV] = str(counts)
    os.environ[EXPECT_ENV] = str(len(workload))
    llm = _engine(model_dir, engine, kvadmit, stop_early, engine_args)
    params = _sampling_params(workload, stop_early)
    prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in workload]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    metrics = llm.get_metrics()
    seen = _read_outputs(workload, outs)
    # Shut the engine down first: its last step's count must be on disk before we read it.
    llm.llm_engine.engine_core.shutdown()
    del llm
    import gc
    gc.collect()
    computed, paused, modelled = (counts.read_text() or "0 0 0.0").split()
    counts.unlink()
    row = _row(label, workload, seen, metrics, wall, int(computed), int(paused))
    row["modelled_s"] = float(modelled)
    row["modelled_tok_per_s"] = row["output_tokens"] / row["modelled_s"] if row["modelled_s"] else 0.0
    return row


def _engine(model_dir: str, engine: BenchEngine, kvadmit: dict | None, stop_early: bool,
            engine_args: dict | None):
    """vLLM's LLM on `engine`'s pool with the bench's scheduler (CountingScheduler: vLLM's
    own, or kvadmit's with `kvadmit` as its config) and, for real lengths, StopAtLength."""
    from vllm import LLM
    kwargs = dict(scheduler_cls="kvadmit.bench.vllm.CountingScheduler", **(engine_args or {}))
    if engine.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = engine.max_num_batched_tokens
    if kvadmit is not None:
        kwargs["additional_config"] = {"kvadmit": kvadmit}
    return LLM(model=model_dir, skip_tokenizer_init=True, dtype=engine.dtype,
               block_size=engine.block_size, num_gpu_blocks_override=engine.num_blocks,
               max_model_len=engine.max_model_len, max_num_seqs=engine.max_num_seqs,
               enforce_eager=True, seed=0,
               gpu_memory_utilization=0.3, disable_log_stats=False, enable_prefix_caching=False,
               logits_processors=[StopAtLength] if stop_early else None, **kwargs)


def _sampling_params(workload: list[BenchRequest], stop_early: bool) -> list:
    """Greedy sampling to max_tokens; with real lengths, EOS at each request's own
    (StopAtLength's key, and min_tokens so the random model cannot stop earlier)."""
    from vllm import SamplingParams
    params = []
    for r in workload:
        extra = {STOP_AT_KEY: r.output_tokens} if stop_early and r.output_tokens < r.max_tokens else None
        params.append(SamplingParams(
            max_tokens=r.max_tokens, temperature=0.0, ignore_eos=not stop_early,
            min_tokens=(r.output_tokens - 1) if extra else 0, extra_args=extra))
    return params


def _read_outputs(workload: list[BenchRequest], outs) -> dict:
    """Per request: its tokens; kvadmit's refusals by stop reason; how many produced
    other than their real length; the TTFT and TPOT of those served."""
    tokens, ttft, tpot, rejected, wrong = [], [], [], {}, 0
    for r, o in zip(workload, outs):
        c = o.outputs[0]
        tokens.append(list(c.token_ids))
        if isinstance(c.stop_reason, str) and c.stop_reason.startswith("kvadmit:"):
            rejected[c.stop_reason] = rejected.get(c.stop_reason, 0) + 1
            continue
        if len(c.token_ids) != r.output_tokens:
            wrong += 1
        m = o.metrics
        if m is not None and m.first_token_latency:
            ttft.append(m.first_token_latency)
            if m.num_generation_tokens > 1:
                tpot.append((m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1))
    return {"tokens": tokens, "ttft": ttft, "tpot": tpot, "rejected": rejected, "wrong": wrong}


def _row(label: str, workload: list[BenchRequest], seen: dict, metrics, wall: float,
         computed: int, paused: int) -> dict:
    """The row of numbers: vLLM's preemption and step counters, the tokens recomputed
    (scheduled beyond what each request needs once), wall time, latencies, refusals."""
    preempt = _metric(metrics, "vllm:num_preemptions")
    iters = _metric(metrics, "vllm:iteration_tokens_total")
    tokens, ttft, tpot = seen["tokens"], seen["ttft"], seen["tpot"]
    # Every request computes its prompt once and feeds back all but its last token.
    needed = sum(len(r.prompt_token_ids) + max(len(t) - 1, 0) for r, t in zip(workload, tokens))
    return {
        "config": label, "preemptions": int(preempt.value) if preempt is not None else None,
        "recomputed_tokens": computed - needed, "paused": paused,
        "steps": int(iters.count) if iters is not None else None,
        "wall_s": wall, "output_tokens": sum(len(t) for t in tokens),
        "output_tok_per_s": sum(len(t) for t in tokens) / wall,
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
        "tpot_p50_s": _pct(tpot, 0.5), "tpot_p99_s": _pct(tpot, 0.99),
        "rejected": seen["rejected"], "wrong_length": seen["wrong"], "tokens": tokens,
    }


# ---------------------------------------------------------------------------
# Fair timing: a discarded warm-up engine, then the configurations in a rotated order

def run_order(n: int, order: str, seed: int) -> list[int]:
    """Indices of n configurations in the order they run: 'given', 'reverse', or
    'shuffle' (a permutation seeded by `seed`), so no configuration always runs first
    (the first engine of a process pays cold caches)."""
    idx = list(range(n))
    if order == "reverse":
        idx.reverse()
    elif order == "shuffle":
        random.Random(seed).shuffle(idx)
    elif order != "given":
        raise ValueError(f"order={order!r}: must be 'given', 'reverse' or 'shuffle'")
    return idx


def warm_up(model_dir: str, workload: list[BenchRequest], engine: BenchEngine,
            stop_early: bool, n: int) -> None:
    """One discarded engine on the first n requests (vLLM's own scheduler), so the
    first measured engine does not pay the process's cold start."""
    if n > 0:
        row = run_one("warm-up", model_dir, workload[:n], engine, None, stop_early)
        say(f"[warm-up] a discarded engine, {min(n, len(workload))} requests: {row['steps']} steps "
            f"({_elapsed()} elapsed)", err=True)


def run_configs(configs: list[BenchConfig], model_dir: str, workload: list[BenchRequest],
                engine: BenchEngine, stop_early: bool, order: str, seed: int,
                tag: str = "") -> list[dict]:
    """Every configuration once, in run_order; rows come back in the given order, each
    with its position in the run (`run_position`, from 1)."""
    rows: list[dict | None] = [None] * len(configs)
    for pos, i in enumerate(run_order(len(configs), order, seed), 1):
        c = configs[i]
        row = run_one(c.label, model_dir, workload, engine, c.kvadmit, stop_early, c.engine_args)
        row["run_position"] = pos
        rows[i] = row
        # one line per engine, once it has run (its start-up logs go to the engine log)
        say(f"{tag}[config {pos}/{len(configs)}] {c.label}: {row['steps']} steps, "
            f"{row['preemptions']} preemptions, generate {row['wall_s']:.1f} s "
            f"({_elapsed()} elapsed)", err=True)
    return rows


_T0 = time.perf_counter()      # main() restarts it: the run's clock for the progress lines


def restart_clock() -> None:
    """The progress lines' clock starts now (at the start of a run)."""
    global _T0
    _T0 = time.perf_counter()


def _elapsed() -> str:
    s = int(time.perf_counter() - _T0)
    return f"{s // 60}:{s % 60:02d}"

"""The bench's requests: synthetic or the first requests of an Azure trace, scaled to
the engine's context, with real lengths under a cap. Imports no vLLM."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

# The Azure 2023 conversation trace bundled in the package (kvadmit.traces.BUNDLED).
DEFAULT_TRACE = "azure2023_conv"


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    output_tokens: int      # the real length: tokens it produces (== max_tokens: no early stop)


def synthetic_workload(n: int, max_model_len: int, cap: int, seed: int = 0,
                       stop_early: bool = True) -> list[BenchRequest]:
    """Prompts of 16-128 random tokens; lognormal real lengths (median 32) under a `cap`."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(16, 128)
        m = min(cap, max_model_len - p)
        real = max(2, min(m, int(rng.lognormvariate(math.log(32), 0.9)))) if stop_early else m
        out.append(BenchRequest(tuple(rng.randrange(3, 1000) for _ in range(p)), m, real))
    return out


def azure_workload(path: str, n: int, max_model_len: int, cap: int, seed: int = 0,
                   trace_context: int = 8192) -> list[BenchRequest]:
    """The first `n` Azure conversation requests, lengths scaled by max_model_len / trace_context
    (the tiny model's context against an 8k-context production model); the cap is scaled too."""
    from kvadmit.traces import load_trace

    scale = max_model_len / trace_context
    rng = random.Random(seed)
    out = []
    for r in load_trace(path, limit=n):
        p = max(1, min(max_model_len - 2, round(r.prompt_tokens * scale)))
        m = max(2, min(round(cap * scale), max_model_len - p))
        real = max(2, min(m, round(r.output_tokens * scale)))
        out.append(BenchRequest(tuple(rng.randrange(3, 1000) for _ in range(p)), m, real))
    return out


def as_burst(requests: list[BenchRequest], name: str = "bench"):
    """The bench's requests as a simulator Workload, all queued at once (as the bench
    runs them), for the native engine model."""
    from kvadmit.simulate import Workload
    return Workload(name=name, arrival_s=[0.0] * len(requests),
                    prompt_tokens=[len(r.prompt_token_ids) for r in requests],
                    output_tokens=[r.output_tokens for r in requests],
                    max_tokens=[r.max_tokens for r in requests])


def build_workload(kind: str, requests: int, max_model_len: int, max_tokens: int, caps: str,
                   stop_early: bool, trace: str | None = None) -> tuple[list[BenchRequest], str]:
    """The bench's requests and a one-line description. kind 'azure' (the first requests
    of an Azure trace, scaled to the context) or 'synthetic'; caps 'cap' (every request
    carries max_tokens) or 'real' (max_tokens = its real output length)."""
    if kind == "synthetic":
        workload = synthetic_workload(requests, max_model_len, max_tokens, stop_early=stop_early)
        source = f"synthetic, {requests} requests, seed 0"
    elif kind == "azure":
        trace = trace or DEFAULT_TRACE
        workload = azure_workload(trace, requests, max_model_len, max_tokens)
        if not stop_early:
            workload = [BenchRequest(r.prompt_token_ids, r.max_tokens, r.max_tokens) for r in workload]
        source = f"first {requests} requests of {trace}, lengths and cap x {max_model_len}/8192"
    else:
        raise ValueError(f"workload={kind!r}: must be 'azure' or 'synthetic'")
    if caps == "real":
        workload = [BenchRequest(r.prompt_token_ids, r.output_tokens, r.output_tokens) for r in workload]
        source += "; max_tokens = real output length"
    elif caps != "cap":
        raise ValueError(f"caps={caps!r}: must be 'cap' or 'real'")
    source += f"; cap {max_tokens}; {'real lengths (EOS)' if stop_early else 'ignore_eos'}"
    return workload, source

"""`kvadmit bench serve`'s configs: which server each row is (vLLM's own scheduler and
its knobs, kvadmit's configs, NAME=JSON), as `vllm serve` flags. Imports no vLLM."""
from __future__ import annotations

import json
from dataclasses import dataclass

VLLM_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"   # vLLM's own (CPU: never async)
KVADMIT_SCHEDULER = "kvadmit.vllm.Scheduler"
DEFAULT_CONFIGS = ("vllm-default", "vllm-queued", "vllm-watermark=0.01", "vllm-watermark=0.05",
                   "vllm-watermark=0.1", "kvadmit-default", "kvadmit-delay")
# The same schedulers, counting the prefill they recompute (kvadmit.bench.serve.recompute)
COUNTING = {VLLM_SCHEDULER: "kvadmit.bench.serve.recompute.VllmScheduler",
            KVADMIT_SCHEDULER: "kvadmit.bench.serve.recompute.KvadmitScheduler"}


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


def counting(config: ServeConfig) -> ServeConfig:
    """`config` with its scheduler swapped for the same one counting its recomputed
    prefill (COUNTING; vLLM has no such counter): what `kvadmit bench serve` runs."""
    flags = list(config.flags)
    i = flags.index("--scheduler-cls") + 1
    flags[i] = COUNTING[flags[i]]
    return ServeConfig(config.label, tuple(flags), config.doc, config.kind)


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


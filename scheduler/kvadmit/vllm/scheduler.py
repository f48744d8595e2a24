"""kvadmit inside vLLM's V1 scheduler.

vLLM keeps doing everything it does (token budgets, chunked prefill, prefix
caching, allocation); kvadmit's core decides three things and this module only
translates vLLM's objects to the core's numbers and back:

- which waiting request may start: `self.waiting` becomes a `GatedWaitingQueue`
  whose truthiness and head come from `AdmissionCore.next_admissible`; vLLM's
  WAITING loop stops when the queue is falsy, so a held head is never started,
  while `len()` stays truthful so the engine keeps stepping;
- which running request is preempted first: `self.running` is put in the core's
  victim order before each step, so the request vLLM pops (`running[-1]`) is the
  core's victim;
- which arrivals are refused: `add_request` asks `AdmissionCore.arrive`; a refused
  request never enters the scheduler and its client gets a finished output with
  `finish_reason=abort` and `stop_reason="kvadmit:<reason>"`.

Per-request SLO targets and agent sessions come from `SamplingParams.extra_args`
(kvadmit.request_fields; vLLM's own `session_id` is the session when kvadmit's
is not given). Every `schedule()` feeds the core the engine's measurements: the
previous step's duration (`observe_step`: the wall time between two schedule()
calls, which spans that step's forward pass) and, with `agent_window`, the KV
blocks in use and the prefix-cache hits of the requests started in the previous
step (`observe_cache`).

Every vLLM private name used here is listed and checked at start-up in
`kvadmit.vllm.compat` (vLLM 0.32.x and 0.33.x).
"""
from __future__ import annotations

import bisect
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvadmit._native import AdmissionCore, BlockObjectQueue
from kvadmit.bridge import EngineBridge
from kvadmit.config import AdmissionConfig, ConfigError, json_object, section_from
# STOP_REASON_PREFIX: re-exported, the simulator reads it from here.
from kvadmit.protocol import PREFIX as STOP_REASON_PREFIX, Refusal, sample_group  # noqa: F401
from kvadmit.request_fields import (
    check_int,
    check_prompt_tokens,
    from_extra_args,
    session_int,
    ttft_target,
)
from kvadmit.vllm import compat
from kvadmit.vllm.metrics import process_metrics
from kvadmit.vllm.settings import VllmSettings

# vLLM's (private) names, imported through compat: a moved one fails naming itself.
_v = compat.import_names(compat.SCHEDULER_IMPORTS)
VllmScheduler, VllmAsyncScheduler = _v.Scheduler, _v.AsyncScheduler
RequestQueue, SchedulingPolicy = _v.RequestQueue, _v.SchedulingPolicy
EngineCoreOutput, EngineCoreOutputs, FinishReason = (_v.EngineCoreOutput, _v.EngineCoreOutputs,
                                                     _v.FinishReason)
FullAttentionSpec, MLAAttentionSpec = _v.FullAttentionSpec, _v.MLAAttentionSpec
Request, RequestStatus = _v.Request, _v.RequestStatus

logger = logging.getLogger("kvadmit.vllm")



def config_from_vllm(vllm_config) -> tuple[AdmissionConfig, VllmSettings]:
    """The `"kvadmit"` object of vLLM's `--additional-config` (a dict or JSON text):
    the core's settings and the vLLM-only ones (kvadmit.vllm.settings). A misspelt or
    null `"kvadmit"` is a ConfigError (kvadmit.config.section_from)."""
    raw = section_from(vllm_config.additional_config, "--additional-config")
    vllm_settings, core_keys = VllmSettings.split(json_object(raw) if isinstance(raw, str) else raw)
    return AdmissionConfig.from_dict(core_keys), vllm_settings


class RequestIdTies:
    """vLLM's priority queue orders requests of equal (priority, arrival_time) by
    request id; the core orders them by a number (`arrive(arrival_tie=)`). Each such
    group's numbers follow its ids: a new id gets one between its neighbours'."""

    def __init__(self):
        self._groups: dict[tuple, list[tuple[str, float]]] = {}   # key -> [(id, tie)], by id
        self._key_of: dict[str, tuple] = {}

    def add(self, key: tuple, request_id: str) -> float:
        self.remove(request_id)
        group = self._groups.setdefault(key, [])
        i = bisect.bisect_left(group, (request_id,))
        lo = group[i - 1][1] if i > 0 else None
        hi = group[i][1] if i < len(group) else None
        if lo is None:
            tie = 0.0 if hi is None else hi - 1.0
        else:
            tie = lo + 1.0 if hi is None else (lo + hi) / 2
        group.insert(i, (request_id, tie))
        self._key_of[request_id] = key
        return tie

    def remove(self, request_id: str) -> None:
        key = self._key_of.pop(request_id, None)
        if key is not None:
            group = self._groups[key]
            del group[bisect.bisect_left(group, (request_id,))]
            if not group:
                del self._groups[key]


class GatedWaitingQueue(RequestQueue):
    """vLLM's waiting queue with kvadmit's gate in front of its head.

    The order is the core's: arrival, or with vLLM's priority scheduling (priority,
    `Request.arrival_time`, request id) as vLLM's own queue. The candidate chosen
    when vLLM first looks (``bool(queue)`` / ``peek_request``) is the one
    ``pop_request`` hands out, so a request vLLM allocated for is the request it
    starts. A request kvadmit does not track (the core refused it when vLLM put it
    back after a `remove_requests`) is served first, ungated.
    """

    def __init__(self, sched: "_KvadmitMixin"):
        self._sched = sched
        self._by_slot: dict[int, Request] = {}
        self._untracked: list[Request] = []
        self._candidate: Request | None = None
        self._looked = False             # _candidate is the core's answer to the last look

    # -- the gate ---------------------------------------------------------
    def _choose(self) -> Request | None:
        if self._untracked:
            return self._untracked[0]
        # One look per change: vLLM asks bool()/peek several times a step, and with
        # head-of-line bypass a look can scan hundreds of held requests.
        if not self._looked and self._by_slot:
            slot = self._sched.kvadmit.core.next_admissible(
                self._sched.kv_cache_manager.block_pool.get_num_free_blocks(), False)
            self._candidate = self._by_slot.get(slot)
            self._looked = True
        return self._candidate

    def __bool__(self) -> bool:
        return self._choose() is not None

    def peek_request(self) -> Request:
        req = self._choose()
        if req is None:
            raise IndexError("no waiting request may start now")
        return req

    def pop_request(self) -> Request:
        req = self.peek_request()
        if self._untracked and req is self._untracked[0]:
            return self._untracked.pop(0)
        self._candidate = None
        self._looked = False
        slot = self._sched.kvadmit.slots[req.request_id]
        del self._by_slot[slot]
        if self._sched.kvadmit.count_shared_prefix:
            self._sched.kvadmit.core.set_shared(slot, self._sched._kvadmit_shared_tokens(req))
        self._sched.kvadmit.core.admit(slot, self._sched.kvadmit.clock())
        popped = self._sched.kvadmit.started_this_step
        if popped is not None:
            popped.append(req)
        return req

    def invalidate(self) -> None:
        """Forgets the chosen candidate: the next look asks the core again."""
        self._candidate = None
        self._looked = False

    # -- plain queue operations -------------------------------------------
    def add_request(self, request: Request) -> None:
        self._candidate = None
        self._looked = False
        slot = self._sched.kvadmit.slots.get(request.request_id)
        if slot is None:   # back after remove_requests: the core takes it anew
            slot = self._sched._kvadmit_adopt(request)
            if slot is None:
                self._untracked.append(request)
                return
        core = self._sched.kvadmit.core
        if core.state(slot) == "running":
            # Popped but not started (vLLM skipped it this step): undo the admission.
            core.cancel_admit(slot)
        self._by_slot[slot] = request

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)   # the core's order puts it where it belongs

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for r in requests:
            self.add_request(r)

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        """They leave the queue, and the core: it must not choose one that is gone."""
        self._candidate = None
        self._looked = False
        ids = {r.request_id for r in requests}
        for slot, r in list(self._by_slot.items()):
            if r.request_id in ids:
                del self._by_slot[slot]
                self._sched._kvadmit_leave(r.request_id)
        self._untracked = [r for r in self._untracked if r.request_id not in ids]

    def __len__(self) -> int:
        return len(self._by_slot) + len(self._untracked)

    def __iter__(self) -> Iterator[Request]:
        by_slot = self._by_slot
        return iter(self._untracked
                    + [by_slot[s] for s in self._sched.kvadmit.core.waiting() if s in by_slot])

    def __getitem__(self, index):
        """The index-th request in the queue's order (vLLM's FCFS queue is a deque)."""
        return list(self)[index]


@dataclass
class KvadmitState:
    """kvadmit's state on one vLLM scheduler: one attribute, `scheduler.kvadmit`, so
    none of kvadmit's names can collide with vLLM's. The simulator
    (kvadmit.simulate.vllm_engine) sets `clock` and reads `pending_refusals`."""
    config: AdmissionConfig
    vllm_settings: VllmSettings
    core: AdmissionCore
    # Request ids <-> core slots, arrivals, leaving, step timing, cache signals.
    bridge: EngineBridge
    # The core's clock (drain rate, queue delay, step times, sessions): injectable,
    # so the simulator can run it on virtual time.
    clock: Callable[[], float]
    vocab_size: int                      # prompt token ids are checked against it
    usable_blocks: int                   # the pool less vLLM's null block
    # vLLM's priority queue: ties of (priority, arrival_time) go by request id (None: FCFS).
    request_id_ties: RequestIdTies | None
    # Agent window with prefix caching: the requests the gate started this step (their
    # prefix-cache hits are reported to the bridge); None otherwise.
    started_this_step: list[Request] | None
    # shortfall pause: vLLM's request id -> blocks (one full-attention group), for the
    # pause plan; None when a request short of blocks is preempted instead.
    pause_plan_blocks: dict | None
    # auto with prefix caching: a prefix running requests share is counted once.
    count_shared_prefix: bool
    metrics: Any | None                  # Prometheus counters (kvadmit.vllm.metrics), if any
    # Refused at add_request: (client index, output), sent by the next update_from_output.
    pending_refusals: list[tuple[int, EngineCoreOutput]] = field(default_factory=list)
    # Samples of parallel-sampling requests that arrived before their siblings:
    # parent id -> [Request]; the request arrives once all n are here.
    samples_awaiting_siblings: dict[str, list[Request]] = field(default_factory=dict)

    @property
    def slots(self):
        """Request id -> core slot of every request kvadmit tracks (read-only view)."""
        return self.bridge.slots


class _KvadmitMixin:
    """The kvadmit behaviour, shared by the sync and async scheduler flavours."""

    kvadmit: KvadmitState

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cfg, vllm_settings = config_from_vllm(self.vllm_config)
        compat.check_scheduler(self, native_allocator=vllm_settings.native_allocator,
                               pause=cfg.pause_on_shortfall or cfg.policy == "auto")
        cfg = self._kvadmit_fit_config(cfg)
        pool = self.kv_cache_manager.block_pool
        if vllm_settings.native_allocator:
            self._kvadmit_install_native_queue(pool)
        # Block 0 is vLLM's null block: never handed to a request.
        usable_blocks = pool.num_gpu_blocks - 1
        core = AdmissionCore(cfg, usable_blocks, self.block_size,
                             self.vllm_config.model_config.max_model_len)
        # The SLO guard predicts prefill time from the engine's token budget a step.
        core.set_step_budget(self.vllm_config.scheduler_config.max_num_batched_tokens)
        caching = self.kv_cache_manager.enable_caching
        # Agent window: prefix hits count only with prefix caching (without it the core
        # sees 0/0: no signal). kvadmit decides which sessions may run; which cached
        # blocks are evicted stays vLLM's LRU (BlockPool's free-block queue): kvadmit
        # cannot keep a paused session's prefix warm without patching vLLM's eviction,
        # and does not.
        self.kvadmit = KvadmitState(
            config=cfg, vllm_settings=vllm_settings, core=core, bridge=EngineBridge(core),
            clock=time.monotonic,
            vocab_size=self.vllm_config.model_config.get_vocab_size(),
            usable_blocks=usable_blocks,
            request_id_ties=RequestIdTies() if self.policy == SchedulingPolicy.PRIORITY else None,
            started_this_step=[] if cfg.agent_window and caching else None,
            pause_plan_blocks=(self.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
                               if cfg.pause_on_shortfall else None),
            count_shared_prefix=(cfg.policy == "auto" and caching
                                 and self._kvadmit_single_full_attention_group()),
            metrics=process_metrics())
        self.waiting = GatedWaitingQueue(self)
        self._kvadmit_publish()      # an idle engine's gauges (headroom: the whole pool) from the start
        logger.info("kvadmit: policy=%s victim=%s on %d blocks of %d tokens", cfg.policy,
                    cfg.victim, usable_blocks, self.block_size)

    def _kvadmit_fit_config(self, cfg: AdmissionConfig) -> AdmissionConfig:
        """The configuration as this engine runs it: its prefill chunk, vLLM's priority
        order, and shortfall "auto" resolved for the model's KV layout."""
        sched_cfg = self.vllm_config.scheduler_config
        if cfg.prefill_chunk_tokens == 0 and sched_cfg.enable_chunked_prefill:
            # Long prompts take several steps to prefill: extend the KV curves by them.
            cfg = cfg.replace(prefill_chunk_tokens=sched_cfg.max_num_batched_tokens)
        if self.policy == SchedulingPolicy.PRIORITY:
            if cfg.queue_order != "priority":
                cfg = cfg.replace(queue_order="priority")
            if cfg.victim != "priority":
                logger.warning("vLLM's priority scheduling picks its own victim (highest "
                               "priority value, latest arrival); kvadmit victim=%r is not used",
                               cfg.victim)
        if cfg.pause_on_shortfall and not self._kvadmit_single_full_attention_group():
            if cfg.shortfall == "pause":
                groups = self.kv_cache_config.kv_cache_groups
                raise ConfigError(
                    f"kvadmit: shortfall={cfg.shortfall!r} needs one full-attention KV cache group; "
                    f"this model has {len(groups)} group(s) of "
                    f"{sorted({type(g.kv_cache_spec).__name__ for g in groups})}: use shortfall='preempt'")
            logger.info("kvadmit: this model's KV layout cannot pause a request; shortfall=auto "
                        "preempts instead")
            cfg = cfg.replace(shortfall="preempt")
        return cfg

    def _kvadmit_shared_tokens(self, request: Request) -> int:
        """Tokens of a just-allocated request in blocks other requests also hold
        (prefix-cache hits on blocks in use: reference count above one). Asked only
        where kvadmit.count_shared_prefix (one full-attention group)."""
        blocks = self.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks.get(
            request.request_id, ())
        return sum(1 for b in blocks if b.ref_cnt > 1) * self.block_size

    def _kvadmit_single_full_attention_group(self) -> bool:
        """The pause plan counts blocks for one full-attention group (listed in its
        manager's req_to_blocks); other layouts (sliding window, hybrid, several groups)
        free and take blocks in ways it does not model."""
        groups = self.kv_cache_config.kv_cache_groups
        return len(groups) == 1 and type(groups[0].kv_cache_spec) in (FullAttentionSpec,
                                                                      MLAAttentionSpec)

    def _kvadmit_plan_pauses(self) -> None:
        """shortfall: pause. The core picks which running requests sit this step out
        (they keep their KV); vLLM skips them through its own per-request deferral,
        `next_decode_eligible_step`, which schedule() checks after advancing
        current_step (hence + 2), as vLLM's diffusion scheduler does."""
        blocks = self.kvadmit.pause_plan_blocks
        input_budget = self.scheduler_config.max_num_batched_tokens
        # vLLM's long-prefill cap, as schedule() derives it.
        num_running, num_waiting = self.get_request_counts()
        eligible = num_running + num_waiting
        threshold = self.scheduler_config.long_prefill_token_threshold if eligible > 1 else 0
        if threshold > 0 and self.adaptive_long_prefill_threshold:
            threshold = max(threshold, input_budget // eligible)
        step = self.current_step + 1          # the step schedule() is about to run
        want, computed, held = [], [], []
        for req in self.running:
            c = req.num_computed_tokens
            # The step's tokens as vLLM's running loop counts them (0: it skips the request).
            n = req.num_tokens_with_spec + req.num_output_placeholders - c
            if step < req.next_decode_eligible_step or (
                    req.num_output_placeholders > 0
                    and c + 2 - req.num_output_placeholders >= req.num_prompt_tokens + req.max_tokens):
                n = 0
            if 0 < threshold < n:
                n = threshold
            n = max(min(n, input_budget, self.max_model_len - c - self.num_sampled_tokens_per_step), 0)
            want.append(n)
            computed.append(c)
            held.append(len(blocks.get(req.request_id, ())))
        paused = self.kvadmit.core.plan_shortfall(
            want, computed, held, self.kv_cache_manager.block_pool.get_num_free_blocks(),
            self.max_num_scheduled_tokens, self.num_lookahead_tokens,
            # vLLM's priority scheduling: the plan pauses the lowest priorities first
            [r.priority for r in self.running] if self.kvadmit.request_id_ties is not None else None)
        for i in paused:
            req = self.running[i]
            req.next_decode_eligible_step = max(req.next_decode_eligible_step, step + 1)

    @staticmethod
    def _kvadmit_install_native_queue(pool) -> None:
        if pool.free_block_queue.num_free_blocks != pool.num_gpu_blocks - 1:
            raise RuntimeError("kvadmit: native_allocator must be installed before any allocation")
        queue = BlockObjectQueue(pool.blocks)
        null = queue.popleft()   # what BlockPool.__init__ did with its own queue
        if null is not pool.null_block:
            raise RuntimeError("kvadmit: native queue disagrees with vLLM on the null block")
        pool.free_block_queue = queue

    # -- arrivals -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:   # streaming input for a live request
            return super().add_request(request)
        if not self.requests:
            self.kvadmit.bridge.engine_idle()
        sp = request.sampling_params
        group = sample_group(request.request_id, sp.extra_args if sp is not None else None)
        if group is None:
            members = [request]
        else:
            # One of n samples (vLLM's parallel sampling): the request arrives as one
            # unit once all of its samples are here.
            parent, n = group
            members = self.kvadmit.samples_awaiting_siblings.setdefault(parent, [])
            members.append(request)
            if len(members) < n:
                return None
            del self.kvadmit.samples_awaiting_siblings[parent]
        # arrive_group asks for each member's numbers in turn (its own id and
        # arrival_time: its place in vLLM's priority order).
        order = iter(members)
        arrival = self.kvadmit.bridge.arrive_group(
            [(r.request_id, r) for r in members], lambda: self._kvadmit_numbers(next(order)),
            self.kvadmit.clock())
        self._kvadmit_shed(arrival.shed)
        if not arrival.accepted:
            for r in members:
                self._kvadmit_forget_order(r.request_id)
                self._kvadmit_refuse(r, arrival.refusal, log=r is request)
            return None
        for r in members:
            super().add_request(r)
        return None

    def _kvadmit_check_body(self, request: Request) -> None:
        """Refuses (FieldError) what would crash the engine further on: a prompt token
        id outside the vocabulary (vLLM checks none with --skip-tokenizer-init), and a
        priority or max_tokens beyond the core's integers (offline `LLM` passes any)."""
        check_prompt_tokens(request.prompt_token_ids, self.kvadmit.vocab_size,
                            multimodal=bool(request.mm_features))
        check_int(request.priority, "priority")
        check_int(request.max_tokens, "max_tokens", 1)

    def _kvadmit_numbers(self, request: Request) -> dict:
        """The core's arrival numbers of a request (FieldError names a malformed field
        or what would crash the engine)."""
        self._kvadmit_check_body(request)
        sp = request.sampling_params
        fields = from_extra_args(sp.extra_args if sp is not None else None)
        session = fields.session
        if session < 0 and request.session_id:   # vLLM's session_id (X-Session-ID)
            session = session_int(request.session_id, "session_id")
        numbers = dict(prompt_tokens=request.num_prompt_tokens, max_new_tokens=request.max_tokens,
                       priority=request.priority,
                       ttft_slo_s=ttft_target(fields, self.kvadmit.config.default_ttft_slo_s),
                       tpot_slo_s=fields.tpot_slo_s, session=session)
        if self.kvadmit.request_id_ties is not None:   # vLLM's priority order: its arrival_time, then id
            numbers.update(arrival_time=request.arrival_time, arrival_tie=self.kvadmit.request_id_ties.add(
                (request.priority, request.arrival_time), request.request_id))
        return numbers

    def _kvadmit_forget_order(self, request_id: str) -> None:
        if self.kvadmit.request_id_ties is not None:
            self.kvadmit.request_id_ties.remove(request_id)

    def _kvadmit_shed(self, shed) -> None:
        """Waiting requests the core shed for an arrival: finished, with their refusal."""
        for victim, refusal in shed:
            self._kvadmit_forget_order(victim.request_id)
            self.finish_requests(victim.request_id, RequestStatus.FINISHED_ABORTED)
            self._kvadmit_refuse(victim, refusal)

    def _kvadmit_adopt(self, request: Request) -> int | None:
        """A request vLLM puts (back) in the waiting queue that kvadmit does not track
        (it left through remove_requests): the core takes it as an arrival; its slot.
        None if the core refuses it: vLLM holds it already, so it is served untracked."""
        arrival = self.kvadmit.bridge.arrive(request.request_id, request,
                                             lambda: self._kvadmit_numbers(request),
                                             self.kvadmit.clock())
        self._kvadmit_shed(arrival.shed)
        if not arrival.accepted:
            self._kvadmit_forget_order(request.request_id)
            logger.warning("kvadmit: %s came back to the waiting queue and is served untracked "
                           "(%s)", request.request_id, arrival.refusal.log_line(request.request_id))
            return None
        return arrival.slot

    def _kvadmit_leave(self, request_id: str, finished: bool = False, progress=None,
                       now: float = 0.0) -> None:
        """The request leaves kvadmit (finished on its own, or aborted)."""
        self._kvadmit_forget_order(request_id)
        self.kvadmit.bridge.leave(request_id, finished, progress, now)

    def _kvadmit_refuse(self, request: Request, refusal: Refusal, log: bool = True) -> None:
        """Finishes a request kvadmit refused (it never enters or has left the scheduler):
        its client gets an output with the refusal (kvadmit.protocol; the API-server
        patch turns it into the HTTP answer)."""
        if log:
            logger.log(logging.WARNING if refusal.reason == "invalid" else logging.INFO,
                       "%s", refusal.log_line(request.request_id))
        self.kvadmit.pending_refusals.append((request.client_index, EngineCoreOutput(
            request_id=request.request_id, new_token_ids=[], finish_reason=FinishReason.ABORT,
            stop_reason=refusal.stop_reason, kv_transfer_params=refusal.to_params())))

    def finish_requests(self, request_ids, finished_status):
        if self.kvadmit.samples_awaiting_siblings and request_ids is None:   # finish everything
            self.kvadmit.samples_awaiting_siblings.clear()
        if self.kvadmit.samples_awaiting_siblings:
            # Samples waiting for their siblings are not in the scheduler yet: drop them.
            if not isinstance(request_ids, str):
                request_ids = list(request_ids)   # read twice: here and by vLLM
            ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
            for parent, members in list(self.kvadmit.samples_awaiting_siblings.items()):
                members[:] = [r for r in members if r.request_id not in ids]
                if not members:
                    del self.kvadmit.samples_awaiting_siblings[parent]
        finished = super().finish_requests(request_ids, finished_status)
        self._kvadmit_publish()
        return finished

    # -- every step ------------------------------------------------------------
    def schedule(self, *args, **kwargs):
        core, bridge = self.kvadmit.core, self.kvadmit.bridge
        now = self.kvadmit.clock()
        # From the previous schedule() to this one: that step's scheduling, forward
        # pass and output processing (with async scheduling, the pipeline's period).
        bridge.begin_step(now)
        if self.kvadmit.config.agent_window:   # KV usage and prefix hits go to the core
            used = self.kvadmit.usable_blocks - self.kv_cache_manager.block_pool.get_num_free_blocks()
            bridge.observe_cache(used, now)
        # The window, the running set and the step-time fit may have changed since the
        # gate last chose: choose again.
        self.waiting.invalidate()
        slots, computed, generated, by_slot = [], [], [], {}
        for req in self.running:
            slot = bridge.slot(req.request_id)
            if slot is None:
                continue
            prompt = req.num_prompt_tokens
            gen = max(req.num_tokens - prompt, req.num_computed_tokens - prompt, 0)
            slots.append(slot)
            generated.append(gen)
            computed.append(min(req.num_computed_tokens, prompt + gen))
            by_slot[slot] = req
        if core.num_running < len(slots):   # started outside the gate (KV-holding queue)
            for slot in slots:
                if core.state(slot) == "waiting":
                    core.admit(slot, now)
        core.update_many(slots, computed, generated)
        if self.kvadmit.count_shared_prefix:
            core.observe_used_blocks(
                self.kvadmit.usable_blocks - self.kv_cache_manager.block_pool.get_num_free_blocks())
        # vLLM preempts running[-1] first: put the core's victim order in place. (Under
        # its priority scheduling vLLM picks its own victim, the lowest priority and
        # latest arrival, as the core's order does: its running order stays its own.)
        if self.kvadmit.request_id_ties is None:
            order = [by_slot[s] for s in core.victim_order() if s in by_slot]
            if len(order) == len(self.running):
                self.running = order
        if self.kvadmit.pause_plan_blocks is not None:
            self._kvadmit_plan_pauses()
        out = super().schedule(*args, **kwargs)
        tokens = out.total_num_scheduled_tokens
        if tokens:
            reqs = self.requests
            scheduled = out.num_scheduled_tokens
            # schedule() has advanced num_computed_tokens by the step's tokens.
            bridge.end_step(tokens, sum([reqs[r].num_computed_tokens for r in scheduled]))
            popped = self.kvadmit.started_this_step
            if popped:
                # Started this step: the tokens computed before it are prefix-cache hits
                # (local, or a KV connector's), out of its num_tokens (vLLM's query).
                lookup = self.kv_cache_manager.prefix_cache_lookup_enabled
                hits = queries = 0
                for req in popped:
                    n = scheduled.get(req.request_id)
                    if n is not None and lookup(req):
                        hits += req.num_computed_tokens - n
                        queries += req.num_tokens
                bridge.note_prefix_hits(hits, queries)
        if self.kvadmit.started_this_step:
            self.kvadmit.started_this_step.clear()
        core.on_step(self.kvadmit.clock())
        return out

    def _kvadmit_publish(self) -> None:
        """The core's counters to Prometheus: after every step's outputs and every
        abort (an abort or the last finish may leave the engine idle, with no step
        to publish it)."""
        if self.kvadmit.metrics is not None:
            self.kvadmit.metrics.update(self.kvadmit.core.stats())

    def _preempt_request(self, request: Request, timestamp: float, *args, **kwargs) -> None:
        slot = self.kvadmit.bridge.slot(request.request_id)
        if slot is not None:
            self.kvadmit.core.preempt(slot, self.kvadmit.clock())
        return super()._preempt_request(request, timestamp, *args, **kwargs)

    def _free_request(self, request: Request, *args, **kwargs):
        if request.request_id in self.kvadmit.bridge.slots:
            natural = request.status in (RequestStatus.FINISHED_STOPPED,
                                         RequestStatus.FINISHED_LENGTH_CAPPED)

            def progress(slot):
                prompt = request.num_prompt_tokens
                gen = request.num_tokens - prompt
                return min(request.num_computed_tokens, prompt + gen), gen

            self._kvadmit_leave(request.request_id, natural, progress,
                                self.kvadmit.clock() if natural else 0.0)
        return super()._free_request(request, *args, **kwargs)

    # -- outputs ---------------------------------------------------------------
    def update_from_output(self, *args, **kwargs) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(*args, **kwargs)
        if self.kvadmit.pending_refusals:
            by_client: dict[int, list[EngineCoreOutput]] = defaultdict(list)
            for client, out in self.kvadmit.pending_refusals:
                by_client[client].append(out)
            self.kvadmit.pending_refusals.clear()
            for client, outs in by_client.items():
                eco = outputs.get(client)
                if eco is None:
                    outputs[client] = eco = EngineCoreOutputs()
                eco.outputs = list(eco.outputs) + outs
        self._kvadmit_publish()
        return outputs

    def has_finished_requests(self) -> bool:
        # Pending rejections keep the engine stepping until their outputs are sent.
        return bool(self.kvadmit.pending_refusals) or super().has_finished_requests()


class KvadmitScheduler(_KvadmitMixin, VllmScheduler):
    """vLLM's Scheduler with kvadmit admission (synchronous scheduling)."""


class KvadmitAsyncScheduler(_KvadmitMixin, VllmAsyncScheduler):
    """vLLM's AsyncScheduler with kvadmit admission (async scheduling)."""


class Scheduler:
    """What `--scheduler-cls kvadmit.vllm.Scheduler` names: picks the flavour
    matching `async_scheduling`, so the engine keeps its overlap on GPUs."""

    def __new__(cls, *args, **kwargs):
        vllm_config = kwargs.get("vllm_config") or args[0]
        if vllm_config.scheduler_config.async_scheduling:
            return KvadmitAsyncScheduler(*args, **kwargs)
        return KvadmitScheduler(*args, **kwargs)

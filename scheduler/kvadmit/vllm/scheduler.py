"""kvadmit inside vLLM's V1 scheduler.

vLLM keeps doing everything it does (token budgets, chunked prefill, prefix
caching, allocation); kvadmit's core decides three things. This module holds the
scheduler mixin (vLLM's overridden methods) and the gated waiting queue; both hand
their part to the scheduler's `VllmAdmission` (`scheduler.kvadmit`,
kvadmit.vllm.admission), which translates vLLM's objects to the core's numbers
and back:

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
is not given). Every `schedule()` is one run of the core's step sequence
(`AdmissionCore.step` / `step_done`, through `CorePort.step`): the previous
step's duration (the wall time between two schedule() calls, which spans that
step's forward pass), with `agent_window` the KV blocks in use and the prefix-cache
hits of the requests started in the previous step, and the running requests'
progress.

Every vLLM private name used here is listed and checked at start-up in
`kvadmit.vllm.compat` (vLLM 0.32.x, 0.33.x and 0.34.x).
"""
from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator

from kvadmit._native import BlockObjectQueue
from kvadmit.config import AdmissionConfig, ConfigError
# STOP_REASON_PREFIX: re-exported (the refusals' stop_reason prefix, kvadmit.protocol).
from kvadmit.protocol import PREFIX as STOP_REASON_PREFIX  # noqa: F401
from kvadmit.vllm import compat, failure
from kvadmit.vllm.admission import RequestIdTies, VllmAdmission  # noqa: F401 - RequestIdTies re-exported
from kvadmit.vllm.fit import fit_to_vllm
from kvadmit.vllm.settings import VllmSettings, configs_of

# vLLM's (private) names, imported through compat: a moved one fails naming itself.
_v = compat.import_names(compat.SCHEDULER_IMPORTS)
VllmScheduler, VllmAsyncScheduler = _v.Scheduler, _v.AsyncScheduler
RequestQueue, SchedulingPolicy = _v.RequestQueue, _v.SchedulingPolicy
create_request_queue = _v.create_request_queue
EngineCoreOutput, EngineCoreOutputs = _v.EngineCoreOutput, _v.EngineCoreOutputs
FullAttentionSpec, MLAAttentionSpec = _v.FullAttentionSpec, _v.MLAAttentionSpec
Request, RequestStatus = _v.Request, _v.RequestStatus

logger = logging.getLogger("kvadmit.vllm")



def config_from_vllm(vllm_config) -> tuple[AdmissionConfig, VllmSettings]:
    """The `"kvadmit"` object of vLLM's `--additional-config` (a dict or JSON text):
    the core's settings and the vLLM-only ones (kvadmit.vllm.settings). A misspelt or
    null `"kvadmit"` is a ConfigError (kvadmit.config.section_from)."""
    config, vllm_settings = configs_of(vllm_config.additional_config)
    knobs = compat.unsupported_knobs(vllm_config)
    if knobs:
        raise ConfigError("kvadmit cannot run beside " + "; ".join(knobs))
    return config, vllm_settings


class GatedWaitingQueue(RequestQueue):
    """vLLM's waiting queue with kvadmit's gate in front of its head.

    The order is the core's: arrival, or with vLLM's priority scheduling (priority,
    `Request.arrival_time`, request id) as vLLM's own queue. The candidate chosen
    when vLLM first looks (``bool(queue)`` / ``peek_request``) is the one
    ``pop_request`` hands out, so a request vLLM allocated for is the request it
    starts. A request kvadmit does not track (the core refused it when vLLM put it
    back after a `remove_requests`) is served first, ungated. The queue sees only
    the queue verbs of `VllmAdmission` (choose, commit, undo, adopt, leave, order).
    """

    def __init__(self, admission: VllmAdmission):
        self._admission = admission
        self._by_slot: dict[int, Request] = {}
        self._untracked: list[Request] = []
        self._candidate: Request | None = None
        self._looked = False             # _candidate is the core's answer to the last look

    # -- the gate ---------------------------------------------------------
    def _choose(self) -> Request | None:
        if self._admission.failed_closed:
            return None    # nothing starts: the scheduler refuses the held ones after the step
        if self._untracked:
            return self._untracked[0]
        # One look per change: vLLM asks bool()/peek several times a step, and with
        # head-of-line bypass a look can scan hundreds of held requests.
        if not self._looked and self._by_slot and not self._admission.failed:
            try:
                self._candidate = self._by_slot.get(self._admission.choose())
                self._looked = True
            except Exception:   # noqa: BLE001 - kvadmit's own error: fail open or closed
                self._admission.fail("choosing a waiting request")
        if self._admission.failed:
            if self._admission.failed_closed:
                return None
            self._release()
            return self._untracked[0] if self._untracked else None
        return self._candidate

    def _release(self) -> None:
        """After a failure: every request the core held, in arrival order, served
        ungated (the scheduler swaps in vLLM's own queue at its next step)."""
        if self._by_slot:
            held = sorted(self._by_slot.values(), key=lambda r: (r.arrival_time, r.request_id))
            self._by_slot.clear()
            self._untracked.extend(held)
        self._candidate = None

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
        try:
            del self._by_slot[self._admission.commit(req)]
        except Exception:   # noqa: BLE001 - kvadmit's own error: fail open or closed
            self._admission.fail("starting a waiting request")
            self._by_slot = {s: r for s, r in self._by_slot.items() if r is not req}
        return req

    def holds(self, request: Request) -> bool:
        """Whether ``request`` waits in this queue (not in another of vLLM's)."""
        slot = self._admission.port.slot(request.request_id)
        return slot in self._by_slot or request in self._untracked

    def invalidate(self) -> None:
        """Forgets the chosen candidate: the next look asks the core again."""
        self._candidate = None
        self._looked = False

    # -- plain queue operations -------------------------------------------
    def add_request(self, request: Request) -> None:
        self._candidate = None
        self._looked = False
        if self._admission.failed:
            self._untracked.append(request)
            return
        slot = self._admission.adopt(request)   # back after remove_requests: the core takes it anew
        if slot is None:
            self._untracked.append(request)
            return
        self._admission.undo(slot)   # popped but not started (vLLM skipped it this step)
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
                if not self._admission.failed:
                    self._admission.leave(r.request_id, self._admission.clock())
        self._untracked = [r for r in self._untracked if r.request_id not in ids]

    def __len__(self) -> int:
        return len(self._by_slot) + len(self._untracked)

    def __iter__(self) -> Iterator[Request]:
        by_slot = self._by_slot
        if self._admission.failed:
            self._release()
            return iter(list(self._untracked))
        return iter(self._untracked
                    + [by_slot[s] for s in self._admission.order() if s in by_slot])

    def __getitem__(self, index):
        """The index-th request in the queue's order (vLLM's FCFS queue is a deque)."""
        return list(self)[index]


class _KvadmitMixin:
    """The kvadmit behaviour, shared by the sync and async scheduler flavours: vLLM's
    overridden methods, each handing its part to the scheduler's `VllmAdmission`
    (`self.kvadmit`, kvadmit.vllm.admission)."""

    kvadmit: VllmAdmission

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cfg, vllm_settings = config_from_vllm(self.vllm_config)
        compat.check_scheduler(self, GatedWaitingQueue,
                               native_allocator=vllm_settings.native_allocator,
                               pause=cfg.pause_on_shortfall or cfg.policy == "auto",
                               allow_degraded=vllm_settings.allow_degraded_vllm)
        compat.check_trust_patch(cfg)
        window = compat.turn_off_cache_aware_window(self)
        if window:
            logger.warning("kvadmit orders vLLM's waiting queue: --cache-aware-admission-window "
                           "%d is not used (kvadmit's agent_window keeps agents' prefixes "
                           "cached)", window)
        cfg = self._kvadmit_fit_config(cfg)
        if vllm_settings.native_allocator:
            self._kvadmit_install_native_queue(self.kv_cache_manager.block_pool)
        self.kvadmit = VllmAdmission(
            self, cfg, vllm_settings,
            single_full_attention_group=self._kvadmit_single_full_attention_group())
        self.waiting = GatedWaitingQueue(self.kvadmit)
        self.kvadmit.publish()      # an idle engine's gauges (headroom: the whole pool) from the start
        logger.info("kvadmit: policy=%s victim=%s on %d blocks of %d tokens", cfg.policy,
                    cfg.victim, self.kvadmit.usable_blocks, self.block_size)

    def _kvadmit_fit_config(self, cfg: AdmissionConfig) -> AdmissionConfig:
        """The configuration as this engine runs it: its prefill chunk, vLLM's priority
        order, and shortfall "auto" resolved for the model's KV layout."""
        sched_cfg = self.vllm_config.scheduler_config
        priority = self.policy == SchedulingPolicy.PRIORITY
        cfg = fit_to_vllm(cfg, chunked_prefill=sched_cfg.enable_chunked_prefill,
                          max_num_batched_tokens=sched_cfg.max_num_batched_tokens,
                          priority_scheduling=priority)
        if priority and cfg.victim != "priority":
            logger.warning("vLLM's priority scheduling picks its own victim (highest "
                           "priority value, latest arrival); kvadmit victim=%r is not used",
                           cfg.victim)
        if self._kvadmit_single_full_attention_group():
            return cfg.for_engine(None)
        groups = self.kv_cache_config.kv_cache_groups
        why = (f"pausing needs one full-attention KV cache group; this model has {len(groups)} "
               f"group(s) of {sorted({type(g.kv_cache_spec).__name__ for g in groups})}")
        if cfg.pause_on_shortfall and cfg.shortfall == "auto":
            logger.info("kvadmit: %s; shortfall=auto preempts instead", why)
        return cfg.for_engine(why)

    def _kvadmit_single_full_attention_group(self) -> bool:
        """The pause plan counts blocks for one full-attention group (listed in its
        manager's req_to_blocks); other layouts (sliding window, hybrid, several groups)
        free and take blocks in ways it does not model."""
        groups = self.kv_cache_config.kv_cache_groups
        return len(groups) == 1 and type(groups[0].kv_cache_spec) in (FullAttentionSpec,
                                                                      MLAAttentionSpec)

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
        if request.request_id in self.requests:
            return super().add_request(request)   # streaming input for a live request
        if self.kvadmit.failed:
            return self._kvadmit_after_failure(request)
        try:
            if not self.requests:
                self.kvadmit.port.engine_idle()
            admitted = self.kvadmit.arrive(request)
        except Exception:   # noqa: BLE001 - kvadmit's own error: fail open or closed
            self.kvadmit.fail("on a request's arrival")
            if request in self._kvadmit_hand_back():
                return None                       # a sample, handed back with its siblings
            return self._kvadmit_after_failure(request)
        for r in admitted:
            super().add_request(r)
            if not self.waiting.holds(r):
                # vLLM queued it apart, outside kvadmit's gate (a request that arrives
                # holding KV, in kv_holding_waiting: vLLM's own tests build such ones; a
                # request served normally enters kv_holding_waiting only after kvadmit's
                # queue let it start). It takes KV without the gate, so the core counts
                # it started: a candidate it could never hand out would stall the gate.
                try:
                    self.kvadmit.commit(r)
                except Exception:   # noqa: BLE001 - kvadmit's own error: fail open or closed
                    self.kvadmit.fail("starting a request vLLM queued apart")
        return None

    def _kvadmit_after_failure(self, request: Request) -> None:
        """An arrival once kvadmit failed: vLLM's (open), or refused (closed)."""
        if self.kvadmit.failed_closed:
            return failure.refuse(self.kvadmit, request)
        return super().add_request(request)

    def _kvadmit_hand_back(self) -> list:
        """After kvadmit failed (outside vLLM's schedule()): vLLM's own waiting queue
        with every request kvadmit held, and the samples that waited for siblings;
        failed closed, those that never started are refused instead
        (kvadmit.vllm.failure.refuse_held). Returns the samples."""
        if not isinstance(self.waiting, GatedWaitingQueue):
            return []
        held = list(self.waiting)           # a failed gate lists them in arrival order
        queue = create_request_queue(self.policy)
        for r in held:
            queue.add_request(r)
        self.waiting = queue
        waiting_samples = [r for members in self.kvadmit.samples_awaiting_siblings.values()
                           for r in members]
        self.kvadmit.samples_awaiting_siblings.clear()
        if self.kvadmit.failed_closed:
            failure.refuse_held(self, held, waiting_samples)
            return waiting_samples
        for r in waiting_samples:
            super().add_request(r)
        return waiting_samples

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

    def _kvadmit_publish(self) -> None:
        if not self.kvadmit.failed:
            try:
                self.kvadmit.publish()
            except Exception:   # noqa: BLE001 - kvadmit's own error: fail open or closed
                self.kvadmit.fail("publishing its metrics")

    # -- every step ------------------------------------------------------------
    def schedule(self, *args, **kwargs):
        if not self.kvadmit.failed:
            try:
                # The window, the running set and the step-time fit may have changed
                # since the gate last chose: choose again.
                self.waiting.invalidate()
                self.kvadmit.before_step(kwargs.get("throttle_prefills",
                                                    args[0] if args else False))
            except Exception:   # noqa: BLE001 - kvadmit's own error: fail open or closed
                self.kvadmit.fail("before a step")
        if self.kvadmit.failed:
            self._kvadmit_hand_back()
            return super().schedule(*args, **kwargs)
        out = super().schedule(*args, **kwargs)
        if not self.kvadmit.failed:
            try:
                self.kvadmit.after_step(out)
            except Exception:   # noqa: BLE001 - kvadmit's own error: fail open or closed
                self.kvadmit.fail("after a step")
        return out

    def _preempt_request(self, request: Request, timestamp: float, *args, **kwargs) -> None:
        slot = None if self.kvadmit.failed else self.kvadmit.port.slot(request.request_id)
        if slot is not None:
            try:
                self.kvadmit.port.preempt(slot, self.kvadmit.clock(),
                                          displaced=self.kvadmit.displacing)
            except Exception:   # noqa: BLE001 - kvadmit's own error: fail open or closed
                self.kvadmit.fail("preempting a request")
        return super()._preempt_request(request, timestamp, *args, **kwargs)

    def _free_request(self, request: Request, *args, **kwargs):
        if not self.kvadmit.failed and request.request_id in self.kvadmit.slots:
            natural = request.status in (RequestStatus.FINISHED_STOPPED,
                                         RequestStatus.FINISHED_LENGTH_CAPPED)

            def progress(slot):
                prompt = request.num_prompt_tokens
                gen = request.num_tokens - prompt
                return min(request.num_computed_tokens, prompt + gen), gen

            try:
                self.kvadmit.leave(request.request_id, self.kvadmit.clock(), natural, progress)
            except Exception:   # noqa: BLE001 - kvadmit's own error: fail open or closed
                self.kvadmit.fail("as a request left")
        session_kv = None if self.kvadmit.failed else self.kvadmit.session_kv
        if session_kv is None:
            return super()._free_request(request, *args, **kwargs)
        blocks = session_kv.blocks_of(request.request_id)
        out = super()._free_request(request, *args, **kwargs)
        try:
            session_kv.freed(request.request_id, blocks, self.kvadmit.clock())
        except Exception:   # noqa: BLE001 - kvadmit's own error: fail open or closed
            self.kvadmit.fail("releasing a session's cached blocks")
        return out

    # -- outputs ---------------------------------------------------------------
    def update_from_output(self, *args, **kwargs) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(*args, **kwargs)
        if self.kvadmit.failed:
            self._kvadmit_hand_back()     # failed closed: its refusals go out in this step
        pending = self.kvadmit.pending_refusals
        if pending:
            by_client: dict[int, list[EngineCoreOutput]] = defaultdict(list)
            for client, out in pending:
                by_client[client].append(out)
            pending.clear()
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


def by_flavour(sync_cls, async_cls, *args, **kwargs):
    """The scheduler vLLM constructs with (args, kwargs), of the flavour its
    `async_scheduling` asks for."""
    vllm_config = kwargs.get("vllm_config") or args[0]
    cls = async_cls if vllm_config.scheduler_config.async_scheduling else sync_cls
    return cls(*args, **kwargs)


class Scheduler:
    """What `--scheduler-cls kvadmit.vllm.Scheduler` names: picks the flavour
    matching `async_scheduling`, so the engine keeps its overlap on GPUs."""

    def __new__(cls, *args, **kwargs):
        return by_flavour(KvadmitScheduler, KvadmitAsyncScheduler, *args, **kwargs)

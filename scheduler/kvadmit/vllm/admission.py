"""kvadmit's view of one vLLM scheduler: `VllmAdmission`, the twin of
`kvadmit.sglang.adapter.SGLangAdmission`.

The scheduler mixin (kvadmit.vllm.scheduler) owns one, as `scheduler.kvadmit`, and
calls it from vLLM's overridden methods; the waiting queue (`GatedWaitingQueue`) sees
only its queue verbs:

- `choose()`: the slot the core lets start now (None: none may);
- `commit(request)`: vLLM takes that request out of the queue to start it;
- `undo(slot)`: vLLM put a request it took back unstarted: the admission is undone;
- `adopt(request)`: a request vLLM puts in the queue: its slot, or the core takes it
  anew (None: refused, vLLM serves it untracked);
- `leave(request_id)`: a waiting request leaves vLLM's queue (and the core);
- `order()`: the waiting slots in the core's order.

Around `schedule()`, `before_step` and `after_step` run the per-step sequence
through the core's port (`CorePort.step`, `step_done`); "what vLLM would schedule" for the pause plan is
`kvadmit.vllm.compat.running_step_tokens`. Refusals reach the client as engine
outputs (`pending_refusals`, sent by the next `update_from_output`); a replay reads
them through `watch_refusals` / `take_refused`.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any

from kvadmit._native import prompt_blocks
from kvadmit.arrival import ArrivalRecord
from kvadmit.config import AdmissionConfig
from kvadmit.port import CorePort, StepReport
from kvadmit.protocol import Refusal, sample_group
from kvadmit.vllm import compat, failure
from kvadmit.vllm.metrics import process_metrics
from kvadmit.vllm.request import arrival_record
from kvadmit.vllm.session_kv import SessionKV
from kvadmit.vllm.settings import VllmSettings

_v = compat.import_names(compat.SCHEDULER_IMPORTS)
EngineCoreOutput, FinishReason = _v.EngineCoreOutput, _v.FinishReason
RequestStatus, SchedulingPolicy = _v.RequestStatus, _v.SchedulingPolicy

logger = logging.getLogger("kvadmit.vllm")


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


class VllmAdmission:
    """kvadmit's state and verbs on one vLLM scheduler (see the module docstring): one
    attribute, `scheduler.kvadmit`, so none of kvadmit's names can collide with vLLM's.
    ``cfg`` is the configuration as this engine runs it (the mixin's fit)."""

    def __init__(self, sched, cfg: AdmissionConfig, vllm_settings: VllmSettings, *,
                 single_full_attention_group: bool, clock: Callable[[], float] = time.monotonic):
        self._sched = sched
        self.config = cfg
        self.vllm_settings = vllm_settings
        kvm = sched.kv_cache_manager
        self._pool = kvm.block_pool
        # Block 0 is vLLM's null block: never handed to a request.
        self.usable_blocks = self._pool.num_gpu_blocks - 1
        # The core's clock (drain rate, queue delay, step times, sessions): injected,
        # so the simulator runs it on virtual time (`set_clock`).
        self._clock: Callable[[], float] = clock
        self.vocab_size = sched.vllm_config.model_config.get_vocab_size()   # prompt ids are checked
        # vLLM's priority queue: ties of (priority, arrival_time) go by request id (None: FCFS).
        self.request_id_ties = RequestIdTies() if sched.policy == SchedulingPolicy.PRIORITY else None
        caching = kvm.enable_caching
        # Agent window: prefix hits count only with prefix caching (without it the core
        # sees 0/0: no signal). kvadmit decides which sessions may run; which cached
        # blocks are evicted stays vLLM's LRU (BlockPool's free-block queue), but for
        # sessions released by their clients' kv_hold_s under native_allocator
        # (session_kv). The requests the gate started this step (their prefix-cache
        # hits are reported to the port); None without the window or caching.
        self.started_this_step: list | None = [] if cfg.agent_window and caching else None
        # auto with prefix caching: a prefix running requests share is counted once.
        self.count_shared_prefix = cfg.policy == "auto" and caching and single_full_attention_group
        # The door into the core: request ids <-> core slots, arrivals, leaving, the
        # step sequence, the queue's verbs (the SLO guard predicts prefill time from
        # the engine's token budget a step).
        self.port = CorePort.create(
            cfg, self.usable_blocks, sched.block_size, sched.vllm_config.model_config.max_model_len,
            step_budget=sched.vllm_config.scheduler_config.max_num_batched_tokens,
            counts_shared_prefix=self.count_shared_prefix)
        # One full-attention group's blocks by request id: the pause plan's and the
        # shared-prefix count's (None where neither runs).
        self._req_to_blocks = (kvm.coordinator.single_type_managers[0].req_to_blocks
                               if cfg.pause_on_shortfall or self.count_shared_prefix else None)
        self.pause_plan_blocks = self._req_to_blocks if cfg.pause_on_shortfall else None
        # Clients' kv_hold_s: done sessions' cached blocks evicted first (native queue only)
        self.session_kv = (SessionKV(self._pool, kvm.coordinator.single_type_managers[0].req_to_blocks,
                                     sched.block_size)
                           if vllm_settings.native_allocator and caching and single_full_attention_group
                           else None)
        self.step_rules = compat.step_rules(sched=sched)   # "what vLLM would schedule", this release's
        # Displacement and pauses (kvadmit._step_plan), beside vLLM's --watermark blocks
        self.planner = self.port.planner(getattr(kvm, "watermark_blocks", 0),
                                         sched.num_lookahead_tokens)
        self._step_now = 0.0                     # the time of the step being scheduled
        self.metrics: Any | None = process_metrics()   # Prometheus counters, if any
        # Refused: (client index, output), sent by the next update_from_output.
        self.pending_refusals: list[tuple[int, Any]] = []
        self._refusal_log: list[tuple[str, Refusal]] | None = None   # watch_refusals
        # Samples of parallel-sampling requests that arrived before their siblings:
        # parent id -> [Request]; the request arrives once all n are here.
        self.samples_awaiting_siblings: dict[str, list] = {}
        # The waiting slot this step's displacement preempted running requests for: it
        # starts first (its victims, back in the queue, may rank before it there).
        self._displaced_for: int | None = None
        # True while _displace preempts: the Scheduler tells the core so
        self.displacing = False
        # kvadmit's own errors inside vLLM's engine (fail): none yet.
        self.internal_errors = 0
        self._hold_unused_said = False

    @property
    def clock(self) -> Callable[[], float]:
        """The clock the core reads its `now` from (seconds): time.monotonic, or `set_clock`'s."""
        return self._clock

    def set_clock(self, clock: Callable[[], float]) -> None:
        """Runs the core on ``clock`` from now on (a replay's virtual time). The one
        way to change it: the core's time is monotone, so give it before any request."""
        if not callable(clock):
            raise TypeError(f"clock={clock!r}: must be a callable returning seconds")
        self._clock = clock

    @property
    def slots(self):
        """Request id -> core slot of every request kvadmit tracks (read-only view)."""
        return self.port.slots

    # -- the waiting queue's verbs -----------------------------------------------
    def choose(self) -> int | None:
        """The slot the core lets start now (None: none may): the one this step's
        displacement made room for first, while it waits."""
        if self._displaced_for is not None:
            if self.port.state(self._displaced_for) == "waiting":
                return self._displaced_for
            self._displaced_for = None
        slot = self.port.next_admissible(self._pool.get_num_free_blocks(), False)
        return None if slot < 0 else slot

    def commit(self, request) -> int:
        """vLLM takes ``request`` (the chosen one) to start it; its slot."""
        slot = self.port.slot(request.request_id)
        if self.count_shared_prefix:
            self.port.set_shared(slot, self._shared_tokens(request))
        self.port.admit(slot, self.clock())
        if self.started_this_step is not None:
            self.started_this_step.append(request)
        return slot

    def undo(self, slot: int) -> None:
        """A request vLLM took but did not start is back: its admission is undone."""
        if self.port.state(slot) == "running":
            self.port.cancel_admit(slot, self.clock())

    def adopt(self, request) -> int | None:
        """The slot of a request vLLM puts in the waiting queue. One kvadmit does not
        track (it left through remove_requests) arrives at the core anew; None if the
        core refuses it: vLLM holds it already, so it is served untracked."""
        slot = self.port.slot(request.request_id)
        if slot is not None:
            return slot
        arrival = self.port.arrive(request.request_id, request,
                                     lambda: self.numbers(request), self.clock())
        self.shed(arrival.shed)
        if not arrival.accepted:
            self.forget_order(request.request_id)
            logger.warning("kvadmit: %s came back to the waiting queue and is served untracked "
                           "(%s)", request.request_id, arrival.refusal.log_line(request.request_id))
            return None
        return arrival.slot

    def leave(self, request_id: str, now: float, finished: bool = False, progress=None) -> None:
        """The request leaves kvadmit at ``now`` (finished on its own, or aborted)."""
        self.forget_order(request_id)
        self.port.leave(request_id, finished, progress, now)

    def order(self):
        """The waiting slots in the core's order."""
        return self.port.waiting()

    # -- failing open or closed (kvadmit.vllm.failure) ---------------------------
    @property
    def failed(self) -> bool:
        return self.internal_errors > 0

    @property
    def failed_closed(self) -> bool:
        """Failed under on_internal_error: closed: held and new requests are refused."""
        return self.internal_errors > 0 and self.config.on_internal_error == "closed"

    def fail(self, where: str) -> None:
        """kvadmit's own code raised inside vLLM's engine (call it from the except block):
        it fails open or closed as the config says (kvadmit.vllm.failure)."""
        failure.record(self, where)

    # -- arrivals ---------------------------------------------------------------
    def arrive(self, request) -> list:
        """``request`` arrives: the requests vLLM may now take (it, with the samples of
        a parallel-sampling request that waited for their siblings), or none (it waits
        for its siblings, or it was refused: its client gets the refusal)."""
        sp = request.sampling_params
        group = sample_group(request.request_id, sp.extra_args if sp is not None else None)
        if group is None:
            members = [request]
        else:
            # One of n samples (vLLM's parallel sampling): the request arrives as one
            # unit once all of its samples are here.
            parent, n = group
            members = self.samples_awaiting_siblings.setdefault(parent, [])
            members.append(request)
            if len(members) < n:
                return []
        # arrive_group asks for each member's numbers in turn (its own id and
        # arrival_time: its place in vLLM's priority order). The samples wait for their
        # siblings until it answered (if it raises, failing hands them all back).
        order = iter(members)
        arrival = self.port.arrive_group(
            [(r.request_id, r) for r in members], lambda: self.numbers(next(order)), self.clock())
        if group is not None:
            del self.samples_awaiting_siblings[group[0]]
        self.shed(arrival.shed)
        if not arrival.accepted:
            for r in members:
                self.forget_order(r.request_id)
                self.refuse(r, arrival.refusal, log=r is request)
            return []
        return members

    def numbers(self, request) -> ArrivalRecord:
        """The core's arrival record of a request (kvadmit.vllm.request; FieldError
        names a malformed field or what would crash the engine)."""
        record = arrival_record(request, self.config, self.vocab_size, self.request_id_ties)
        if self.session_kv is not None:
            self.session_kv.arrived(request.request_id, record)
        elif record.kv_hold_s >= 0 and not self._hold_unused_said:
            self._hold_unused_said = True
            logger.warning("kvadmit: requests give kv_hold_s; it takes native_allocator: true "
                           "and prefix caching (docs/slo-agents.md); not used")
        return record

    def forget_order(self, request_id: str) -> None:
        if self.request_id_ties is not None:
            self.request_id_ties.remove(request_id)

    def shed(self, shed) -> None:
        """Waiting requests the core dropped (shed for an arrival, or past their TTL):
        finished, with their refusal."""
        for victim, refusal in shed:
            self.forget_order(victim.request_id)
            self._sched.finish_requests(victim.request_id, RequestStatus.FINISHED_ABORTED)
            self.refuse(victim, refusal)

    def refuse(self, request, refusal: Refusal, log: bool = True) -> None:
        """Finishes a request kvadmit refused (it never enters or has left the scheduler):
        its client gets an output with the refusal (kvadmit.protocol; the API-server
        patch turns it into the HTTP answer)."""
        if log:
            logger.log(logging.WARNING if refusal.reason == "invalid" else logging.INFO,
                       "%s", refusal.log_line(request.request_id))
        if self.session_kv is not None:
            self.session_kv.forget(request.request_id)
        if self._refusal_log is not None:
            self._refusal_log.append((request.request_id, refusal))
        self.pending_refusals.append((request.client_index, EngineCoreOutput(
            request_id=request.request_id, new_token_ids=[], finish_reason=FinishReason.ABORT,
            stop_reason=refusal.stop_reason, kv_transfer_params=refusal.to_params())))

    def watch_refusals(self) -> None:
        """From now on every refusal (at arrival, or a waiting request shed) is also
        noted for `take_refused` (a replay's record; a server does not call this)."""
        if self._refusal_log is None:
            self._refusal_log = []

    def take_refused(self) -> list[tuple[str, str]]:
        """[(request id, reason)] refused since the last call (after `watch_refusals`)."""
        return [(rid, refusal.reason) for rid, refusal in self.take_refusals()]

    def take_refusals(self) -> list[tuple[str, Refusal]]:
        """[(request id, Refusal)] refused since the last call (after `watch_refusals`):
        with the client's Retry-After."""
        log = self._refusal_log
        if not log:
            return []
        self._refusal_log = []
        return log

    # -- every step ---------------------------------------------------------------
    def before_step(self, throttle_prefills: bool = False) -> None:
        """Before vLLM's schedule(): the step's report to the port (its time, the KV
        blocks in use, the running requests' progress) and the plan back: `running`
        put in the core's victim order (vLLM preempts running[-1] first); then the
        pause plan, applied through vLLM's own decode deferral."""
        sched, port = self._sched, self.port
        # From the previous schedule() to this one: that step's scheduling, forward
        # pass and output processing (with async scheduling, the pipeline's period).
        self._step_now = now = self.clock()
        self._displaced_for = None
        if self.session_kv is not None:
            self.session_kv.tick(now)
        slots, computed, generated, by_slot = [], [], [], {}
        for req in sched.running:
            slot = port.slot(req.request_id)
            if slot is None:
                continue
            prompt = req.num_prompt_tokens
            gen = max(req.num_tokens - prompt, req.num_computed_tokens - prompt, 0)
            slots.append(slot)
            generated.append(gen)
            computed.append(min(req.num_computed_tokens, prompt + gen))
            by_slot[slot] = req
        plan = port.step(StepReport(
            now=now, used_blocks=self.usable_blocks - self._pool.get_num_free_blocks(),
            slots=slots, computed=computed, generated=generated))
        self.shed(plan.dropped)        # stale work leaves vLLM's queue before it admits
        # vLLM preempts running[-1] first: put the core's victim order in place. (Under
        # its priority scheduling vLLM picks its own victim, the lowest priority and
        # latest arrival, as the core's order does: its running order stays its own.)
        if self.request_id_ties is None:
            order = [by_slot[s] for s in plan.victim_order if s in by_slot]
            if len(order) == len(sched.running):
                sched.running = order
        self._displace()
        if self.pause_plan_blocks is not None:
            self._pause(throttle_prefills)

    def _displace(self) -> None:
        """Priority retraction (queue_order priority) and flow displacement (flows on),
        through the step planner (kvadmit._step_plan): the waiting request the core lets
        start may take the KV of running requests less important than it, or of flows
        over their share. vLLM preempts only for a running request short of blocks,
        never for a waiting one, and kvadmit's pool seldom runs short: so the planner's
        victims are preempted here, and the request starts first in this step."""
        sched, planner = self._sched, self.planner
        free = self._pool.get_num_free_blocks()
        slot, victims = planner.find_candidate(free)
        if slot < 0:
            return
        req = self.port.obj(self.port.key(slot))
        need, hit_ids = self._prompt_need(req)
        running = sched.running
        if not planner.is_short(need, free, len(running)):
            return
        held = sched.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks
        members = set(running)
        freed, kept, by_slot = [], [], {}
        for v in victims:
            vreq = by_slot[v] = self.port.obj(self.port.key(v))
            if vreq not in members or not sched._request_blocks_can_be_freed(vreq):
                freed.append(-1)
                kept.append(0)
                continue
            # a block only the victim holds comes free; one the request hits it takes
            # straight back (counted in its need, once cached-free)
            alone = [b.block_id for b in held.get(vreq.request_id, ()) if b.ref_cnt == 1]
            freed.append(len(alone))
            kept.append(sum(1 for b in alone if b in hit_ids))
        displaced = planner.displace(free, len(running), freed, kept)
        if not displaced:
            return
        now = time.monotonic()
        self.displacing = True
        try:
            for v in displaced:
                vreq = by_slot[v]
                sched.running.remove(vreq)
                sched._preempt_request(vreq, now,    # the core hears of it (Scheduler)
                                       drop_stale_output=getattr(sched, "requires_kv_delivery", False))
        finally:
            self.displacing = False
        self._displaced_for = slot
        sched.waiting.invalidate()

    def _prompt_need(self, req) -> tuple[int, set]:
        """The free blocks a waiting request takes when it starts, as vLLM allocates
        them (the planner's prompt_blocks: the whole input under vLLM's full-input
        check, else the step's budget at most), and its prefix-cache hits' block ids."""
        sched = self._sched
        kvm, bs = sched.kv_cache_manager, sched.block_size
        hits = ()
        if req.num_computed_tokens == 0 and kvm.prefix_cache_lookup_enabled(req):
            # (blocks, tokens, ...): no block moves (with KV cache events in vLLM's "full"
            # report mode it emits the hit blocks' events again)
            found = kvm.get_computed_blocks(req)
            hits = found[0].blocks[0][:found[1] // bs]
        full_input = getattr(sched, "scheduler_reserve_full_isl", True)
        need = prompt_blocks(req.num_tokens, req.num_computed_tokens, len(hits),
                             sum(1 for b in hits if b.ref_cnt == 0),
                             req.num_tokens if full_input else sched.max_num_scheduled_tokens,
                             sched.num_lookahead_tokens, bs)
        return need, {b.block_id for b in hits}

    def _pause(self, throttle_prefills: bool) -> None:
        """shortfall: pause. The planner picks which running requests sit this step
        out (they keep their KV); vLLM skips them through its own per-request deferral,
        `next_decode_eligible_step`, which schedule() checks after advancing
        current_step (hence + 2), as vLLM's diffusion scheduler does."""
        sched, blocks, running = self._sched, self.pause_plan_blocks, self._sched.running
        paused = self.planner.pause(
            compat.running_step_tokens(sched, self.step_rules, throttle_prefills),
            [req.num_computed_tokens for req in running],
            [len(blocks.get(req.request_id, ())) for req in running],
            [r.priority for r in running] if self.config.queue_order == "priority" else None,
            self._pool.get_num_free_blocks(), sched.max_num_scheduled_tokens,
            # read under shortfall "cost" only: the slots (its no-thrash rule) and, in a
            # priced step, the blocks each one's preemption frees (shared prefixes stay)
            [-1 if (slot := self.port.slot(req.request_id)) is None else slot for req in running]
            if self.config.shortfall == "cost" else None,
            (lambda: [sum(b.ref_cnt == 1 for b in blocks.get(r.request_id, ())) for r in running])
            if self.config.shortfall == "cost" else None)
        step = sched.current_step + 1          # the step schedule() is about to run
        for i in paused:
            req = running[i]
            req.next_decode_eligible_step = max(req.next_decode_eligible_step, step + 1)

    def after_step(self, out) -> None:
        """After vLLM's schedule() returned ``out``: what the step runs (its tokens and
        context, the prefix hits of the requests the gate started) to the port,
        which steps the core at the step's time."""
        self._displaced_for = None       # this step's: the next one displaces anew
        tokens = out.total_num_scheduled_tokens
        started = self.started_this_step
        context = hits = queries = 0
        if tokens:
            reqs = self._sched.requests
            scheduled = out.num_scheduled_tokens
            # schedule() has advanced num_computed_tokens by the step's tokens.
            context = sum([reqs[r].num_computed_tokens for r in scheduled])
            if started:
                # Started this step: the tokens computed before it are prefix-cache hits
                # (local, or a KV connector's), out of its num_tokens (vLLM's query).
                lookup = self._sched.kv_cache_manager.prefix_cache_lookup_enabled
                for req in started:
                    n = scheduled.get(req.request_id)
                    if n is not None and lookup(req):
                        hits += req.num_computed_tokens - n
                        queries += req.num_tokens
        if started:
            started.clear()
        if self.session_kv is not None:
            for new in out.scheduled_new_reqs:      # their prefix hits: tokens computed before
                self.session_kv.started(new.req_id, new.num_computed_tokens)
        self.port.step_done(tokens, context, self._step_now, hits, queries)

    def _shared_tokens(self, request) -> int:
        """Tokens of a just-allocated request in blocks other requests also hold
        (prefix-cache hits on blocks in use: reference count above one)."""
        blocks = self._req_to_blocks.get(request.request_id, ())
        return sum(1 for b in blocks if b.ref_cnt > 1) * self._sched.block_size

    def publish(self) -> None:
        """The core's counters to Prometheus."""
        if self.metrics is not None:
            self.metrics.update(self.port.stats())

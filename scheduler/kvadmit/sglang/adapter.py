"""The SGLang adapter: translates SGLang's scheduler objects into the core's
numbers and the core's answers back into SGLang's actions.

Policy lives in the compiled core (`kvadmit.AdmissionCore`); this module only
keeps a map from SGLang request ids (``Req.rid``) to core slots and reports
progress. Everything here is a pure function of scheduler state (the waiting
queue, the running batch, the allocator's free tokens) and of the adapter's
clock, so every tensor-parallel rank takes the same decisions. The clock feeds
decisions (step times, deadlines, idle sessions, the drain rate, TTLs), through the
config or through any request's own fields (``ttl_s``, ``max_queue_delay_s``): on a
server with several ranks per waiting queue the adapter takes rank 0's clock, which
rides SGLang's per-iteration request broadcast (`ClockTick`), instead of its own.

The configuration as SGLang runs it is `kvadmit.sglang.settings`; one request's
numbers, and a refusal's finish reason, `kvadmit.sglang.request`.

SGLang classes are imported lazily: ``import kvadmit.sglang`` works without
SGLang installed.
"""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from kvadmit import AdmissionConfig
from kvadmit.arrival import ArrivalRecord
from kvadmit.port import CorePort, StepReport
from kvadmit.protocol import Refusal
from kvadmit.sglang import failure
from kvadmit.sglang.request import arrival_record
from kvadmit.sglang.settings import (engine_config, priority_config,
                                     ranks_per_queue, step_budget_of, unsupported_reasons)

logger = logging.getLogger("kvadmit.sglang")


@dataclass
class EnqueueOutcome:
    """What `SGLangAdmission.on_enqueue` decided for one request."""

    rejection: Optional[Refusal] = None              # refuse the incoming request
    shed: list = field(default_factory=list)         # [(Req, Refusal)] waiting requests to abort
    requeued: bool = False                           # a running request came back (retraction)


class ClockTick:
    """Rank 0's clock for one scheduler iteration. Appended on rank 0 to the
    requests SGLang broadcasts to every rank of the waiting queue (the same
    channel as SGLang's own timeout aborts), and taken out before SGLang
    dispatches them, so each rank feeds its core the same times."""

    __slots__ = ("t",)

    def __init__(self, t: float):
        self.t = t

    def __reduce__(self):
        return (ClockTick, (self.t,))

    def __repr__(self):
        return f"ClockTick({self.t!r})"


def _batch_shape(batch):
    """(scheduled tokens, KV context tokens) of an SGLang batch, or None (none or idle)."""
    if batch is None:
        return None
    mode = getattr(batch, "forward_mode", None)
    if mode is None or mode.is_idle():
        return None
    lens = getattr(batch, "seq_lens_cpu", None)  # seq_lens_sum is None after prepare_for_decode
    context = int(lens.sum()) if lens is not None else (getattr(batch, "seq_lens_sum", None) or 0)
    if mode.is_extend():  # extend and mixed: new prompt (and decode) tokens
        tokens = getattr(batch, "extend_num_tokens", None) or 0
    else:
        tokens = len(batch.reqs)
    if tokens <= 0:
        return None
    return float(tokens), float(context)


# Live adapters, so static SGLang hooks (the retraction order gets only the
# request list) can find the adapter that owns a request.
_ADAPTERS: "weakref.WeakSet[SGLangAdmission]" = weakref.WeakSet()


def adapter_for_reqs(reqs: Iterable[Any]) -> Optional["SGLangAdmission"]:
    """The live adapter tracking these requests (by object, not only rid), or None."""
    for req in reqs:
        for adapter in list(_ADAPTERS):
            if not adapter.failed and adapter.port.obj(req.rid) is req:
                return adapter
    return None


class SGLangAdmission:
    """kvadmit's view of one SGLang scheduler.

    ``num_tokens`` is the KV pool in tokens (SGLang's max_total_num_tokens),
    ``page_size`` its page (the core's block). ``low_priority_values_first``
    mirrors SGLang's flag: the core serves lower values first, so SGLang's
    default (higher value = more important) is negated.
    """

    def __init__(self, config: AdmissionConfig, *, num_tokens: int, page_size: int = 1,
                 max_model_len: int = 0, low_priority_values_first: bool = False,
                 clock: Callable[[], float] = time.time, step_budget: int = 0,
                 synced_clock: bool = False, vocab_size: int = 0,
                 priority_preemption: bool = False):
        if page_size < 1:
            raise ValueError(f"page_size={page_size}: must be >= 1")
        config = engine_config(config)
        self.config = config
        self.page_size = page_size
        self.num_tokens = num_tokens
        self.vocab_size = vocab_size   # prompt token ids are checked against it (0: unknown)
        self.low_priority_values_first = low_priority_values_first
        # SGLang's --enable-priority-scheduling with its preemption on: a waiting request
        # may evict running ones the core lets it displace (KvadmitPrefillAdder.displace_for)
        self.priority_preemption = priority_preemption and config.queue_order == "priority"
        self.clock = clock
        # Several ranks share the waiting queue and time feeds decisions: every
        # rank uses rank 0's clock (ClockTick) instead of its own.
        self.synced_clock = synced_clock
        self.step_budget = max(int(step_budget), 0)
        # The door into the core: rids <-> core slots, arrivals, leaving, step timing,
        # cache signals, the queue's verbs.
        self.port = CorePort.create(config, max(num_tokens // page_size, 1), page_size,
                                    max_model_len, step_budget=self.step_budget)
        # ("displaced" is the core's: stats())
        self.counters = {"rejected_sent": 0, "shed_sent": 0, "requeued": 0,
                         "adopted": 0, "untracked": 0, "steps": 0, "ticks": 0}
        self._tick_t: Optional[float] = None   # rank 0's clock, latest tick
        self._step_tick = 0                    # ticks seen at the start of the last step
        self._step_fresh = True                # start_step's verdict on the interval
        # SGLang's PrefillAdder asking this adapter (kvadmit.sglang.prefill imports SGLang:
        # imported here, on first use, so this module imports without it)
        from kvadmit.sglang.prefill import KvadmitPrefillAdder
        self.adder_class = type("KvadmitPrefillAdder", (KvadmitPrefillAdder,), {"kvadmit": self})
        self.internal_errors = 0               # kvadmit's own errors in SGLang (fail)
        self.exporter = None
        _ADAPTERS.add(self)

    # ------------------------------------------------------------------
    # Construction from a live SGLang Scheduler
    @property
    def failed(self) -> bool:
        return self.internal_errors > 0

    @property
    def failed_closed(self) -> bool:
        """Failed under on_internal_error: closed: the hooks refuse every waiting request
        that never started and every new one (kvadmit.sglang.plugin.close_waiting)."""
        return self.failed and self.config.on_internal_error == "closed"

    def fail(self, where: str) -> None:
        """kvadmit's own code raised inside SGLang's scheduler (call it from the except
        block): logged once with its traceback, counted, and from now on every hook
        takes its stock branch (SGLang's waiting queue is its own list: nothing to hand
        back), so the scheduler process and its requests live on. Failed closed
        (on_internal_error: closed), the hooks also refuse what has not started
        (503 kvadmit:failed_closed) until restart; running requests finish. The state
        reaches the HTTP server's /health and the Prometheus series (`failure.record`)."""
        failure.record(self, where)

    @classmethod
    def for_scheduler(cls, scheduler, config: AdmissionConfig,
                      explicit: frozenset = frozenset()) -> "SGLangAdmission":
        """Checks the server is one kvadmit supports and builds its adapter."""
        problems = unsupported_reasons(scheduler)
        if problems:
            raise RuntimeError(
                "kvadmit cannot manage this SGLang server: " + "; ".join(problems)
                + ". Remove --kvadmit-config / KVADMIT_CONFIG or change the server flags.")
        chunk = getattr(scheduler, "chunked_prefill_size", None)
        if "prefill_chunk_tokens" not in explicit and chunk and chunk > 0:
            config = config.replace(prefill_chunk_tokens=int(chunk))
        config = priority_config(config, scheduler, explicit)
        adapter = cls(
            config,
            num_tokens=int(scheduler.max_total_num_tokens),
            page_size=int(scheduler.page_size),
            max_model_len=int(getattr(scheduler, "max_req_len", 0) or 0),
            low_priority_values_first=bool(scheduler.schedule_low_priority_values_first),
            step_budget=step_budget_of(scheduler),
            # any request's ttl_s or max_queue_delay_s lets the clock decide
            synced_clock=ranks_per_queue(scheduler) > 1,
            vocab_size=int(getattr(getattr(scheduler, "model_config", None), "vocab_size", 0) or 0),
            priority_preemption=bool(getattr(scheduler, "enable_priority_preemption", False)),
        )
        from kvadmit.sglang.metrics import exporter_for_scheduler
        adapter.exporter = exporter_for_scheduler(scheduler)
        logger.info("kvadmit: policy=%s victim=%s queue_order=%s on %d tokens (page %d), "
                    "max_model_len=%d, step budget %d tokens, clock %s", config.policy,
                    config.victim, config.queue_order, adapter.num_tokens, adapter.page_size,
                    adapter.port.max_model_len, adapter.step_budget,
                    "rank 0's (synced)" if adapter.synced_clock else "local")
        return adapter

    # ------------------------------------------------------------------
    # Clock
    def now(self) -> float:
        """The time decisions use: rank 0's (the latest tick) on a synced
        server, this process's clock otherwise."""
        if self.synced_clock and self._tick_t is not None:
            return self._tick_t
        return self.clock()

    def make_tick(self) -> Optional[ClockTick]:
        """On rank 0, once per iteration: the tick to broadcast (None when not synced)."""
        return ClockTick(self.clock()) if self.synced_clock else None

    def on_tick(self, tick: ClockTick) -> None:
        """Every rank: rank 0's clock for this iteration arrived."""
        self._tick_t = float(tick.t)
        self.counters["ticks"] += 1

    # ------------------------------------------------------------------
    # Request progress
    def slot_for(self, req) -> Optional[int]:
        return self.port.slot(req.rid)

    def _progress(self, slot: int, req) -> tuple[int, int]:
        """(computed, generated) tokens of a tracked request, as the core counts them."""
        generated = len(req.output_ids)
        prompt = self.port.info(slot)["prompt_tokens"]
        return min(max(int(req.kv.kv_committed_len), 0), prompt + generated), generated

    def _update(self, slot: int, req) -> None:
        self.port.update(slot, *self._progress(slot, req))

    # ------------------------------------------------------------------
    # Arrival: Scheduler._abort_on_queued_limit
    def on_enqueue(self, req, now: Optional[float] = None) -> EnqueueOutcome:
        """A request enters SGLang's waiting queue: a new arrival (caps, maybe
        shedding) or a running request coming back (retraction, preemption)."""
        now = self.now() if now is None else now
        slot = self.port.slot(req.rid)
        if slot is not None:
            self.port.set_obj(req.rid, req)
            if self.port.state(slot) == "running":
                self._update(slot, req)
                self.port.preempt(slot, now)
                self.counters["requeued"] += 1
                return EnqueueOutcome(requeued=True)
            return EnqueueOutcome()
        # A malformed kvadmit field (or count) is refused as invalid: retrying the same
        # request cannot help (HTTP 400).
        arrival = self.port.arrive(req.rid, req, lambda: self._numbers(req, now, strict=True), now)
        if not arrival.accepted:
            self.counters["rejected_sent"] += 1
            return EnqueueOutcome(rejection=arrival.refusal)
        shed = [(victim, refusal) for victim, refusal in arrival.shed if victim is not None]
        self.counters["shed_sent"] += len(shed)
        return EnqueueOutcome(shed=shed)

    def _numbers(self, req, now: float, strict: bool) -> ArrivalRecord:
        """The core's arrival record of an SGLang request (`kvadmit.sglang.request.arrival_record`;
        ``strict``: a malformed kvadmit field or request body raises FieldError)."""
        return arrival_record(req, now, strict, self.config, self.low_priority_values_first,
                              self.vocab_size)

    def displaced(self, slot: int, req) -> None:
        """The adder evicts running ``req`` for a more important waiting request
        (priority preemption, flow displacement): the core preempts it, with its
        progress so far."""
        self._update(slot, req)
        self.port.preempt(slot, self.now(), displaced=True)

    def forget(self, req) -> None:
        """SGLang dropped a request kvadmit had accepted (e.g. its own queue cap)."""
        self.port.leave(req.rid, False, None, self.now())

    def _adopt(self, req, now: float) -> Optional[int]:
        """A request reached the queue or batch by a path kvadmit did not see.
        The core has no cap-free arrival, so one refused here stays untracked
        (a malformed field falls back to the defaults: no refusal here)."""
        arrival = self.port.arrive(req.rid, req, lambda: self._numbers(req, now, strict=False), now)
        if not arrival.accepted or arrival.shed:   # shed: cannot happen without shedding config
            self.counters["untracked"] += 1
            logger.warning("kvadmit: request %s bypassed the queue hook and is %s (%s)", req.rid,
                           "tracked but shed others" if arrival.accepted else "not tracked",
                           arrival.refusal)
            if not arrival.accepted:
                return None
        self.counters["adopted"] += 1
        return arrival.slot

    # ------------------------------------------------------------------
    # Admission: get_prefill_adder_class + the adder
    def order_waiting(self, waiting_queue: list) -> None:
        """Sorts SGLang's waiting list in place into the core's service order
        (queue_order fcfs / priority); SGLang's admission loop then offers
        requests in that order. Untracked requests keep their place at the end."""
        pos = {s: i for i, s in enumerate(self.port.waiting())}
        end = len(pos)
        slots = self.port.slots
        waiting_queue.sort(key=lambda r: pos.get(slots.get(r.rid), end))

    def prepare_decision(self, slot: int, req) -> None:
        """The waiting request as the core must see it when SGLang offers it.

        Its prefix-cache hit (``req.prefix_len``, found by SGLang just before)
        becomes the core's cached tokens. And SGLang's prefill step emits the
        request's first token while the running requests do not decode, so
        from the next decode step on the request stands one token ahead of the
        core's lockstep clock: it is reported as having generated that token
        already (prompt + 1 tokens, max_new - 1 steps), which is what the
        ledger will hold after the prefill anyway. The predict policy keeps
        SGLang's own accounting (it mirrors SGLang's rule), so it is left out.
        """
        if self.port.state(slot) != "waiting":
            return
        info = self.port.info(slot)
        generated = len(req.output_ids)
        if self.config.policy != "predict":
            generated = min(generated + 1, info["max_new_tokens"])
        if generated != info["generated_tokens"]:
            self.port.update(slot, 0, generated)
        cached = min(int(req.prefix_len), info["prompt_tokens"] + generated)
        self.port.set_cached(slot, max(cached, 0))

    def on_admitted(self, slot: int, req=None, prefix_tokens: int = 0) -> None:
        """The adder took the request: the core commits; its prefix-cache hit
        (tokens SGLang's radix cache matched) counts toward this step's hit rate."""
        self.port.admit(slot, self.now())
        if req is not None:
            self.port.note_prefix_hits(max(int(prefix_tokens), 0),
                                         len(req.origin_input_ids) + len(req.output_ids))

    # ------------------------------------------------------------------
    # Step timing: the interval between consecutive scheduler iterations
    def start_step(self) -> float:
        """At the top of every scheduler iteration (get_next_batch_to_run): the
        step's clock. The time since the previous one is how long the batch it
        scheduled took; it feeds the core's step-time fit (`step`).

        Not observed: the first iteration, an iteration after one without a
        batch (idle time is not step time), and on a synced server an interval
        that did not see exactly one tick (an iteration SGLang skipped)."""
        now = self.now()
        self._step_fresh = (not self.synced_clock
                            or (self._tick_t is not None
                                and self.counters["ticks"] == self._step_tick + 1))
        self._step_tick = self.counters["ticks"]
        return now

    # ------------------------------------------------------------------
    # Once per scheduler step: Scheduler.get_next_batch_to_run
    def begin_step(self, running_batch, last_batch, chunked_req, waiting_queue,
                   now: Optional[float] = None) -> None:
        """Brings the ledger in line with SGLang before the step decides anything:
        progress of every request holding KV, finished / aborted ones leave."""
        now = self.now() if now is None else now
        port = self.port
        waiting_rids = {r.rid for r in waiting_queue}
        live = {}
        for batch in (running_batch, last_batch):
            if batch is not None:
                for r in batch.reqs:
                    if not r.finished():
                        live[r.rid] = r
        if chunked_req is not None and not chunked_req.finished():
            live[chunked_req.rid] = chunked_req
        for rid, r in live.items():
            if rid in waiting_rids:
                continue
            slot = self.port.slot(rid)
            if slot is None:
                slot = self._adopt(r, now)
                if slot is None:
                    continue
            self.port.set_obj(rid, r)
            if port.state(slot) == "waiting":
                port.admit(slot, now)
            self._update(slot, r)
        key = self.port.key
        for slot in port.running():
            if key(slot) not in live:
                self._leave(key(slot), now)
        for slot in port.waiting():
            rid = key(slot)
            if rid not in waiting_rids and rid not in live:
                self._leave(rid, now)
        for r in waiting_queue:
            if r.rid not in self.port.slots:
                self._adopt(r, now)

    def _leave(self, rid, now: float) -> None:
        """SGLang is done with a tracked request: finished on its own, or aborted."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        req = self.port.obj(rid)
        natural = (req is not None and req.finished()
                   and not isinstance(req.finished_reason, FINISH_ABORT))
        self.port.leave(rid, natural, lambda slot: self._progress(slot, req), now)

    def step(self, free_tokens: int, now: float):
        """Once per step, after `begin_step` and before admission: the step's report
        to the core's port (`CorePort.step`: the previous step's time, and KV in
        use: the pool less SGLang's free and evictable ``free_tokens``, in the core's
        blocks; the progress `begin_step` has reported request by request) and its
        plan back (the victim order is applied at retraction, `retraction_order`)."""
        used = self.num_tokens - max(int(free_tokens), 0)
        return self.port.step(StepReport(now=now, used_blocks=used // self.page_size,
                                           fresh=self._step_fresh))

    def end_step(self, now: Optional[float] = None, batch=None) -> None:
        """After the scheduler chose ``batch``: its shape to the port (the step
        timing charges the next interval to it), which steps the core at the step's
        time ``now``."""
        now = self.now() if now is None else now
        tokens, context = _batch_shape(batch) or (0, 0)
        self.port.step_done(tokens, context, now)
        self.counters["steps"] += 1
        if self.exporter is not None:
            self.exporter.publish(self.stats())

    # ------------------------------------------------------------------
    # Retraction: ScheduleBatch._get_decode_retraction_order
    def retraction_order(self, reqs: list) -> list:
        """Indices of ``reqs`` from most protected to first victim (SGLang pops
        victims off the end), in the core's victim order."""
        slots = []
        for r in reqs:
            slot = self.port.slot(r.rid)
            if slot is not None and self.port.state(slot) == "running":
                self._update(slot, r)
                slots.append(slot)
            else:
                slots.append(None)
        pos = {s: i for i, s in enumerate(self.port.victim_order())}
        # Untracked requests are kept (front); ties keep SGLang's batch order.
        return sorted(range(len(reqs)), key=lambda i: (pos.get(slots[i], -1), i))

    # ------------------------------------------------------------------
    def stats(self) -> dict:
        out = self.port.stats()
        out.update(self.counters, observed_steps=self.port.observed_steps)
        out.update(policy=self.config.policy, victim=self.config.victim,
                   num_blocks=self.port.num_blocks, block_size=self.port.block_size,
                   step_budget=self.step_budget,
                   clock="synced" if self.synced_clock else "local")
        return out



"""The one door into the core: `CorePort`, the only Python code that calls an
`AdmissionCore` (tests/test_lint_scheduler.py checks the package for it).

An adapter (kvadmit.vllm.admission, kvadmit.sglang.adapter) translates its
engine's objects into numbers and back; `CorePort` does the rest, the same way for
every engine:

- request tracking: the engine's request id <-> the core's slot, and the engine's
  request object while the core tracks it;
- arrival through the core: the numbers, or a malformed request refused as
  `invalid` (counted by the core, as every reason is), or a refusal with the
  client's answer (`kvadmit.protocol.Refusal`), and the waiting requests shed
  for it; a parallel-sampling request's samples arrive as one unit
  (`arrive_group`: all accepted, or the request refused once);
- leaving: a request that finished on its own reports its final progress and
  finishes; any other (client abort, engine error, shed) is an abort;
- the step: `step(StepReport)` at the start of an engine step (before it
  schedules anything) and `step_done(...)` once the engine has scheduled it,
  translated onto the core's one step sequence (`AdmissionCore.step` /
  `step_done`, which the native engine model runs too): the step time, the cache
  signals, the progress and the blocks in use are the core's, in its order;
- the queue's verbs and reads, each one call of the core (admit, decide, preempt,
  the waiting order, the stats...), and the step planner (kvadmit._step_plan) over
  the same core.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Hashable, Optional, Sequence

from kvadmit._native import AdmissionCore, StepPlanner
from kvadmit.arrival import ArrivalRecord
from kvadmit.protocol import Refusal


@dataclass
class Arrival:
    """The core's answer to an arrival: accepted (slots, one per sample) or refused."""
    slots: list = field(default_factory=list)
    refusal: Optional[Refusal] = None
    shed: list = field(default_factory=list)   # [(engine object, Refusal)] waiting ones shed for it

    @property
    def accepted(self) -> bool:
        return self.refusal is None

    @property
    def slot(self) -> int:
        return self.slots[0]


@dataclass
class StepReport:
    """What an engine reports at the start of a step (`CorePort.step`)."""
    now: float                      # the step's time: every call of this step uses it
    used_blocks: int                # KV blocks in use now
    # The running requests' progress (the tracked ones, in the engine's order), if the
    # adapter has not reported it request by request already.
    slots: Sequence[int] = ()
    computed: Sequence[int] = ()    # tokens with KV, per slot
    generated: Sequence[int] = ()   # output tokens, per slot
    # False: the interval since the previous step start is not one step's time (the
    # engine skipped an iteration).
    fresh: bool = True


@dataclass
class StepPlan:
    """The core's plan for the step (`CorePort.step`). Admissions stay the gate's
    answers to the engine's own loop (`AdmissionCore.next_admissible` per candidate,
    as allocation goes), displacement and pauses the step planner's
    (`kvadmit._step_plan.StepPlanner`, which needs the engine's own numbers)."""
    # Running slots from most protected to first victim (engines preempt from the end).
    victim_order: list
    # Waiting requests that must not reach prefill, no longer tracked: [(obj,
    # Refusal)], past their TTL (reason expired) or sheddable while others wait for
    # KV (reason shed). The engine takes them out of its queue and answers their
    # clients before it admits anything (`CorePort.drop_waiting`).
    dropped: list = field(default_factory=list)


class CorePort:
    """One engine's requests in one `AdmissionCore` (see the module docstring).
    ``counts_shared_prefix``: the adapter reports each admitted request's tokens in
    blocks other running requests hold (`AdmissionCore.set_shared`, policy auto), so
    the core's step reports the blocks in use for them (`AdmissionCore.step`)."""

    @classmethod
    def create(cls, config, num_blocks: int, block_size: int, max_model_len: int = 0, *,
               step_budget: int = 0, counts_shared_prefix: bool = False) -> "CorePort":
        """A port on a new core over a pool of ``num_blocks`` blocks of ``block_size``
        tokens; ``step_budget``: the engine's token budget a step (the SLO guard
        predicts prefill time from it; 0: not known)."""
        core = AdmissionCore(config, num_blocks, block_size, max_model_len)
        if step_budget:
            core.set_step_budget(step_budget)
        return cls(core, counts_shared_prefix)

    def __init__(self, core, counts_shared_prefix: bool = False):
        self._core = core
        self.counts_shared_prefix = counts_shared_prefix
        core.counts_shared_prefix = counts_shared_prefix     # the core's step reports the blocks in use
        self._agent_window = bool(core.config.agent_window)
        # the status of a retryable refusal (503 or 429), the config's
        self._overload_status = core.config.overload_status
        self._slot: dict = {}     # engine request id -> slot
        self._key: dict = {}      # slot -> engine request id
        self._obj: dict = {}      # engine request id -> engine object (a strong ref while tracked)

    # -- tracking ------------------------------------------------------------
    def slot(self, key: Hashable) -> Optional[int]:
        return self._slot.get(key)

    def key(self, slot: int) -> Hashable:
        return self._key[slot]

    def obj(self, key: Hashable) -> Any:
        return self._obj.get(key)

    def set_obj(self, key: Hashable, obj: Any) -> None:
        """The engine replaced its object for a tracked request."""
        self._obj[key] = obj

    @property
    def slots(self):
        """Engine request id -> slot of every tracked request (a read-only view)."""
        return MappingProxyType(self._slot)

    def track(self, key: Hashable, slot: int, obj: Any) -> None:
        self._slot[key] = slot
        self._key[slot] = key
        self._obj[key] = obj

    def untrack(self, slot: int) -> Any:
        """Forgets a slot's request (the core's side is the caller's); returns its object."""
        key = self._key.pop(slot)
        del self._slot[key]
        return self._obj.pop(key, None)

    # -- arrival -------------------------------------------------------------
    def refuse_invalid(self, error: Exception) -> Refusal:
        """A malformed request (its error names the field): counted by the core."""
        return self.refusal(self._core.refuse_invalid(str(error), getattr(error, "field", None)))

    def refusal(self, rejection) -> Refusal:
        """The client's answer to one of the core's rejections."""
        return Refusal.of(rejection, self._overload_status)

    def arrive(self, key: Hashable, obj: Any, numbers: Callable[[], ArrivalRecord],
               now: float) -> Arrival:
        """One request arrives. ``numbers()`` gives its `ArrivalRecord` from the
        engine's request; a ValueError from it (a malformed field or count), or an
        OverflowError (a count beyond the core's integers), refuses the request as
        `invalid`."""
        try:
            res = self._core.arrive(numbers(), now=now)
        except (ValueError, OverflowError) as e:   # OverflowError: beyond the core's int64
            return Arrival(refusal=self.refuse_invalid(e))
        shed = [(self.untrack(s), self.refusal(rejection)) for s, rejection in res.shed]
        if not res.accepted:
            return Arrival(refusal=self.refusal(res.rejection), shed=shed)
        self.track(key, res.slot, obj)
        return Arrival(slots=[res.slot], shed=shed)

    def arrive_group(self, members: list, numbers: Callable[[], ArrivalRecord],
                     now: float) -> Arrival:
        """The samples of one parallel-sampling request, [(key, obj)], arrive as one
        unit: all accepted (as many slots, in order, each sample its own sequence in
        the queue, caps counting all of them), or the request refused once (the
        samples accepted before the refusal are withdrawn, uncounted; more samples
        than max_queued_requests is a refusal retrying cannot help)."""
        oversized = self._core.refuse_oversized_group(len(members)) if len(members) > 1 else None
        if oversized is not None:
            return Arrival(refusal=self.refusal(oversized))
        slots, shed = [], []
        for key, obj in members:
            one = self.arrive(key, obj, numbers, now)
            shed += one.shed
            if not one.accepted:
                for s in slots:
                    self.untrack(s)
                    self._core.withdraw(s)
                return Arrival(refusal=one.refusal, shed=shed)
            slots.append(one.slot)
        return Arrival(slots=slots, shed=shed)

    def drop_waiting(self, now: float) -> list:
        """The waiting requests that must not reach prefill as of ``now``, no longer
        tracked: [(obj, Refusal)] (`AdmissionCore.drop_waiting`). The engine aborts them
        and answers their clients before it admits anything this step."""
        return [(self.untrack(s), self.refusal(rejection)) for s, rejection in self._core.drop_waiting(now)]

    # -- leaving -------------------------------------------------------------
    def leave(self, key: Hashable, finished: bool,
              progress: Optional[Callable[[int], tuple[int, int]]], now: float) -> Any:
        """The engine is done with a tracked request at ``now`` (None if it was not
        tracked). ``finished``: it ended on its own (stop, length); a running one then
        reports ``progress(slot)`` = (computed tokens, generated tokens) and finishes.
        Anything else, or a request that never ran, is an abort (at ``now`` too: it
        ticks the core's clock, the drain rate's backlog clock with it)."""
        slot = self._slot.get(key)
        if slot is None:
            return None
        obj = self.untrack(slot)
        core = self._core
        if finished and core.state(slot) == "running":
            if progress is not None:
                computed, generated = progress(slot)
                core.update(slot, computed, generated)
            core.finish(slot, now)
        else:
            core.abort(slot, now)
        return obj

    # -- the step ------------------------------------------------------------
    def step(self, report: StepReport) -> StepPlan:
        """The start of an engine step, before it schedules anything: the report to
        the core's step sequence (`AdmissionCore.step`: the previous step's time, the
        cache signals, the running requests' progress, the blocks in use), and the
        step's plan back (`StepPlan`). The engine then schedules, and reports what it
        scheduled through `step_done`."""
        core = self._core
        used = int(report.used_blocks)
        if not self.counts_shared_prefix:
            used = max(used, 0)      # only the cache signal reads it: clamped there as well
        order = core.step(report.now, used, report.slots, report.computed, report.generated,
                          report.fresh)
        if self._agent_window:
            # The sessions the window paused, logged for an engine that demotes their
            # cached prefixes (the native engine does); vLLM's and SGLang's eviction is
            # their own, so the log is emptied here, or it would grow for the server's life.
            core.take_paused_sessions()
        return StepPlan(victim_order=order, dropped=self.drop_waiting(report.now))

    def step_done(self, tokens: float, context: float, now: float,
                  hit_tokens: int = 0, query_tokens: int = 0) -> None:
        """The engine scheduled the step that `step` began at ``now``: ``tokens``
        tokens over ``context`` KV tokens, and the prefix-cache hits of the requests
        it admitted (`AdmissionCore.step_done`, which steps the core)."""
        self._core.step_done(tokens, context, now, hit_tokens, query_tokens)

    def engine_idle(self) -> None:
        """The engine had nothing to run: the time until the next step is no step time."""
        self._core.engine_idle()

    def note_prefix_hits(self, hit_tokens: int, query_tokens: int) -> None:
        """Prefix-cache hits of admitted requests: tokens found cached, out of their
        prompt + output tokens (the agent window sees them at the next step)."""
        self._core.note_prefix_hits(hit_tokens, query_tokens)

    @property
    def observed_steps(self) -> int:
        """Step times the core's step-time fit was given."""
        return self._core.observed_steps

    @property
    def prefix_hit_tokens(self) -> int:
        return self._core.prefix_hit_tokens

    @property
    def prefix_query_tokens(self) -> int:
        return self._core.prefix_query_tokens

    # -- the core's verbs and reads, one call each ----------------------------
    @property
    def core(self):
        """The core itself, for tests and tools that inspect it; the package goes
        through the port's own methods."""
        return self._core

    @property
    def config(self):
        return self._core.config

    @property
    def num_blocks(self) -> int:
        return self._core.num_blocks

    @property
    def block_size(self) -> int:
        return self._core.block_size

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def flows_on(self) -> bool:
        """Whether flows are on (once a flow id has arrived)."""
        return self._core.flows.on

    @property
    def paused(self) -> int:
        """Running requests the pause plan paused this step."""
        return self._core.paused

    def planner(self, watermark_blocks: int = 0, lookahead_tokens: int = 0) -> StepPlanner:
        """The step planner (kvadmit._step_plan) over this core."""
        return StepPlanner(self._core, watermark_blocks, lookahead_tokens)

    def state(self, slot: int) -> str:
        return self._core.state(slot)

    def info(self, slot: int) -> dict:
        return self._core.info(slot)

    def waiting(self) -> list:
        """The waiting slots in the core's order."""
        return self._core.waiting()

    def running(self) -> list:
        return self._core.running()

    def victim_order(self) -> list:
        return self._core.victim_order()

    def next_admissible(self, free_blocks: int, check_blocks: bool = True) -> int:
        """The waiting slot the core lets start now (-1: none)."""
        return self._core.next_admissible(free_blocks, check_blocks)

    def decide(self, slot: int, free_blocks: int) -> str:
        return self._core.decide(slot, free_blocks)

    def displaceable(self, slot: int, flows_only: bool = False) -> list:
        return self._core.displaceable(slot, flows_only)

    def admit(self, slot: int, now: float) -> None:
        self._core.admit(slot, now)

    def cancel_admit(self, slot: int, now: float) -> None:
        self._core.cancel_admit(slot, now)

    def preempt(self, slot: int, now: float, displaced: bool = False) -> None:
        self._core.preempt(slot, now, displaced)

    def update(self, slot: int, computed_tokens: int, generated_tokens: int) -> None:
        self._core.update(slot, computed_tokens, generated_tokens)

    def set_cached(self, slot: int, cached_tokens: int) -> None:
        self._core.set_cached(slot, cached_tokens)

    def set_shared(self, slot: int, shared_tokens: int) -> None:
        self._core.set_shared(slot, shared_tokens)

    def stats(self) -> dict:
        return self._core.stats()

    def flow_stats(self) -> dict:
        return self._core.flow_stats()

    def router_signals(self) -> dict:
        return self._core.router_signals()

    def next_window_change(self) -> float:
        return self._core.next_window_change()

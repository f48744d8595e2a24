"""What every engine adapter does with the core, once: the engine bridge.

An adapter (kvadmit.vllm.scheduler, kvadmit.sglang.adapter) translates its
engine's objects into numbers; `EngineBridge` does the rest, the same way for
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
  signals, the progress and the blocks in use are the core's, in its order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Hashable, Optional, Sequence

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
    """What an engine reports at the start of a step (`EngineBridge.step`)."""
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
    """The core's plan for the step (`EngineBridge.step`). Admissions stay the gate's
    answers to the engine's own loop (`AdmissionCore.next_admissible` per candidate,
    as allocation goes) and pauses the pause plan's (`AdmissionCore.plan_shortfall`,
    which needs the engine's per-request token arithmetic)."""
    # Running slots from most protected to first victim (engines preempt from the end).
    victim_order: list
    # Waiting requests that must not reach prefill, no longer tracked: [(obj,
    # Refusal)], past their TTL (reason expired) or sheddable while others wait for
    # KV (reason shed). The engine takes them out of its queue and answers their
    # clients before it admits anything (`EngineBridge.drop_waiting`).
    dropped: list = field(default_factory=list)


class EngineBridge:
    """One engine's requests in one `AdmissionCore` (see the module docstring).
    ``counts_shared_prefix``: the adapter reports each admitted request's tokens in
    blocks other running requests hold (`AdmissionCore.set_shared`, policy auto), so
    the core's step reports the blocks in use for them (`AdmissionCore.step`)."""

    def __init__(self, core, counts_shared_prefix: bool = False):
        self.core = core
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
        return self.refusal(self.core.refuse_invalid(str(error), getattr(error, "field", None)))

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
            res = self.core.arrive(numbers(), now=now)
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
        oversized = self.core.refuse_oversized_group(len(members)) if len(members) > 1 else None
        if oversized is not None:
            return Arrival(refusal=self.refusal(oversized))
        slots, shed = [], []
        for key, obj in members:
            one = self.arrive(key, obj, numbers, now)
            shed += one.shed
            if not one.accepted:
                for s in slots:
                    self.untrack(s)
                    self.core.withdraw(s)
                return Arrival(refusal=one.refusal, shed=shed)
            slots.append(one.slot)
        return Arrival(slots=slots, shed=shed)

    def drop_waiting(self, now: float) -> list:
        """The waiting requests that must not reach prefill as of ``now``, no longer
        tracked: [(obj, Refusal)] (`AdmissionCore.drop_waiting`). The engine aborts them
        and answers their clients before it admits anything this step."""
        return [(self.untrack(s), self.refusal(rejection)) for s, rejection in self.core.drop_waiting(now)]

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
        core = self.core
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
        core = self.core
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
        self.core.step_done(tokens, context, now, hit_tokens, query_tokens)

    def engine_idle(self) -> None:
        """The engine had nothing to run: the time until the next step is no step time."""
        self.core.engine_idle()

    def note_prefix_hits(self, hit_tokens: int, query_tokens: int) -> None:
        """Prefix-cache hits of admitted requests: tokens found cached, out of their
        prompt + output tokens (the agent window sees them at the next step)."""
        self.core.note_prefix_hits(hit_tokens, query_tokens)

    @property
    def observed_steps(self) -> int:
        """Step times the core's step-time fit was given."""
        return self.core.observed_steps

    @property
    def prefix_hit_tokens(self) -> int:
        return self.core.prefix_hit_tokens

    @property
    def prefix_query_tokens(self) -> int:
        return self.core.prefix_query_tokens

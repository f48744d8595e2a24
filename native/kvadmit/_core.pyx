# The admission core: the sequence of what happens to a request, over its parts.
#
# Engine-agnostic and clock-free: the caller passes `now` (seconds) and the
# engine's current free blocks. Query, then commit: `next_admissible` / `decide`
# only look, `admit` / `preempt` / `finish` change state. The parts, each its own
# module:
#   kvadmit._ledger          every request's numbers, every state transition and its sums
#   kvadmit._waiting_queue   the queue's order, the bypass scan, shedding's order
#   kvadmit._decision        may a waiting request start? may an arrival queue?
#   kvadmit._policies        the policy's rule (the decision asks it)
#   kvadmit._shortfall       shortfall "pause": which running requests sit out a step
#   kvadmit._arrival_gate    caps, refusals, the drain rate, Retry-After
#   kvadmit._slo_guard, kvadmit._agent_window, kvadmit._victims
#   kvadmit._core_view       the parts held, and every read and stat over them
# This module calls each part, in order, where a request arrives, waits, starts,
# stops or leaves, and keeps the counters and the clock.

from libc.math cimport INFINITY, isfinite
from libc.stdint cimport int32_t, int64_t
from libcpp.vector cimport vector

from kvadmit._agent_window cimport AgentWindow
from kvadmit._arrival cimport ArrivalRecord, check_record, record_of
from kvadmit._arrival_gate cimport ArrivalGate, ArrivalResult, Rejection, R_INVALID, R_QUEUE_FULL
from kvadmit._core_view cimport CoreView, check_now
from kvadmit._decision cimport Decision
from kvadmit._flows cimport FL_PREEMPTED, FL_REFUSED, FlowTable
from kvadmit._ledger cimport Ledger, ST_RUNNING, ST_WAITING
from kvadmit._policies cimport make_policy
from kvadmit._shortfall cimport ShortfallPlanner
from kvadmit._slo_guard cimport SloGuard
from kvadmit._victims cimport victim_slot
from kvadmit._waiting_queue cimport WaitingQueue

from kvadmit._victims import VICTIMS
from kvadmit._waiting_queue import DECISIONS


cdef int _check_hits(int64_t hit_tokens, int64_t query_tokens) except -1:
    if hit_tokens < 0 or query_tokens < 0:
        raise ValueError(f"hit_tokens={hit_tokens}, query_tokens={query_tokens}: must be >= 0")
    return 0


cdef class AdmissionCore(CoreView):
    """Decides which waiting request takes KV memory, which waits, which is
    refused and which running request gives memory back.

    ``config`` is a `kvadmit.AdmissionConfig`; ``num_blocks`` and
    ``block_size`` describe the engine's KV pool, ``max_model_len`` its
    context limit (0: no limit).
    """
    def __init__(self, config, int64_t num_blocks, int64_t block_size, int64_t max_model_len=0):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: must be >= 1")
        if block_size < 1 or block_size > 1 << 20:
            raise ValueError(f"block_size={block_size}: must be in [1, 1048576]")
        if max_model_len < 0:
            raise ValueError(f"max_model_len={max_model_len}: must be >= 0 (0: no limit)")
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len
        self.config = config
        self._victim = VICTIMS.index(config.victim)
        self._victim_by_priority = config.queue_order == "priority"
        self.ledger = Ledger(block_size, config.prefill_chunk_tokens)
        self.policy = make_policy(config, self.ledger, num_blocks, max_model_len)
        self.gate = ArrivalGate(config)
        self.slo_guard = SloGuard(config)
        self.policy.step_time = self.slo_guard.step_time
        self.agent_window = AgentWindow(config, num_blocks)
        self.flows = FlowTable(config, self.ledger, num_blocks)
        self.queue = WaitingQueue(config, self.ledger, self.agent_window, self.flows)
        self.shortfall = ShortfallPlanner(config.pause_on_shortfall, block_size,
                                          config.queue_order == "priority",
                                          config.priority_preemption_threshold,
                                          config.shortfall == "cost")
        self.decision = Decision(self.ledger, self.policy, self.slo_guard, self.agent_window,
                                 self.queue, self.gate, self.flows, num_blocks,
                                 config.queue_order == "priority")
        self._now = 0.0
        self._shape_tokens = -1.0
        self._n_arrived = self._n_admitted = self._n_preempted = self._n_displaced = 0
        self._n_finished = self._n_aborted = 0

    # ------------------------------------------------------------------
    # The clock, one for the whole core. Every mutator takes the engine's `now`
    # (seconds, required) and starts with `_tick(now)`: the core's time `_now` is
    # the latest `now` seen (a `now` earlier than it, such as an arrival the engine
    # replays late, is the request's own arrival time, not the core's). The arrival
    # gate is told the same time (its backlog clock: seconds with requests waiting,
    # the drain rate's clock) and is told when the queue changes (`_enqueue` /
    # `_dequeue`), so it knows what waited in between. Sessions' idle clocks, the
    # queue-delay cap and the router signals read `_now`. Reads move no clock.
    cdef inline void _tick(self, double now) noexcept nogil:
        if now > self._now:
            self._now = now
        self.gate.c_note_time(self._now)
        self.agent_window.c_note_time(self._now)

    # ------------------------------------------------------------------
    # What the parts hear when a request joins or leaves the queue or the running set
    cdef void _enqueue(self, int32_t s) noexcept nogil:
        """The ledger enqueued s: it takes its place in the queue."""
        self.queue.c_add(s)
        self.gate.c_queue_changed(True)
        self.agent_window.c_queued(self.ledger.session(s), self._now)

    cdef void _dequeue(self, int32_t s) noexcept nogil:
        self.queue.c_remove(s)
        self.gate.c_queue_changed(not self.queue.c_empty())
        self.ledger.dequeue(s)
        self.agent_window.c_unqueued(self.ledger.session(s), self._now)

    cdef void _stopped(self, int32_t s) noexcept nogil:
        """The ledger took s out of the running set."""
        self.policy.c_running_changed()
        self.slo_guard.c_stopped(self.ledger.tpot(s))
        self.agent_window.c_stopped(self.ledger.session(s), self._now)

    # ------------------------------------------------------------------
    # Arrivals
    def refuse_invalid(self, str message, str limit=None):
        """Counts the refusal of a malformed request (reason 'invalid', never
        retryable) and returns it: one an engine adapter found before `arrive`
        (its fields, its token ids), or that `arrive` raised ValueError for.
        Not counted as an arrival: it never reached the queue."""
        return self.gate.c_refuse(R_INVALID, message, limit, None, None)

    def refuse_oversized_group(self, int64_t samples):
        """Counts and returns the refusal of a parallel-sampling request whose
        `samples` sequences could never be queued together (more than
        max_queued_requests): queue_full, never retryable. An arrival, as the
        request's other refusals are (None when it fits the cap)."""
        cdef int64_t cap = self.gate.max_queued_requests
        if cap <= 0 or samples <= cap:
            return None
        self._n_arrived += 1
        return self.gate.c_refuse(
            R_QUEUE_FULL, f"the request's n={samples} samples exceed max_queued_requests="
            f"{cap}: they can never be queued together",
            "max_queued_requests", cap, None)

    def arrive(self, record, *, double now):
        """A request arrives at `now` (required, keyword) with its numbers,
        ``record`` (a `kvadmit.arrival.ArrivalRecord`): queue it (slot) or refuse it
        (Rejection). Bad numbers raise ValueError naming the field; limits of this
        server (context, KV pool, queue caps, SLO feasibility) give a Rejection."""
        cdef ArrivalRecord r = record_of(record)
        return self.c_arrive(&r, now)

    cdef ArrivalResult c_arrive(self, const ArrivalRecord* r, double now):
        check_record(r)
        check_now(now)
        self._tick(now)
        self._n_arrived += 1
        cdef int32_t f = 0
        if r.flow >= 0:
            f = self.flows.c_index(r.flow)
            self.queue.c_flows_on()
        cdef Rejection refused = self.gate.c_refuse_context(r.prompt_tokens, r.max_new_tokens,
                                                            self.max_model_len)
        if refused is not None:
            return ArrivalResult(False, -1, self._of_flow(refused, f), [])
        cdef double ttl = r.ttl_s if r.ttl_s >= 0 else self.gate.max_queue_age_s
        cdef int32_t s = self.ledger.add(
            r, self.slo_guard.c_ttft_target(r.ttft_slo_s),
            self.slo_guard.c_tpot_target(r.tpot_slo_s), now,
            r.session if self.agent_window.enabled else -1, now + ttl if ttl > 0 else INFINITY, f)
        self.agent_window.c_track(self.ledger.session(s), now, r.ttft_slo_s)
        cdef list shed = []
        self._judging(s)
        refused = self.decision.c_refusal(s)
        if refused is None and self.ledger.sheddable(s) and self.queue.c_saturated():
            refused = self.gate.c_refuse_sheddable(False)
        if refused is None:
            refused = self._make_room(s, now, shed)
        if refused is not None:
            self.ledger.release(s)
            return ArrivalResult(False, -1, self._of_flow(refused, f), [])
        self.ledger.enqueue(s, True)
        self._enqueue(s)
        if self.flows.on and self.ledger.flow_live(f) == 1:
            self.flows.c_activate(f)
        return ArrivalResult(True, s, None, shed)

    cdef Rejection _of_flow(self, Rejection refused, int32_t f):
        """A refusal of a request of flow f (once flows are on): counted for the flow,
        and its message names the flow."""
        if self.flows.on:
            self.flows.c_count(f, FL_REFUSED)
            if f > 0:
                refused.message = f"{refused.message} (flow {self.flows.c_name(f)})"
        return refused

    def drop_waiting(self, double now):
        """Drops the waiting requests that must not reach prefill as of `now`:
        [(slot, Rejection)], their slots freed. Those that have not started within
        their TTL (their ``ttl_s``, else the config's max_queue_age_s; reason expired)
        and, while the latest scan held a request that is not sheddable, every
        sheddable one that has not started (reason shed: saturated, GIE's rule).
        Engines call it at each step's start, before admitting."""
        check_now(now)
        self._tick(now)
        return self.c_drop_waiting(now)

    cdef list c_drop_waiting(self, double now):
        cdef list out = []
        cdef vector[int32_t] picked
        cdef int32_t v
        if self.queue.c_saturated():
            self.queue.c_pick_sheddable(&picked)
            for v in picked:
                self._out_of_queue(v)
                out.append(self._dropped(v, self.gate.c_refuse_sheddable(True)))
        if now < self.queue.c_next_expiry():
            return out
        self.queue.c_pick_expired(now, &picked)
        cdef double own
        for v in picked:
            own = self.ledger.ttl_s(v)        # negative: it had the config's
            self._out_of_queue(v)
            out.append(self._dropped(v, self.gate.c_refuse_expired(
                now - self.ledger.arrive_t(v), own if own >= 0 else self.gate.max_queue_age_s,
                own >= 0)))
        return out

    cdef inline void _out_of_queue(self, int32_t v) noexcept nogil:
        """Waiting v leaves the queue to be refused (the gate told whose refusal is next)."""
        self._dequeue(v)
        self._judging(v)

    cdef tuple _dropped(self, int32_t v, Rejection refused):
        """(v, its refusal, counted for its flow), its slot freed: v left the queue
        (_out_of_queue) and its refusal was made from its numbers."""
        cdef tuple out = (v, self._of_flow(refused, self.ledger.flow_ix(v)))
        self.ledger.release(v)
        return out

    cdef inline void _judging(self, int32_t s) noexcept nogil:
        """Tells the gate which request its next refusal is of (its retry line
        knows a request back early by these numbers)."""
        self.gate.c_request(self.ledger.prompt(s), self.ledger.max_new(s), self.ledger.priority(s),
                            self.ledger.session(s), self.ledger.prompt_hash(s), self.ledger.step())

    cdef Rejection _make_room(self, int32_t s, double now, list shed):
        """Room in the queue for the new request s under the caps: none needed, or
        less important waiting requests shed (appended to `shed`: sheddable ones for
        any other arrival, and under shed_lower_priority strictly lower priorities
        too); else the refusal of s."""
        cdef int64_t queued = self.ledger.queued_of(s)
        cdef int64_t over_reqs = 0, over_tokens = 0
        cdef Rejection full = self._flow_full(s) if self.flows.on else None
        if full is not None:
            return full
        if self.gate.max_queued_requests > 0:
            over_reqs = self.queue.c_size() + 1 - self.gate.max_queued_requests
        if self.gate.max_queued_tokens > 0:
            over_tokens = self.ledger.queued_tokens() + queued - self.gate.max_queued_tokens
        if over_reqs <= 0 and over_tokens <= 0:
            return None
        cdef vector[int32_t] picked
        cdef int32_t v
        cdef bint lower = self.gate.shed_lower_priority
        if (lower or not self.ledger.sheddable(s)) and self.queue.c_pick_shed(
                s, not lower, over_reqs, over_tokens, &picked):
            for v in picked:
                self._out_of_queue(v)
                shed.append(self._dropped(v, self.gate.c_refuse_shed(
                    self.ledger.priority(s), self.ledger.priority(v),
                    self.ledger.sheddable(v) and not self.ledger.sheddable(s), over_reqs > 0)))
            return None
        return self.gate.c_refuse_full(over_reqs, over_tokens, self.queue.c_size(),
                                       self.ledger.queued_tokens(), queued)

    cdef Rejection _flow_full(self, int32_t s):
        """The refusal of s over its flow's own queue caps (None: within them). A flow's
        cap is its alone: nothing is shed for it."""
        cdef int32_t f = self.ledger.flow_ix(s)
        cdef int64_t cap = self.flows.c_cap_reqs(f), waiting = self.ledger.flow_waiting(f)
        cdef int64_t queued = self.ledger.queued_of(s), tokens = self.ledger.flow_queued(f)
        if cap > 0 and waiting + 1 > cap:
            return self.gate.c_refuse_flow_full(waiting + 1 - cap, 0, waiting, tokens, queued, cap)
        cap = self.flows.c_cap_tokens(f)
        if cap > 0 and tokens + queued > cap:
            return self.gate.c_refuse_flow_full(0, tokens + queued - cap, waiting, tokens, queued,
                                                cap)
        return None

    # ------------------------------------------------------------------
    # Admission
    def decide(self, int64_t slot, int64_t free_blocks, bint check_blocks=True):
        """What the policy says about one waiting request: 'admit', 'hold_blocks'
        (not enough free blocks now) or 'hold_capacity' (the policy's future rule).

        ``check_blocks=False`` leaves today's fit to the engine's own allocator
        (which knows prefix hits the core does not); the policy rule still applies."""
        self.ledger.check_state(slot, ST_WAITING)
        return DECISIONS[self.decision.c_decide(<int32_t>slot, free_blocks, check_blocks)]

    def plan_shortfall(self, want_tokens, computed_tokens, held_blocks, int64_t free_blocks,
                       int64_t token_budget, int64_t lookahead_tokens=0, priorities=None):
        """Which running requests to pause this step, under ``shortfall: "pause"``.

        One entry per running request, in the order the engine serves them:
        ``want_tokens`` it would compute this step (the engine's own caps applied,
        0 if the engine skips it anyway), ``computed_tokens`` it has KV for,
        ``held_blocks`` it holds. In that order each takes min(want, budget left)
        tokens and the blocks they need (plus ``lookahead_tokens``) while blocks
        last; one that finds too few is paused: skipped this step, its KV kept, and
        its tokens left to the requests behind it. Returns the positions paused:
        none under "preempt". When none could run, the first one that wanted to is
        not paused: the engine preempts its victims for it as usual (else no request
        would ever free a block). While any request is paused this step, no waiting
        request is admitted (held as "hold_paused").

        ``priorities`` (one per entry; under queue_order "priority"): the plan serves
        the most important first (equal ones in the engine's order), and one that finds
        too few blocks while running requests of strictly lower priority hold enough is
        not paused: the engine's preemption takes their KV for it, lowest first.

        Under shortfall "cost" an engine's rows carry their slots and freed blocks
        (`StepPlanner.pause`, not this entry): a short request is paused only where that
        loses more than recomputing its victims.
        """
        return self.shortfall.plan(want_tokens, computed_tokens, held_blocks, free_blocks,
                                   token_budget, lookahead_tokens, priorities)

    cdef int64_t c_plan_shortfall(self, const int64_t* want, const int64_t* computed,
                                  const int64_t* held, int64_t n, int64_t free_blocks,
                                  int64_t budget, int64_t lookahead, char* paused,
                                  const int64_t* priority=NULL) noexcept nogil:
        return self.shortfall.c_plan(want, computed, held, n, free_blocks, budget, lookahead, paused,
                                     priority)

    def next_admissible(self, int64_t free_blocks, bint check_blocks=True):
        """The waiting request to admit next, or -1: the head, or under bypass a
        later one that fits while the held ones ahead of it have been passed fewer
        than max_bypass times and have not waited out the wait bound
        (max_queue_delay_s, or head_of_line auto's learned one).

        A look that changes no decision; it counts the hold of the request at the
        head (stats()["held"], by reason) once per request per step (`on_step`),
        however often an engine looks within a step."""
        return self.c_next_admissible(free_blocks, check_blocks)

    cdef int32_t c_next_admissible(self, int64_t free_blocks, bint check_blocks) noexcept nogil:
        self.policy.c_scan_begin()
        cdef int32_t s = self.queue.c_scan(self.decision, free_blocks, check_blocks,
                                           self.shortfall.paused_now > 0, self._now)
        self.policy.c_scan_end()
        return s

    def admit(self, int64_t slot, double now):
        """Commits: the waiting request starts running. Requests it passed count a bypass."""
        self.ledger.check_state(slot, ST_WAITING)
        check_now(now)
        self.c_admit(<int32_t>slot, now)

    cdef void c_admit(self, int32_t s, double now) noexcept nogil:
        self._tick(now)
        self.queue.c_admitted(s, self._now)
        cdef int64_t session = self.ledger.session(s)
        cdef bint activated = session >= 0 and self.agent_window.c_activate(session)
        cdef int64_t queued = self.ledger.queued_of(s)
        self._dequeue(s)
        self.ledger.start(s, activated)
        self.slo_guard.c_started(self.ledger.tpot(s))
        self.agent_window.c_started(session)
        self.policy.c_on_admit(s)
        if self.flows.on:
            self.flows.c_charge(s)
        if self.ledger.pred_total(s) == 0:
            self.ledger.set_prediction(s, self.ledger.generated(s) + self.policy.c_expected_output(s))
        self._n_admitted += 1
        self.gate.c_admitted(queued)
        self.policy.c_after_admit()

    def withdraw(self, int64_t slot):
        """Takes back an accepted arrival that never waited on its own: a sample of a
        parallel-sampling request whose sibling was refused (the request is one unit,
        refused once). Not counted as an arrival nor as an abort."""
        self.ledger.check_state(slot, ST_WAITING)
        cdef int32_t s = <int32_t>slot
        if self.ledger.admit_seq(s) >= 0:
            raise ValueError(f"slot {slot}: only a never-admitted waiting request can be withdrawn")
        self._dequeue(s)
        self._n_arrived -= 1
        self.ledger.release(s)

    def cancel_admit(self, int64_t slot, double now):
        """Undoes an admission the engine did not carry out (it put the request
        back before running it): running -> waiting, not counted as a preemption."""
        self.ledger.check_state(slot, ST_RUNNING)
        check_now(now)
        cdef int32_t s = <int32_t>slot
        self._tick(now)
        if self.flows.on:
            self.flows.c_charge(s, -1)
        cdef bint activated = self.ledger.cancel_start(s)   # it shares nothing until admitted again
        self._stopped(s)
        self._enqueue(s)
        self._n_admitted -= 1
        self.policy.c_admission_undone()
        self.gate.c_admission_undone()
        if self.ledger.session(s) >= 0 and activated:
            self.agent_window.c_undo_activation(self.ledger.session(s))   # its admission is undone

    # ------------------------------------------------------------------
    # Progress reports from the engine
    def update(self, int64_t slot, int64_t computed_tokens, int64_t generated_tokens):
        """The engine's counts for a request: tokens with KV computed, tokens generated."""
        self.ledger.check_counts(slot, computed_tokens, generated_tokens)
        self.ledger.set_counts(<int32_t>slot, computed_tokens, generated_tokens)
        if self.ledger.state(<int32_t>slot) == ST_RUNNING:
            self.policy.c_running_changed()

    cdef void c_progress(self, int32_t s, int64_t computed_tokens, int64_t generated_tokens) noexcept nogil:
        """`update` for a running request, unchecked (the native engine's hot path)."""
        self.ledger.set_counts(s, computed_tokens, generated_tokens)
        self.policy.c_running_changed()

    def update_many(self, slots, computed_tokens, generated_tokens):
        """`update` for many requests at once (one call per engine step). Every
        entry is checked before any is applied: a refused call changes nothing."""
        if self.ledger.update_many(slots, computed_tokens, generated_tokens):
            self.policy.c_running_changed()

    def set_cached(self, int64_t slot, int64_t cached_tokens):
        """Prefix-cache hit the engine found for a waiting request (tokens)."""
        self.ledger.check_state(slot, ST_WAITING)
        if cached_tokens < 0 or cached_tokens > self.ledger.tokens(<int32_t>slot):
            raise ValueError(f"cached_tokens={cached_tokens}: must be in [0, {self.ledger.tokens(<int32_t>slot)}]")
        self.ledger.set_cached(<int32_t>slot, cached_tokens)

    def set_blocks(self, int64_t slot, int64_t blocks):
        """KV blocks the engine holds for a request (for accounting and metrics)."""
        self.ledger.check_live(slot)
        if blocks < 0:
            raise ValueError(f"blocks={blocks}: must be >= 0")
        self.ledger.set_blocks(<int32_t>slot, blocks)

    def on_step(self, double now):
        """Once per engine step at `now`, after its preemptions: advances the predict ratio."""
        check_now(now)
        self.c_on_step(now)

    cdef void c_on_step(self, double now) noexcept nogil:
        self._tick(now)
        if self.flows.on:
            self.flows.c_accrue(now)
        self.ledger.next_step()
        self.policy.c_on_step(self.ledger.n_running() == 0 and self.queue.c_empty())
        self.shortfall.c_new_step()

    def preempt(self, int64_t slot, double now, bint displaced=False):
        """Commits: a running request gives its memory back and waits again
        (recompute: its KV is gone, its output so far is kept). `displaced`: the
        engine preempted it for a waiting request the core let take its KV
        (`displaceable`), not because the pool ran short."""
        self.ledger.check_state(slot, ST_RUNNING)
        check_now(now)
        self.c_preempt(<int32_t>slot, now, displaced)

    cdef void c_preempt(self, int32_t s, double now, bint displaced) noexcept nogil:
        """`preempt`, unchecked (the native engine's path too)."""
        self._tick(now)
        if self.flows.on:
            self.flows.c_released(s)
        if not displaced and self.shortfall.costed:
            self.shortfall.c_note_recompute(s, self.ledger.arrival(s))
        self.ledger.preempt(s)
        self._stopped(s)
        self._enqueue(s)
        self._n_preempted += 1
        if self.flows.on:
            self.flows.c_count(self.ledger.flow_ix(s), FL_PREEMPTED)
        if displaced:
            self._n_displaced += 1
        elif self.shortfall.recompute_now == 0:
            # A displacement, or a recompute shortfall "cost" chose, is the core's choice,
            # not a forecast that fell short: the policy's controllers (auto's quantile,
            # SGLang's ratio) do not hear of it.
            self.policy.c_on_preempt()

    def finish(self, int64_t slot, double now):
        """A running request is done; its output length feeds the length model."""
        self.ledger.check_state(slot, ST_RUNNING)
        check_now(now)
        self.c_finish(<int32_t>slot, now)

    cdef void c_finish(self, int32_t s, double now) noexcept nogil:
        """`finish`, unchecked (the native engine's path too)."""
        self._tick(now)
        if self.flows.on:
            self.flows.c_released(s)
        self.ledger.finish(s)
        self._stopped(s)
        if self.ledger.max_new(s) > 0:      # a prompt-only request tells nothing of outputs
            self.policy.c_on_finish(s)
        self.shortfall.c_note_finish()
        self._n_finished += 1
        self.ledger.release(s)

    def abort(self, int64_t slot, double now):
        """The request is gone (client cancelled, engine error): forget it."""
        self.ledger.check_live(slot)
        check_now(now)
        self._tick(now)
        cdef int32_t s = <int32_t>slot
        if self.ledger.state(s) == ST_RUNNING:
            if self.flows.on:
                self.flows.c_released(s)
            self.ledger.stop(s)
            self._stopped(s)
        else:
            self._dequeue(s)
        self._n_aborted += 1
        self.ledger.release(s)

    # ------------------------------------------------------------------
    # The step: the one place a step's sequence is written, for every engine (the
    # core port's `CorePort.step` / `step_done` translate onto it; the native
    # engine model calls the c_ twins). `step` at the start of an engine step, before
    # it schedules anything; `step_done` once the engine has scheduled it.
    def step(self, double now, int64_t used_blocks, slots=(), computed_tokens=(),
             generated_tokens=(), bint fresh=True):
        """An engine step starts at `now` with `used_blocks` KV blocks in use, in this
        order:

        1. the previous step's time to the step-time fit, charged to what it scheduled
           (`step_done`): the time it was given, or else the interval since the
           previous start (not observed: after a step that ran no tokens, after
           `engine_idle`, or when ``fresh`` is False: an interval the engine cannot
           vouch for, such as one that skipped an iteration);
        2. with the agent window: the blocks in use and the prefix hits noted since
           the previous start (`observe_cache`);
        3. the running requests' progress, if given (``slots`` with their
           ``computed_tokens`` and ``generated_tokens``, every entry checked before
           any is applied): one that started outside the gate (a queue that keeps
           KV) is admitted first;
        4. with ``counts_shared_prefix``: the blocks in use (`observe_used_blocks`).

        Returns the running slots in victim order, most protected first (the
        engine preempts from the end)."""
        check_now(now)
        if used_blocks < 0:
            raise ValueError(f"used_blocks={used_blocks}: must be >= 0")
        cdef Py_ssize_t n = self.ledger.check_rows(slots, computed_tokens, generated_tokens, "step")
        self.c_step(now, used_blocks, self.ledger.rows(), n, fresh)
        return self.victim_order()

    cdef void c_step(self, double now, int64_t used_blocks, const int64_t* rows, int64_t n,
                     bint fresh) noexcept nogil:
        """`step`, unchecked: ``rows`` are n (slot, computed, generated) triples of live
        slots (none: NULL, 0; the native engine reports progress as it runs)."""
        cdef int64_t i
        if self._shape_tokens >= 0:
            if self._shape_seconds >= 0:
                self.slo_guard.c_observe_step(self._shape_tokens, self._shape_context,
                                              self._shape_seconds)
                self.observed_steps += 1
            elif fresh and self._step_started and now >= self._step_start:
                self.slo_guard.c_observe_step(self._shape_tokens, self._shape_context,
                                              now - self._step_start)
                self.observed_steps += 1
        self._step_start, self._step_started, self._shape_tokens = now, True, -1.0
        if self.agent_window.enabled:
            self.c_observe_cache(used_blocks if used_blocks < self.num_blocks else self.num_blocks,
                                 self._hits, self._queries, now)
        self._hits = self._queries = 0
        if n > 0:
            if self.ledger.n_running() < n:      # some started outside the gate
                for i in range(n):
                    if self.ledger.state(<int32_t>rows[3 * i]) == ST_WAITING:
                        self.c_admit(<int32_t>rows[3 * i], now)
            if self.ledger.apply_rows(rows, n):
                self.policy.c_running_changed()
        if self.counts_shared_prefix:
            self.c_observe_used_blocks(used_blocks)

    def step_done(self, double tokens, double context, double now, int64_t hit_tokens=0,
                  int64_t query_tokens=0, double seconds=-1.0):
        """The engine scheduled the step that `step` began at `now`: ``tokens`` tokens
        over ``context`` KV tokens (0 tokens: nothing runs, so the interval to the next
        start is no step time), and the prefix-cache hits of the requests it admitted
        (`note_prefix_hits`). ``seconds`` (>= 0): the step's time, known (an engine
        model); else the next `step` measures it. Then the core steps (`on_step`) at
        the step's time."""
        check_now(now)
        if not (isfinite(tokens) and tokens >= 0 and isfinite(context) and context >= 0):
            raise ValueError(f"tokens={tokens}, context={context}: must be finite numbers >= 0")
        if not isfinite(seconds):
            raise ValueError(f"seconds={seconds}: must be finite (negative: measured)")
        _check_hits(hit_tokens, query_tokens)
        self.c_step_done(tokens, context, now, hit_tokens, query_tokens, seconds)

    cdef void c_step_done(self, double tokens, double context, double now, int64_t hit_tokens,
                          int64_t query_tokens, double seconds) noexcept nogil:
        if tokens > 0 or seconds >= 0:
            self._shape_tokens, self._shape_context, self._shape_seconds = tokens, context, seconds
        else:
            self._shape_tokens = -1.0
        self.c_note_prefix_hits(hit_tokens, query_tokens)
        self.c_on_step(now)

    def note_prefix_hits(self, int64_t hit_tokens, int64_t query_tokens):
        """Prefix-cache hits of requests admitted this step (tokens found cached, out of
        their prompt + output tokens): the agent window sees them at the next `step`."""
        _check_hits(hit_tokens, query_tokens)
        self.c_note_prefix_hits(hit_tokens, query_tokens)

    cdef void c_note_prefix_hits(self, int64_t hit_tokens, int64_t query_tokens) noexcept nogil:
        self._hits += hit_tokens
        self._queries += query_tokens
        self.prefix_hit_tokens += hit_tokens
        self.prefix_query_tokens += query_tokens

    @property
    def pending_prefix_hits(self):
        """(hit, query) tokens noted since the latest step start (the next `step`'s)."""
        return (self._hits, self._queries)

    def engine_idle(self):
        """The engine had nothing to run: the time until the next step is no step time."""
        self.c_engine_idle()

    cdef void c_engine_idle(self) noexcept nogil:
        self._shape_tokens = -1.0

    # ------------------------------------------------------------------
    # Step-time model, cache signals and the agent window
    def set_step_budget(self, int64_t tokens):
        """The engine's token budget a step (vLLM max_num_batched_tokens), for TTFT predictions."""
        if tokens < 0:
            raise ValueError(f"step budget tokens={tokens}: must be >= 0 (0: unknown)")
        self.slo_guard.c_set_step_budget(tokens)

    def observe_step(self, double tokens, double context, double seconds):
        """An engine step took `seconds` for `tokens` scheduled tokens over `context`
        tokens of KV: refines the step-time model the SLO guard predicts with."""
        self.slo_guard.observe_step(tokens, context, seconds)

    def observe_cache(self, int64_t used_blocks, int64_t hit_tokens, int64_t query_tokens,
                      double now):
        """Once per engine step: KV blocks in use and the step's prefix-cache hit and
        query tokens. Every agent_interval_s the agent window follows AIMD."""
        check_now(now)
        self.c_observe_cache(used_blocks, hit_tokens, query_tokens, now)

    cdef void c_observe_cache(self, int64_t used_blocks, int64_t hit_tokens, int64_t query_tokens,
                               double now) noexcept nogil:
        self._tick(now)
        if not self.agent_window.enabled:
            return
        self.agent_window.c_observe_cache(used_blocks, hit_tokens, query_tokens, self._now)

    def observe_used_blocks(self, int64_t used_blocks):
        """Once per engine step, after `update_many`: KV blocks in use (auto counts the
        prefixes running requests share once)."""
        if used_blocks < 0:
            raise ValueError(f"used_blocks={used_blocks}: must be >= 0")
        self.c_observe_used_blocks(used_blocks)

    cdef void c_observe_used_blocks(self, int64_t used_blocks) noexcept nogil:
        self.policy.c_observe_used_blocks(used_blocks)

    def set_shared(self, int64_t slot, int64_t shared_tokens):
        """At admission: prompt tokens of a request that sit in KV blocks other running
        requests already hold (prefix-cache hits on blocks in use). Only auto uses it."""
        self.ledger.check_live(slot)
        if shared_tokens < 0 or shared_tokens > self.ledger.tokens(<int32_t>slot):
            raise ValueError(f"shared_tokens={shared_tokens}: must be in [0, {self.ledger.tokens(<int32_t>slot)}]")
        self.c_set_shared(<int32_t>slot, shared_tokens)

    cdef void c_set_shared(self, int32_t s, int64_t shared_tokens) noexcept nogil:
        self.policy.c_set_shared(s, shared_tokens)

    def expire_sessions(self, double now):
        """The engine had nothing to run until `now` (it calls this when idle; steps do
        it themselves): idle sessions leave the agent window, and W follows a due
        update while sessions are held outside it."""
        check_now(now)
        self._tick(now)
        self.agent_window.c_on_time(self._now)

    # ------------------------------------------------------------------
    # Victims (their order: CoreView.victim_order)
    def victim(self):
        """The running request to preempt first, or -1."""
        return self.c_victim()

    cdef int32_t c_victim(self) noexcept nogil:
        return victim_slot(self.ledger, self._victim, self._victim_by_priority, self._over_share())


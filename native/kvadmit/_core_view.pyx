# The admission core's reads: what it holds and reports, none of which changes a
# decision (AdmissionCore, in kvadmit._core, adds what does). The parts are set up
# by AdmissionCore.__init__.

from libc.stdint cimport int32_t, int64_t, INT64_MAX

from kvadmit._curves cimport cdiv
from kvadmit._victims cimport victim_order, victims_first
from kvadmit._ledger cimport ST_WAITING

from kvadmit._ledger import STATES


cdef class CoreView:
    """The parts of an admission core and what they report (see AdmissionCore)."""

    @property
    def paused(self):
        """Running requests paused so far, counted per step (shortfall: "pause")."""
        return self.shortfall.paused_total

    @property
    def num_waiting(self):
        return self.queue.c_size()

    @property
    def num_running(self):
        return self.ledger.n_running()

    @property
    def queued_tokens(self):
        return self.ledger.queued_tokens()

    @property
    def new_token_ratio(self):
        """The predict policy's current ratio (SGLang's new_token_ratio)."""
        return self.policy.ratio

    @property
    def quantile(self):
        """The adaptive policy's current length quantile."""
        return self.policy.quantile

    @property
    def length_model(self):
        return self.policy.lengths

    @property
    def step_time(self):
        """The step-time fit the SLO guard predicts with (kvadmit.StepTimeFit)."""
        return self.slo_guard.step_time

    @property
    def reserved_blocks(self):
        """Sum over running of blocks for prompt + max_new (the reserve policy's load)."""
        return self.ledger.reserve_load()

    def waiting(self):
        """Waiting slots in service order."""
        return self.queue.slots()

    def running(self):
        """Running slots (no particular order; see victim_order)."""
        return [self.ledger.running_at(i) for i in range(self.ledger.n_running())]

    def victim_order(self):
        """Running slots from most protected to first victim (the last one goes first)."""
        return victim_order(self.ledger, self._victim, self._victim_by_priority, self._over_share())

    def may_take_kv(self):
        """Whether a waiting request may take KV from running ones now: under
        queue_order "priority" (priority retraction) or flows (displacement, on once a
        flow id arrives). Where not, `displaceable` is always empty."""
        return self.decision.c_may_take_kv()

    def displaceable(self, int64_t slot, bint flows_only=False):
        """The running requests the waiting request `slot` may take KV from, first
        victim first (kvadmit._decision's c_mark_takeable): under queue_order
        "priority" those less important than it by more than
        priority_preemption_threshold; under flows those of its band whose flow is
        over its share, where its own flow with it stays within its share. In the
        victim order (least important class first, then flows over their share). Empty
        when neither applies. An engine that must free KV at once for `slot` (vLLM's
        blocks for its prompt, SGLang evicts at admission) takes them in this order.
        `flows_only`: flow displacement alone (an engine that does not retract by
        priority)."""
        self.ledger.check_state(slot, ST_WAITING)
        cdef vector[int32_t] out
        self.c_displaceable(<int32_t>slot, out, flows_only)
        return [r for r in out]

    def state(self, int64_t slot):
        if slot < 0 or slot >= self.ledger.n_slots():
            return "free"
        return STATES[self.ledger.state(<int32_t>slot)]

    def info(self, int64_t slot):
        """The ledger's numbers for one request."""
        return self.ledger.info(slot)

    def peak_blocks(self):
        """Peak blocks the running requests can reach under the policy's curves."""
        return self.policy.c_peak_blocks()

    def predict_ttft(self, int64_t prompt_tokens, double now):
        """The TTFT the SLO guard predicts for an arrival of `prompt_tokens` at
        `now` (queued behind everything waiting). A read: it moves no clock."""
        if prompt_tokens < 1:
            raise ValueError(f"prompt_tokens={prompt_tokens}: must be >= 1")
        check_now(now)
        cdef int64_t ahead, ahead_tokens
        # its place: behind every waiting request but sheddable ones (the least
        # priority, no deadline)
        self.queue.c_ahead_of(self.queue.c_order_key(False, INT64_MAX // 2, now, 0.0, 0.0, 0.0,
                                                     self.ledger.next_seq()), &ahead, &ahead_tokens)
        cdef double delay = self.gate.c_peek_predicted_delay(ahead, ahead_tokens, prompt_tokens, now)
        return self.slo_guard.c_predict_ttft(ahead_tokens, prompt_tokens, delay, self.ledger.n_running(),
                                             self.ledger.running_context())

    # --- the agent window -------------------------------------------------
    def next_window_change(self):
        """When the agent window next changes with nothing run (inf: never): an idle
        session leaves, a held one becomes overdue, or W follows an update while
        sessions are held. An engine with only window-held requests waiting sleeps
        until then and calls `expire_sessions`."""
        return self.agent_window.c_next_change()

    def take_paused_sessions(self):
        """Sessions paused or expired since the last call (an engine can demote
        their cached prefixes)."""
        return self.agent_window.take_paused_sessions()

    def session_active(self, int64_t session):
        """Whether this session is inside the agent window (True without agent_window)."""
        return self.agent_window.c_is_active(session)

    @property
    def agent_window_size(self):
        """The current W (the number of sessions that may be active)."""
        return self.agent_window.c_size()

    @property
    def active_sessions(self):
        return self.agent_window.c_active()

    def window_history(self):
        """W after each of the recent AIMD updates (the last 4096 at least), oldest first."""
        return self.agent_window.history()

    # --- what a router and an operator see ---------------------------------
    def router_signals(self):
        """What a router in front of several engines can use (kvadmit knows it, their
        gauges do not): ``kv_headroom_blocks``, the blocks the policy could still admit
        without a forecast shortfall once the waiting requests' prompts are in;
        ``admission_pressure``, the forecast plus those prompts over the pool (above 1:
        more is queued than fits); ``predicted_queue_delay_s``, the wait of a request
        arriving now behind the queue at the recent admission rate (0 when none is
        known or nothing waits)."""
        cdef int64_t queued = self.ledger.queued_tokens()
        cdef int64_t demand = self.policy.c_forecast_blocks() + cdiv(queued, self.block_size)
        return {
            "kv_headroom_blocks": max(self.num_blocks - demand, 0),
            "admission_pressure": demand / <double>self.num_blocks,
            "predicted_queue_delay_s": self.gate.c_peek_predicted_delay(
                self.queue.c_size(), queued, 0, self._now),
        }

    def flow_stats(self):
        """Per flow, by its name (its key in the config's flows, else its id; None:
        requests without a flow, once any request had one): weight, admitted, held,
        refused, preempted, waiting, running, queued_tokens, kv_block_steps,
        kv_block_seconds, kv_share (its share of the block-seconds) and
        usage_per_weight (the fair order's key). Empty until a request with a flow
        arrives."""
        return self.flows.stats()

    def stats(self):
        """Counters since construction, and the router signals."""
        return {
            **self.router_signals(),
            "arrived": self._n_arrived, "admitted": self._n_admitted,
            "preempted": self._n_preempted, "paused": self.paused,
            # of the preempted: for a waiting request the core let take their KV
            "displaced": self._n_displaced,
            # short requests auto priced cheaper to recompute for than to pause
            "shortfall_recomputes": self.shortfall.recompute_total,
            # admissions auto priced worth a later recompute (past the peak)
            "past_peak": self.policy.past_peak,
            "finished": self._n_finished, "aborted": self._n_aborted,
            "held": self.queue.held(),
            # seconds of waiting after which a held request is passed by none
            "wait_bound_s": self.queue.wait_bound_s,
            "rejected": self.gate.rejected(),
            "waiting": self.queue.c_size(), "running": self.ledger.n_running(),
            "queued_tokens": self.ledger.queued_tokens(),
            "new_token_ratio": self.policy.ratio, "quantile": self.policy.quantile,
            "step_time_fit": dict(zip(("a", "b", "c"), self.step_time.coefficients),
                                  observations=self.step_time.observations),
            "agent_window": self.agent_window.stats(),
            "length_predictions": self.ledger.length_predictions(),
        }

# The core's two rules, over its parts:
#   c_decide(s)   may the waiting request s start now? The agent window (its session
#                 outside it: hold_agent), the blocks it needs now (hold_blocks), the
#                 policy's rule (hold_capacity; with the KV of the running requests s
#                 may take counted as free: c_takes_running), the TPOT guard
#                 (hold_slo); the queue's scan asks it of each request it reaches.
#   c_refusal(s)  why the new arrival s can never be queued here (the KV pool, the
#                 prefill cap) or cannot now (its predicted queueing delay or TTFT).
# The queue caps and priority shedding are the core's (`_make_room`): they evict.
#
# Whose KV a waiting request may take (c_mark_takeable), the one place that says it:
#   priority retraction (queue_order "priority"): a running request less important
#     than s (sheddable where s is not, or a larger priority value by more than
#     priority_preemption_threshold);
#   (an engine that does not retract by priority asks with flows_only: the flow rule alone)
#   flow displacement (flows on): a running request of s's band (its class and, under
#     queue_order "priority", its priority value) whose flow holds more than its
#     weighted share of the pool now, where s's flow, with s, stays within its own;
#     the victim's flow has used no less of the pool per weight over time (block-steps,
#     the fair order's usage) than s's; and without the victim it still holds no less
#     per weight than s's with s. A block moves only from a flow above its share to
#     one that stays within it (so no displacement is answered by one back), never
#     from a flow that is over its share only for a burst, having used less than its
#     share over time (a quiet flow's running requests are not preempted for the noisy
#     one's), and only where the two are far apart (near a balance the recompute would
#     cost more than the fairness it buys; the fair order evens out the rest).
# The engine then takes that KV back as it needs it (the victim order goes least
# important class, then flows over their share, first) or at once where it must
# (CoreView.displaceable).

from libc.stdint cimport int32_t, int64_t

from kvadmit._agent_window cimport AgentWindow
from kvadmit._arrival_gate cimport ArrivalGate, Rejection, R_KV_CAPACITY
from kvadmit._flows cimport FlowTable
from kvadmit._curves cimport cdiv
from kvadmit._ledger cimport Ledger
from kvadmit._policies cimport Policy
from kvadmit._slo_guard cimport SloGuard
from kvadmit._waiting_queue cimport (D_ADMIT, D_HOLD_AGENT, D_HOLD_BLOCKS, D_HOLD_CAPACITY,
                                     D_HOLD_SLO, Judge, WaitingQueue)

from kvadmit._policies import POLICIES


cdef class Decision(Judge):
    """The rules of one core, over its parts (a pool of `num_blocks` blocks)."""

    def __init__(self, Ledger ledger, Policy policy, SloGuard slo_guard, AgentWindow agent_window,
                 WaitingQueue queue, ArrivalGate gate, FlowTable flows, int64_t num_blocks,
                 bint by_priority=False):
        self.ledger, self.policy = ledger, policy
        self.slo_guard, self.agent_window = slo_guard, agent_window
        self.queue, self.gate, self.flows = queue, gate, flows
        self.block_size, self.num_blocks = ledger.block_size, num_blocks
        self.by_priority = by_priority

    cdef int c_decide(self, int32_t s, int64_t free_blocks, bint check_blocks) noexcept nogil:
        if self.agent_window.c_holds(self.ledger.session(s)):
            return D_HOLD_AGENT
        cdef int64_t need_now = cdiv(self.ledger.tokens(s), self.block_size) \
            - self.ledger.cached(s) // self.block_size
        if check_blocks and need_now > free_blocks:
            return D_HOLD_BLOCKS
        if not self.policy.c_fits(s, free_blocks) and not self.c_takes_running(s, free_blocks):
            return D_HOLD_CAPACITY
        if not self.slo_guard.c_tpot_ok(self.ledger.tpot(s), self.ledger.n_running(),
                                        <double>self.ledger.running_context() + self.ledger.tokens(s)):
            return D_HOLD_SLO
        return D_ADMIT

    cdef bint c_takes_running(self, int32_t s, int64_t free_blocks) noexcept nogil:
        """May s, which the policy holds, start on the KV of the running requests it
        may take (c_mark_takeable)? The policy's rule with their KV, held and still to
        come, counted as free (Policy.c_fits_taking)."""
        if not self.c_mark_takeable(s):
            return False
        return self.policy.c_fits_taking(s, free_blocks, self.takeable)

    cdef bint c_may_displace(self, int32_t s) noexcept nogil:
        return self.c_mark_takeable(s)

    cdef bint c_mark_takeable(self, int32_t s, bint flows_only=False) noexcept nogil:
        """Marks, by position in the ledger's running set, the running requests whose
        KV the waiting s may take (see the top of this file); True if any.
        `flows_only`: flow displacement alone, for an engine that does not retract by
        priority (SGLang with its priority preemption off): no class takes another's."""
        cdef size_t i, n = self.ledger.n_running()
        cdef int32_t r, g, f = self.ledger.flow_ix(s)
        cdef int64_t need = cdiv(self.ledger.tokens(s), self.block_size)
        cdef bint any_marked = False, by_flow = False, take
        self.takeable.assign(n, 0)
        if not self.c_may_take_kv():
            return False
        if self.flows.on:
            self.flows.c_over_share(self.over)
            by_flow = self.flows.c_within_share(f, need)
        for i in range(n):
            r = self.ledger.running_at(i)
            g = self.ledger.flow_ix(r)
            if self.by_priority and not flows_only \
                    and self.ledger.ranks_below(r, s, self.policy.priority_margin):
                take = True
            else:
                take = by_flow and g != f and self.over[g] \
                    and self.flows.c_vtime(g) >= self.flows.c_vtime(f) \
                    and self.flows.c_stays_ahead(g, self.ledger.held_blocks(r), f, need) \
                    and self.ledger.sheddable(r) == self.ledger.sheddable(s) \
                    and (not self.by_priority or self.ledger.priority(r) == self.ledger.priority(s))
            self.takeable[i] = take
            any_marked = any_marked or take
        return any_marked

    cdef Rejection c_refusal(self, int32_t s):
        """Why the new request s can never be queued here, or cannot now (as of the
        core's time); None: it may queue."""
        if not self.policy.c_fits_alone(s):
            return self.gate.c_refuse(
                R_KV_CAPACITY,
                f"request needs more KV than the whole pool holds under policy "
                f"'{POLICIES[self.policy.kind]}' (prompt_tokens={self.ledger.prompt(s)}, "
                f"max_new_tokens={self.ledger.max_new(s)}, pool={self.num_blocks} blocks of "
                f"{self.block_size} tokens)",
                "num_blocks", self.num_blocks, None)
        cdef int64_t queued = self.ledger.queued_of(s)
        cdef Rejection refused = self.gate.c_refuse_prefill(queued)
        if refused is not None:
            return refused
        cdef double delay = 0.0
        cdef int64_t ahead = 0, ahead_tokens = 0
        cdef bint ttft_guarded = self.slo_guard.enabled and self.ledger.ttft(s) > 0
        # the cap on its predicted queueing delay (0: none)
        cdef double cap = self.gate.max_queue_delay_s
        cdef str limit = "max_queue_delay_s"
        cdef double own = self.ledger.record(s).max_queue_delay_s
        if own > 0 and (cap <= 0 or own < cap):   # a request may only tighten it
            cap, limit = own, "kvadmit_max_queue_delay_s"
        if cap > 0 or ttft_guarded:
            self.queue.c_ahead_of_slot(s, &ahead, &ahead_tokens)
            delay = self.c_predicted_delay(ahead, ahead_tokens, queued)
        if cap > 0:
            refused = self.gate.c_refuse_delay(delay, self.queue.c_size(), self.ledger.queued_tokens(),
                                               cap, limit)
            if refused is not None:
                return refused
        if ttft_guarded:
            return self.gate.c_refuse_slo(
                self.slo_guard.c_predict_ttft(ahead_tokens, queued, delay, self.ledger.n_running(),
                                              self.ledger.running_context()),
                self.ledger.ttft(s), self.queue.c_size(), self.ledger.n_running())
        return None

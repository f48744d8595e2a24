# The core's two rules, over its parts:
#   c_decide(s)   may the waiting request s start now? The agent window (its session
#                 outside it: hold_agent), the blocks it needs now (hold_blocks), the
#                 policy's rule (hold_capacity; under queue_order "priority" with the
#                 KV of strictly lower-priority running requests counted as free:
#                 c_takes_from_lower), the TPOT guard (hold_slo); the queue's scan
#                 asks it of each request it reaches.
#   c_refusal(s)  why the new arrival s can never be queued here (the KV pool, the
#                 prefill cap) or cannot now (its predicted queueing delay or TTFT).
# The queue caps and priority shedding are the core's (`_make_room`): they evict.

from libc.stdint cimport int32_t, int64_t

from kvadmit._agent_window cimport AgentWindow
from kvadmit._arrival_gate cimport ArrivalGate, Rejection, R_KV_CAPACITY
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
                 WaitingQueue queue, ArrivalGate gate, int64_t num_blocks, bint by_priority=False):
        self.ledger, self.policy = ledger, policy
        self.slo_guard, self.agent_window = slo_guard, agent_window
        self.queue, self.gate = queue, gate
        self.block_size, self.num_blocks = ledger.block_size, num_blocks
        self.by_priority = by_priority

    cdef int c_decide(self, int32_t s, int64_t free_blocks, bint check_blocks,
                      int64_t headroom) noexcept nogil:
        if self.agent_window.c_holds(self.ledger.session(s)):
            return D_HOLD_AGENT
        cdef int64_t need_now = cdiv(self.ledger.tokens(s), self.block_size) \
            - self.ledger.cached(s) // self.block_size
        if headroom > 0:       # the flows' headroom (kvadmit._flows.c_headroom)
            free_blocks = free_blocks - headroom if free_blocks > headroom else 0
        if check_blocks and need_now > free_blocks:
            return D_HOLD_BLOCKS
        self.policy.headroom = headroom
        cdef bint fits = self.policy.c_fits(s, free_blocks)
        self.policy.headroom = 0
        if not fits and not self.c_takes_from_lower(s, free_blocks):
            return D_HOLD_CAPACITY
        if not self.slo_guard.c_tpot_ok(self.ledger.tpot(s), self.ledger.n_running(),
                                        <double>self.ledger.running_context() + self.ledger.tokens(s)):
            return D_HOLD_SLO
        return D_ADMIT

    cdef bint c_takes_from_lower(self, int32_t s, int64_t free_blocks) noexcept nogil:
        """Priority retraction, under queue_order "priority": may s, which the policy
        holds, start on the KV of running requests of strictly lower priority (a larger
        priority value)? The policy's rule with their KV, held and still to come,
        counted as free (Policy.c_fits_taking_lower). The engine then takes that KV back
        as it needs it: the victim order and the pause plan go lowest priority first.
        Equal or higher priorities are never displaced, nor lower ones within
        priority_preemption_threshold of it (SGLang's preemption threshold)."""
        if not self.by_priority or not self.c_lower_priority_runs(s):
            return False
        return self.policy.c_fits_taking_lower(s, free_blocks)

    cdef bint c_may_displace(self, int32_t s) noexcept nogil:
        return self.by_priority and self.c_lower_priority_runs(s)

    cdef bint c_lower_priority_runs(self, int32_t s) noexcept nogil:
        """Whether a running request is less important than s (sheddable where s is
        not, or a larger priority value by more than priority_preemption_threshold)."""
        cdef size_t i
        for i in range(self.ledger.n_running()):
            if self.ledger.ranks_below(self.ledger.running_at(i), s, self.policy.priority_margin):
                return True
        return False

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
        if self.gate.max_queue_delay_s > 0 or ttft_guarded:
            self.queue.c_ahead_of_slot(s, &ahead, &ahead_tokens)
            delay = self.c_predicted_delay(ahead, ahead_tokens, queued)
        if self.gate.max_queue_delay_s > 0:
            refused = self.gate.c_refuse_delay(delay, self.queue.c_size(), self.ledger.queued_tokens())
            if refused is not None:
                return refused
        if ttft_guarded:
            return self.gate.c_refuse_slo(
                self.slo_guard.c_predict_ttft(ahead_tokens, queued, delay, self.ledger.n_running(),
                                              self.ledger.running_context()),
                self.ledger.ttft(s), self.queue.c_size(), self.ledger.n_running())
        return None

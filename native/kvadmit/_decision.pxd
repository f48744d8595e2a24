# The core's two rules' C-level API (see _decision.pyx): may a waiting request
# start now (the queue's scan asks c_decide), may a new arrival be queued (c_refusal).
from libc.stdint cimport int32_t, int64_t
from libcpp.vector cimport vector

from kvadmit._agent_window cimport AgentWindow
from kvadmit._arrival_gate cimport ArrivalGate, Rejection
from kvadmit._flows cimport FlowTable
from kvadmit._ledger cimport Ledger
from kvadmit._policies cimport Policy
from kvadmit._slo_guard cimport SloGuard
from kvadmit._waiting_queue cimport Judge, WaitingQueue


cdef class Decision(Judge):
    cdef Ledger ledger
    cdef Policy policy
    cdef SloGuard slo_guard
    cdef AgentWindow agent_window
    cdef WaitingQueue queue
    cdef ArrivalGate gate
    cdef FlowTable flows
    cdef int64_t block_size, num_blocks
    cdef bint by_priority                 # queue_order "priority": priority retraction
    cdef vector[char] takeable            # c_mark_takeable's marks, by running position
    cdef vector[char] over                # the flows over their share, as c_mark_takeable saw them

    cdef inline double c_predicted_delay(self, int64_t ahead, int64_t ahead_tokens,
                                         int64_t queued) noexcept nogil:
        """The arrival gate's predicted queueing delay behind `ahead` requests (as of
        the core's time)."""
        return self.gate.c_predicted_delay(ahead, ahead_tokens, queued)

    cdef inline bint c_may_take_kv(self) noexcept nogil:
        """Whether any waiting request may take KV from running ones: under queue_order
        "priority" (priority retraction) or flows (displacement)."""
        return self.by_priority or self.flows.on

    cdef int c_decide(self, int32_t s, int64_t free_blocks, bint check_blocks) noexcept nogil
    cdef bint c_takes_running(self, int32_t s, int64_t free_blocks) noexcept nogil
    cdef bint c_mark_takeable(self, int32_t s, bint flows_only=*) noexcept nogil
    cdef bint c_may_displace(self, int32_t s) noexcept nogil
    cdef Rejection c_refusal(self, int32_t s)

# What the admission core holds and reports (see _core_view.pyx): its parts and
# counters, and the reads and stats over them. AdmissionCore (kvadmit._core)
# extends it with everything that changes state.
from libc.math cimport isfinite
from libc.stdint cimport int32_t, int64_t
from libcpp.vector cimport vector

from kvadmit._agent_window cimport AgentWindow
from kvadmit._arrival_gate cimport ArrivalGate
from kvadmit._decision cimport Decision
from kvadmit._flows cimport FlowTable
from kvadmit._ledger cimport Ledger
from kvadmit._policies cimport Policy
from kvadmit._shortfall cimport ShortfallPlanner
from kvadmit._slo_guard cimport SloGuard
from kvadmit._victims cimport V_LIFO, victim_order_into, victims_first
from kvadmit._waiting_queue cimport WaitingQueue


cdef inline int check_now(double now) except -1:
    """Every entry point's clock: a non-finite `now` would stop the core's clocks
    (nothing is later than inf) and with them the drain rate and idle expiry."""
    if not isfinite(now):
        raise ValueError(f"now={now}: must be a finite number of seconds")
    return 0


cdef class CoreView:
    # engine shape
    cdef readonly int64_t num_blocks
    cdef readonly int64_t block_size
    cdef readonly int64_t max_model_len
    cdef readonly object config
    # the parts
    cdef readonly Ledger ledger            # the requests, by slot, and the running set
    cdef readonly WaitingQueue queue       # the waiting requests' order and the scan
    cdef readonly Policy policy            # the admission rule (one Policy subclass per policy)
    cdef readonly Decision decision        # may a waiting request start, may an arrival queue
    cdef readonly ShortfallPlanner shortfall   # shortfall "pause": who sits out a step
    cdef readonly ArrivalGate gate         # caps, refusals, drain rate and Retry-After
    cdef readonly SloGuard slo_guard       # TPOT hold, TTFT prediction, the step-time fit
    cdef readonly AgentWindow agent_window # sessions, W, idle expiry, the pause log
    cdef readonly FlowTable flows          # flows: weights, caps, KV usage (the fair order)
    cdef int _victim                       # victim order (an index into VICTIMS)
    cdef bint _victim_by_priority          # queue_order "priority": victims within classes, least important first
    cdef vector[char] _over                # scratch: the flows over their share (the victim order's)
    # counters and the latest time seen
    cdef int64_t _n_arrived, _n_admitted, _n_preempted, _n_displaced, _n_finished, _n_aborted
    cdef double _now                       # the core's time: the latest `now` of any mutator (monotone)

    cdef inline const char* _over_share(self) noexcept nogil:
        """Per flow index, whether it is over its share (FlowTable.c_over_share: the
        victim order's key under flows); NULL while flows are off."""
        if not self.flows.on:
            return NULL
        self.flows.c_over_share(self._over)
        return self._over.data()

    cdef inline bint c_victim_order(self, vector[int32_t]& out) noexcept nogil:
        """`victim_order`, into `out`; False (out untouched) where it is the order of
        admission: lifo with no priority classes, no flows and no sheddable request
        running (the common case needs no sort)."""
        cdef size_t i
        if self._victim == V_LIFO and not self._victim_by_priority and not self.flows.on:
            for i in range(self.ledger.n_running()):
                if self.ledger.sheddable(self.ledger.running_at(i)):
                    break
            else:
                return False
        victim_order_into(self.ledger, self._victim, self._victim_by_priority,
                          self._over_share(), out)
        return True

    cdef inline void c_displaceable(self, int32_t s, vector[int32_t]& out,
                                    bint flows_only=False) noexcept nogil:
        """`displaceable` for the waiting s, into `out`."""
        out.clear()
        if self.decision.c_mark_takeable(s, flows_only):      # (it has just judged the flows' shares)
            victims_first(self.ledger, self._victim, self._victim_by_priority,
                          self.decision.over.data() if self.flows.on else NULL,
                          self.decision.takeable, out)

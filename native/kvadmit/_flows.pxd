# The flows' fair share (see _flows.pyx): per flow its weight, its queue caps, its
# normalised KV usage (the queue's fair order) and its counters. The ledger keeps the
# per-flow sums of its requests (live, waiting, queued tokens); this table the rest.
from libc.stdint cimport int32_t, int64_t
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

from kvadmit._ledger cimport Ledger

cdef enum:   # per-flow counters
    FL_ADMITTED = 0
    FL_HELD = 1         # (request, step) pairs its request was held at the queue's head
    FL_REFUSED = 2      # refusals of its requests, any reason (arrival, shed, expired)
    FL_PREEMPTED = 3
    N_FLOW_COUNTERS = 4


cdef class FlowTable:
    cdef readonly bint on                 # a request with a flow arrived: the fair order is on
    cdef Ledger ledger
    cdef int64_t num_blocks
    cdef double _default_weight
    cdef unordered_map[int64_t, int32_t] _ix   # flow id -> index (index 0: no flow)
    cdef vector[int64_t] _id
    cdef vector[double] _weight
    cdef vector[int64_t] _cap_reqs, _cap_tokens   # 0: no cap
    cdef vector[double] _vtime            # block-steps / weight: the fair order's key
    cdef vector[double] _block_steps, _block_s
    cdef vector[int64_t] _holding         # blocks its running requests held at the last step,
                                          # plus those admitted since
    cdef vector[int64_t] _now             # blocks its running requests hold now: _holding
                                          # less those preempted or finished since (the
                                          # shares' judgments within a step)
    cdef vector[int64_t] _counts          # N_FLOW_COUNTERS per flow
    cdef dict _configured                 # flow id -> its key in the config's flows
    cdef double _last_t
    cdef bint _stepped

    cdef inline double c_vtime(self, int32_t f) noexcept nogil:
        return self._vtime[f]
    cdef inline double c_weight(self, int32_t f) noexcept nogil:
        return self._weight[f]
    cdef inline double c_holding(self, int32_t f) noexcept nogil:
        """Blocks flow f holds now (as of the last step, plus its admissions since),
        per unit of weight."""
        return self._holding[f] / self._weight[f]
    cdef inline int64_t c_cap_reqs(self, int32_t f) noexcept nogil:
        return self._cap_reqs[f]
    cdef inline int64_t c_cap_tokens(self, int32_t f) noexcept nogil:
        return self._cap_tokens[f]
    cdef inline void c_count(self, int32_t f, int what) noexcept nogil:
        self._counts[N_FLOW_COUNTERS * f + what] += 1

    cdef void _add(self, int64_t flow, double weight, int64_t cap_reqs, int64_t cap_tokens)
    cdef int32_t c_index(self, int64_t flow) except -1
    cdef void c_activate(self, int32_t f) noexcept nogil
    cdef void c_charge(self, int32_t s, int sign=*) noexcept nogil
    cdef void c_accrue(self, double now) noexcept nogil
    cdef void c_released(self, int32_t s) noexcept nogil
    cdef double c_live_weight(self, int32_t f) noexcept nogil
    cdef double c_share(self, int32_t f) noexcept nogil
    cdef inline bint c_within_share(self, int32_t f, int64_t more) noexcept nogil:
        """Whether flow f, holding `more` blocks besides, stays within its share."""
        return self._now[f] + more <= self.c_share(f)
    cdef void c_over_share(self, vector[char]& over) noexcept nogil
    cdef inline bint c_stays_ahead(self, int32_t g, int64_t less, int32_t f, int64_t more) noexcept nogil:
        """Whether flow g, `less` blocks lighter, still holds no less per weight than
        flow f does `more` blocks heavier."""
        return (self._now[g] - less) / self._weight[g] >= (self._now[f] + more) / self._weight[f]
    cdef str c_name(self, int32_t f)

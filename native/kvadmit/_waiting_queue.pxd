# The waiting queue's C-level API (see _waiting_queue.pyx): its order, the
# bounded-bypass scan, and the order in which priority shedding evicts.
from cython.operator cimport dereference as deref
from libc.math cimport INFINITY
from libc.stdint cimport int32_t, int64_t
from libcpp.map cimport map as cmap
from libcpp.vector cimport vector

from kvadmit._agent_window cimport AgentWindow
from kvadmit._flows cimport FlowTable
from kvadmit._ledger cimport Ledger

cdef enum:  # indexes into DECISIONS
    D_ADMIT = 0
    D_HOLD_BLOCKS = 1
    D_HOLD_CAPACITY = 2
    D_HOLD_SLO = 3        # the TPOT guard: the step would be too slow for a running request
    D_HOLD_AGENT = 4      # its session is outside the active-agent window
    D_HOLD_PAUSED = 5     # running requests are paused this step (shortfall: pause)
    N_DECISIONS = 6

cdef enum:
    AUTO_MAX_BYPASS = 1000   # head_of_line auto: times a held request may be passed
    AUTO_LOOKAHEAD = 256     # head_of_line auto: requests examined behind a held head
    WAIT_WINDOW = 32         # the wait bound's mean: over about this many first admissions

cdef extern from *:
    """
    #include <map>
    // The waiting queue's key, smallest served first: (class: sheddable after all
    // others, order key, the engine's arrival time, its tie-break, arrival seq). The engine's arrival time and tie-break order
    // requests of equal priority under queue_order "priority" (vLLM: arrival_time, then
    // request id); elsewhere they are 0 and the arrival seq decides.
    struct kvadmit_QKey {
        int64_t cls; int64_t first; double time; double tie; int64_t second;
        bool operator<(const kvadmit_QKey& o) const {
            if (cls != o.cls) return cls < o.cls;
            if (first != o.first) return first < o.first;
            if (time != o.time) return time < o.time;
            if (tie != o.tie) return tie < o.tie;
            return second < o.second;
        }
    };
    // The fair walk's cursor into one flow's waiting requests: where it is, and the
    // flow's normalised usage plus what the requests before it would add.
    struct kvadmit_FlowCursor {
        std::map<kvadmit_QKey, int32_t>::iterator it, end;
        double tag, weight;
    };
    """
    cdef cppclass QKey "kvadmit_QKey":
        int64_t cls
        int64_t first
        double time
        double tie
        int64_t second
        bint operator<(const QKey&)
    cdef cppclass FlowCursor "kvadmit_FlowCursor":
        cmap[QKey, int32_t].iterator it
        cmap[QKey, int32_t].iterator end
        double tag
        double weight


cdef inline int rank_cmp(const QKey& a, const QKey& b) noexcept nogil:
    """-1, 0 or 1: a's importance key (its class, then its order key) before, equal
    to or after b's; arrival and tie-breaks left out (the fair walk orders equal
    keys by its tags)."""
    if a.cls != b.cls:
        return -1 if a.cls < b.cls else 1
    if a.first != b.first:
        return -1 if a.first < b.first else 1
    return 0

cdef class Judge:
    """What a scan asks of each waiting request it reaches: one of D_* (the core's
    decision: the agent window, the blocks, the policy, the SLO guard)."""
    cdef int c_decide(self, int32_t s, int64_t free_blocks, bint check_blocks) noexcept nogil
    cdef bint c_may_displace(self, int32_t s) noexcept nogil


cdef class WaitingQueue:
    cdef Ledger ledger
    cdef AgentWindow agent_window
    cdef bint _priority_order, _deadline_order, _bypass
    cdef bint _resume_first       # shortfall "cost": a preempted request is passed by none
    cdef int64_t _max_bypass, _lookahead
    cdef double _max_wait_s       # max_queue_delay_s: a request that waited it is passed by none
    cdef bint _learn_wait         # head_of_line auto: the wait bound is learned from waits
    cdef double _wait_mean        # mean queue wait of recent first admissions (WAIT_WINDOW)
    cdef int64_t _waits           # first admissions noted
    cdef cmap[QKey, int32_t] _waiting
    cdef cmap[QKey, int32_t] _shed_order   # never-admitted waiting, by (priority, arrival)
    cdef cmap[QKey, int32_t] _expiry       # never-admitted waiting with a TTL, by expiry time
    cdef int64_t _held[N_DECISIONS]        # (request, step) pairs held at the queue head
    cdef bint _saturated                   # the latest scan held a request that is not sheddable
    cdef int64_t _n_sheddable              # sheddable requests waiting
    # flows (kvadmit._flows): once on, each flow's waiting requests in queue order too;
    # while two or more flows wait, the queue's order is the fair walk over them
    cdef FlowTable flows
    cdef bint _fair
    cdef cmap[int32_t, cmap[QKey, int32_t]] _by_flow
    cdef vector[FlowCursor] _cursors

    cdef inline int64_t c_size(self) noexcept nogil:
        return self._waiting.size()

    cdef inline bint c_empty(self) noexcept nogil:
        return self._waiting.empty()

    cdef inline bint c_saturated(self) noexcept nogil:
        """Whether the latest scan held a request that is not sheddable: the pool is
        saturated for it, and sheddable work gives way (queue, arrivals). Not once no
        request that is not sheddable waits: the held one has started or left, whether
        or not the engine scanned since (vLLM does not look at an empty queue)."""
        return self._saturated and <int64_t>self._waiting.size() > self._n_sheddable

    cdef inline bint _agent_held(self, int32_t s) noexcept nogil:
        return self.agent_window.c_holds(self.ledger.session(s))

    cdef inline QKey c_order_key(self, bint sheddable, int64_t priority, double arrive_t,
                                 double ttft, double engine_t, double engine_tie,
                                 int64_t arrival) noexcept nogil:
        """The queue's key of a request with these numbers (see QKey)."""
        cdef QKey k
        k.cls = sheddable
        k.first = priority if self._priority_order else 0
        if self._deadline_order:   # microseconds; no target: an hour after arrival
            k.first = <int64_t>((arrive_t + (ttft if ttft > 0 else 3600.0)) * 1e6)
        k.time = engine_t if self._priority_order else 0.0
        k.tie = engine_tie if self._priority_order else 0.0
        k.second = arrival
        return k

    cdef inline QKey c_key(self, int32_t s) noexcept nogil:
        return self.c_order_key(self.ledger.sheddable(s), self.ledger.priority(s), self.ledger.arrive_t(s), self.ledger.ttft(s),
                                self.ledger.engine_t(s), self.ledger.engine_tie(s), self.ledger.arrival(s))

    cdef inline QKey _expiry_key(self, int32_t s) noexcept nogil:
        cdef QKey k
        k.cls = k.first = 0
        k.time = self.ledger.expire_at(s)
        k.tie = 0.0
        k.second = self.ledger.arrival(s)
        return k

    cdef inline double c_next_expiry(self) noexcept nogil:
        """When the next never-started request's TTL runs out (INFINITY: none has one)."""
        return deref(self._expiry.begin()).first.time if not self._expiry.empty() else INFINITY

    cdef inline QKey _shed_key(self, int32_t s) noexcept nogil:
        """Shedding's order: the least important (sheddable, then the largest priority
        value) evicted first."""
        cdef QKey k
        k.cls = self.ledger.sheddable(s)
        k.first = self.ledger.priority(s)
        k.time = self.ledger.engine_t(s) if self._priority_order else 0.0
        k.tie = self.ledger.engine_tie(s) if self._priority_order else 0.0
        k.second = self.ledger.arrival(s)
        return k

    cdef inline bint _walking(self) noexcept nogil:
        """Whether the order is the fair walk now (two or more flows wait)."""
        return self._fair and self._by_flow.size() > 1

    cdef void c_flows_on(self) noexcept nogil
    cdef void _walk_begin(self) noexcept nogil
    cdef int32_t _walk_next(self) noexcept nogil
    cdef void c_add(self, int32_t s) noexcept nogil
    cdef void c_remove(self, int32_t s) noexcept nogil
    cdef void c_ahead_of(self, QKey key, int64_t* reqs, int64_t* tokens) noexcept nogil
    cdef void c_ahead_of_slot(self, int32_t s, int64_t* reqs, int64_t* tokens) noexcept nogil
    cdef void c_admitted(self, int32_t s, double now) noexcept nogil
    cdef double c_wait_bound(self) noexcept nogil
    cdef bint _waited_out(self, double waited, double bound) noexcept nogil
    cdef int32_t c_scan(self, Judge judge, int64_t free_blocks, bint check_blocks,
                        bint paused, double now) noexcept nogil
    cdef void _count_hold(self, int32_t s, int d) noexcept nogil
    cdef void c_pick_expired(self, double now, vector[int32_t]* picked) noexcept nogil
    cdef bint c_pick_shed(self, int32_t s, bint sheddable_only, int64_t over_reqs,
                          int64_t over_tokens, vector[int32_t]* picked) noexcept nogil
    cdef void c_pick_sheddable(self, vector[int32_t]* picked) noexcept nogil

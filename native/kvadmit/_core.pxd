# The admission core's C-level API (see _core.pyx). The native engine model and
# anything else compiled drive it through the c_* methods and the parts'
# own APIs (ledger, policy, gate, slo_guard, agent_window), as the engine
# adapters drive it through the Python methods.
from libc.stdint cimport int32_t, int64_t
from libcpp.map cimport map as cmap
from libcpp.vector cimport vector

from kvadmit._agent_window cimport AgentWindow
from kvadmit._arrival_gate cimport ArrivalGate, Rejection
from kvadmit._ledger cimport Ledger
from kvadmit._policies cimport Policy
from kvadmit._slo_guard cimport SloGuard

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

cdef extern from *:
    """
    // The waiting queue's key, smallest served first: (order key, the engine's arrival
    // time, its tie-break, arrival seq). The engine's arrival time and tie-break order
    // requests of equal priority under queue_order "priority" (vLLM: arrival_time, then
    // request id); elsewhere they are 0 and the arrival seq decides.
    struct kvadmit_QKey {
        int64_t first; double time; double tie; int64_t second;
        bool operator<(const kvadmit_QKey& o) const {
            if (first != o.first) return first < o.first;
            if (time != o.time) return time < o.time;
            if (tie != o.tie) return tie < o.tie;
            return second < o.second;
        }
    };
    """
    cdef cppclass QKey "kvadmit_QKey":
        int64_t first
        double time
        double tie
        int64_t second
        bint operator<(const QKey&)


cdef class AdmissionCore:
    # engine shape
    cdef readonly int64_t num_blocks
    cdef readonly int64_t block_size
    cdef readonly int64_t max_model_len
    cdef readonly object config
    # settings
    cdef int _victim
    cdef bint _priority_order, _bypass
    cdef int64_t _max_bypass, _lookahead
    # the requests, by slot, and the running set
    cdef readonly Ledger ledger
    # the admission rule (one Policy subclass per policy)
    cdef readonly Policy policy
    # queues
    cdef cmap[QKey, int32_t] _waiting
    cdef cmap[QKey, int32_t] _shed_order   # never-admitted waiting, by (priority, arrival)
    # aggregates
    cdef int64_t _queued_tokens, _seq
    cdef bint _pause_on_shortfall
    cdef int64_t _paused_now, _n_pauses   # running requests paused this step; request-steps in all
    cdef readonly ArrivalGate gate      # caps, refusals, drain rate and Retry-After
    # counters
    cdef int64_t _n_arrived, _n_admitted, _n_preempted, _n_finished, _n_aborted
    cdef int64_t _held[N_DECISIONS]           # (request, step) pairs held at the queue head
    # SLO guard
    cdef readonly SloGuard slo_guard     # TPOT hold, TTFT prediction, the step-time fit
    cdef bint _deadline_order
    # agent window
    cdef readonly AgentWindow agent_window   # sessions, W, idle expiry, the pause log
    cdef double _last_now
    cdef int64_t _n_len_obs
    cdef double _len_abs_err, _len_pred_sum, _len_actual_sum

    cdef inline int64_t c_num_waiting(self) noexcept nogil:
        return self._waiting.size()

    cdef inline bint c_pauses_on_shortfall(self) noexcept nogil:
        """shortfall: "pause" (the engine asks c_plan_shortfall each step)."""
        return self._pause_on_shortfall

    cdef inline double _running_context(self) noexcept nogil
    cdef bint _tpot_ok(self, int32_t s) noexcept nogil
    cdef inline bint _agent_held(self, int32_t s) noexcept nogil
    cdef int _decide(self, int32_t s, int64_t free_blocks, bint check_blocks) noexcept nogil
    cdef int _decide_memory(self, int32_t s, int64_t free_blocks, bint check_blocks) noexcept nogil
    cdef inline QKey _qkey(self, int32_t s) noexcept nogil
    cdef inline QKey _order_key(self, int64_t priority, double arrive_t, double ttft, double engine_t,
                                double engine_tie, int64_t arrival) noexcept nogil
    cdef inline QKey _shed_key(self, int32_t s) noexcept nogil
    cdef void _enqueue(self, int32_t s) noexcept nogil
    cdef void _dequeue(self, int32_t s) noexcept nogil
    cdef void _run_add(self, int32_t s) noexcept nogil
    cdef void _run_remove(self, int32_t s) noexcept nogil
    cdef inline void _tick(self, double now) noexcept nogil
    cdef inline void _note_time(self, double now) noexcept nogil
    cdef inline void _advance(self, double now) noexcept nogil
    cdef inline double _predicted_delay(self, int64_t ahead, int64_t ahead_tokens, int64_t queued,
                                        double now) noexcept nogil
    cdef void _ahead_of(self, QKey key, int64_t* reqs, int64_t* tokens) noexcept nogil
    cdef int32_t _new_request(self, int64_t prompt_tokens, int64_t max_new_tokens, int64_t priority,
                              int64_t cached_tokens, double now, double ttft_slo_s, double tpot_slo_s,
                              int64_t session, double arrival_time, double arrival_tie)
    cdef void _judging(self, int32_t s) noexcept nogil
    cdef Rejection _refusal(self, int32_t s, double now)
    cdef Rejection _make_room(self, int32_t s, double now, list shed)
    cdef bint _shed_for(self, int64_t priority, int64_t over_reqs, int64_t over_tokens,
                        double now, list out)
    cdef int64_t c_plan_shortfall(self, const int64_t* want, const int64_t* computed,
                                  const int64_t* held, int64_t n, int64_t free_blocks,
                                  int64_t budget, int64_t lookahead, char* paused) noexcept nogil
    cdef int32_t c_next_admissible(self, int64_t free_blocks, bint check_blocks) noexcept nogil
    cdef int32_t _scan_queue(self, int64_t free_blocks, bint check_blocks) noexcept nogil
    cdef inline void _count_hold(self, int32_t s, int d) noexcept nogil
    cdef inline bint _waited_out(self, int32_t s) noexcept nogil
    cdef void c_admit(self, int32_t s, double now) noexcept nogil
    cdef vector[int64_t] _batch   # update_many's checked (slot, computed, generated) rows
    cdef int _update(self, int64_t slot, int64_t computed_tokens, int64_t generated_tokens) except -1
    cdef int _check_update(self, int64_t slot, int64_t computed_tokens, int64_t generated_tokens) except -1
    cdef void _apply_update(self, int32_t s, int64_t computed_tokens, int64_t generated_tokens) noexcept nogil
    cdef void c_progress(self, int32_t s, int64_t computed_tokens, int64_t generated_tokens) noexcept nogil
    cdef void c_on_step(self) noexcept nogil
    cdef void c_preempt(self, int32_t s, double now) noexcept nogil
    cdef void _preempt(self, int32_t s) noexcept nogil
    cdef void c_finish(self, int32_t s, double now) noexcept nogil
    cdef void _finish(self, int32_t s) noexcept nogil
    cdef void c_observe_cache(self, int64_t used_blocks, int64_t hit_tokens, int64_t query_tokens,
                               double now) noexcept nogil
    cdef void c_observe_used_blocks(self, int64_t used_blocks) noexcept nogil
    cdef void c_set_shared(self, int32_t s, int64_t shared_tokens) noexcept nogil
    cdef int32_t c_victim(self) noexcept nogil

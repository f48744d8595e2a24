# The arrival gate's C-level API (see _arrival_gate.pyx).
from libc.stdint cimport int64_t, uint64_t
from libcpp.deque cimport deque
from libcpp.pair cimport pair
from libcpp.unordered_map cimport unordered_map

cdef enum:  # indexes into REJECT_REASONS
    R_QUEUE_FULL = 0
    R_QUEUED_TOKENS = 1
    R_CONTEXT = 2
    R_KV_CAPACITY = 3
    R_SHED = 4
    R_QUEUE_DELAY = 5
    R_SLO = 6
    R_INVALID = 7         # malformed request (its engine fields, its numbers)
    R_EXPIRED = 8         # waited past its TTL (ttl_s / max_queue_age_s) without starting
    N_REJECT_REASONS = 9


cdef struct Place:          # one place in the retry line (see ArrivalGate._in_line)
    double at                # the promised retry time (engine clock)
    uint64_t key             # the refused request's signature (ArrivalGate.c_request)
    int64_t claim            # claim order: when it was last handed out (a sequence number)
    int64_t step             # the engine step it was last handed out in


cdef class Rejection:
    cdef readonly str reason
    cdef readonly str message
    cdef readonly str limit      # the config field or engine limit that refused it
    cdef readonly object limit_value
    cdef readonly object retry_after_s


cdef class ArrivalResult:
    cdef readonly bint accepted
    cdef readonly int64_t slot
    cdef readonly Rejection rejection
    cdef readonly list shed


cdef class ArrivalGate:
    cdef readonly int64_t max_queued_requests, max_queued_tokens   # 0: no cap
    cdef readonly bint shed_lower_priority
    cdef readonly double max_queue_delay_s                         # 0: no cap
    cdef readonly double max_queue_age_s       # a request's TTL when it has none (0: none)
    cdef double _retry_default, _retry_max, _drain_window
    # drain rate: admissions against the backlog clock (seconds with requests waiting)
    cdef deque[pair[double, int64_t]] _drain   # (backlog clock, prefill tokens) per admission
    cdef int64_t _drain_tokens                 # sum of the prefill tokens in _drain
    cdef double _t_last, _backlog_s
    cdef bint _seen_time
    cdef bint _backlog                         # a request waits in the core's queue now
    # Retry-After line: the promised retry times still in the future, in time order
    cdef deque[Place] _line
    cdef unordered_map[uint64_t, int64_t] _line_keys   # places in the line per signature
    cdef int64_t _claims                      # places handed out (new or again) so far
    cdef int64_t _step                        # the engine step of the request being judged
    cdef uint64_t _key                        # signature of the request being judged
    cdef int64_t _place                       # the last refusal's place in the line (1-based)
    cdef int64_t _rejected[N_REJECT_REASONS]

    cdef void c_note_time(self, double now) noexcept nogil
    cdef void c_queue_changed(self, bint waiting) noexcept nogil
    cdef void c_admitted(self, int64_t prefill_tokens) noexcept nogil
    cdef void c_request(self, int64_t prompt_tokens, int64_t max_new_tokens, int64_t priority,
                        int64_t session, int64_t prompt_hash, int64_t step) noexcept nogil
    cdef void c_admission_undone(self) noexcept nogil
    cdef double c_predicted_delay(self, int64_t ahead, int64_t ahead_tokens,
                                  int64_t queued) noexcept nogil
    cdef double c_peek_predicted_delay(self, int64_t ahead, int64_t ahead_tokens, int64_t queued,
                                       double now) noexcept nogil
    cdef Rejection c_refuse(self, int code, str message, str limit, object value, object retry)
    cdef Rejection c_refuse_context(self, int64_t prompt_tokens, int64_t max_new_tokens,
                                    int64_t max_model_len)
    cdef Rejection c_refuse_prefill(self, int64_t queued)
    cdef Rejection c_refuse_delay(self, double delay, int64_t waiting, int64_t queued_tokens,
                                  double cap, str limit)
    cdef Rejection c_refuse_slo(self, double predicted, double target, int64_t waiting,
                                int64_t running)
    cdef Rejection c_refuse_full(self, int64_t over_reqs, int64_t over_tokens, int64_t waiting,
                                 int64_t queued_tokens, int64_t queued)
    cdef Rejection c_refuse_flow_full(self, int64_t over_reqs, int64_t over_tokens,
                                      int64_t waiting, int64_t queued_tokens, int64_t queued,
                                      int64_t cap)
    cdef Rejection c_refuse_shed(self, int64_t priority, int64_t victim_priority,
                                 bint sheddable, bint over_reqs)
    cdef Rejection c_refuse_sheddable(self, bint queued)
    cdef Rejection c_refuse_expired(self, double waited_s, double ttl_s, bint own_ttl)
    cdef bint _drain_rates(self, double* reqs_per_s,
                           double* tokens_per_s) noexcept nogil
    cdef bint _rates_as_of(self, double now, double* reqs_per_s,
                           double* tokens_per_s) noexcept nogil
    cdef bint _paced_rates(self, double* reqs_per_s,
                           double* tokens_per_s) noexcept nogil
    cdef object _retry_after(self, double excess_reqs, double excess_tokens)
    cdef double _in_line(self, double wait) noexcept nogil
    cdef double _insert_place(self, double at, double now) noexcept nogil
    cdef void _forget_key(self, uint64_t key) noexcept nogil

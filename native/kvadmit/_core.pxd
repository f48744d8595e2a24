# The admission core's C-level API (see _core.pyx). The native engine model and
# anything else compiled drive it through the c_* methods and the parts'
# own APIs (ledger, queue, shortfall, policy, gate, slo_guard, agent_window), as
# the engine adapters drive it through the Python methods.
from libc.stdint cimport int32_t, int64_t
from libcpp.vector cimport vector

from kvadmit._arrival cimport ArrivalRecord
from kvadmit._arrival_gate cimport ArrivalResult, Rejection
from kvadmit._core_view cimport CoreView


cdef class AdmissionCore(CoreView):
    # The step (step / step_done): what one step leaves for the next
    cdef public bint counts_shared_prefix   # the engine reports shared prefixes (set_shared): each step reports blocks in use
    cdef double _step_start                 # the latest step's start (`step`'s now)
    cdef bint _step_started
    cdef double _shape_tokens, _shape_context   # the step scheduled last (tokens < 0: none to observe)
    cdef double _shape_seconds              # its known time (< 0: measured, the interval to the next start)
    cdef int64_t _hits, _queries            # prefix hits noted since the latest step start
    cdef readonly int64_t observed_steps    # step times given to the step-time fit
    cdef readonly int64_t prefix_hit_tokens, prefix_query_tokens   # every prefix hit noted

    cdef inline int64_t c_num_waiting(self) noexcept nogil:
        return self.queue.c_size()

    cdef inline bint c_pauses_on_shortfall(self) noexcept nogil:
        """shortfall: "pause" (the engine asks c_plan_shortfall each step)."""
        return self.shortfall.enabled

    cdef ArrivalResult c_arrive(self, const ArrivalRecord* r, double now)
    cdef list c_drop_waiting(self, double now)
    cdef inline void _tick(self, double now) noexcept nogil
    cdef void _enqueue(self, int32_t s) noexcept nogil
    cdef void _dequeue(self, int32_t s) noexcept nogil
    cdef void _stopped(self, int32_t s) noexcept nogil
    cdef void _judging(self, int32_t s) noexcept nogil
    cdef Rejection _make_room(self, int32_t s, double now, list shed)
    cdef Rejection _flow_full(self, int32_t s)
    cdef Rejection _of_flow(self, Rejection refused, int32_t f)
    cdef void _out_of_queue(self, int32_t v) noexcept nogil
    cdef tuple _dropped(self, int32_t v, Rejection refused)
    cdef int64_t c_plan_shortfall(self, const int64_t* want, const int64_t* computed,
                                  const int64_t* held, int64_t n, int64_t free_blocks,
                                  int64_t budget, int64_t lookahead, char* paused,
                                  const int64_t* priority=*) noexcept nogil
    cdef int32_t c_next_admissible(self, int64_t free_blocks, bint check_blocks) noexcept nogil
    cdef void c_admit(self, int32_t s, double now) noexcept nogil
    cdef void c_progress(self, int32_t s, int64_t computed_tokens, int64_t generated_tokens) noexcept nogil
    cdef void c_on_step(self, double now) noexcept nogil
    cdef void c_step(self, double now, int64_t used_blocks, const int64_t* rows, int64_t n,
                     bint fresh) noexcept nogil
    cdef void c_step_done(self, double tokens, double context, double now, int64_t hit_tokens,
                          int64_t query_tokens, double seconds) noexcept nogil
    cdef void c_note_prefix_hits(self, int64_t hit_tokens, int64_t query_tokens) noexcept nogil
    cdef void c_engine_idle(self) noexcept nogil
    cdef void c_preempt(self, int32_t s, double now, bint displaced) noexcept nogil
    cdef void c_finish(self, int32_t s, double now) noexcept nogil
    cdef void c_observe_cache(self, int64_t used_blocks, int64_t hit_tokens, int64_t query_tokens,
                               double now) noexcept nogil
    cdef void c_observe_used_blocks(self, int64_t used_blocks) noexcept nogil
    cdef void c_set_shared(self, int32_t s, int64_t shared_tokens) noexcept nogil
    cdef int32_t c_victim(self) noexcept nogil

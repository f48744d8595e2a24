# The SLO guard's C-level API (see _slo_guard.pyx).
from libc.stdint cimport int32_t, int64_t
from libcpp.map cimport map as cmap

from kvadmit._step_time cimport StepTimeFit


cdef class SloGuard:
    cdef readonly bint enabled
    cdef readonly StepTimeFit step_time
    cdef double _default_ttft_s, _default_tpot_s
    cdef int64_t _step_budget                   # the engine's tokens a step (0: unknown)
    cdef double _ema_step_tokens                # recent tokens a step
    cdef cmap[double, int32_t] _tpot_running     # TPOT targets of running requests (multiset)

    cdef inline double c_ttft_target(self, double asked) noexcept nogil:
        """A request's TTFT target: its own (>= 0; 0 is none) or the config's default."""
        return asked if asked >= 0 else self._default_ttft_s

    cdef inline double c_tpot_target(self, double asked) noexcept nogil:
        return asked if asked >= 0 else self._default_tpot_s

    cdef void c_started(self, double tpot) noexcept nogil
    cdef void c_stopped(self, double tpot) noexcept nogil
    cdef bint c_tpot_ok(self, double tpot, double running, double context) noexcept nogil
    cdef double c_predict_ttft(self, int64_t ahead_tokens, int64_t queued, double drain,
                               double running, double context) noexcept nogil
    cdef void c_set_step_budget(self, int64_t tokens) noexcept nogil
    cdef void c_observe_step(self, double tokens, double context, double seconds) noexcept nogil
    cdef double _prefill_time(self, double q, double r, double ctx) noexcept nogil

# The step-time model's C-level API (see _step_time.pyx).
from libc.stdint cimport int64_t


cdef class StepTimeFit:
    cdef double _theta[3]
    cdef double _p[3][3]
    cdef readonly double forgetting
    cdef double _p_max
    cdef readonly int64_t observations

    cdef double c_predict(self, double tokens, double context) noexcept nogil
    cdef void c_observe(self, double tokens, double context, double seconds) noexcept nogil

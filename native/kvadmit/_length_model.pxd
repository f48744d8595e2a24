# The output-length model's C-level API (see _length_model.pyx), and the
# adaptive policy's quantile controller.
from libc.stdint cimport int32_t, int64_t
from libcpp.vector cimport vector


cdef class OutputLengthModel:
    # per lane (lane 0: every length observed in it; see _length_model.pyx)
    cdef vector[vector[int32_t]] _fenwick
    cdef vector[vector[int32_t]] _ring
    cdef vector[int64_t] _ring_pos
    cdef vector[int64_t] _count
    cdef int64_t _window
    cdef int64_t _lane_window
    cdef int64_t _bucket
    cdef int64_t _nbuckets
    cdef int64_t _min_samples

    cdef inline int64_t c_window(self) noexcept nogil:
        """How many recent finished lengths lane 0 keeps."""
        return self._window

    cdef void _open(self, int32_t lane) noexcept nogil
    cdef void c_observe(self, int64_t length, int32_t lane=*) noexcept nogil
    cdef int64_t c_samples(self, int32_t lane=*) noexcept nogil
    cdef int64_t c_predict_remaining(self, int64_t generated, int64_t max_new,
                                     double quantile, int32_t lane=*) noexcept nogil
    cdef double c_survival(self, int64_t generated, int32_t lane=*) noexcept nogil
    cdef inline int64_t _bucket_of(self, int64_t length) noexcept nogil
    cdef inline void _add(self, int32_t lane, int64_t j, int32_t d) noexcept nogil
    cdef inline int64_t _count_upto(self, int32_t lane, int64_t j) noexcept nogil
    cdef inline int64_t _first_bucket_reaching(self, int32_t lane, int64_t target) noexcept nogil


cdef inline double c_next_quantile(double q, double base, double q_max, int64_t preemptions,
                                   int64_t admissions, double target_rate) noexcept nogil:
    if admissions <= 0:
        return q
    if <double>preemptions > target_rate * admissions:
        return q + (q_max - q) / 2.0
    if preemptions == 0 and q > base:
        q -= (q - base) / 4.0
        return base if q < base + 1e-9 else q
    return q

# The peak rule's C-level API (see _curves.pyx for the model): a request's KV
# curve and the exact peak of a set of curves.
from libc.stdint cimport int32_t, int64_t
from libcpp.vector cimport vector


cdef struct Curve:
    int64_t steps    # decode steps left, >= 1
    int64_t tokens   # tokens held at the next step


cdef inline int64_t cdiv(int64_t a, int64_t b) noexcept nogil:
    return (a + b - 1) // b


cdef inline bint curve_longer(const Curve& a, const Curve& b) noexcept nogil:
    """Sort order of a profile: most steps left first."""
    return a.steps > b.steps


cdef int64_t peak_blocks_sorted(const Curve* curves, int64_t n, const Curve* extra,
                                int64_t B, int64_t limit, vector[int32_t]& fen) noexcept nogil
cdef int64_t first_over_sorted(const Curve* curves, int64_t n, const Curve* extra, int64_t B,
                               int64_t limit, vector[int32_t]& fen) noexcept nogil

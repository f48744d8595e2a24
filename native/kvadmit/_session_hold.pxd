# Session holds' C-level API (see _session_hold.pyx). Sessions are the engine's
# session ids (-1: none; every call ignores it).
from libc.stdint cimport int64_t
from libcpp.pair cimport pair
from libcpp.queue cimport priority_queue
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector


cdef class SessionHold:
    cdef unordered_map[int64_t, int64_t] _pending   # session -> its pending hold's number
    cdef priority_queue[pair[double, pair[int64_t, int64_t]]] _due   # (-due, (session, number))
    cdef int64_t _numbered
    cdef readonly int64_t released, expired, came_back

    cdef bint c_finished(self, int64_t session, double now, double hold_s) noexcept nogil
    cdef void c_returned(self, int64_t session) noexcept nogil
    cdef void c_take_due(self, double now, vector[int64_t]& release) noexcept nogil
    cdef bint _live(self, pair[int64_t, int64_t] entry) noexcept nogil
    cdef void _compact(self) noexcept nogil

# The free-block queue's C-level API (see _free_queue.pyx). The O(1) link
# operations are inline here so the allocator's per-block loops call them
# directly, not through the vtable.
from libc.stdint cimport int32_t, int64_t
from cpython.long cimport PyLong_AsLongLong, PyLong_CheckExact
from cpython.object cimport PyObject, Py_TYPE
from libcpp.vector cimport vector


cdef class FreeBlockQueue:
    cdef vector[int32_t] _prev
    cdef vector[int32_t] _next
    cdef int32_t _n
    cdef int32_t _head
    cdef int32_t _tail
    cdef int64_t _count

    cdef inline int64_t c_len(self) noexcept nogil:
        """Blocks in the queue."""
        return self._count

    cdef inline int32_t c_num_blocks(self) noexcept nogil:
        """Block ids are 0 .. c_num_blocks() - 1."""
        return self._n

    cdef inline bint c_contains(self, int32_t b) noexcept nogil:
        return 0 <= b < self._n and self._prev[b] != -1

    cdef inline void _link_before(self, int32_t at, int32_t b) noexcept nogil:
        cdef int32_t p = self._prev[at]
        self._next[p] = b
        self._prev[b] = p
        self._next[b] = at
        self._prev[at] = b
        self._count += 1

    cdef inline void _unlink(self, int32_t b) noexcept nogil:
        cdef int32_t p = self._prev[b]
        cdef int32_t nx = self._next[b]
        self._next[p] = nx
        self._prev[nx] = p
        self._prev[b] = -1
        self._next[b] = -1
        self._count -= 1

    cdef inline int32_t c_popleft(self) noexcept nogil:
        """The head's id, unlinked; -1 when empty."""
        cdef int32_t b = self._next[self._head]
        if b == self._tail:
            return -1
        self._unlink(b)
        return b

    cdef inline int32_t c_pop_tail(self) noexcept nogil:
        """The tail's id, unlinked (undoes the last c_append); -1 when empty."""
        cdef int32_t b = self._prev[self._tail]
        if b == self._head:
            return -1
        self._unlink(b)
        return b

    cdef inline int c_remove(self, int32_t b) noexcept nogil:
        if not self.c_contains(b):
            return -1
        self._unlink(b)
        return 0

    cdef inline int c_append(self, int32_t b) noexcept nogil:
        if b < 0 or b >= self._n or self._prev[b] != -1:
            return -1
        self._link_before(self._tail, b)
        return 0

    cdef inline int c_prepend(self, int32_t b) noexcept nogil:
        if b < 0 or b >= self._n or self._prev[b] != -1:
            return -1
        self._link_before(self._next[self._head], b)
        return 0

    cdef int _check_append(self, int64_t b) except -1


cdef class BlockObjectQueue:
    cdef FreeBlockQueue _q
    cdef list _blocks
    # Fast path for __slots__ blocks (vLLM's KVCacheBlock is a slots dataclass):
    # read block_id at its slot offset instead of a full attribute lookup.
    cdef PyObject* _slot_type
    cdef Py_ssize_t _id_offset

    cdef inline int64_t _id(self, object block) except? -9:
        cdef PyObject* v
        if <PyObject*>Py_TYPE(block) == self._slot_type:
            v = (<PyObject**>((<char*><PyObject*>block) + self._id_offset))[0]
            if v != NULL and PyLong_CheckExact(<object>v):
                return PyLong_AsLongLong(<object>v)
        return block.block_id


# Free-block queue: an intrusive doubly linked list over block ids.
#
# Links live in two int32 arrays indexed by block id, with two sentinels
# (HEAD = n, TAIL = n + 1), so every operation is O(1) per block, allocates
# nothing and touches no Python object. The order is the eviction order:
# the head is popped first (least recently freed), freed blocks go to the tail.
#
# FreeBlockQueue works on ints. BlockObjectQueue wraps it with the operations
# and error behaviour of vLLM's FreeKVCacheBlockQueue, for objects that carry a
# `block_id`, so vLLM's BlockPool can use it as its `free_block_queue`.

from cpython.object cimport PyObject
from libc.stdint cimport int32_t, int64_t
from libcpp.vector cimport vector

cdef class FreeBlockQueue:
    """Queue of free block ids 0..num_blocks-1 with O(1) removal anywhere.

    Initially holds every block in id order (or none, with ``fill=False``).
    """

    def __cinit__(self, int64_t num_blocks, bint fill=True):
        if num_blocks < 0 or num_blocks > 2_000_000_000:
            raise ValueError(f"num_blocks={num_blocks}: must be in [0, 2000000000]")
        self._n = <int32_t>num_blocks
        self._head = self._n
        self._tail = self._n + 1
        # -1 in _prev marks "not in the queue".
        self._prev.assign(self._n + 2, -1)
        self._next.assign(self._n + 2, -1)
        self._prev[self._head] = self._head
        self._next[self._head] = self._tail
        self._prev[self._tail] = self._head
        self._next[self._tail] = self._tail
        self._count = 0
        cdef int32_t b
        if fill:
            for b in range(self._n):
                self._link_before(self._tail, b)

    cdef int _check_append(self, int64_t b) except -1:
        if b < 0 or b >= self._n:
            raise ValueError(f"block id {b} out of range [0, {self._n})")
        if self._prev[b] != -1:
            raise ValueError(f"block {b} is already in the free queue (double free)")
        return 0

    # --- Python API (same names as vLLM's FreeKVCacheBlockQueue) ---------
    @property
    def num_free_blocks(self):
        return self._count

    @property
    def num_blocks(self):
        return self._n

    def __len__(self):
        return self._count

    def __contains__(self, int64_t b):
        return self.c_contains(<int32_t>b) if 0 <= b < self._n else False

    def popleft(self):
        cdef int32_t b = self.c_popleft()
        if b < 0:
            raise ValueError("No free blocks available")
        return b

    def popleft_n(self, int64_t n):
        if n < 0 or n > self._count:
            raise ValueError(f"popleft_n({n}): only {self._count} free blocks")
        cdef list out = []
        cdef int64_t i
        for i in range(n):
            out.append(self.c_popleft())
        return out

    def remove(self, int64_t b):
        if b < 0 or b >= self._n or self.c_remove(<int32_t>b) != 0:
            raise RuntimeError(f"remove() called on block {b}, which is not in the free queue")

    def append(self, int64_t b):
        self._check_append(b)
        self.c_append(<int32_t>b)

    def append_n(self, blocks):
        """Append blocks at the tail in order. A refused call links nothing: the
        blocks appended before a bad one are taken back off the tail."""
        cdef int64_t b
        cdef Py_ssize_t appended = 0
        try:
            for b in blocks:
                self._check_append(b)
                self.c_append(<int32_t>b)
                appended += 1
        except BaseException:
            while appended > 0:
                self.c_pop_tail()
                appended -= 1
            raise

    def prepend_n(self, blocks):
        """Put blocks at the head, keeping their order (blocks[0] pops first)."""
        cdef list ids = list(blocks)
        cdef int64_t b
        cdef Py_ssize_t i
        for b in ids:
            self._check_append(b)
        if len(set(ids)) != len(ids):      # checked first: a refused call links nothing
            b = next(x for i, x in enumerate(ids) if x in ids[:i])
            raise ValueError(f"block {b} listed twice in prepend_n")
        for i in range(len(ids) - 1, -1, -1):
            self.c_prepend(<int32_t>ids[i])

    def get_all_free_blocks(self):
        cdef list out = []
        cdef int32_t b = self._next[self._head]
        while b != self._tail:
            out.append(b)
            b = self._next[b]
        return out

    def iter_blocks_after(self, int64_t b=-1):
        """Free block ids after block b, in eviction order (from the head when b
        is -1; nothing when b is not free, as in vLLM)."""
        cdef int32_t cur
        if b == -1:
            cur = self._next[self._head]
        elif b < 0 or b >= self._n or self._prev[b] == -1:
            return
        else:
            cur = self._next[b]
        while cur != self._tail:
            yield cur
            cur = self._next[cur]

    def check_invariants(self):
        """Walks the list both ways; raises AssertionError on any broken link."""
        cdef int64_t seen = 0
        cdef int32_t b = self._next[self._head]
        cdef int32_t prev = self._head
        cdef vector[char] mark
        mark.assign(self._n, 0)
        while b != self._tail:
            assert 0 <= b < self._n, f"bad block id {b} in the free list"
            assert not mark[b], f"block {b} is in the free list twice"
            assert self._prev[b] == prev, f"block {b}: prev link broken"
            mark[b] = 1
            seen += 1
            prev = b
            b = self._next[b]
            assert seen <= self._n, "cycle in the free list"
        assert self._prev[self._tail] == prev, "tail link broken"
        assert seen == self._count, f"count {self._count} != {seen} linked blocks"
        for b in range(self._n):
            assert (self._prev[b] != -1) == bool(mark[b]), f"block {b}: stale link"


cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member

cdef enum:
    T_OBJECT_EX = 16  # structmember.h: a __slots__ attribute


cdef class BlockObjectQueue:
    """vLLM ``FreeKVCacheBlockQueue`` drop-in: the same methods over block objects.

    ``blocks`` is the pool's list of all blocks, ``blocks[i].block_id == i``;
    all start free, in id order, as in vLLM. The links live in a native
    FreeBlockQueue; objects are looked up by id only at the boundary.
    """
    def __init__(self, list blocks):
        cdef Py_ssize_t i
        for i in range(len(blocks)):
            if blocks[i].block_id != i:
                raise ValueError(
                    f"blocks[{i}].block_id is {blocks[i].block_id}: must equal its index")
        self._blocks = blocks
        self._q = FreeBlockQueue(len(blocks))
        self._slot_type = NULL
        self._id_offset = -1
        if blocks:
            cls = type(blocks[0])
            descr = next((k.__dict__["block_id"] for k in cls.__mro__ if "block_id" in k.__dict__), None)
            if (type(descr).__name__ == "member_descriptor"
                    and (<PyMemberDescrObject*>descr).d_member.type == T_OBJECT_EX
                    and all(type(b) is cls for b in blocks)):
                self._slot_type = <PyObject*>cls
                self._id_offset = (<PyMemberDescrObject*>descr).d_member.offset

    @property
    def num_free_blocks(self):
        return self._q.c_len()

    @property
    def native(self):
        """The underlying FreeBlockQueue of ids."""
        return self._q

    def popleft(self):
        cdef int32_t b = self._q.c_popleft()
        if b < 0:
            raise ValueError("No free blocks available")
        return self._blocks[b]

    def popleft_n(self, Py_ssize_t n):
        if n < 0 or n > self._q.c_len():
            raise ValueError(f"popleft_n({n}): only {self._q.c_len()} free blocks")
        cdef list out = [None] * n
        cdef Py_ssize_t i
        for i in range(n):
            out[i] = self._blocks[self._q.c_popleft()]
        return out

    def remove(self, block):
        cdef int64_t b = self._id(block)
        if b < 0 or b >= self._q.c_num_blocks() or self._q.c_remove(<int32_t>b) != 0:
            raise RuntimeError(f"remove() called on an invalid block: {block}")

    def append(self, block):
        cdef int64_t b = self._id(block)
        if b < 0 or b >= self._q.c_num_blocks() or self._q.c_append(<int32_t>b) != 0:
            raise RuntimeError(f"append() called on a block already free or unknown: {block}")

    def append_n(self, blocks):
        """A refused call links nothing: the blocks appended before a bad one are
        taken back off the tail."""
        cdef int64_t b
        cdef list seq = blocks if type(blocks) is list else list(blocks)
        cdef Py_ssize_t i, appended = 0
        try:
            for i in range(len(seq)):
                b = self._id(seq[i])
                if b < 0 or b >= self._q.c_num_blocks() or self._q.c_append(<int32_t>b) != 0:
                    raise RuntimeError(f"append_n() called on a block already free or unknown: {seq[i]}")
                appended += 1
        except BaseException:
            while appended > 0:
                self._q.c_pop_tail()
                appended -= 1
            raise

    def prepend_n(self, blocks):
        self._q.prepend_n([block.block_id for block in blocks])

    def get_all_free_blocks(self):
        cdef list blocks = self._blocks
        return [blocks[b] for b in self._q.get_all_free_blocks()]

    def iter_blocks_after(self, cursor):
        cdef list blocks = self._blocks
        for b in self._q.iter_blocks_after(-1 if cursor is None else cursor.block_id):
            yield blocks[b]

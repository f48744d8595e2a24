# The KV block allocator's C-level API (see _allocator.pyx): what the native
# engine model and benchmarks call per block, without Python objects.
from cython.operator cimport dereference as deref
from libc.stdint cimport int32_t, int64_t, uint64_t
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

from kvadmit._free_queue cimport FreeBlockQueue


cdef class BlockAllocator:
    cdef FreeBlockQueue _free
    cdef vector[int32_t] _ref
    cdef vector[uint64_t] _hash
    cdef vector[char] _has_hash
    cdef unordered_map[uint64_t, int32_t] _cached      # hash -> its earliest cached block
    cdef unordered_map[uint64_t, vector[int32_t]] _dups  # hash -> later blocks, in caching order
    cdef int32_t _n
    cdef int64_t _num_cached_free
    cdef int64_t _num_hashed                            # blocks holding a hash

    cdef inline int64_t c_num_free(self) noexcept nogil:
        """Blocks with no owner (cached-free ones included)."""
        return self._free.c_len()

    cdef inline int32_t c_ref_count(self, int32_t b) noexcept nogil:
        """Owners of block b (0: free); b must be a valid id."""
        return self._ref[b]

    cdef inline bint c_held_hash(self, int32_t b, uint64_t* h) noexcept nogil:
        """Whether block b holds a prefix hash (then written to h)."""
        if not self._has_hash[b]:
            return False
        h[0] = self._hash[b]
        return True

    cdef inline int32_t c_lookup(self, uint64_t h) noexcept nogil:
        """The block a lookup of hash h answers, or -1."""
        cdef unordered_map[uint64_t, int32_t].iterator it = self._cached.find(h)
        if it == self._cached.end():
            return -1
        return deref(it).second

    cdef int c_allocate(self, int64_t n, int32_t* out) noexcept nogil
    cdef int c_free(self, const int32_t* ids, int64_t n) noexcept nogil
    cdef int c_share(self, int32_t b) noexcept nogil
    cdef int32_t c_cache(self, int32_t b, uint64_t h) noexcept nogil
    cdef bint c_demote(self, int32_t b, uint64_t h) noexcept nogil
    cdef int64_t c_prefix_hits(self, const uint64_t* hashes, int64_t n) noexcept nogil
    cdef void _unmap(self, int32_t b) noexcept nogil
    cdef inline void _evict(self, int32_t b) noexcept nogil
    cdef bint _is_duplicate(self, int32_t b)

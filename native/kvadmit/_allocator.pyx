# KV block allocator with reference counts and a prefix cache.
#
# A block is either used (ref_cnt > 0) or in the free queue (ref_cnt == 0).
# A free block may still hold a prefix hash ("cached-free"): it can be taken
# back by a request with the same prefix until an allocation evicts it. Free
# blocks without a hash go to the head of the queue so they are reused before
# cached ones; cached blocks go to the tail, so eviction is LRU.
#
# Hashes are chained by the caller (block i's hash covers blocks 0..i), so a
# prefix hit is the longest run of leading hashes found in the cache.
#
# As vLLM's BlockHashToBlockMap, the cache does not de-duplicate: a block that
# fills with content another block already holds (two requests computing the
# same prefix, or a short prompt's decode reaching a shared prefix) holds the
# hash too, is freed to the tail and evicted on its own; a lookup answers the
# earliest cached block still holding the hash.

from cython.operator cimport dereference as deref
from libc.stdint cimport int32_t, int64_t, uint64_t
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

from kvadmit._free_queue cimport FreeBlockQueue

cdef class BlockAllocator:
    """Fixed pool of ``num_blocks`` KV blocks: allocate/free/share/cache, O(1) a block."""

    def __cinit__(self, int64_t num_blocks):
        if num_blocks < 1 or num_blocks > 2_000_000_000:
            raise ValueError(f"num_blocks={num_blocks}: must be in [1, 2000000000]")
        self._n = <int32_t>num_blocks
        self._free = FreeBlockQueue(num_blocks)
        self._ref.assign(self._n, 0)
        self._hash.assign(self._n, 0)
        self._has_hash.assign(self._n, 0)
        self._num_cached_free = 0
        self._num_hashed = 0

    # --- C-level operations ---------------------------------------------
    cdef void _unmap(self, int32_t b) noexcept nogil:
        """Takes b out of the cache: the next block with its hash (if any) answers
        lookups (vLLM's BlockHashToBlockMap.pop)."""
        cdef uint64_t h = self._hash[b]
        cdef unordered_map[uint64_t, vector[int32_t]].iterator it = self._dups.find(h)
        cdef vector[int32_t]* later
        cdef size_t i
        if it == self._dups.end():
            self._cached.erase(h)
            return
        later = &deref(it).second
        if self._cached[h] == b:
            self._cached[h] = deref(later)[0]
            later.erase(later.begin())
        else:
            for i in range(later.size()):
                if deref(later)[i] == b:
                    later.erase(later.begin() + i)
                    break
        if later.empty():
            self._dups.erase(it)

    cdef inline void _evict(self, int32_t b) noexcept nogil:
        """Drops b's hash (b is leaving the free queue for a new owner)."""
        if self._has_hash[b]:
            self._unmap(b)
            self._has_hash[b] = 0
            self._num_hashed -= 1
            self._num_cached_free -= 1

    cdef int c_allocate(self, int64_t n, int32_t* out) noexcept nogil:
        """Takes n blocks into out[0..n); -1 (nothing taken) if fewer are free."""
        if n < 0 or n > self._free.c_len():
            return -1
        cdef int64_t i
        cdef int32_t b
        for i in range(n):
            b = self._free.c_popleft()
            self._evict(b)
            self._ref[b] = 1
            out[i] = b
        return 0

    cdef int c_free(self, const int32_t* ids, int64_t n) noexcept nogil:
        """Drops one reference from each block; -1 at the first invalid id."""
        cdef int64_t i
        cdef int32_t b
        for i in range(n):
            b = ids[i]
            if b < 0 or b >= self._n or self._ref[b] <= 0:
                return -1
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._has_hash[b]:
                    self._free.c_append(b)
                    self._num_cached_free += 1
                else:
                    self._free.c_prepend(b)
        return 0

    cdef int c_share(self, int32_t b) noexcept nogil:
        """Adds a reference; a cached-free block leaves the free queue."""
        if b < 0 or b >= self._n:
            return -1
        if self._ref[b] == 0:
            if not self._has_hash[b]:
                return -1  # a free block without content has nothing to share
            self._free.c_remove(b)
            self._num_cached_free -= 1
        self._ref[b] += 1
        return 0

    cdef int32_t c_cache(self, int32_t b, uint64_t h) noexcept nogil:
        """`cache` unchecked: b (used) now holds hash h; returns the block a lookup
        of h answers (b, or an earlier block with the same content)."""
        if self._has_hash[b]:
            return self.c_lookup(self._hash[b])
        cdef int32_t existing = self.c_lookup(h)
        self._hash[b] = h
        self._has_hash[b] = 1
        self._num_hashed += 1
        if existing >= 0:
            self._dups[h].push_back(b)
            return existing
        self._cached[h] = b
        return b

    cdef bint c_demote(self, int32_t b, uint64_t h) noexcept nogil:
        """A cached-free block still holding hash h moves to the head of the free
        queue: still reusable, but taken (evicted) next (a paused agent's prefix).
        False if b was reused meanwhile."""
        if b < 0 or b >= self._n or self._ref[b] != 0 or not self._has_hash[b] or self._hash[b] != h:
            return False
        self._free.c_remove(b)
        self._free.c_prepend(b)
        return True

    cdef int64_t c_prefix_hits(self, const uint64_t* hashes, int64_t n) noexcept nogil:
        cdef int64_t i
        for i in range(n):
            if self.c_lookup(hashes[i]) < 0:
                return i
        return n

    # --- Python API -------------------------------------------------------
    @property
    def num_blocks(self):
        return self._n

    @property
    def num_free(self):
        """Blocks with no owner (includes cached-free ones)."""
        return self._free.c_len()

    @property
    def num_cached_free(self):
        """Free blocks that still hold a prefix hash."""
        return self._num_cached_free

    @property
    def num_used(self):
        return self._n - self._free.c_len()

    @property
    def num_cached(self):
        """Blocks holding a prefix hash, used or free."""
        return self._num_hashed

    def can_allocate(self, int64_t n):
        return 0 <= n <= self._free.c_len()

    def allocate(self, int64_t n):
        """Takes n blocks (ref_cnt 1 each) and returns their ids."""
        if n < 0:
            raise ValueError(f"allocate(n={n}): n must be >= 0")
        if n > self._free.c_len():
            raise ValueError(f"allocate(n={n}): only {self._free.c_len()} blocks free")
        cdef vector[int32_t] out
        out.resize(n)
        self.c_allocate(n, out.data())
        return [b for b in out]

    def free(self, ids):
        """Drops one reference from each block. Pass a request's blocks tail
        first: among cached blocks freed together, the first is evicted first."""
        cdef vector[int32_t] v
        cdef int64_t b
        for b in ids:
            if b < 0 or b >= self._n:
                raise ValueError(f"free: block id {b} out of range [0, {self._n})")
            v.push_back(<int32_t>b)
        cdef Py_ssize_t i
        # Validate the whole batch first so a bad id leaves nothing half-freed.
        cdef unordered_map[int32_t, int32_t] drops
        for i in range(<Py_ssize_t>v.size()):
            drops[v[i]] += 1
            if drops[v[i]] > self._ref[v[i]]:
                raise ValueError(
                    f"free: block {v[i]} has ref_cnt {self._ref[v[i]]}, freed more often (double free)")
        self.c_free(v.data(), v.size())

    def share(self, ids):
        """Adds a reference to each block (a prefix hit taking cached blocks)."""
        cdef int64_t b
        ids = list(ids)          # checked, then shared: an iterator would be spent by the check
        for b in ids:
            if b < 0 or b >= self._n:
                raise ValueError(f"share: block id {b} out of range [0, {self._n})")
            if self._ref[b] == 0 and not self._has_hash[b]:
                raise ValueError(f"share: block {b} is free and holds no prefix")
        for b in ids:
            self.c_share(<int32_t>b)

    def cache(self, int64_t block, uint64_t block_hash):
        """Records that a used block holds the prefix with this chained hash.

        Returns the block a lookup of the hash now answers: ``block``, or an
        older block with the same content (``block`` then holds the hash too and
        is evicted on its own, as in vLLM)."""
        if block < 0 or block >= self._n:
            raise ValueError(f"cache: block id {block} out of range [0, {self._n})")
        if self._ref[block] <= 0:
            raise ValueError(f"cache: block {block} is free; only a used block can be cached")
        if self._has_hash[block]:
            if self._hash[block] == block_hash:
                return block
            raise ValueError(f"cache: block {block} already holds another hash")
        return self.c_cache(<int32_t>block, block_hash)

    def demote(self, int64_t block, uint64_t block_hash):
        """Moves a cached-free block still holding `block_hash` to the head of the
        free queue (taken next); False if it was reused meanwhile."""
        if block < 0 or block >= self._n:
            raise ValueError(f"demote: block id {block} out of range [0, {self._n})")
        return self.c_demote(<int32_t>block, block_hash)

    def lookup(self, uint64_t block_hash):
        """Block id cached under this hash, or -1."""
        return self.c_lookup(block_hash)

    def prefix_hits(self, hashes):
        """Length of the longest run of leading hashes that are cached."""
        cdef vector[uint64_t] v = hashes
        return self.c_prefix_hits(v.data(), v.size())

    def acquire_prefix(self, hashes):
        """Shares the cached blocks of the longest cached prefix; returns their ids."""
        cdef vector[uint64_t] v = hashes
        cdef int64_t k = self.c_prefix_hits(v.data(), v.size())
        cdef list out = []
        cdef int64_t i
        cdef int32_t b
        for i in range(k):
            b = self.c_lookup(v[i])
            self.c_share(b)
            out.append(b)
        return out

    def ref_count(self, int64_t block):
        if block < 0 or block >= self._n:
            raise ValueError(f"block id {block} out of range [0, {self._n})")
        return self._ref[block]

    def free_order(self):
        """Free block ids in eviction order (next to be taken first)."""
        return self._free.get_all_free_blocks()

    cdef bint _is_duplicate(self, int32_t b):
        cdef unordered_map[uint64_t, vector[int32_t]].iterator it = self._dups.find(self._hash[b])
        if it == self._dups.end():
            return False
        for x in deref(it).second:
            if x == b:
                return True
        return False

    def check_invariants(self):
        """Raises AssertionError if any allocator invariant is broken."""
        self._free.check_invariants()
        cdef int32_t b
        cdef int64_t cached_free = 0, with_hash = 0
        for b in range(self._n):
            assert self._ref[b] >= 0, f"block {b}: negative ref_cnt"
            assert (self._ref[b] == 0) == self._free.c_contains(b), \
                f"block {b}: ref_cnt {self._ref[b]} but in_free_queue={self._free.c_contains(b)}"
            if self._has_hash[b]:
                with_hash += 1
                assert self.c_lookup(self._hash[b]) == b or self._is_duplicate(b), \
                    f"block {b}: hash not mapped back"
                if self._ref[b] == 0:
                    cached_free += 1
        cdef int64_t mapped = self._cached.size()
        for kv in self._dups:
            assert not kv.second.empty(), "an empty duplicate list"
            assert self._cached.count(kv.first), "duplicates of a hash no block answers"
            mapped += kv.second.size()
        assert with_hash == mapped == self._num_hashed, "hash map holds stale entries"
        assert cached_free == self._num_cached_free, \
            f"num_cached_free {self._num_cached_free} != {cached_free}"


def bench_native_cycles(BlockAllocator alloc, int64_t iters, int64_t k):
    """Benchmark helper: `iters` cycles of allocate(k) then free tail-first, all in
    native code (the path the core's own engine model takes). Returns block ops."""
    if k < 1 or k > alloc.num_blocks:
        raise ValueError(f"k={k}: must be in [1, num_blocks={alloc.num_blocks}]")
    cdef vector[int32_t] ids
    ids.resize(k)
    cdef int64_t i, j, cycles = 0
    cdef int32_t tmp
    with nogil:
        for i in range(iters):
            if alloc.c_allocate(k, ids.data()) != 0:
                break
            for j in range(k // 2):
                tmp = ids[j]
                ids[j] = ids[k - 1 - j]
                ids[k - 1 - j] = tmp
            alloc.c_free(ids.data(), k)
            cycles += 1
    return 2 * k * cycles

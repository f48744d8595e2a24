"""BlockAllocator: exact behaviour, and random sequences that keep its invariants."""
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvadmit import BlockAllocator


def test_allocate_and_free_counts():
    a = BlockAllocator(8)
    got = a.allocate(3)
    assert got == [0, 1, 2]
    assert (a.num_free, a.num_used, a.num_cached_free) == (5, 3, 0)
    a.free(reversed(got))
    assert (a.num_free, a.num_used) == (8, 0)
    with pytest.raises(ValueError, match="only 8 blocks free"):
        a.allocate(9)
    assert a.can_allocate(8) and not a.can_allocate(9)
    a.check_invariants()


def test_uncached_free_blocks_are_reused_before_cached_ones():
    a = BlockAllocator(4)
    b = a.allocate(4)
    a.cache(b[0], 100)
    a.cache(b[1], 101)
    a.free([b[1], b[0]])   # cached: to the tail, in this order
    a.free([b[2], b[3]])   # uncached: to the head
    assert a.free_order() == [3, 2, 1, 0]
    assert a.num_cached_free == 2
    assert a.allocate(2) == [3, 2]
    assert a.num_cached == 2
    # The next allocation evicts the least recently freed cached block first.
    assert a.allocate(1) == [1]
    assert a.lookup(101) == -1 and a.lookup(100) == 0
    a.check_invariants()


def test_prefix_lookup_is_contiguous_and_shares_blocks():
    a = BlockAllocator(6)
    b = a.allocate(3)
    for blk, h in zip(b, (11, 12, 13)):
        assert a.cache(blk, h) == blk
    a.free(reversed(b))
    assert a.num_cached_free == 3
    assert a.prefix_hits([11, 12, 13, 14]) == 3
    assert a.prefix_hits([11, 99, 13]) == 1   # a hit on block 2 needs block 1
    got = a.acquire_prefix([11, 12, 77])
    assert got == [b[0], b[1]]
    assert [a.ref_count(x) for x in b] == [1, 1, 0]
    assert a.num_cached_free == 1
    # A second request shares the same prefix: reference counts go to 2 (any
    # iterable of ids, as free takes: an iterator once shared nothing).
    a.share(iter(got))
    assert a.ref_count(b[0]) == 2
    a.free(got)
    assert a.ref_count(b[0]) == 1 and a.num_free == 4
    a.free(got)
    assert a.num_free == 6 and a.num_cached_free == 3
    a.check_invariants()


def test_cache_duplicates_and_errors():
    a = BlockAllocator(3)
    x, y = a.allocate(2)
    assert a.cache(x, 5) == x
    # Same content as x (no de-duplication, as vLLM): y holds the hash too, a lookup
    # answers x while x is cached, then y.
    assert a.cache(y, 5) == x
    assert a.lookup(5) == x and a.num_cached == 2
    a.check_invariants()
    with pytest.raises(ValueError, match="already holds another hash"):
        a.cache(x, 6)
    with pytest.raises(ValueError, match="is free"):
        a.cache(2, 7)
    with pytest.raises(ValueError, match="double free"):
        a.free([y, y])
    assert a.ref_count(y) == 1          # the rejected batch freed nothing
    with pytest.raises(ValueError, match="holds no prefix"):
        a.share([2])
    with pytest.raises(ValueError, match="out of range"):
        a.free([3])
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockAllocator(0)


def test_duplicate_content_is_freed_to_the_tail_and_evicted_on_its_own():
    """vLLM's BlockHashToBlockMap keeps every block of a hash: a duplicate goes to the
    tail of the free queue like any cached block (not the head, as a plain block), and
    evicting the answering block hands lookups to the next one."""
    a = BlockAllocator(4)
    x, y, z = a.allocate(3)
    a.cache(x, 5)
    a.cache(y, 5)
    a.free([z])                      # plain: the head
    a.free([y])                      # a duplicate: the tail
    assert a.free_order() == [z, 3, y] and a.num_cached_free == 1
    a.free([x])
    assert a.free_order() == [z, 3, y, x]
    assert a.allocate(3) == [z, 3, y]   # y evicted: x still answers
    assert a.lookup(5) == x and a.num_cached == 1
    a.check_invariants()
    b = a.allocate(1)[0]             # x evicted too
    assert b == x and a.lookup(5) == -1 and a.num_cached == 0
    a.free([y])
    a.cache(b, 6)
    a.cache(z, 6)
    a.free([b])                      # the answering block goes; z answers once b is taken
    a.allocate(2)
    assert a.lookup(6) == z
    a.check_invariants()


class AllocatorModel(RuleBasedStateMachine):
    """Random allocate / free / share / cache / evict against owner bookkeeping."""

    N = 16

    def __init__(self):
        super().__init__()
        self.a = BlockAllocator(self.N)
        self.owned = []           # one list of block ids per owner
        self.next_hash = 1
        self.hash_of = {}         # block -> hash, as far as the model knows

    @rule(n=st.integers(0, 6))
    def allocate(self, n):
        if n > self.a.num_free:
            with pytest.raises(ValueError):
                self.a.allocate(n)
            return
        got = self.a.allocate(n)
        assert len(set(got)) == n
        held = {b for blocks in self.owned for b in blocks}
        assert not held & set(got), "a used block was handed out again"
        for b in got:
            self.hash_of.pop(b, None)  # evicted if it was cached-free
        self.owned.append(got)

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def free_owner(self, data):
        i = data.draw(st.integers(0, len(self.owned) - 1))
        self.a.free(reversed(self.owned.pop(i)))

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def cache_one(self, data):
        blocks = data.draw(st.sampled_from(self.owned))
        if blocks:
            b = data.draw(st.sampled_from(blocks))
            if b not in self.hash_of:
                assert self.a.cache(b, self.next_hash) == b
                self.hash_of[b] = self.next_hash
                self.next_hash += 1

    @precondition(lambda self: self.hash_of)
    @rule(data=st.data())
    def share_cached(self, data):
        b = data.draw(st.sampled_from(sorted(self.hash_of)))
        assert self.a.lookup(self.hash_of[b]) == b
        self.a.share([b])
        self.owned.append([b])

    @invariant()
    def counts(self):
        a = self.a
        assert a.num_free + a.num_used == self.N
        refs = {}
        for blocks in self.owned:
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        for b in range(self.N):
            assert a.ref_count(b) == refs.get(b, 0) >= 0
        assert a.num_used == len(refs)
        assert a.num_cached_free == sum(1 for b in self.hash_of if b not in refs)
        a.check_invariants()


TestAllocatorModel = AllocatorModel.TestCase

"""FreeBlockQueue against a list model, and the vLLM-shaped object queue."""
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvadmit import BlockObjectQueue, FreeBlockQueue


def test_starts_full_in_id_order():
    q = FreeBlockQueue(5)
    assert q.num_free_blocks == 5 and len(q) == 5
    assert q.get_all_free_blocks() == [0, 1, 2, 3, 4]
    assert FreeBlockQueue(3, fill=False).get_all_free_blocks() == []


def test_operations_keep_order():
    q = FreeBlockQueue(6)
    assert q.popleft() == 0
    assert q.popleft_n(2) == [1, 2]
    q.remove(4)
    assert q.get_all_free_blocks() == [3, 5]
    q.append(0)
    q.append_n([4, 2])
    assert q.get_all_free_blocks() == [3, 5, 0, 4, 2]
    q.remove(5)
    q.prepend_n([1, 5])
    assert q.get_all_free_blocks() == [1, 5, 3, 0, 4, 2]
    assert list(q.iter_blocks_after(3)) == [0, 4, 2]
    assert list(q.iter_blocks_after()) == [1, 5, 3, 0, 4, 2]
    q.remove(0)
    assert list(q.iter_blocks_after(0)) == []     # a cursor no longer free: nothing
    q.check_invariants()


def test_errors_match_vllm():
    q = FreeBlockQueue(2)
    q.popleft_n(2)
    with pytest.raises(ValueError, match="No free blocks available"):
        q.popleft()
    with pytest.raises(RuntimeError, match="not in the free queue"):
        q.remove(0)
    q.append(1)
    with pytest.raises(ValueError, match="double free"):
        q.append(1)
    with pytest.raises(ValueError, match="out of range"):
        q.append(7)
    with pytest.raises(ValueError, match="only 1 free"):
        q.popleft_n(2)
    with pytest.raises(ValueError, match="block 0 listed twice"):
        q.prepend_n([0, 0])
    assert q.get_all_free_blocks() == [1]        # refused whole: nothing was linked
    with pytest.raises(ValueError, match="double free"):
        q.append_n([0, 1])                       # 1 is already free: 0 stays out
    with pytest.raises(ValueError, match="double free"):
        q.append_n([0, 0])
    with pytest.raises(TypeError):
        q.append_n([0, None])
    assert q.get_all_free_blocks() == [1]
    q.check_invariants()


class Block:
    """Stands in for vLLM's KVCacheBlock: all the object queue reads is block_id."""

    def __init__(self, block_id):
        self.block_id = block_id


def test_object_queue_returns_the_pools_own_objects():
    blocks = [Block(i) for i in range(4)]
    q = BlockObjectQueue(blocks)
    assert q.popleft() is blocks[0]
    got = q.popleft_n(2)
    assert got[0] is blocks[1] and got[1] is blocks[2]
    q.remove(blocks[3])
    assert q.num_free_blocks == 0
    with pytest.raises(ValueError, match="No free blocks available"):
        q.popleft()
    q.append_n([blocks[2], blocks[1]])
    q.append(blocks[0])
    q.prepend_n([blocks[3]])
    assert [b.block_id for b in q.get_all_free_blocks()] == [3, 2, 1, 0]
    assert [b.block_id for b in q.iter_blocks_after(blocks[2])] == [1, 0]
    with pytest.raises(RuntimeError, match="invalid block"):
        q.remove(Block(9))
    with pytest.raises(RuntimeError):
        q.append(blocks[0])
    q.popleft_n(2)                                   # 3 and 2 out; 1, 0 free
    with pytest.raises(RuntimeError, match="already free or unknown: .*"):
        q.append_n([blocks[3], blocks[2], blocks[0]])   # 0 is free: 3 and 2 stay out
    with pytest.raises(AttributeError):
        q.append_n([blocks[3], object()])
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 0]
    with pytest.raises(ValueError, match="must equal its index"):
        BlockObjectQueue([Block(1)])


class QueueModel(RuleBasedStateMachine):
    """Random operations agree with a plain Python list and keep the links sound."""

    N = 12

    def __init__(self):
        super().__init__()
        self.q = FreeBlockQueue(self.N)
        self.model = list(range(self.N))

    def taken(self):
        return [b for b in range(self.N) if b not in self.model]

    @precondition(lambda self: self.model)
    @rule()
    def popleft(self):
        assert self.q.popleft() == self.model.pop(0)

    @rule(n=st.integers(0, 4))
    def popleft_n(self, n):
        if n > len(self.model):
            with pytest.raises(ValueError):
                self.q.popleft_n(n)
            return
        assert self.q.popleft_n(n) == self.model[:n]
        del self.model[:n]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data):
        b = data.draw(st.sampled_from(self.model))
        self.q.remove(b)
        self.model.remove(b)

    @precondition(lambda self: len(self.model) < self.N)
    @rule(data=st.data())
    def append(self, data):
        b = data.draw(st.sampled_from(self.taken()))
        self.q.append(b)
        self.model.append(b)

    @precondition(lambda self: len(self.model) < self.N)
    @rule(data=st.data(), front=st.booleans())
    def add_many(self, data, front):
        bs = data.draw(st.lists(st.sampled_from(self.taken()), unique=True, min_size=1))
        if front:
            self.q.prepend_n(bs)
            self.model[:0] = bs
        else:
            self.q.append_n(bs)
            self.model.extend(bs)

    @invariant()
    def agrees(self):
        assert self.q.get_all_free_blocks() == self.model
        assert self.q.num_free_blocks == len(self.model)
        self.q.check_invariants()


TestQueueModel = QueueModel.TestCase

"""peak_blocks: the lockstep KV-curve peak, exact against brute force."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvadmit import peak_blocks
from kvadmit._curves import first_over


def demand(tokens, steps, B, k):
    return sum(-(-(t + k) // B) for t, r in zip(tokens, steps) if r > k)


def brute_peak(tokens, steps, B):
    best = 0
    for k in range(max(steps, default=0)):
        best = max(best, sum(-(-(t + k) // B) for t, r in zip(tokens, steps) if r > k))
    return best


@pytest.mark.parametrize("tokens,steps,B,expected", [
    ([], [], 16, 0),
    ([100], [50], 16, 10),             # ceil((100 + 49) / 16)
    ([100, 50], [50, 10], 16, 11),     # at k=9: 7 + 4; at k=49: 10
    ([16, 16], [1, 1], 16, 2),         # exact block boundary, no growth
    ([16, 16], [2, 2], 16, 4),         # first decode step crosses into a new block
    ([0, 1, 15], [1, 1, 1], 16, 2),    # zero tokens hold nothing
    ([10] * 4, [5, 4, 3, 2], 1, 44),      # at k=1 all four hold 11
])
def test_table(tokens, steps, B, expected):
    assert peak_blocks(tokens, steps, B) == expected == brute_peak(tokens, steps, B)


@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 120)), max_size=25),
       st.sampled_from([1, 2, 3, 16, 32, 64]))
def test_matches_brute_force(items, B):
    tokens = [t for t, _ in items]
    steps = [r for _, r in items]
    assert peak_blocks(tokens, steps, B) == brute_peak(tokens, steps, B)


@given(st.lists(st.tuples(st.integers(1, 300), st.integers(1, 120)), min_size=1, max_size=25),
       st.sampled_from([1, 16, 32]))
def test_peak_is_at_most_the_reservation(items, B):
    # Never more than reserving every request's final size at once.
    reserve = sum(-(-(t + r - 1) // B) for t, r in items)
    assert peak_blocks([t for t, _ in items], [r for _, r in items], B) <= reserve


def test_errors():
    with pytest.raises(ValueError, match="block_size=0"):
        peak_blocks([1], [1], 0)
    with pytest.raises(ValueError, match="steps=0"):
        peak_blocks([1], [0], 16)
    with pytest.raises(ValueError, match="entries"):
        peak_blocks([1, 2], [1], 16)


@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 120)), max_size=25),
       st.sampled_from([1, 2, 16, 32]), st.integers(0, 60))
def test_first_over_finds_the_crossing(items, B, limit):
    """first_over: -1 exactly when the peak fits the limit, else the first step the
    demand exceeds it."""
    tokens = [t for t, _ in items]
    steps = [r for _, r in items]
    t = first_over(tokens, steps, B, limit)
    if brute_peak(tokens, steps, B) <= limit:
        assert t == -1
        return
    assert t == next(k for k in range(max(steps)) if demand(tokens, steps, B, k) > limit)


def test_first_over_table():
    # one request of 100 tokens (7 blocks of 16), 50 steps left: 8 blocks from step
    # 13 (113 tokens), 9 from step 29, 10 at its last (149)
    assert first_over([100], [50], 16, 8) == 29
    assert first_over([100], [50], 16, 10) == -1
    assert first_over([100, 100], [50, 10], 16, 14) == -1   # 7 + 7 until the second ends
    assert first_over([100, 100], [50, 10], 16, 13) == 0

"""OutputLengthModel and the adaptive quantile controller: exact values."""
import pytest

from kvadmit import OutputLengthModel, next_quantile


def model_with(lengths, bucket=1, window=100, min_samples=1):
    m = OutputLengthModel(bucket, 1000, window, min_samples)
    for x in lengths:
        m.observe(x)
    return m


def test_quantiles_conditioned_on_generated():
    m = model_with(range(10, 101, 10))           # 10, 20, ..., 100
    assert m.predict_remaining(0, 1000, 0.5) == 50     # 5th of 10
    # After 35 tokens only 40..100 are peers: the 4th of those 7 is 70.
    assert m.predict_remaining(35, 1000, 0.5) == 35
    assert m.predict_remaining(35, 50, 0.5) == 15      # capped by max_new - generated
    assert m.predict_remaining(0, 1000, 1.0) == 100
    assert m.predict_remaining(0, 1000, 0.01) == 10
    # Past every observed length: worst case.
    assert m.predict_remaining(100, 300, 0.9) == 200


def test_buckets_round_up():
    m = model_with([1, 5, 17], bucket=8)
    assert m.predict_remaining(0, 100, 0.5) == 8       # bucket (0, 8]
    assert m.predict_remaining(0, 100, 1.0) == 24      # bucket (16, 24]
    assert m.predict_remaining(9, 100, 0.5) == 15      # peers: 17 only -> 24 - 9


def test_min_samples_and_window():
    m = model_with([5, 6], min_samples=3)
    assert m.predict_remaining(0, 77, 0.5) == 77       # too few samples: max_new
    m = model_with([5, 6, 7, 100], window=3)
    assert m.num_samples == 3
    assert m.predict_remaining(0, 1000, 0.01) == 6     # 5 has left the window


def test_each_lane_keeps_its_own_lengths_and_window():
    m = model_with([100, 100, 100], window=3)          # lane 0
    for x in (5, 6, 7, 8):
        m.observe(x, lane=3)
    assert m.num_samples == 3 and m.lane_samples(3) == 3 and m.lane_samples(1) == 0
    assert m.predict_remaining(0, 1000, 0.5) == 100    # lane 0: only its own lengths
    assert m.predict_remaining(0, 1000, 0.01, lane=3) == 6   # 5 has left lane 3's window
    assert m.predict_remaining(0, 77, 0.5, lane=1) == 77     # a lane never observed: max_new
    assert m.predict_remaining(0, 77, 0.5, lane=9) == 77     # nor one past the last
    # Other lanes keep at most lane_window lengths, lane 0 its window.
    m = OutputLengthModel(1, 1000, 4, 1, 2)
    for x in (5, 6, 7, 8):
        m.observe(x)
        m.observe(x, lane=1)
    assert (m.num_samples, m.lane_samples(1)) == (4, 2)
    assert m.predict_remaining(0, 1000, 0.01, lane=1) == 7


def test_errors():
    with pytest.raises(ValueError, match="quantile=0.0"):
        model_with([1]).predict_remaining(0, 10, 0.0)
    with pytest.raises(ValueError, match="bucket_tokens=0"):
        OutputLengthModel(0, 10, 10, 1)
    with pytest.raises(ValueError, match="lane=-1"):
        model_with([1]).observe(3, lane=-1)


@pytest.mark.parametrize("q,pre,adm,expected", [
    (0.9, 5, 100, 0.9 + (0.999 - 0.9) / 2),   # 5% > 1% target: halfway up
    (0.9, 1, 100, 0.9),                        # at target: hold
    (0.98, 0, 100, 0.98 - (0.98 - 0.9) / 4),  # quiet window: relax a quarter back
    (0.9, 0, 100, 0.9),                        # already at base
    (0.95, 3, 0, 0.95),                        # empty window: unchanged
])
def test_next_quantile_table(q, pre, adm, expected):
    assert next_quantile(q, 0.9, 0.999, pre, adm, 0.01) == pytest.approx(expected, abs=1e-12)


def test_next_quantile_sequence_converges_up_then_back():
    q, seq = 0.9, []
    for pre in (10, 10, 0, 0):
        q = next_quantile(q, 0.9, 0.999, pre, 64, 0.01)
        seq.append(q)
    assert seq == pytest.approx([0.9495, 0.97425, 0.9556875, 0.941765625], abs=1e-12)

"""Step loop over a workload with SGLang's real scheduling classes and a fake
forward (see sglang_harness): admission, decode growth, retraction. Counts
retractions per policy against SGLang's own admission."""
import random

import pytest

pytest.importorskip("sglang.srt")  # not "sglang": see conftest.py

from kvadmit import AdmissionConfig  # noqa: E402


def arrivals(seed, n_short=100, n_long=24, long_at=300, every=4):
    """Short answers first (SGLang's new_token_ratio decays while they run),
    then requests that run to max_new: SGLang's estimate then over-admits."""
    rng = random.Random(seed)
    plan = {}
    for i in range(n_short):
        plan.setdefault(i * every, []).append((f"s{i}", rng.randint(20, 120), 512, rng.randint(8, 40)))
    for i in range(n_long):
        plan.setdefault(long_at + i * every, []).append((f"l{i}", rng.randint(20, 120), 512, 512))
    return plan


def run(policy, seed):
    from sglang_harness import Harness, make_req

    config = None if policy is None else AdmissionConfig.from_dict({"policy": policy})
    h = Harness(config, pool_tokens=2048)
    plan = {step: [make_req(*w[:3], out_len=w[3]) for w in ws]
            for step, ws in arrivals(seed).items()}
    n = sum(len(v) for v in plan.values())
    log = h.run(plan)
    assert log.finished == n and len(h.finished) == n
    assert h.allocator.available_size() + h.tree_cache.evictable_size() == 2048  # no KV leaked
    return h, log


@pytest.mark.parametrize("seed", [1, 2])
def test_retractions_per_policy(kvadmit_hooks, seed):
    counts = {}
    for policy in (None, "reserve", "peak", "predict", "adaptive", "overcommit"):
        h, log = run(policy, seed)
        counts[policy] = log.retracted
        if h.adapter is not None:
            stats = h.adapter.stats()
            # The core saw every retraction SGLang made, and the ledger drained.
            assert stats["preempted"] == log.retracted == stats["requeued"]
            assert stats["finished"] == log.finished
            assert stats["running"] == 0 and stats["waiting"] == 0
            assert stats["admitted"] == log.finished + log.retracted
    print("retractions", counts)
    assert counts["reserve"] == 0
    assert counts["peak"] == 0
    assert counts[None] >= 3                     # SGLang's default admission retracts
    assert counts["overcommit"] > counts[None]   # vLLM-style admission retracts more
    assert counts["predict"] > 0                 # SGLang's rule, run by the core


def test_peak_runs_more_at_once_than_reserve(kvadmit_hooks):
    """Both never retract; peak packs more requests, so the workload takes fewer steps."""
    h_reserve, log_reserve = run("reserve", 1)
    h_peak, log_peak = run("peak", 1)
    assert log_reserve.retracted == log_peak.retracted == 0
    assert h_peak.steps < h_reserve.steps

"""Property tests in the lockstep-decode model: guarantees and accounting."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvadmit import AdmissionConfig, POLICIES
from oracle.lockstep import Request, run_lockstep


@st.composite
def workloads(draw):
    B = draw(st.sampled_from([1, 4, 16]))
    n = draw(st.integers(1, 30))
    reqs = []
    for _ in range(n):
        p = draw(st.integers(1, 60))
        m = draw(st.integers(1, 60))
        reqs.append(Request(draw(st.integers(0, 20)), p, m, draw(st.integers(1, m))))
    need = max(-(-(r.prompt_tokens + r.max_new_tokens) // B) for r in reqs)
    num_blocks = draw(st.integers(need + 1, need * 4))  # +1: predict needs strictly less
    return reqs, num_blocks, B


@given(workloads())
def test_reserve_and_peak_never_preempt(w):
    reqs, num_blocks, B = w
    for policy in ("reserve", "peak"):
        res = run_lockstep(AdmissionConfig(policy=policy), reqs, num_blocks, B)
        assert res.preemptions == 0, policy
        assert res.finished == len(reqs) and res.leaked_blocks == 0


@given(workloads(), st.sampled_from(POLICIES), st.sampled_from(["lifo", "priority", "lcf", "length"]))
def test_every_request_completes_and_every_block_returns(w, policy, victim):
    reqs, num_blocks, B = w
    res = run_lockstep(AdmissionConfig(policy=policy, victim=victim), reqs, num_blocks, B)
    assert res.finished + sum(res.rejected.values()) == len(reqs)
    assert res.rejected == {}          # the pool holds every request alone
    assert res.leaked_blocks == 0
    assert res.peak_used_blocks <= num_blocks


def test_peak_packs_more_than_reserve_on_long_caps():
    # Short real outputs under long max_new caps: reserve idles the pool.
    reqs = [Request(i // 2, 32, 256, 16 + (i % 7) * 8) for i in range(200)]
    by = {p: run_lockstep(AdmissionConfig(policy=p), reqs, 200, 16)
          for p in ("overcommit", "reserve", "peak", "adaptive")}
    assert by["reserve"].preemptions == by["peak"].preemptions == 0
    assert by["peak"].steps < by["reserve"].steps
    assert by["peak"].mean_running > by["reserve"].mean_running
    # The length model learns the short outputs and packs like overcommit without its storms.
    assert by["adaptive"].steps <= by["peak"].steps
    assert by["adaptive"].preemptions <= by["overcommit"].preemptions

"""The default policy, auto: exact decisions, its settings, and its guarantee.

Pool: 40 blocks of 4 tokens unless a row says otherwise. auto's length quantile
starts at 0.4 and its length model (16-token buckets) predicts after one finish.
"""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers import add_running, add_waiting, make_core
from kvadmit import AdmissionConfig
from kvadmit.lockstep import Request, run_lockstep


def history(core, early: int, capped: int, max_new: int = 100, length: int = 8):
    """`early` finished requests that stopped at `length` tokens under a cap of
    `max_new`, and `capped` that ran to their cap (honest max_tokens)."""
    for n, out in ((early, length), (capped, max_new)):
        for _ in range(n):
            s = add_running(core, 4, max_new)
            core.update(s, 4 + out - 1, out)
            core.finish(s)


@pytest.mark.parametrize("policy,early,capped,expected", [
    # Running (20, 60), candidate (24, 80): worst case, at the running one's last
    # step, 20 + 21 = 41 blocks > 40.
    ("peak", 4, 0, "hold_capacity"),
    # Requests stop early (caps far above the lengths): auto predicts 16 more tokens
    # each (the 0.4-quantile's bucket edge): 9 + 10 blocks.
    ("auto", 4, 0, "admit"),
    # Honest caps (every request ran to its max_tokens): auto keeps peak's curves.
    ("auto", 0, 4, "hold_capacity"),
    # A mixture: h = 7/10 capped >= 1 - 0.4, so the cap is the 0.4-quantile: peak's curves.
    ("auto", 3, 7, "hold_capacity"),
    # h = 5/10 < 0.6: the early lengths' 0.8-quantile (16 tokens): packs.
    ("auto", 5, 5, "admit"),
    # No finished request yet: the worst case, as peak.
    ("auto", 0, 0, "hold_capacity"),
])
def test_auto_learns_whether_caps_are_honest(policy, early, capped, expected):
    core = make_core(policy, num_blocks=40)
    history(core, early, capped)
    add_running(core, 20, 60)
    cand = add_waiting(core, 24, 80)
    assert core.decide(cand, 40 - 5) == expected


@pytest.mark.parametrize("policy,expected", [
    ("peak", "hold_capacity"), ("adaptive", "hold_capacity"), ("auto", "admit")])
def test_auto_counts_a_shared_prefix_once(policy, expected):
    """Two running requests of 64 prompt tokens; the second found 48 of them in the
    first one's blocks (the engine holds 16 + 4 blocks, not 32). Candidate (40, 4):
    11 blocks. Counted per request: 17 + 17 + 11 = 45 > 40; counted once: 17 + 5 + 11."""
    core = make_core(policy, num_blocks=40)
    a = add_running(core, 64, 4)
    core.update(a, 64, 0)
    s = core.arrive(64, 4).slot
    core.set_shared(s, 48)
    core.admit(s)
    core.update(s, 64, 0)
    core.observe_used_blocks(16 + 4)
    cand = add_waiting(core, 40, 4)
    assert core.decide(cand, 20) == expected


def test_auto_holds_again_once_shared_blocks_are_no_longer_shared():
    """The blocks in use beyond the running requests' own parts are counted once:
    when the engine reports more blocks in use, auto holds again."""
    core = make_core("auto", num_blocks=40)
    a = add_running(core, 64, 4)
    core.update(a, 64, 0)
    s = core.arrive(64, 4).slot
    core.set_shared(s, 48)
    core.admit(s)
    core.update(s, 64, 0)
    cand = add_waiting(core, 40, 4)
    core.observe_used_blocks(20)
    assert core.decide(cand, 20) == "admit"
    core.observe_used_blocks(32)     # 12 blocks in use beyond the own parts: 22 + 11 + 12 > 40
    assert core.decide(cand, 20) == "hold_capacity"


def test_set_shared_checks_its_input():
    core = make_core("auto", num_blocks=40)
    s = add_waiting(core, 10, 4)
    with pytest.raises(ValueError, match="shared_tokens=11"):
        core.set_shared(s, 11)
    with pytest.raises(KeyError):
        core.set_shared(99, 1)
    with pytest.raises(ValueError, match="used_blocks=-1"):
        core.observe_used_blocks(-1)


@pytest.mark.parametrize("settings,pauses,bypasses", [
    ({}, True, True),                                          # the default: auto
    ({"policy": "auto", "shortfall": "preempt"}, False, True),
    ({"policy": "auto", "head_of_line": "strict"}, True, False),
    ({"policy": "peak"}, False, False),                        # "auto" keys: other policies as before
    ({"policy": "overcommit", "victim": "lifo"}, False, False),  # vLLM's own schedule
    ({"policy": "peak", "shortfall": "pause", "head_of_line": "bypass"}, True, True),
])
def test_shortfall_and_head_of_line_auto(settings, pauses, bypasses):
    c = AdmissionConfig.from_dict(settings)
    assert (c.pause_on_shortfall, c.bypass_head_of_line) == (pauses, bypasses)


def test_auto_bypasses_a_held_head_more_than_the_explicit_default():
    """head_of_line auto passes a held head up to 1000 times (explicit bypass: max_bypass, 4)."""
    for settings, passes in (({}, 1000), ({"head_of_line": "bypass"}, 4)):
        core = make_core("auto", num_blocks=40, **{k: v for k, v in settings.items()})
        add_running(core, 80, 60)                     # 35 blocks at its peak
        big = add_waiting(core, 60, 40)               # held: 35 + 25 > 40
        admitted = 0
        for _ in range(1200):
            small = add_waiting(core, 4, 4)
            if core.next_admissible(40) != small:
                core.abort(small)
                break
            core.admit(small)
            core.finish(small)
            admitted += 1
        assert admitted == passes, settings
        assert core.state(big) == "waiting"


@st.composite
def honest_workloads(draw):
    """Random arrivals and lengths; every request's max_tokens is its real length."""
    B = draw(st.sampled_from([1, 4, 16]))
    n = draw(st.integers(1, 30))
    reqs = []
    for _ in range(n):
        m = draw(st.integers(1, 60))
        reqs.append(Request(draw(st.integers(0, 20)), draw(st.integers(1, 60)), m, m))
    need = max(-(-(r.prompt_tokens + r.max_new_tokens) // B) for r in reqs)
    return reqs, draw(st.integers(need, need * 4)), B


@given(honest_workloads())
def test_auto_never_preempts_with_honest_caps(w):
    reqs, num_blocks, B = w
    res = run_lockstep(AdmissionConfig(), reqs, num_blocks, B)
    assert res.preemptions == 0
    assert res.finished == len(reqs) and res.leaked_blocks == 0


def test_auto_packs_generous_caps_like_adaptive_without_its_storms():
    """Short real outputs under long caps (the common case: no honest max_tokens)."""
    reqs = [Request(i // 2, 32, 256, 16 + (i % 7) * 8) for i in range(200)]
    by = {p: run_lockstep(AdmissionConfig(policy=p), reqs, 200, 16)
          for p in ("overcommit", "peak", "auto")}
    assert by["auto"].steps < by["peak"].steps
    assert by["auto"].preemptions == 0 < by["overcommit"].preemptions
    assert by["auto"].finished == 200 and by["auto"].leaked_blocks == 0

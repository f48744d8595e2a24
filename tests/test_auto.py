"""The default policy, auto: exact decisions, its settings, and its guarantee.

Pool: 40 blocks of 4 tokens unless a row says otherwise. auto's length quantile
starts at 0.4 (0.8 without pause) and its length model (16-token buckets) predicts after one finish.
"""
import dataclasses

import pytest
from hypothesis import given

from helpers import add_running, add_waiting, make_core
from kvadmit import AdmissionConfig
from oracle.lockstep import Request, run_lockstep
from test_lockstep import workloads
from kvadmit.arrival import ArrivalRecord


def history(core, early: int, capped: int, max_new: int = 100, length: int = 8):
    """`early` finished requests that stopped at `length` tokens under a cap of
    `max_new`, and `capped` that ran to their cap (honest max_tokens)."""
    for n, out in ((early, length), (capped, max_new)):
        for _ in range(n):
            s = add_running(core, 4, max_new)
            core.update(s, 4 + out - 1, out)
            core.finish(s, 0.0)


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
    # h = 2/10 < 0.6: packs too ...
    ("auto", 8, 2, "admit"),
    # No finished request yet: the worst case, as peak.
    ("auto", 0, 0, "hold_capacity"),
])
def test_auto_learns_whether_caps_are_honest(policy, early, capped, expected):
    core = make_core(policy, num_blocks=40)
    history(core, early, capped)
    add_running(core, 20, 60)
    cand = add_waiting(core, 24, 80)
    assert core.decide(cand, 40 - 5) == expected


@pytest.mark.parametrize("cap,expected", [
    # Both with the honest client's cap: h = (5 + 2 x 0.5) / (5 + 2) = 6/7 >= 0.6, so
    # each runs to its cap: 20 + 21 blocks > 40. (Over all finishes h = 0.5 < 0.6
    # would pack both on the early lengths' quantile.)
    (60, "hold_capacity"),
    # Both with the slack client's cap: h = (0 + 1) / 7, so the early lengths: packs.
    (100, "admit"),
])
def test_auto_learns_honesty_per_max_tokens(cap, expected):
    """Two clients: one's max_tokens 100 stops at 8 tokens, the other's 60 is honest
    (5 finishes each). auto learns each max_tokens's own share of capped finishes,
    shrunk towards all finishes' by two finishes' worth."""
    core = make_core("auto", num_blocks=40)
    history(core, 5, 0, max_new=100)
    history(core, 0, 5, max_new=60)
    add_running(core, 20, cap)
    cand = add_waiting(core, 24, cap)
    assert core.decide(cand, 40 - 5) == expected


@pytest.mark.parametrize("policy", ["auto", "adaptive"])
def test_auto_predicts_a_flows_requests_from_its_own_lengths(policy):
    """A chat flow's requests stop at 8 tokens, a batch flow's at 90, under the same
    max_tokens 100 (16 and 32 finishes). All lengths together put auto's 0.4-quantile
    (and adaptive's default 0.7) in the long mode (96 tokens more for anyone); with
    flows, each flow's own lengths predict its requests once it has 16. Running: a
    batch request (20, 100)."""
    def core_after(flows):
        core = make_core(policy, num_blocks=40)
        for flow, n, out in ((1, 16, 8), (2, 32, 90)):
            for _ in range(n):
                res = core.arrive(ArrivalRecord(4, 100, flow=flow if flows else -1), now=0.0)
                core.admit(res.slot, 0.0)
                core.update(res.slot, 4 + out - 1, out)
                core.finish(res.slot, 0.0)
        res = core.arrive(ArrivalRecord(20, 100, flow=2 if flows else -1), now=0.0)
        core.admit(res.slot, 0.0)
        chat = core.arrive(ArrivalRecord(24, 100, flow=1 if flows else -1), now=0.0).slot
        batch = core.arrive(ArrivalRecord(24, 100, flow=2 if flows else -1), now=0.0).slot
        return core, chat, batch

    core, chat, batch = core_after(flows=True)
    # The chat request: 16 more tokens, 10 blocks beside the batch one's 29.
    assert core.decide(chat, 40 - 5) == "admit"
    # Another batch request: 96 more each, 29 + 30 blocks.
    assert core.decide(batch, 40 - 5) == "hold_capacity"
    # Without flows the chat request is predicted as long as the others.
    core, chat, batch = core_after(flows=False)
    assert core.decide(chat, 40 - 5) == "hold_capacity"


def test_only_the_first_64_flows_get_lengths_of_their_own():
    """Flow ids come from a header: past 64 flows, a flow's lengths go to every
    request's lane only, so the model cannot grow without bound."""
    core = make_core("auto", num_blocks=40)
    for flow in range(70):
        res = core.arrive(ArrivalRecord(4, 100, flow=1000 + flow), now=0.0)
        core.admit(res.slot, 0.0)
        core.update(res.slot, 4 + 8 - 1, 8)
        core.finish(res.slot, 0.0)
    lengths = core.length_model
    assert lengths.num_samples == 70
    assert [lengths.lane_samples(i) for i in (1, 63, 64, 70)] == [1, 1, 0, 0]


def shared_prefix_core(policy):
    """Pool 48 blocks of 4 tokens. Running: A (64 prompt tokens, 4 to come) and B, C
    (64 each, of which 48 sit in A's blocks). The engine holds 16 + 4 + 4 blocks."""
    core = make_core(policy, num_blocks=48)
    a = add_running(core, 64, 4)
    core.update(a, 64, 0)
    for _ in range(2):
        s = core.arrive(ArrivalRecord(64, 4), now=0.0).slot
        core.set_shared(s, 48)
        core.admit(s, 0.0)
        core.update(s, 64, 0)
    core.observe_used_blocks(16 + 4 + 4)
    return core, a


@pytest.mark.parametrize("policy,expected", [
    ("peak", "hold_capacity"), ("adaptive", "hold_capacity"), ("auto", "admit")])
def test_auto_counts_a_shared_prefix_once(policy, expected):
    """Candidate (12, 4): 4 blocks. Counted per request: 17 * 3 + 4 = 55 > 48.
    auto: own parts 17 + 5 + 5 + 4, plus the shared prefix (12 blocks) once more,
    as it stays in use while B or C runs after A is done: 43 <= 48."""
    core, _ = shared_prefix_core(policy)
    cand = add_waiting(core, 12, 4)
    assert core.decide(cand, 24) == expected


def test_auto_keeps_a_shared_prefix_after_its_first_holder_finishes():
    """A finishes; its 12 prefix blocks stay in use for B and C: auto now counts
    them as in use beyond the own parts (5 + 5 + 12 = 22 blocks), not as freed."""
    core, a = shared_prefix_core("auto")
    core.update(a, 67, 4)
    core.finish(a, 0.0)
    core.observe_used_blocks(12 + 4 + 4)
    big = add_waiting(core, 100, 4)          # 26 blocks: 5 + 5 + 26 + 12 = 48 fits
    assert core.decide(big, 28) == "admit"
    bigger = add_waiting(core, 104, 4)       # 27 blocks: 49 > 48
    assert core.decide(bigger, 28) == "hold_capacity"


def test_honest_caps_with_a_shared_prefix_do_not_preempt():
    """B shares A's 10-block prompt and outlives it; C arrives meanwhile. auto
    must keep A's prefix counted after A finishes (a forecast that freed it
    admitted C too early and preempted)."""
    from kvadmit.simulate.engine import EngineShape, run_native
    from kvadmit.simulate.steptime import CPU_TINY
    from kvadmit.simulate.workload import Workload
    w = Workload("shared", arrival_s=[0.0, 0.01, 0.03], prompt_tokens=[160, 161, 64],
                 output_tokens=[40, 150, 150], max_tokens=[40, 150, 150], hash_block_tokens=16,
                 hash_offsets=[0, 10, 20, 20], hash_ids=list(range(1, 11)) * 2,
                 hashed_tokens=[160, 160, 0])
    shape = EngineShape(num_blocks=32, block_size=16, max_model_len=512, max_num_seqs=8,
                        max_num_batched_tokens=512, prefix_caching=True)
    run = run_native(w, AdmissionConfig(), shape, CPU_TINY)
    assert run.totals.prefix_hit_tokens == 160          # B really shares A's prompt
    assert run.totals.preemptions == 0 and run.extra["core"]["paused"] == 0
    assert run.totals.finished == 3


def test_cancel_admit_forgets_what_the_request_shared():
    core = make_core("auto", num_blocks=48)
    s = core.arrive(ArrivalRecord(64, 4), now=0.0).slot
    core.set_shared(s, 48)
    core.admit(s, 0.0)
    core.cancel_admit(s, 0.0)
    core.admit(s, 0.0)                    # admitted again, sharing nothing this time
    core.update(s, 64, 0)
    core.observe_used_blocks(16)
    # 17 own blocks + nothing shared: a 31-block candidate fits exactly (17 + 31 = 48)
    assert core.decide(add_waiting(core, 120, 4), 32) == "admit"
    assert core.decide(add_waiting(core, 124, 4), 32) == "hold_capacity"


@pytest.mark.parametrize("key,value", [
    ("adaptive_quantile", 0.5), ("adaptive_min_samples", 4), ("adaptive_interval", 16),
    ("max_bypass", 0), ("bypass_lookahead", 8)])
def test_keys_that_auto_fixes_are_errors_not_ignored(key, value):
    from kvadmit import ConfigError
    with pytest.raises(ConfigError, match=f"{key}={value!r} has no effect under policy 'auto'"):
        AdmissionConfig.from_dict({key: value})
    AdmissionConfig.from_dict({"policy": "adaptive", key: value})     # fine elsewhere
    if key in ("max_bypass", "bypass_lookahead"):                      # explicit bypass takes them
        AdmissionConfig.from_dict({"head_of_line": "bypass", key: value})


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
    ({"policy": "peak"}, False, False),  # "auto" keys: other policies as before
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
                core.abort(small, 0.0)
                break
            core.admit(small, 0.0)
            core.finish(small, 0.0)
            admitted += 1
        assert admitted == passes, settings
        assert core.state(big) == "waiting"


@pytest.mark.parametrize("settings,bounded", [
    ({}, True),
    ({"head_of_line": "bypass", "max_bypass": 1000}, False),   # explicit bypass: no bound
    ({"max_queue_delay_s": 100.0}, False),                     # the user's bound instead
    ({"shortfall": "preempt"}, False),                         # no pause (SGLang): no bound
])
def test_auto_passes_a_held_request_until_it_waited_twice_the_recent_mean(settings, bounded):
    """head_of_line auto bounds bypass by the queue's own waits: a held request is
    passed until it has waited more than twice the mean queue wait of the recent
    first admissions, then it blocks the queue (gets the next free KV)."""
    core = make_core("auto", num_blocks=40, **settings)
    assert core.stats()["wait_bound_s"] == (100.0 if "max_queue_delay_s" in settings else None)
    add_running(core, 80, 60, now=0.0)                # 35 blocks at its peak; waited 0 s
    for t in (10.0, 20.0):                            # two more that waited 5 s and 15 s
        s = add_waiting(core, 4, 4, now=t - (5.0 if t == 10.0 else 15.0))
        core.on_step(t)
        assert core.next_admissible(40) == s
        core.admit(s, t)
        core.finish(s, t)
    if bounded:
        assert core.stats()["wait_bound_s"] == pytest.approx(2 * (0 + 5 + 15) / 3)
    big = add_waiting(core, 60, 40, now=20.0)         # held: 35 + 25 > 40
    for t in (25.0, 29.0):       # big has waited 5 s <= 13.3 s, then 9 s <= 10 s (the mean falls)
        core.on_step(t)
        small = add_waiting(core, 4, 4, now=t)
        assert core.next_admissible(40) == small
        core.admit(small, t)                          # waited 0 s
        core.finish(small, t)
    bound = core.stats()["wait_bound_s"]
    if bounded:
        assert bound == pytest.approx(2 * (0 + 5 + 15 + 0 + 0) / 5)
    core.on_step(35.0)                                # big has waited 15 s > 8 s: blocks
    small = add_waiting(core, 4, 4, now=35.0)
    assert core.next_admissible(40) == (-1 if bounded else small)
    assert core.state(big) == "waiting"


@pytest.mark.parametrize("settings,bounded", [
    ({}, True),
    ({"head_of_line": "bypass", "max_bypass": 1000}, False),
])
def test_the_wait_bound_lets_a_burst_pass_its_own_held_request(settings, bounded):
    """Requests that arrived in the same engine step as a held request that has waited
    out the bound (its burst) still pass it; a later arrival does not."""
    core = make_core("auto", num_blocks=40, **settings)
    add_running(core, 80, 60, now=0.0)                # 35 blocks at its peak; waited 0 s
    add_running(core, 4, 4, now=0.0)                  # waited 0 s: the bound is 0 s
    core.on_step(1.0)
    big = add_waiting(core, 60, 40, now=1.0)          # held: 35 + 25 > 40
    peer = add_waiting(core, 4, 4, now=1.0)           # the same step
    core.on_step(3.0)                                 # big has waited 2 s > 0 s
    late = add_waiting(core, 4, 4, now=3.0)
    assert core.next_admissible(40) == peer
    core.admit(peer, 3.0)                             # waited 2 s: the bound is 4/3 s
    assert core.next_admissible(40) == (-1 if bounded else late)
    assert core.state(big) == "waiting"


def honest(w):
    """test_lockstep's random workloads with every max_tokens the request's real length."""
    reqs, num_blocks, B = w
    return [dataclasses.replace(r, max_new_tokens=r.output_tokens) for r in reqs], num_blocks, B


@given(workloads().map(honest))
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


@pytest.mark.parametrize("generated,peak", [(0, 9), (16, 20)])
def test_a_request_that_outlived_the_early_stoppers_is_expected_to_run_to_its_cap(generated, peak):
    """h = 2/10 ran to their cap, 8 stopped by 8 tokens. A running request (20, 60)
    that has generated nothing is predicted short (16 tokens: 35 at most, 9 blocks);
    one that has generated 16 outlived every early stopper, so it runs to its cap
    (36 + 43 = 79 tokens: 20 blocks)."""
    core = make_core("auto", num_blocks=40)
    history(core, 8, 2)
    add_running(core, 20, 60, generated=generated)
    assert core.peak_blocks() == peak


def test_pauseless_auto_keeps_room_for_an_overrun():
    """auto on an engine without pause (shortfall "preempt", SGLang): once lengths are
    known, a request the length model says stops early still keeps room for running
    to its cap, and a running request grows no less than SGLang's new_token_ratio
    estimate; with pause (vLLM) the same state admits."""
    from helpers import add_running, add_waiting, make_core

    decisions = {}
    for shortfall in ("pause", "preempt"):
        core = make_core("auto", num_blocks=100, block_size=4, shortfall=shortfall)
        for i in range(40):     # 40 finished requests of 8 tokens, caps 200
            s = add_running(core, 4, 200)
            core.update(s, 4 + 7, 8)
            core.finish(s, 0.0)
        add_running(core, 100, 200, generated=4)
        s = add_waiting(core, 100, 200)
        decisions[shortfall] = core.decide(s, 100)
    assert decisions == {"pause": "admit", "preempt": "hold_capacity"}


def test_pauseless_auto_predicts_at_a_higher_quantile():
    """Without pause an overrun costs a retraction, so auto's length quantile starts at
    0.8 there (0.4 with pause). After 100 finished lengths of 1-100 tokens under caps
    of 100, a fresh request (4, 100) is predicted to stop at the 0.4-quantile's bucket
    edge with pause (48 tokens: 4 + 48 = 13 blocks), at the 0.8-quantile's without (96:
    25 blocks, above SGLang's 0.7 x 100 estimate)."""
    peaks = {}
    for shortfall in ("pause", "preempt"):
        core = make_core("auto", num_blocks=100, block_size=4, shortfall=shortfall)
        for out in range(1, 101):
            s = add_running(core, 4, 100)
            core.update(s, 4 + out - 1, out)
            core.finish(s, 0.0)
        add_running(core, 4, 100)
        peaks[shortfall] = (core.quantile, core.peak_blocks())
    assert peaks["pause"][0] == 0.4 and peaks["preempt"][0] == 0.8
    assert peaks["pause"][1] == 13 and peaks["preempt"][1] == 25, peaks

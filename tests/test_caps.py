"""Arrival caps: every rejection reason, its message, Retry-After, shedding."""
import dataclasses
import types

import pytest

from helpers import add_running, add_waiting, make_core
from kvadmit.arrival import ArrivalRecord


def test_context_length():
    core = make_core(max_model_len=100)
    res = core.arrive(ArrivalRecord(60, 50), now=0.0)
    assert not res.accepted
    r = res.rejection
    assert (r.reason, r.limit, r.limit_value, r.retry_after_s, r.retryable) == \
        ("context_length", "max_model_len", 100, None, False)
    assert "60" in r.message and "50" in r.message and "max_model_len=100" in r.message


@pytest.mark.parametrize("policy,prompt,max_new,ok", [
    ("peak", 30, 11, True),         # ceil((30 + 10) / 4) = 10 blocks: fits exactly
    ("peak", 30, 12, False),
    ("reserve", 30, 10, True),      # ceil(40 / 4) = 10
    ("reserve", 30, 11, False),
    ("overcommit", 30, 11, True),
    ("overcommit", 30, 12, False),  # would grow past the pool: could never finish
    ("predict", 30, 9, True),       # 39 < 40 tokens
    ("predict", 30, 10, False),
])
def test_kv_capacity(policy, prompt, max_new, ok):
    core = make_core(policy, num_blocks=10, block_size=4)
    res = core.arrive(ArrivalRecord(prompt, max_new), now=0.0)
    assert res.accepted == ok
    if not ok:
        assert res.rejection.reason == "kv_capacity" and not res.rejection.retryable
        assert "10 blocks of 4 tokens" in res.rejection.message


def test_queue_full_with_retry_after_from_drain_rate():
    core = make_core("overcommit", num_blocks=1000, max_queued_requests=2, drain_window_s=10)
    a = add_waiting(core, 4, 4, now=0.0)
    add_waiting(core, 4, 4, now=0.0)
    res = core.arrive(ArrivalRecord(4, 4), now=0.5)
    assert res.rejection.reason == "queue_full"
    assert res.rejection.retry_after_s == 1.0            # nothing drained yet: the default
    assert "max_queued_requests=2" in res.rejection.message
    core.admit(a, 1.0)
    for t in (2.0, 3.0, 4.0):
        add_running(core, 4, 4, now=t)                   # 3 more admissions
    add_waiting(core, 4, 4, now=4.5)
    res = core.arrive(ArrivalRecord(4, 4), now=5.0)
    # 4 admissions over 5 s = 0.8/s; one request too many -> 1.25 s.
    assert res.rejection.retry_after_s == pytest.approx(1.25)
    assert core.stats()["rejected"]["queue_full"] == 2


@pytest.mark.parametrize("call", ["admit", "preempt", "finish", "abort", "cancel_admit",
                                  "on_step", "expire_sessions", "observe_cache", "predict_ttft"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_every_clock_entry_point_refuses_a_non_finite_now(call, bad):
    """An infinite `now` would stop the backlog clock for good (nothing is later),
    so the drain rate and its Retry-After would freeze: refused where it enters,
    and the refusal leaves the core as it was (the drain-rate numbers below are
    those of test_queue_full_with_retry_after_from_drain_rate)."""
    core = make_core("overcommit", num_blocks=1000, max_queued_requests=2, drain_window_s=10)
    a = add_waiting(core, 4, 4, now=0.0)
    add_waiting(core, 4, 4, now=0.0)
    core.admit(a, 1.0)
    running = add_running(core, 4, 4, now=2.0)
    args = {"admit": (add_waiting(core, 4, 4, now=2.0),), "preempt": (running,),
            "finish": (running,), "abort": (running,), "cancel_admit": (running,),
            "on_step": (), "expire_sessions": (), "observe_cache": (0, 0, 0),
            "predict_ttft": (4,)}[call]
    before = core.stats()
    with pytest.raises(ValueError, match=f"now={bad}: must be a finite number of seconds"):
        getattr(core, call)(*args, now=bad) if call not in ("expire_sessions", "predict_ttft") \
            else getattr(core, call)(*args, bad)
    assert core.stats() == before


def test_retry_after_is_capped():
    core = make_core("overcommit", num_blocks=1000, max_queued_requests=1,
                     drain_window_s=1000, retry_after_max_s=60)
    add_running(core, 4, 4, now=0.0)
    add_waiting(core, 4, 4, now=0.0)
    assert core.arrive(ArrivalRecord(4, 4), now=500.0).rejection.retry_after_s == 60


def test_queued_tokens():
    core = make_core("overcommit", num_blocks=1000, max_queued_tokens=100, drain_window_s=10)
    add_waiting(core, 60, 4, now=0.0)
    res = core.arrive(ArrivalRecord(60, 4), now=1.0)
    assert res.rejection.reason == "queued_tokens_full"
    assert "max_queued_tokens=100" in res.rejection.message and res.rejection.retryable
    # A prompt bigger than the cap can never be queued: not retryable.
    res = core.arrive(ArrivalRecord(101, 4), now=1.0)
    assert res.rejection.reason == "queued_tokens_full" and not res.rejection.retryable
    # Cached prefix tokens do not count.
    assert core.arrive(ArrivalRecord(60, 4, cached_tokens=20), now=1.0).accepted
    assert core.queued_tokens == 100


def test_priority_shedding_evicts_strictly_lower_priority():
    core = make_core("overcommit", num_blocks=1000, max_queued_requests=2,
                     shed_lower_priority=True)
    low = add_waiting(core, 4, 4, priority=5)
    mid = add_waiting(core, 4, 4, priority=3)
    res = core.arrive(ArrivalRecord(4, 4, priority=1), now=0.0)
    assert res.accepted
    assert [s for s, _ in res.shed] == [low]
    rej = res.shed[0][1]
    assert rej.reason == "shed" and "priority 1 < 5" in rej.message
    assert core.state(low) == "free" and core.waiting() == [mid, res.slot]
    # Equal priority is not strictly higher: refused.
    res = core.arrive(ArrivalRecord(4, 4, priority=3), now=0.0)
    assert not res.accepted and res.rejection.reason == "queue_full" and res.shed == []
    assert core.stats()["rejected"]["shed"] == 1


def test_shedding_never_evicts_a_preempted_request():
    core = make_core("overcommit", num_blocks=1000, max_queued_requests=1,
                     shed_lower_priority=True)
    a = add_running(core, 4, 4, priority=9)
    core.preempt(a, 0.0)                      # waiting again, with work done
    res = core.arrive(ArrivalRecord(4, 4, priority=0), now=0.0)
    assert not res.accepted and res.rejection.reason == "queue_full"


@pytest.mark.parametrize("kwargs,needle", [
    (dict(prompt_tokens=0, max_new_tokens=4), "prompt_tokens=0: must be >= 1"),
    (dict(prompt_tokens=4, max_new_tokens=-1), "max_new_tokens=-1: must be >= 0"),
    (dict(prompt_tokens=4, max_new_tokens=4, cached_tokens=5), "cached_tokens=5"),
    (dict(prompt_tokens=4, max_new_tokens=4, now=float("inf")), "now=inf"),
])
def test_bad_input_raises_naming_the_field(kwargs, needle):
    now = kwargs.pop("now", 0.0)
    if now == 0.0:      # the record refuses it when built
        with pytest.raises(ValueError, match=needle):
            ArrivalRecord(**kwargs)
    # and the core, given any object with the record's fields, checks it again
    fields = {f.name: f.default for f in dataclasses.fields(ArrivalRecord)
              if f.default is not dataclasses.MISSING}
    core = make_core()
    with pytest.raises(ValueError, match=needle):
        core.arrive(types.SimpleNamespace(**{**fields, **kwargs}), now=now)
    assert core.stats()["arrived"] == 0         # a bad record is no arrival


def test_slot_misuse_is_an_error():
    core = make_core()
    s = add_waiting(core, 4, 4)
    with pytest.raises(ValueError, match="is waiting, expected running"):
        core.finish(s, 0.0)
    with pytest.raises(KeyError, match="slot 99"):
        core.admit(99, 0.0)
    core.abort(s, 0.0)
    with pytest.raises(KeyError):
        core.abort(s, 0.0)


def test_queue_delay_cap_from_the_admission_rate():
    core = make_core("overcommit", num_blocks=1000, max_queue_delay_s=2.0, drain_window_s=100)
    # No admission seen yet: no rate, so no prediction and no refusal.
    for _ in range(5):
        assert core.arrive(ArrivalRecord(8, 4), now=0.0).accepted
    for t in (1.0, 2.0, 3.0, 4.0):                        # 4 admissions, 32 prompt tokens, in 4 s
        core.admit(core.waiting()[0], t)
    # 1 waiting + the arrival at 1 request/s and 8 tokens/s: 2 s, not over the cap.
    assert core.arrive(ArrivalRecord(8, 4), now=4.0).accepted
    res = core.arrive(ArrivalRecord(8, 4), now=4.0)  # 3 requests ahead of nothing: 3 s
    assert not res.accepted and res.rejection.reason == "queue_delay"
    assert res.rejection.limit == "max_queue_delay_s" and res.rejection.retry_after_s == pytest.approx(1.0)
    assert "predicted queueing delay 3 s" in res.rejection.message
    # A long prompt is judged on its prefill tokens too: (16 + 40) tokens at 8/s = 7 s.
    assert core.arrive(ArrivalRecord(40, 4), now=4.0).rejection.reason == "queue_delay"
    assert core.stats()["rejected"]["queue_delay"] == 2


def test_retry_after_spreads_a_burst_in_line():
    """A refused burst is told to come back one after another, at the engine's pace,
    not all after the same second; the message says the room expected, the hint and
    the place in line (issue 13 item 5)."""
    core = make_core("overcommit", num_blocks=1000, max_queued_requests=2, drain_window_s=100)
    add_waiting(core, 4, 4, now=0.0)
    add_waiting(core, 4, 4, now=0.0)
    # No admission seen yet: the default 1 s, then one place per default / cap (0.5 s).
    burst = [core.arrive(ArrivalRecord(4, 4), now=0.5).rejection for _ in range(4)]
    assert [r.retry_after_s for r in burst] == pytest.approx([1.0, 1.5, 2.0, 2.5])
    assert "place 3 in the retry line" in burst[2].message
    for t in (1.0, 2.0, 3.0, 4.0):
        core.admit(core.waiting()[0], t)
        add_waiting(core, 4, 4, now=t)
    # 4 admissions over 10 s of backlog: 0.4/s, one request too many -> 2.5 s, and each
    # client of the burst one admission (2.5 s) after the one before it.
    burst = [core.arrive(ArrivalRecord(4, 4), now=10.0).rejection for _ in range(4)]
    assert [r.retry_after_s for r in burst] == pytest.approx([2.5, 5.0, 7.5, 10.0])
    last = burst[-1].message
    for words in ("2 requests waiting", "max_queued_requests=2", "room expected in 2.5 s",
                  "retry in 10 s", "place 4 in the retry line"):
        assert words in last, last
    # Once the line has passed, a refusal gets its own predicted wait again.
    res = core.arrive(ArrivalRecord(4, 4), now=30.0)
    assert res.rejection.retry_after_s == pytest.approx(30 / 4)
    # The line never pushes a hint past retry_after_max_s.
    capped = make_core("overcommit", num_blocks=1000, max_queued_requests=1, retry_after_max_s=2)
    add_waiting(capped, 4, 4)
    assert max(capped.arrive(ArrivalRecord(4, 4), now=0.0).rejection.retry_after_s
               for _ in range(10)) == 2


def test_invalid_is_a_core_reason():
    core = make_core()
    r = core.refuse_invalid("kvadmit field ttft_slo_s='soon': must be a number", "ttft_slo_s")
    assert (r.reason, r.limit, r.retryable) == ("invalid", "ttft_slo_s", False)
    st = core.stats()
    assert st["rejected"]["invalid"] == 1 and st["arrived"] == 0   # it never reached the queue


def test_a_group_larger_than_the_queue_cap_can_never_be_queued():
    core = make_core(max_queued_requests=2)
    assert core.refuse_oversized_group(2) is None
    r = core.refuse_oversized_group(3)
    assert (r.reason, r.retryable, r.limit_value) == ("queue_full", False, 2)
    assert "n=3 samples exceed max_queued_requests=2" in r.message
    assert core.stats()["arrived"] == 1 and core.stats()["rejected"]["queue_full"] == 1
    assert make_core().refuse_oversized_group(100) is None     # no cap


def test_withdraw_takes_back_an_arrival_uncounted():
    core = make_core(max_queued_requests=3)
    a = add_waiting(core, 8, 4)
    b = add_waiting(core, 8, 4)
    core.withdraw(b)
    st = core.stats()
    assert (st["arrived"], st["waiting"], st["aborted"], st["queued_tokens"]) == (1, 1, 0, 8)
    core.admit(a, 0.0)
    with pytest.raises(ValueError):
        core.withdraw(a)                                   # running: not an arrival to take back
    with pytest.raises(KeyError):
        core.withdraw(b)


def test_a_hold_counts_once_per_request_and_step():
    """next_admissible is a look: an engine may ask many times a step (vLLM's queue on
    every bool(), SGLang's adder per candidate); held counts steps (issue 11 item 4)."""
    core = make_core("peak", num_blocks=10, block_size=4)
    add_running(core, 20, 16)                  # 9 of 10 blocks at its peak
    add_waiting(core, 16, 8)                   # 6 more: never fits beside it
    for _ in range(5):
        assert core.next_admissible(5) == -1
    assert core.stats()["held"]["hold_capacity"] == 1
    core.on_step(0.0)
    for _ in range(3):
        core.next_admissible(5)
    assert core.stats()["held"]["hold_capacity"] == 2


def test_retry_after_paces_a_burst_not_its_first_milliseconds():
    """Three admissions 30 ms apart, while the engine still had room, are not the pace it
    keeps once full: hints use a rate measured over at least retry_after_default_s."""
    core = make_core("overcommit", num_blocks=1000, max_queued_requests=3, drain_window_s=30)
    for t in (0.0, 0.03, 0.06):
        add_waiting(core, 4, 4, now=t)
    for t in (0.03, 0.06, 0.09):
        core.admit(core.waiting()[0], t)
    for _ in range(3):
        add_waiting(core, 4, 4, now=0.09)
    hints = [core.arrive(ArrivalRecord(4, 4), now=0.1).rejection.retry_after_s for _ in range(6)]
    # 3 admissions over 1 s at most: one place in line per 1/3 s.
    assert hints == pytest.approx([1 / 3, 2 / 3, 1.0, 4 / 3, 5 / 3, 2.0])

"""The Retry-After line (issue 19 item 4): it holds the retry times promised and not
yet come, forgets a place when its time passes, and gives a request refused again
before its time its own place back instead of a second one. Exact, on injected times."""
import re

import pytest

from helpers import add_waiting, make_core
from kvadmit.arrival import ArrivalRecord

FILLER = (4, 4)      # the requests that keep the queue full; the refused ones differ


def capped_core(cap=4):
    core = make_core("overcommit", num_blocks=10 ** 6, max_queued_requests=cap, drain_window_s=30)
    for _ in range(cap):
        add_waiting(core, *FILLER, now=0.0)
    return core


def admit_one(core, t):
    """An engine step ending at t: it took the head of the queue, and a new request
    fills its room."""
    core.admit(core.waiting()[0], t)
    core.on_step(t)
    add_waiting(core, *FILLER, now=t)


def refuse(core, prompt, max_new, t, prompt_hash=0):
    res = core.arrive(ArrivalRecord(prompt, max_new, prompt_hash=prompt_hash), now=t)
    assert not res.accepted and res.rejection.reason == "queue_full", res
    return res.rejection


def numbers(rejection):
    """(room expected, retry in, place) from a refusal's message."""
    m = re.search(r"room expected in ([0-9.e+-]+) s, retry in ([0-9.e+-]+) s "
                  r"\(place (\d+) in the retry line\)", rejection.message)
    assert m, rejection.message
    return float(m.group(1)), float(m.group(2)), int(m.group(3))


def test_a_burst_that_never_returns_does_not_inflate_the_hint_5_s_later():
    """The issue's case: a burst refused while the pace was still measured low (its
    first second) is laid out as a long, sparse line; nobody comes back; 5 s later,
    at the engine's real pace, a fresh refusal is told the wait it really has. (The
    old line, a counter and the time of its last place, told it 22.4 s, place 83:
    `room expected in 0.0962 s, retry in 22.4 s (place 83 in the retry line)`.)"""
    core = capped_core()
    for t in (0.03, 0.06, 0.09):
        admit_one(core, t)
    burst = [refuse(core, 8, 100 + i, 0.1) for i in range(82)]
    # 3 admissions over the 1 s floor: a place every 1/3 s, out to 27.4 s.
    assert [r.retry_after_s for r in burst] == pytest.approx([(i + 1) / 3 for i in range(82)])
    for k in range(1, 51):                    # then 10 admissions a second, for 5 s
        admit_one(core, 0.1 + k / 10)
    fresh = refuse(core, 8, 999, 5.1)
    room, wait, place = numbers(fresh)
    assert room == pytest.approx(5.1 / 53, rel=1e-3)    # 53 admissions over 5.1 s of backlog
    # 15 places have passed, forgotten; the 67 still to come are 1/3 s apart, and
    # the fresh client fits before the next one (5.433 s) at the pace now (0.096 s).
    assert fresh.retry_after_s == pytest.approx(5.1 / 53)
    assert wait == pytest.approx(room, rel=1e-2) and place == 1


def test_the_line_counts_only_places_still_to_come():
    core = capped_core()
    for k in range(1, 21):                    # 10 admissions a second for 2 s
        admit_one(core, k / 10)
    burst = [refuse(core, 8, 100 + i, 2.0) for i in range(20)]
    assert [r.retry_after_s for r in burst] == pytest.approx([(i + 1) / 10 for i in range(20)])
    admit_one(core, 2.1)
    # At 3.05 s the places at 2.1 .. 3.0 have passed; 10 are still to come (3.1 .. 4.0):
    # a fresh refusal is 11th (the old line said 21st), one admission after the last
    # at the pace now (21 admissions over 3.05 s of backlog).
    fresh = refuse(core, 8, 999, 3.05)
    assert numbers(fresh)[2] == 11
    assert 3.05 + fresh.retry_after_s == pytest.approx(4.0 + 3.05 / 21)
    # Once every place has passed, a refusal gets its own predicted wait, first in line.
    room, wait, place = numbers(refuse(core, 8, 998, 5.0))
    assert place == 1 and wait == pytest.approx(room)


# vllm-router's defaults: a refusal (429, kvadmit's default, or 503) is retried after
# 50 ms, then x1.5, 5 attempts in all, Retry-After ignored (/work/shared/notes/ROUTERS.md).
ROUTER_ATTEMPTS = [0.0, 0.05, 0.125, 0.2375, 0.40625]


def _router_burst(retries: bool, sizes, fresh_size):
    """A line already stands (40 clients refused at 2.0 s, who never retry); a burst
    of `sizes` comes at 2.01 s behind vllm-router, which retries each refusal on its
    default schedule (`retries`); the engine admits one every 40 ms throughout;
    a fresh client (`fresh_size`) comes at 2.51 s. Returns the hints of
    the burst (per request, per attempt) and the fresh client's refusal."""
    core = capped_core()
    events = [(k * 0.04, 0, None) for k in range(1, 90)]            # admissions, to 3.56 s
    events += [(2.0, 1, (8, 300 + j)) for j in range(40)]            # the standing line
    for i, size in enumerate(sizes):
        for a in (ROUTER_ATTEMPTS if retries else ROUTER_ATTEMPTS[:1]):
            events.append((2.01 + a, 2, (i, size)))
    events.append((2.51, 3, fresh_size))
    hints, fresh = {}, None
    for t, kind, what in sorted(events, key=lambda e: (e[0], e[1])):
        if kind == 0:
            admit_one(core, t)
        elif kind == 1:
            refuse(core, *what, t)
        elif kind == 2:
            i, size = what
            hints.setdefault(i, []).append((t, refuse(core, *size, t).retry_after_s))
        else:
            fresh = refuse(core, *what, t)
    return hints, fresh


@pytest.mark.parametrize("sizes", [[(8, 100 + i) for i in range(10)],     # requests differ
                                   [(8, 50)] * 10])                       # all alike
def test_router_retries_before_their_time_do_not_inflate_the_line(sizes):
    """Each request's 4 early retries get its own place back, not 4 more: the burst's
    places, and the hint a fresh client gets behind them, are those without the
    retries. (The old line gave each retry a new place: on main's build the fresh
    client was told 3.14 s, place 91, with the retries and 1.53 s, place 51, without;
    here 1.53 s, place 39, both ways: the 12 places passed by then are forgotten.)"""
    alike = sizes[0] == sizes[-1]
    fresh_size = sizes[0] if alike else (8, 999)
    quiet, fresh_quiet = _router_burst(False, sizes, fresh_size)
    retried, fresh = _router_burst(True, sizes, fresh_size)
    for i in range(len(sizes)):
        (t0, h0), = quiet[i]
        assert len(retried[i]) == 5 and retried[i][0] == (t0, h0)
        for t, h in retried[i]:                  # every attempt: the same promised time
            assert t + h == pytest.approx(t0 + h0, abs=1e-9)
    if not alike:
        # 12 places of the standing line have passed by 2.51 s: 28 of it, then the
        # burst's 10, then the fresh client, with the retries or without.
        assert fresh.retry_after_s == pytest.approx(fresh_quiet.retry_after_s, abs=1e-9)
        assert numbers(fresh)[2] == numbers(fresh_quiet)[2] == 39
    else:
        # The fresh client has the numbers of the burst's requests and comes after an
        # engine step, so it is taken for the first of them back early and told its
        # place (29th; a distinct client is 39th): too short, never too long, and
        # the same with the retries or without.
        assert fresh.retry_after_s == pytest.approx(fresh_quiet.retry_after_s, abs=1e-9)
        assert numbers(fresh)[2] == numbers(fresh_quiet)[2] == 29


def test_a_burst_of_equal_requests_still_gets_a_place_each():
    """Equal requests refused in one engine step are distinct clients, whether at one
    time or a few ms apart (no client can retry before the step that refused it has
    ended); one refused in a later step while a place of its numbers is still to come
    is taken for that place's client back early."""
    core = capped_core()
    for k in range(1, 21):
        admit_one(core, k / 10)
    hints = [refuse(core, 8, 50, 2.0 + i * 1e-3).retry_after_s for i in range(5)]
    assert [2.0 + i * 1e-3 + h for i, h in enumerate(hints)] == \
        pytest.approx([2.1, 2.2, 2.3, 2.4, 2.5], abs=1e-3)
    # Another 50 ms later, still in the same step (the next ends at 2.1 s): a sixth place.
    last = 2.004 + hints[-1]
    assert 2.05 + refuse(core, 8, 50, 2.05).retry_after_s == pytest.approx(last + 2.05 / 20)
    admit_one(core, 2.1)
    # After a step, one is taken for the client of the earliest-given place
    # still to come (2.2 s; 2.1 s has passed) back early: it keeps that turn (first),
    # at its own predicted room now (2.12 + 2.12 / 21 s, a little after 2.2 s) ...
    _, wait, place = numbers(refuse(core, 8, 50, 2.12))
    assert place == 1 and 2.12 + wait == pytest.approx(2.12 + 2.12 / 21, rel=1e-3)
    # ... and the next one for the client of 2.3 s, told that place again.
    again = refuse(core, 8, 50, 2.12)
    assert numbers(again)[2] == 2 and 2.12 + again.retry_after_s == pytest.approx(2.3, abs=1e-3)
    # Still 5 places to come (2.2 .. 2.6 s; 2.1 s has passed): a different request is 6th.
    assert numbers(refuse(core, 8, 999, 2.12))[2] == 6


def test_equal_numbers_with_another_prompt_are_another_client():
    """A fixed-length benchmark's burst, refused over several engine steps: its
    requests' numbers are equal and their prompts are not, so each one refused
    after a step is a new client with a place of its own (the CI failure of
    test_serve's burst: 10 refusals told one place), while the same prompt again is
    a retry and gets its place back."""
    core = capped_core()
    for k in range(1, 21):
        admit_one(core, k / 10)
    refuse(core, 8, 50, 2.0, prompt_hash=1)
    admit_one(core, 2.05)
    places = [numbers(refuse(core, 8, 50, 2.06, prompt_hash=h))[2] for h in (2, 3, 4)]
    assert places == [2, 3, 4]
    admit_one(core, 2.08)
    assert numbers(refuse(core, 8, 50, 2.09, prompt_hash=1))[2] == 1      # keeps its turn
    assert numbers(refuse(core, 8, 50, 2.09, prompt_hash=5))[2] == 5


def test_an_early_retry_whose_room_is_later_than_its_place_keeps_its_turn():
    core = capped_core()
    for k in range(1, 21):
        admit_one(core, k / 10)
    refuse(core, 8, 77, 2.0)                                  # its place: 2.1 s
    for j in range(3):
        refuse(core, 8, 200 + j, 2.0)                         # 2.2, 2.3, 2.4 s
    admit_one(core, 2.05)
    # Back at 2.06 s: one admission away at the pace now is 2.06 + 2.06 / 21 = 2.158 s,
    # later than its place: the place moves there, still first, and the line keeps
    # 4 places, not 5 (a fresh client is 5th, after 2.4 s).
    _, wait, place = numbers(refuse(core, 8, 77, 2.06))
    assert place == 1 and 2.06 + wait == pytest.approx(2.06 + 2.06 / 21, rel=1e-3)
    fresh = refuse(core, 8, 999, 2.06)
    assert numbers(fresh)[2] == 5 and 2.06 + fresh.retry_after_s == pytest.approx(2.4 + 2.06 / 21)

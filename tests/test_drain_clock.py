"""One clock (issue 21, item 3): every mutator takes the engine's `now`, and the
drain rate's backlog clock (seconds during which requests wait) runs to each
call's time, aborts and undone admissions included.

The timeline of the tests below (overcommit pool of 1000 blocks of 4 tokens, every
prompt 8 tokens):
  t=0   A arrives                 queue: A          backlog clock runs
  t=1   A admitted (1 admission)  queue: -          backlog 1 s
  t=1   B arrives                 queue: B
  t=3   B aborted                 queue: -          backlog 3 s
  t=3   C arrives                 queue: C
  t=4   C admitted (2 admissions) queue: -          backlog 4 s
  t=6   C's admission undone      queue: C          (1 admission: undone)
  t=8   C aborted                 queue: -          backlog 6 s
  t=20  D, E arrive               queue: D, E
A router reading at t=20 sees 1 admission over 6 s of backlog: a request behind D
and E waits (2 + 1) / (1/6 per s) = 18 s. An abort that did not move the clock to
its time would lose B's 1..3 (12 s); an undo that did not would count C's 4..6 as
waiting (24 s)."""
import pytest

from helpers import add_waiting, make_core
from kvadmit.arrival import ArrivalRecord
from kvadmit.port import CorePort

EXPECTED_DELAY_S = 18.0


def core_for_the_timeline():
    return make_core("overcommit", num_blocks=1000)


def test_aborts_and_cancellations_move_the_backlog_clock_to_their_time():
    core = core_for_the_timeline()
    a = add_waiting(core, 8, 4, now=0.0)
    core.admit(a, 1.0)
    b = add_waiting(core, 8, 4, now=1.0)
    core.abort(b, 3.0)
    c = add_waiting(core, 8, 4, now=3.0)
    core.admit(c, 4.0)
    core.cancel_admit(c, 6.0)
    assert core.state(c) == "waiting"
    core.abort(c, 8.0)
    assert core.num_waiting == 0
    add_waiting(core, 8, 4, now=20.0)
    add_waiting(core, 8, 4, now=20.0)
    assert core.router_signals()["predicted_queue_delay_s"] == pytest.approx(EXPECTED_DELAY_S)
    assert core.stats()["aborted"] == 2 and core.stats()["admitted"] == 1


def test_the_bridge_aborts_at_the_engine_time():
    """The adapters' path: CorePort.leave(now) aborts at `now` (it aborted at no
    time before, so the backlog clock skipped the abort for the real engines)."""
    core = core_for_the_timeline()
    port = CorePort(core)

    def arrive(key, now):
        arrival = port.arrive(key, object(), lambda: ArrivalRecord(8, 4), now)
        assert arrival.accepted, arrival.refusal
        return arrival.slot

    core.admit(arrive("a", 0.0), 1.0)
    arrive("b", 1.0)
    port.leave("b", False, None, 3.0)
    c = arrive("c", 3.0)
    core.admit(c, 4.0)
    core.cancel_admit(c, 6.0)
    port.leave("c", True, None, 8.0)    # finished, but never ran since: an abort
    assert core.num_waiting == 0 and core.stats()["aborted"] == 2
    arrive("d", 20.0)
    arrive("e", 20.0)
    assert core.router_signals()["predicted_queue_delay_s"] == pytest.approx(EXPECTED_DELAY_S)


def test_the_clock_never_goes_back_and_reads_do_not_move_it():
    """A `now` earlier than the core's time (an arrival replayed late) is that
    request's own time; the backlog clock stays where it was. A read as of a later
    time (predict_ttft) changes nothing."""
    core = core_for_the_timeline()
    a = add_waiting(core, 8, 4, now=0.0)
    core.admit(a, 2.0)                       # 1 admission over 2 s of backlog
    add_waiting(core, 8, 4, now=2.0)
    add_waiting(core, 8, 4, now=1.0)         # late: the clock stays at 2
    assert core.router_signals()["predicted_queue_delay_s"] == pytest.approx(3 * 2.0)
    core.predict_ttft(8, 50.0)               # a read as of t=50
    assert core.router_signals()["predicted_queue_delay_s"] == pytest.approx(3 * 2.0)
    core.on_step(4.0)                        # 2 more seconds with 2 waiting
    assert core.router_signals()["predicted_queue_delay_s"] == pytest.approx(3 * 4.0)


@pytest.mark.parametrize("call", ["arrive", "admit", "preempt", "finish", "abort", "cancel_admit",
                                  "on_step", "observe_cache", "expire_sessions"])
def test_every_mutator_requires_now(call):
    core = core_for_the_timeline()
    waiting = add_waiting(core, 8, 4, now=0.0)
    running = add_waiting(core, 8, 4, now=0.0)
    core.admit(running, 0.0)
    args = {"arrive": (8, 4), "admit": (waiting,), "preempt": (running,), "finish": (running,),
            "abort": (running,), "cancel_admit": (running,), "on_step": (),
            "observe_cache": (0, 0, 0), "expire_sessions": ()}[call]
    before = core.stats()
    with pytest.raises(TypeError, match=call):
        getattr(core, call)(*args)
    assert core.stats() == before

"""Agent-level admission (CONCUR): the AIMD rule, exact window sequences, holds
that never block other sessions, pausing between generations, idle expiry."""
import pytest

from helpers import make_core
from kvadmit._native import next_agent_window
from kvadmit.arrival import ArrivalRecord
from kvadmit import Requests


@pytest.mark.parametrize("w, usage, hits, want", [
    (4, 0.1, 0.0, 6),          # usage below U_low: +alpha
    (4, 0.3, 0.0, 4),          # between the thresholds: hold
    (4, 0.6, 0.1, 2),          # usage high and hits low (thrashing): *beta
    (4, 0.6, 0.5, 4),          # usage high but the cache works: hold
    (1, 0.9, 0.0, 1),          # never below the floor
    (9, 0.0, 0.0, 10),         # never above the ceiling
])
def test_aimd_rule(w, usage, hits, want):
    assert next_agent_window(w, usage, hits, 2.0, 0.5, 0.2, 0.5, 0.2, 1.0, 10.0) == want


def agent_core(**cfg):
    settings = dict(agent_window=True, agent_window_init=4, agent_interval_s=0.0,
                    agent_cooldown_intervals=1, agent_idle_s=60.0)
    settings.update(cfg)
    return make_core("overcommit", num_blocks=100, **settings)


def one_session_in_a_busy_pool(**cfg):
    """A core whose window (W = 1) is full: session 1 runs, the pool 90% used."""
    core = agent_core(agent_window_init=1, **cfg)
    core.admit(core.arrive(ArrivalRecord(10, 5, session=1), now=0.0).slot, 0.0)
    core.observe_cache(90, 0, 0, now=0.0)
    return core


def test_exact_window_sequence_with_cooldown():
    core = agent_core()
    # (used blocks of 100, hit tokens, query tokens) per step, one update per step
    for used, hit, query in [(10, 0, 0), (60, 0, 100), (10, 0, 0), (10, 0, 0), (60, 50, 100),
                             (30, 0, 100)]:
        core.observe_cache(used, hit, query, 0.0)
    # grow; thrash -> halve; cooldown holds one update; grow; hits high -> hold; in band -> hold
    assert core.window_history() == [6, 3, 3, 5, 5, 5]
    assert core.agent_window_size == 5


def test_signals_are_averaged_over_the_interval():
    """One update per agent_interval_s of engine time, however many steps it holds."""
    core = agent_core(agent_interval_s=1.0)
    core.observe_cache(10, 0, 0, 0.0)
    core.observe_cache(50, 0, 0, 1.0)          # a second on: mean usage 0.3, hold
    core.observe_cache(5, 0, 0, 1.5)
    core.observe_cache(15, 0, 0, 1.9)          # not yet a second since the update
    core.observe_cache(0, 0, 0, 2.0)           # mean 0.067: grow
    assert core.window_history() == [4, 6]


def test_session_outside_the_window_waits_without_blocking_others():
    core = agent_core(agent_window_init=1, agent_window_max=1, agent_max_wait_s=0.0)
    a1 = core.arrive(ArrivalRecord(10, 5, session=7), now=0.0).slot
    assert core.next_admissible(100) == a1
    core.admit(a1, 0.0)
    b1 = core.arrive(ArrivalRecord(10, 5, session=8), now=1.0).slot
    a2 = core.arrive(ArrivalRecord(10, 5, session=7), now=2.0).slot  # behind b1 in arrival order
    assert core.decide(b1, 100) == "hold_agent"
    assert core.next_admissible(100) == a2                   # b1 does not block session 7
    core.admit(a2, 2.0)
    assert core.info(b1)["bypassed"] == 0                    # a window hold is not a bypass
    assert core.session_active(7) and not core.session_active(8)
    assert core.stats()["held"]["hold_agent"] >= 1
    core.finish(a1, 3.0)
    core.finish(a2, 4.0)
    # Session 7 is idle but keeps its place for agent_idle_s (tool calls, thinking).
    core.observe_cache(0, 0, 0, now=30.0)
    assert core.next_admissible(100) == -1
    core.observe_cache(0, 0, 0, now=64.0)                     # idle 60 s: it leaves
    assert not core.session_active(7)
    assert core.next_admissible(100) == b1


def test_a_held_session_waits_at_most_agent_max_wait_s():
    """A session held agent_max_wait_s enters over a full window, and W grows to take
    it (no other session is pushed out for it); counted as overdue."""
    core = agent_core(agent_window_init=2, agent_window_max=8, agent_max_wait_s=10.0)
    a = core.arrive(ArrivalRecord(10, 5, session=1), now=0.0).slot
    b = core.arrive(ArrivalRecord(10, 5, session=2), now=0.0).slot
    core.admit(a, 0.0)
    core.admit(b, 0.0)
    core.finish(b, 5.0)                                       # session 2: in a tool call
    c = core.arrive(ArrivalRecord(10, 5, session=3), now=6.0).slot
    core.observe_cache(90, 0, 0, now=15.9)
    assert core.decide(c, 100) == "hold_agent"                # waited 9.9 s
    core.observe_cache(90, 0, 0, now=16.0)
    assert core.decide(c, 100) == "admit"                     # 10 s: no longer held
    core.admit(c, 16.0)
    assert all(core.session_active(x) for x in (1, 2, 3))
    window = core.stats()["agent_window"]
    assert (window["overdue"], window["exits"]["paused"], core.agent_window_size) == (1, 0, 3)


def test_past_agent_window_max_overdue_sessions_take_turns():
    """At agent_window_max W does not grow: the overdue session runs its turn, then
    is paused between generations (the newest activated) and waits again."""
    core = agent_core(agent_window_init=1, agent_window_max=1, agent_max_wait_s=10.0)
    a = core.arrive(ArrivalRecord(10, 5, session=1), now=0.0).slot
    core.admit(a, 0.0)
    b = core.arrive(ArrivalRecord(10, 5, session=2), now=0.0).slot
    core.observe_cache(90, 0, 0, now=10.0)
    assert core.decide(b, 100) == "admit"
    core.admit(b, 10.0)
    core.finish(b, 11.0)
    core.observe_cache(90, 0, 0, now=11.0)                    # 2 active over W = 1
    assert core.session_active(1) and not core.session_active(2)
    assert core.stats()["agent_window"]["exits"]["paused"] == 1


def test_an_interactive_session_is_held_at_most_half_its_ttft_target():
    """A session whose request carries its own TTFT target (interactive) is held at
    most half of it (the rest is for its queue and prefill), however long
    agent_max_wait_s is."""
    core = one_session_in_a_busy_pool(agent_window_max=1, agent_max_wait_s=60.0,
                                      agent_interval_s=10.0)
    batch = core.arrive(ArrivalRecord(10, 5, session=2), now=0.0).slot
    chat = core.arrive(ArrivalRecord(10, 5, session=3, ttft_slo_s=2.0), now=0.0).slot
    assert core.next_window_change() == pytest.approx(1.0)
    core.observe_cache(90, 0, 0, now=0.99)
    assert core.decide(batch, 100) == core.decide(chat, 100) == "hold_agent"
    core.observe_cache(90, 0, 0, now=1.0)
    assert core.decide(batch, 100) == "hold_agent" and core.decide(chat, 100) == "admit"
    assert core.stats()["agent_window"]["interactive_sessions"] == 1


def test_an_idle_engine_wakes_when_the_window_can_change():
    """With only held sessions waiting, the next change is the sooner of a held
    session's bound and the next update; at it the pool is empty, so the held
    session enters and W grows by one for it."""
    core = agent_core(agent_window_init=1, agent_window_max=4, agent_interval_s=0.5,
                      agent_max_wait_s=10.0)
    a = core.arrive(ArrivalRecord(10, 5, session=1), now=0.0).slot
    core.admit(a, 0.0)
    core.observe_cache(30, 0, 0, now=0.0)                     # usage 0.3: the interval starts
    core.finish(a, 0.1)
    b = core.arrive(ArrivalRecord(10, 5, session=2), now=0.2).slot
    assert core.decide(b, 100) == "hold_agent"
    assert core.next_window_change() == pytest.approx(0.5)
    core.expire_sessions(0.5)                                 # nothing ran: the pool is empty
    assert core.agent_window_size == 1                        # the interval's mean 0.3: hold
    assert core.decide(b, 100) == "admit"
    core.admit(b, 0.5)
    assert core.agent_window_size == 2 and core.active_sessions == 2


def test_a_nearly_empty_pool_holds_no_session():
    """Below agent_usage_low at the latest step, a session enters a full window and W
    grows by one (up to agent_window_max), between updates; above it the window holds."""
    core = agent_core(agent_window_init=1, agent_window_max=2, agent_interval_s=10.0)
    a = core.arrive(ArrivalRecord(10, 5, session=1), now=0.0).slot
    core.admit(a, 0.0)
    core.observe_cache(50, 0, 100, now=0.0)        # usage 0.5; no update for 10 s
    b = core.arrive(ArrivalRecord(10, 5, session=2), now=0.0).slot
    assert core.decide(b, 100) == "hold_agent"
    core.observe_cache(10, 0, 100, now=0.1)        # usage 0.1
    assert core.decide(b, 100) == "admit"
    core.admit(b, 0.1)
    assert core.agent_window_size == 2 and core.window_history() == []   # not an update
    c = core.arrive(ArrivalRecord(10, 5, session=3), now=0.2).slot
    assert core.decide(c, 100) == "hold_agent"                # at agent_window_max


def test_while_a_session_is_held_a_finished_one_leaves_after_four_return_gaps():
    """Sessions come back from their tools 1 s after a turn (8 such gaps seen): while
    another session is held, one idle for 4 s is taken as finished and leaves, instead
    of keeping its place for agent_idle_s (60 s)."""
    core = agent_core(agent_window_init=1, agent_window_max=1, agent_max_wait_s=0.0)
    t = 0.0
    for turn in range(9):                      # one session, 9 turns, 1 s tool waits
        s = core.arrive(ArrivalRecord(10, 5, session=1), now=t).slot
        core.admit(s, t)
        core.finish(s, t + 0.5)
        t += 1.5
    window = core.stats()["agent_window"]
    assert window["return_gaps"] == 8 and window["return_gap_mean_s"] == pytest.approx(1.0)
    held = core.arrive(ArrivalRecord(10, 5, session=2), now=t).slot     # session 1 is done
    assert core.next_window_change() == pytest.approx(t - 1.0 + 4.0)   # idle since t - 1
    core.observe_cache(90, 0, 0, now=t - 1.0 + 3.9)
    assert core.decide(held, 100) == "hold_agent"
    core.observe_cache(90, 0, 0, now=t - 1.0 + 4.0)
    assert not core.session_active(1) and core.decide(held, 100) == "admit"
    assert core.stats()["agent_window"]["exits"]["expired"] == 1


def test_an_undone_overdue_entry_counts_once_and_gives_its_place_back():
    """vLLM may undo an admission step after step (no KV after all): the overdue
    entry and W's growth for it are taken back each time, counted once in the end."""
    core = one_session_in_a_busy_pool(agent_window_max=4, agent_max_wait_s=10.0,
                                      agent_interval_s=60.0)
    b = core.arrive(ArrivalRecord(10, 5, session=2), now=0.0).slot
    for t in (10.0, 10.1, 10.2):
        core.observe_cache(90, 0, 0, now=t)
        core.admit(b, t)
        assert core.agent_window_size == 2 and core.stats()["agent_window"]["overdue"] == 1
        core.cancel_admit(b, t)
        assert core.agent_window_size == 1 and core.stats()["agent_window"]["overdue"] == 0
    core.admit(b, 10.3)
    assert core.stats()["agent_window"]["overdue"] == 1 and core.active_sessions == 2


def test_a_session_paused_with_a_queued_request_is_held_from_its_pause():
    """A session paused when W shrinks may have a request queued (waiting for KV) for
    long: its bound counts from the pause, not from when that request queued."""
    core = agent_core(agent_window_init=2, agent_window_max=2, agent_max_wait_s=10.0,
                      agent_cooldown_intervals=0, agent_interval_s=60.0)
    a = core.arrive(ArrivalRecord(10, 5, session=1), now=0.0).slot
    core.admit(a, 0.0)
    b = core.arrive(ArrivalRecord(10, 5, session=2), now=0.0).slot
    core.admit(b, 0.0)
    core.finish(b, 1.0)
    b2 = core.arrive(ArrivalRecord(10, 5, session=2), now=1.0).slot    # queued, not admitted
    core.observe_cache(60, 0, 100, now=1.0)                  # the interval starts
    core.observe_cache(90, 0, 100, now=61.0)                 # thrashing: W 2 -> 1, 2 paused
    assert core.agent_window_size == 1 and not core.session_active(2)
    core.observe_cache(90, 0, 100, now=70.9)
    assert core.decide(b2, 100) == "hold_agent"              # queued 70 s, held 9.9 s
    core.observe_cache(90, 0, 100, now=71.0)
    assert core.decide(b2, 100) == "admit"


def test_the_native_engine_wakes_for_a_held_session_at_interval_zero():
    """With W updated every step (agent_interval_s 0) and nothing running, the engine
    still wakes when the held session's bound ends (it raised 'stuck' before)."""
    from kvadmit import AdmissionConfig
    from kvadmit._native import NativeEngine
    cfg = AdmissionConfig(agent_window=True, agent_window_init=1, agent_window_max=1,
                          agent_interval_s=0.0, agent_max_wait_s=2.0)
    e = NativeEngine(cfg, 1000, 16, 4096, 64, 2048, step_a=0.01, step_b=1e-5)
    e.add_requests(Requests([0.0, 0.001], [100, 100], [5, 5], [10, 10], session=[1, 2]))
    e.run()
    r = e.results()
    assert r["rejected"] == [None, None]
    assert 2.001 <= r["first_token_s"][1] < 2.5                 # its bound, not agent_idle_s
    assert e.totals()["free_blocks_at_end"] == 1000


def test_shrinking_window_pauses_latest_sessions_between_generations():
    core = agent_core(agent_window_init=3, agent_cooldown_intervals=0)
    slots = {}
    for sess in (1, 2, 3):                                   # activated in this order
        s = core.arrive(ArrivalRecord(10, 5, session=sess), now=0.0).slot
        core.admit(s, 0.0)
        slots[sess] = s
    core.finish(slots[1], 0.0)
    core.finish(slots[3], 0.0)                                    # 1 and 3 are between turns
    assert core.active_sessions == 3
    core.observe_cache(90, 0, 100, 0.0)                           # thrashing: W 3 -> 1.5
    # Paused latest first, never mid-generation: 3 goes, 2 (running) stays, then 1 goes.
    assert not core.session_active(3) and core.session_active(2) and not core.session_active(1)
    assert core.active_sessions == 1
    s3 = core.arrive(ArrivalRecord(10, 5, session=3), now=0.0).slot
    assert core.decide(s3, 100) == "hold_agent"


def test_the_engine_bridge_empties_the_pause_log_every_step():
    """The core logs paused sessions for an engine that demotes their prefixes; the
    adapters' engines do not, so the port empties it at each step's cache signals
    (else it grew by a session id per pause for the server's whole life)."""
    from kvadmit.port import CorePort, StepReport
    core = agent_core(agent_window_init=3, agent_cooldown_intervals=0)
    port = CorePort(core)
    slots = [core.arrive(ArrivalRecord(10, 5, session=sess), now=0.0).slot for sess in (1, 2, 3)]
    for s in slots:
        core.admit(s, 0.0)
    core.finish(slots[0], 0.0)
    core.finish(slots[2], 0.0)
    port.note_prefix_hits(0, 100)
    port.step(StepReport(now=0.0, used_blocks=90))         # thrashing: 3 and 1 paused
    assert not core.session_active(3) and not core.session_active(1)
    assert core.take_paused_sessions() == []


def test_the_window_history_keeps_the_recent_updates_not_every_one():
    """A server calls observe_cache every step for months: the history is bounded."""
    core = agent_core(agent_window_init=4, agent_window_max=8, agent_cooldown_intervals=0)
    for i in range(20000):
        core.observe_cache(10 if i % 2 else 90, 0, 100, 0.0)          # idle / thrashing in turns
    hist = core.window_history()
    assert 4096 <= len(hist) < 8192
    assert hist[-1] == core.agent_window_size               # the newest is kept


def test_without_agent_window_sessions_are_ignored():
    core = make_core("overcommit", num_blocks=100)
    s = core.arrive(ArrivalRecord(10, 5, session=5), now=0.0).slot
    assert core.decide(s, 100) == "admit" and core.session_active(5)


def test_cancelled_admission_undoes_the_activation():
    core = agent_core(agent_window_init=1, agent_window_max=1)
    a = core.arrive(ArrivalRecord(10, 5, session=1), now=0.0).slot
    b = core.arrive(ArrivalRecord(10, 5, session=2), now=0.0).slot
    core.admit(a, 0.0)
    core.cancel_admit(a, 0.0)                  # the engine did not run it after all
    assert not core.session_active(1) and core.active_sessions == 0
    assert core.next_admissible(100) == a  # the head again; session 2 still waits behind it
    assert core.decide(b, 100) == "admit"


def test_full_window_of_idle_sessions_does_not_stall_the_engine():
    """Session 1 is done but holds the only place; the engine sleeps until it expires
    (agent_idle_s) instead of stopping, and session 2 then runs."""
    from kvadmit import AdmissionConfig
    from kvadmit._native import NativeEngine
    cfg = AdmissionConfig(agent_window=True, agent_window_init=1, agent_window_max=1,
                          agent_idle_s=5.0)
    e = NativeEngine(cfg, 1000, 16, 4096, 64, 2048, step_a=0.01, step_b=1e-5)
    e.add_requests(Requests([0.0, 0.001], [100, 100], [5, 5], [10, 10], session=[1, 2]))
    e.run()
    r = e.results()
    assert r["rejected"] == [None, None]
    assert r["finish_s"][1] > r["finish_s"][0] + 5.0            # waited for the expiry
    assert e.totals()["free_blocks_at_end"] == 1000


def test_agent_workload_with_a_small_window_finishes():
    from kvadmit import AdmissionConfig
    from kvadmit.simulate import EngineShape, agent_sessions, get_preset, run_native
    w = agent_sessions(60, 2.0, seed=1, turns_mean=4, tool_wait_mean_s=1.0)
    raw = run_native(w, AdmissionConfig(policy="overcommit", agent_window=True, agent_window_init=4),
                     EngineShape(num_blocks=1200, prefix_caching=True), get_preset("h100-8b"))
    assert raw.totals.finished + raw.totals.rejected == len(w)
    assert raw.totals.finished > len(w) // 2
    assert set(raw.per_request["rejected"]) <= {None, "context_length"}   # turns past 8192


def test_held_requests_are_not_counted_ahead_of_an_arrival():
    from kvadmit import AdmissionConfig, AdmissionCore
    core = AdmissionCore(AdmissionConfig(
        policy="overcommit", agent_window=True, agent_window_init=1, agent_window_max=1,
        slo_guard=True, step_time_a=0.01, step_time_b=0.001, step_time_c=0.0,
        step_time_forgetting=1.0), 100_000, 4)
    core.set_step_budget(1000)
    core.admit(core.arrive(ArrivalRecord(10, 5, session=1), now=0.0).slot, 0.0)
    for sess in range(2, 12):                                  # ten held 30k-token prompts
        assert core.arrive(ArrivalRecord(30_000, 5, session=sess, ttft_slo_s=0.0), now=0.0).accepted
    # a session-less request is served next: only its own prefill is predicted
    res = core.arrive(ArrivalRecord(100, 5, ttft_slo_s=1.0), now=0.0)
    assert res.accepted, res
    assert core.predict_ttft(100, 0.0) < 1.0


def test_demoted_block_is_taken_next():
    from kvadmit._native import BlockAllocator
    a = BlockAllocator(8)
    b = a.allocate(1)[0]
    a.cache(b, 42)
    a.free([b])
    assert a.free_order()[-1] == b                             # cached: evicted last
    assert a.demote(b, 42) and a.free_order()[0] == b          # paused: evicted first
    assert a.lookup(42) == b                                   # still reusable
    assert not a.demote(b, 43)                                 # another hash: untouched
    a.check_invariants()

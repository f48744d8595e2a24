"""SLO targets, deadlines and the agent window through SGLang's real request
path: per-request fields in SamplingParams.custom_params["kvadmit"], the TTFT
guard at arrival (slo_infeasible), the TPOT guard and the agent window in the
hooked PrefillAdder, the step-time fit fed by the step hook, and rank 0's
clock shared with the other ranks of a waiting queue."""
import json
from http import HTTPStatus

import pytest

pytest.importorskip("sglang.srt")  # not "sglang": see conftest.py

from kvadmit import AdmissionConfig  # noqa: E402
from kvadmit.request_fields import (  # noqa: E402
    NONE,
    FieldError,
    RequestFields,
    session_int,
)
from kvadmit.sglang import ClockTick, parse_request_params, plugin  # noqa: E402

# The virtual clock's step model (a + b * tokens + c * context seconds), also
# given to the core as its starting fit: observed steps then match it exactly.
# Powers of two (~7.8 ms, ~122 us/token, ~0.95 us/context token): every step
# time is a multiple of 2**-20 s, which the clock (UNIX time, ~1.8e9) holds exactly.
MODEL = (2.0 ** -7, 2.0 ** -13, 2.0 ** -20)
MODEL_CFG = {"step_time_a": MODEL[0], "step_time_b": MODEL[1], "step_time_c": MODEL[2]}


def harness(pool=2048, model=MODEL, **cfg):
    from sglang_harness import Harness

    return Harness(AdmissionConfig.from_dict(cfg), pool_tokens=pool, step_model=model)


def kv(**fields):
    return {"kvadmit": fields}


def only_abort(h):
    (abort, _), = h.outbox.sent
    return abort.finished_reason


# ----------------------------------------------------------------------
# Request fields
NOW = 1.8e9


def test_fields_parse():
    """custom_params["kvadmit"] holds kvadmit.request_fields' fields (as vLLM's extra_args)."""
    assert parse_request_params(None, NOW) is NONE
    assert parse_request_params({"thinking_budget": 3}, NOW) is NONE   # other keys: not ours
    assert parse_request_params(kv(), NOW) is NONE
    got = parse_request_params(kv(ttft_slo_s=2, tpot_slo_s=0.05, session="agent-7"), NOW)
    assert got == RequestFields(ttft_slo_s=2.0, tpot_slo_s=0.05, session=session_int("agent-7"))
    assert parse_request_params(kv(session=42), NOW).session == 42
    assert parse_request_params(kv(deadline_s=NOW + 1.5), NOW).deadline_s == NOW + 1.5
    # SGLang's own session id is the session when kvadmit's names none.
    assert parse_request_params(None, NOW, "conv-1").session == session_int("conv-1", "session_id")
    assert parse_request_params(kv(session=5), NOW, "conv-1").session == 5
    assert parse_request_params(None, NOW, "").session == -1


@pytest.mark.parametrize("custom, words", [
    (kv(ttft_slo_s="fast"), "custom_params.kvadmit.ttft_slo_s='fast'"),
    (kv(ttft_slo_s=-1), "custom_params.kvadmit.ttft_slo_s=-1"),
    (kv(tpot_slo_s=1e9), "custom_params.kvadmit.tpot_slo_s"),
    (kv(deadline_s=True), "custom_params.kvadmit.deadline_s"),
    (kv(deadline_s=30), "custom_params.kvadmit.deadline_s"),      # relative: not a UNIX time
    (kv(deadline_s=NOW * 1000), "custom_params.kvadmit.deadline_s"),  # milliseconds
    (kv(session=-3), "custom_params.kvadmit.session"),
    (kv(session=1.5), "custom_params.kvadmit.session"),
    (kv(session=""), "custom_params.kvadmit.session"),
    (kv(ttft=1.0), "custom_params.kvadmit.ttft"),      # unknown field (a typo): refused
    ({"kvadmit": 5}, "custom_params.kvadmit=5"),
])
def test_bad_field_is_refused_naming_it(kvadmit_hooks, custom, words):
    from sglang_harness import make_req

    with pytest.raises(FieldError) as info:
        parse_request_params(custom, NOW)
    assert words in str(info.value)

    h = harness(slo_guard=True)
    assert not h.submit(make_req("bad", 30, 10, custom_params=custom))
    reason = only_abort(h)
    assert reason["status_code"] == HTTPStatus.BAD_REQUEST   # retrying cannot help
    assert reason["kvadmit_reason"] == "invalid"
    assert words in reason["message"] and "retrying will not help" in reason["message"]
    assert "retry_after" not in reason
    stats = h.adapter.stats()
    assert stats["arrived"] == 0 and stats["rejected"]["invalid"] == 1
    assert h.adapter.slot_for(make_req("bad", 1, 1)) is None
    assert h.submit(make_req("good", 30, 10, custom_params=kv(ttft_slo_s=5)))


# ----------------------------------------------------------------------
# TTFT guard at arrival
def test_infeasible_ttft_refused_while_feasible_runs(kvadmit_hooks):
    from sglang_harness import make_req

    h = harness(slo_guard=True, **MODEL_CFG)
    core = h.adapter.port.core
    first = make_req("first", 100, 8, custom_params=kv(ttft_slo_s=1.0))
    assert h.submit(first)
    h.step()
    h.step()
    assert core.state(h.adapter.slot_for(first)) == "running"
    # One decoding request beside a 100-token prefill: one step of the model.
    info = core.info(h.adapter.slot_for(first))
    context = info["prompt_tokens"] + info["generated_tokens"]
    pred = core.predict_ttft(100, h.t)
    assert pred == pytest.approx(MODEL[0] + MODEL[1] * (1 + 100) + MODEL[2] * (context + 100))

    late = make_req("late", 100, 8, custom_params=kv(ttft_slo_s=pred / 2))
    assert not h.submit(late)
    reason = only_abort(h)
    assert reason["kvadmit_reason"] == "slo_infeasible"
    assert reason["status_code"] == HTTPStatus.TOO_MANY_REQUESTS   # overload: retry (the default 429)
    assert reason["retry_after"] >= 1
    assert f"ttft_slo_s={pred / 2:g}" in reason["message"]

    fine = make_req("fine", 100, 8, custom_params=kv(ttft_slo_s=pred * 2))
    assert h.submit(fine)
    h.run()
    assert first.finished() and fine.finished() and not late.finished()
    stats = h.adapter.stats()
    assert stats["rejected"]["slo_infeasible"] == 1 and stats["finished"] == 2


def test_deadline(kvadmit_hooks):
    """deadline_s is absolute (UNIX) time, against the server's clock."""
    from sglang_harness import make_req

    h = harness(slo_guard=True, **MODEL_CFG)
    pred = h.adapter.port.core.predict_ttft(100, h.t)   # empty server: one prefill step
    assert pred == pytest.approx(MODEL[0] + MODEL[1] * 100 + MODEL[2] * 100)
    assert not h.submit(make_req("near", 100, 8, custom_params=kv(deadline_s=h.t + pred / 2)))
    reason = h.outbox.sent[-1][0].finished_reason
    assert reason["kvadmit_reason"] == "slo_infeasible"
    assert reason["status_code"] == HTTPStatus.TOO_MANY_REQUESTS
    # ttft_slo_s alone would pass; the deadline is tighter.
    assert not h.submit(make_req("both", 100, 8, custom_params=kv(
        ttft_slo_s=10.0, deadline_s=h.t + pred / 2)))
    # Already passed: a target no request meets (as on vLLM: refused as infeasible).
    assert not h.submit(make_req("gone", 100, 8, custom_params=kv(deadline_s=h.t - 1)))
    assert h.outbox.sent[-1][0].finished_reason["kvadmit_reason"] == "slo_infeasible"
    assert h.submit(make_req("ok", 100, 8, custom_params=kv(deadline_s=h.t + 2 * pred)))
    assert h.submit(make_req("loose", 100, 8, custom_params=kv(
        ttft_slo_s=2 * pred, deadline_s=h.t + 100)))
    assert h.adapter.stats()["rejected"]["slo_infeasible"] == 3


def test_deadline_order(kvadmit_hooks):
    """queue_order 'deadline': the earliest deadline is served first; without
    the guard a passed deadline is not refused, just most urgent."""
    from sglang_harness import make_req

    h = harness(queue_order="deadline")
    t = h.t
    for rid, d in (("late", t + 9), ("none", None), ("soon", t + 2), ("passed", t - 5)):
        assert h.submit(make_req(rid, 20, 4, custom_params=kv(deadline_s=d) if d else None))
    h.sched.get_prefill_adder_class()  # the hook sorts the queue in the core's order
    assert [r.rid for r in h.sched.waiting_queue] == ["passed", "soon", "late", "none"]


# ----------------------------------------------------------------------
# TPOT guard in the adder
def test_tpot_guard_holds_without_blocking_the_loop(kvadmit_hooks):
    from sglang_harness import make_req

    h = harness(pool=8192, slo_guard=True, **MODEL_CFG)
    core = h.adapter.port.core
    a = make_req("a", 100, 6, custom_params=kv(tpot_slo_s=0.009))
    assert h.submit(a)
    h.step()
    h.step()
    # b's 2000 tokens of context would slow a's decode steps past 9 ms (alone: about 8 ms).
    b = make_req("b", 2000, 4)
    assert h.submit(b)
    while not a.finished():
        batch = h.step()
        assert [r.rid for r in batch.reqs] == ["a"] and b in h.sched.waiting_queue
        assert core.decide(h.adapter.slot_for(b), 8192) == "hold_slo"
        # A TPOT hold stops the step without marking the batch full.
        assert not h.sched.running_batch.batch_is_full
    batch = h.step()  # a is gone: nothing left to slow down
    assert [r.rid for r in batch.reqs] == ["b"] and batch.forward_mode.is_extend()
    assert core.stats()["held"]["hold_slo"] >= 3


# ----------------------------------------------------------------------
# Agent window
def test_agent_window_holds_other_sessions_until_idle(kvadmit_hooks):
    """W = 1: session A's requests run, B's waits without blocking A's later
    request; B starts the step after A's last request finished (idle_s = 0)."""
    from sglang_harness import make_req

    h = harness(agent_window=True, agent_window_init=1, agent_window_max=1,
                agent_interval_s=0.0, agent_idle_s=0.0)
    core = h.adapter.port.core
    a1 = make_req("a1", 50, 3, custom_params=kv(session="A"))
    b1 = make_req("b1", 50, 3, custom_params=kv(session="B"))
    a2 = make_req("a2", 40, 3, custom_params=kv(session="A"))
    for r in (a1, b1, a2):
        assert h.submit(r)
    got = []
    for _ in range(5):
        batch = h.step()
        got.append((batch.forward_mode.is_extend(), [r.rid for r in batch.reqs],
                    [r.rid for r in h.sched.waiting_queue], core.active_sessions))
    assert got == [
        (True, ["a1", "a2"], ["b1"], 1),     # b1 (session B) skipped, a2 passes it
        (False, ["a1", "a2"], ["b1"], 1),
        (False, ["a1", "a2"], ["b1"], 1),    # a1, a2 finish (3 tokens)
        (True, ["b1"], [], 1),               # A idle and out of the window: B in
        (False, ["b1"], [], 1),
    ]
    assert core.session_active(session_int("B")) and not core.session_active(session_int("A"))
    assert core.agent_window_size == 1.0
    # b1 was held for 3 steps: a hold counts once per request and step (SGLang's adder
    # looks at the queue once per candidate, twice in the first step).
    assert core.stats()["held"]["hold_agent"] == 3
    assert not h.sched.running_batch.batch_is_full


def test_agent_window_grows_on_an_idle_pool(kvadmit_hooks):
    """observe_cache gets the pool's usage each step: a nearly empty pool grows W."""
    from sglang_harness import make_req

    h = harness(agent_window=True, agent_window_init=1, agent_interval_s=0.0, agent_alpha=1.0)
    for i in range(3):
        assert h.submit(make_req(f"s{i}", 20, 6, custom_params=kv(session=i)))
    h.run()
    core = h.adapter.port.core
    assert core.agent_window_size > 1.0 and core.stats()["agent_window"]["changes"] >= 1
    assert h.adapter.stats()["finished"] == 3


# ----------------------------------------------------------------------
# Step-time fit
def test_observe_step_counts_steps(kvadmit_hooks):
    """Each batch's duration (the interval to the next step) reaches the core
    with that batch's tokens and context: with the model as the starting fit
    the observations match it exactly and the fit does not move."""
    import random

    from sglang_harness import make_req

    h = harness(pool=4096, **MODEL_CFG)
    rng = random.Random(5)
    plan = {3 * i: [make_req(f"r{i}", rng.randint(20, 400), 64, out_len=rng.randint(5, 60))]
            for i in range(20)}
    log = h.run(plan)
    fit = h.adapter.port.core.step_time
    # Every batch is followed by a step (run() ends with one), so each is observed once.
    assert fit.observations == log.prefill + log.decode == h.adapter.stats()["observed_steps"]
    assert log.prefill > 0 and log.decode > 0
    for got, want in zip(fit.coefficients, MODEL):
        assert got == pytest.approx(want, rel=1e-6)
    assert h.adapter.stats()["step_time_fit"]["observations"] == fit.observations


def test_observe_step_learns(kvadmit_hooks):
    import random

    from sglang_harness import make_req

    truth = (0.02, 2e-4, 3e-6)
    h = harness(pool=4096, model=truth)  # the core starts from its default fit
    prior = h.adapter.port.core.step_time.predict(8, 3000)
    want = truth[0] + truth[1] * 8 + truth[2] * 3000
    rng = random.Random(5)
    h.run({3 * i: [make_req(f"r{i}", rng.randint(20, 400), 64, out_len=rng.randint(5, 60))]
           for i in range(30)})
    after = h.adapter.port.core.step_time.predict(8, 3000)
    assert abs(after - want) < abs(prior - want) / 3


def test_idle_time_is_not_step_time(kvadmit_hooks):
    from sglang_harness import make_req

    h = harness(**MODEL_CFG)
    h.step()
    h.t += 50.0  # idle
    h.step()
    assert h.adapter.port.core.step_time.observations == 0
    assert h.submit(make_req("a", 30, 3))
    h.step()            # prefill (the forward advances the clock by the model)
    h.step()            # observes the prefill
    assert h.adapter.port.core.step_time.observations == 1
    for got, want in zip(h.adapter.port.core.step_time.coefficients, MODEL):
        assert got == pytest.approx(want, rel=1e-6)


def test_step_budget_from_sglang(kvadmit_hooks, monkeypatch):
    from sglang_harness import Harness

    sched = Harness(None).sched
    sched.metrics_reporter = None
    sched.max_prefill_tokens = 16384
    monkeypatch.setenv("KVADMIT_CONFIG", json.dumps({"slo_guard": True}))
    for chunk, budget in ((512, 512), (None, 16384), (32768, 16384)):
        sched.chunked_prefill_size = chunk
        plugin.around_scheduler_init(lambda self, *a, **k: None, sched)
        assert sched._kvadmit.step_budget == budget
        assert sched._kvadmit.stats()["step_budget"] == budget
        assert not sched._kvadmit.synced_clock  # one rank here


# ----------------------------------------------------------------------
# Rank 0's clock on every rank
def _ingest(h, items):
    """What SGLang's ingest_requests does with the broadcast list on each rank."""
    seen = []
    plugin.around_process_input_requests(lambda self, reqs: seen.extend(reqs), h.sched, items)
    return seen


def test_clock_tick_rides_the_broadcast(kvadmit_hooks):
    from sglang_harness import make_req

    h = harness(slo_guard=True)
    assert plugin.after_poll_timeout_aborts([], h.sched) == []   # one rank: nothing added
    h.adapter.synced_clock = True
    out = plugin.after_poll_timeout_aborts(["abort"], h.sched)
    assert out[0] == "abort" and isinstance(out[1], ClockTick) and out[1].t == h.t
    import pickle

    assert pickle.loads(pickle.dumps(out[1])).t == h.t   # broadcast_pyobj pickles it
    items = ["x", ClockTick(123.5), "y"]
    assert _ingest(h, items) == ["x", "y"] and len(items) == 3   # the caller's list is kept
    assert h.adapter.now() == 123.5
    req = make_req("r", 10, 2)
    assert _ingest(h, [req]) == [req]                 # no tick: passed through untouched

    # SGLang's own (hooked) methods: the tick joins the polled aborts, and the
    # dispatch loop never sees it (its dispatcher knows no ClockTick).
    from types import SimpleNamespace

    sched = h.sched
    polled = sched._poll_timeout_aborts()
    assert len(polled) == 1 and isinstance(polled[0], ClockTick) and polled[0].t == h.t
    sched.session_controller = SimpleNamespace(maybe_reap=lambda now: None)
    sched.flush_wrapper = SimpleNamespace(check_pending=lambda: None)
    sched.external_corpus_manager = None
    sched.scheduler_stage_metrics = None
    sched.process_input_requests([ClockTick(77.0)])
    assert h.adapter.now() == 77.0


@pytest.mark.parametrize("synced", [True, False])
def test_ranks_agree_with_rank0_clock(kvadmit_hooks, synced):
    """Two ranks of one queue whose clocks differ by 0.5 s: with rank 0's ticks
    they refuse and admit the same requests and fit the same step times; with
    their own clocks a deadline near the edge splits them."""
    from sglang_harness import make_req

    ranks = [harness(slo_guard=True)]
    ranks.append(harness(slo_guard=True))
    ranks[1].adapter.clock = lambda: ranks[1].t + 0.5
    for h in ranks:
        h.adapter.synced_clock = synced
    accepted = [[], []]
    for step in range(30):
        tick = plugin.after_poll_timeout_aborts([], ranks[0].sched)
        deadline = ranks[0].t + 0.3   # the client's, against rank 0's time
        for i, h in enumerate(ranks):
            _ingest(h, list(tick))
            if step % 3 == 0:
                d = deadline
                r = make_req(f"r{step}", 40, 6, custom_params=kv(deadline_s=d))
                if h.submit(r):
                    accepted[i].append(r.rid)
            h.step()
    s0, s1 = (h.adapter.stats() for h in ranks)
    if synced:
        assert accepted[0] == accepted[1] and len(accepted[0]) == 10
        assert s0["step_time_fit"] == s1["step_time_fit"]
        assert s0["step_time_fit"]["observations"] > 0
        assert s0["admitted"] == s1["admitted"]
    else:
        # Rank 1 sees the first deadlines as passed (infeasible): the ranks' queues split.
        assert len(accepted[0]) == 10 and "r0" not in accepted[1] and accepted[0] != accepted[1]

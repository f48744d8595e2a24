"""Priority preemption on SGLang's real scheduling classes: with
--enable-priority-scheduling a waiting request more important than running ones by
more than --priority-scheduling-preemption-threshold (SGLang's default 10) takes
them out, least important first; equal, less important or within-threshold ones
never displace a running request; with priority scheduling off nothing changes.

Each case runs the same workload on stock SGLang (no kvadmit) and under kvadmit's
default ``{}``, and asserts who is evicted and who runs in both."""
import pytest

pytest.importorskip("sglang.srt")  # not "sglang": see conftest.py

from kvadmit import AdmissionConfig  # noqa: E402

STOCK, KVADMIT = "stock", "kvadmit"


def run_case(engine, *, high, running=(("lo", 0), ("mid", 5)), max_running=2, pool=4000,
             prompt=50, new=200, high_prompt=50, enabled=True, threshold=10, disable=False,
             low_first=False, steps=12):
    """Running requests (rid, priority) admitted first (prompt + new tokens each), then
    "hi" arrives with priority ``high``; ``steps`` scheduler steps later: who was evicted
    for it (priority preemption, in order), who was retracted at decode, and whether
    "hi" has started."""
    from sglang_harness import Harness, make_req

    h = Harness(AdmissionConfig.from_dict({}) if engine == KVADMIT else None,
                pool_tokens=pool, max_running=max_running, enable_priority_scheduling=enabled,
                low_priority_values_first=low_first, disable_priority_preemption=disable,
                preemption_threshold=threshold)
    for rid, p in running:
        assert h.submit(make_req(rid, prompt, new, out_len=new, priority=p))
        h.step()
        h.step()
    assert sorted(r.rid for r in h.sched.running_batch.reqs) == sorted(r for r, _ in running)
    hi = make_req("hi", high_prompt, 8, out_len=8, priority=high)
    assert h.submit(hi)
    for _ in range(steps):
        h.step()
    return {"displaced": h.displaced, "retracted": h.retracted,
            "hi_started": len(hi.output_ids) > 0}


def sglang_schedule(monkeypatch, low_first):
    """SGLang's global schedule settings as a server with these flags has them (stock
    preempt_to_schedule reads the sign there)."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(
        model_path="dummy", device="cpu", enable_priority_scheduling=True,
        schedule_low_priority_values_first=low_first))


@pytest.fixture
def restore_schedule():
    yield
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", device="cpu"))


# (case, kwargs, displaced in order, "hi" started): the same for stock SGLang and kvadmit.
# SGLang's default sign: a larger priority value is more important.
ROW_CASES = [
    ("higher by 20: evicts the least important", dict(high=20), ["lo"], True),
    ("higher by 14: only 'lo' is beyond the threshold", dict(high=14), ["lo"], True),
    ("higher by 11 than 'lo', by 6 than 'mid'", dict(high=15, running=(("lo", 4), ("mid", 9))),
     ["lo"], True),
    ("higher by exactly the threshold: no eviction", dict(high=10), [], False),
    ("within the threshold of both: no eviction", dict(high=12, running=(("lo", 3), ("mid", 5))),
     [], False),
    ("equal: never", dict(high=5, running=(("lo", 5), ("mid", 5))), [], False),
    ("lower: never", dict(high=-20), [], False),
    ("threshold 0: any higher priority evicts", dict(high=1, threshold=0), ["lo"], True),
    ("threshold 0, equal: never", dict(high=0, threshold=0, running=(("lo", 0), ("mid", 0))),
     [], False),
    ("--disable-priority-preemption: never", dict(high=100, disable=True), [], False),
    ("priority scheduling off: never", dict(high=100, enabled=False), [], False),
]


@pytest.mark.parametrize("case,kwargs,displaced,started", ROW_CASES, ids=[c[0] for c in ROW_CASES])
@pytest.mark.parametrize("engine", [STOCK, KVADMIT])
def test_no_request_slot_left(kvadmit_hooks, engine, case, kwargs, displaced, started):
    """The batch is out of request slots (--max-running-requests 2): SGLang's
    scheduler asks the adder's preempt_to_schedule, stock's and kvadmit's."""
    out = run_case(engine, **kwargs)
    assert out["displaced"] == displaced
    assert out["hi_started"] == started
    assert out["retracted"] == []


@pytest.mark.parametrize("engine", [STOCK, KVADMIT])
def test_low_values_first(kvadmit_hooks, monkeypatch, restore_schedule, engine):
    """--schedule-low-priority-values-first: a smaller value is more important."""
    sglang_schedule(monkeypatch, low_first=True)
    out = run_case(engine, high=-20, running=(("lo", 5), ("mid", 0)), low_first=True)
    assert out["displaced"] == ["lo"] and out["hi_started"]
    out = run_case(engine, high=20, running=(("lo", 5), ("mid", 0)), low_first=True)
    assert out["displaced"] == [] and not out["hi_started"]


def test_eviction_takes_as_many_as_it_needs(kvadmit_hooks):
    """Out of KV as well as slots, 'hi' (1100 + 8 tokens) needs two of the three running
    requests (500 + 100 each, of 2000) gone. kvadmit evicts the least important first
    until the core admits 'hi' (two here), and 'hi' starts. Stock SGLang 0.5.23 credits
    an evicted request with only its future tokens (new_token_ratio x remaining), not the
    KV it holds: it evicts one (for the slot) and 'hi' still does not fit, so it waits
    for the others to finish."""
    running = (("a", 0), ("b", 1), ("c", 2))
    kw = dict(high=50, running=running, max_running=3, pool=2000, prompt=500, new=100)
    stock = run_case(STOCK, high_prompt=1100, **kw)
    assert stock["displaced"] == ["a"] and not stock["hi_started"]
    for hp, displaced in ((900, ["a"]), (1100, ["a", "b"]), (1500, ["a", "b", "c"])):
        out = run_case(KVADMIT, high_prompt=hp, **kw)
        assert out["displaced"] == displaced, hp
        assert out["hi_started"], hp
        assert out["retracted"] == []


@pytest.mark.parametrize("high,displaced", [(20, ["lo"]), (10, []), (5, [])])
def test_out_of_kv_only(kvadmit_hooks, high, displaced):
    """Request slots to spare but no KV for 'hi' now. Stock SGLang 0.5.23 evicts
    only for a request slot (preempt_to_schedule is asked only when the batch is out
    of slots): 'hi' waits for the running requests to finish. kvadmit takes the KV
    of the least important running request beyond the threshold (issue 22, item 1),
    and still never that of one within it."""
    kw = dict(high=high, max_running=8, pool=1200, prompt=500, new=100, high_prompt=300)
    stock = run_case(STOCK, **kw)
    assert stock["displaced"] == [] and not stock["hi_started"]
    ours = run_case(KVADMIT, **kw)
    assert ours["displaced"] == displaced
    assert ours["hi_started"] == bool(displaced)
    assert ours["retracted"] == []


def test_displaced_requests_complete(kvadmit_hooks):
    """Nothing lost: an evicted request returns to the queue, runs again after 'hi',
    and every request finishes; the core counts the eviction as a preemption."""
    from sglang_harness import Harness, make_req

    h = Harness(AdmissionConfig.from_dict({}), pool_tokens=4000, max_running=2,
                enable_priority_scheduling=True)
    plan = {0: [make_req("lo", 50, 60, priority=0)], 2: [make_req("mid", 50, 60, priority=5)],
            6: [make_req("hi", 50, 20, priority=30)]}
    h.run(plan)
    assert sorted(r.rid for r in h.finished) == ["hi", "lo", "mid"]
    assert h.displaced == ["lo"]
    stats = h.adapter.stats()
    assert stats["displaced"] == 1 and stats["preempted"] == 1
    assert stats["running"] == 0 and stats["waiting"] == 0
    done = [r.rid for r in h.finished]
    assert done.index("hi") < done.index("lo")
    assert h.allocator.available_size() + h.tree_cache.evictable_size() == 4000


def test_decode_retraction_takes_lower_priority_first(kvadmit_hooks):
    """Under priority scheduling kvadmit's victim at decode is the least important
    class first; stock SGLang's default --retraction-policy 'length' retracts the one
    with the fewest output tokens, whatever its priority (ScheduleBatch's real
    retraction order, hooked, as retract_decode asks it)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang_harness import Harness, make_req

    first = {}
    for engine in (STOCK, KVADMIT):
        cfg = AdmissionConfig.from_dict({"policy": "overcommit"}) if engine == KVADMIT else None
        h = Harness(cfg, pool_tokens=4000, enable_priority_scheduling=True)
        # 'vip' (priority 9) arrives last, so it has the fewest output tokens
        for rid, prio in (("x", 0), ("y", 1), ("vip", 9)):
            assert h.submit(make_req(rid, 100, 400, out_len=400, priority=prio))
            h.step()
            h.step()
        reqs = h.sched.running_batch.reqs
        assert sorted(r.rid for r in reqs) == ["vip", "x", "y"]
        order = ScheduleBatch._get_decode_retraction_order(reqs)
        first[engine] = reqs[order[-1]].rid     # retract_decode pops victims off the end
    assert first == {STOCK: "vip", KVADMIT: "x"}


def test_priority_off_changes_nothing(kvadmit_hooks):
    from sglang_harness import Harness

    h = Harness(AdmissionConfig.from_dict({}))
    assert h.adapter.config.queue_order == "fcfs"
    assert h.adapter.config.priority_preemption_threshold == 0
    assert not h.adapter.priority_preemption
    h = Harness(AdmissionConfig.from_dict({}), enable_priority_scheduling=True,
                disable_priority_preemption=True)
    assert h.adapter.config.queue_order == "priority" and not h.adapter.priority_preemption


def test_priority_config_follows_sglangs_flags(kvadmit_hooks):
    """How SGLangAdmission.for_scheduler maps SGLang's flags (an explicit kvadmit
    threshold is kept; an explicit queue order is replaced: SGLang orders by priority)."""
    from types import SimpleNamespace

    from kvadmit.sglang.settings import NO_PREEMPTION, priority_config

    def sched(**kw):
        base = dict(enable_priority_scheduling=True, enable_priority_preemption=True,
                    priority_scheduling_preemption_threshold=10)
        return SimpleNamespace(**dict(base, **kw))

    cfg = AdmissionConfig.from_dict({})
    assert priority_config(cfg, sched(enable_priority_scheduling=False)) is cfg
    out = priority_config(cfg, sched(priority_scheduling_preemption_threshold=3))
    assert (out.queue_order, out.priority_preemption_threshold) == ("priority", 3)
    out = priority_config(AdmissionConfig.from_dict({"priority_preemption_threshold": 1}),
                          sched(), frozenset({"priority_preemption_threshold"}))
    assert out.priority_preemption_threshold == 1
    out = priority_config(AdmissionConfig.from_dict({"queue_order": "deadline"}), sched(),
                          frozenset({"queue_order"}))
    assert out.queue_order == "priority"
    out = priority_config(cfg, sched(enable_priority_preemption=False))
    assert out.priority_preemption_threshold == NO_PREEMPTION

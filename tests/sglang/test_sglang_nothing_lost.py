"""Nothing lost on SGLang 0.5.23's real scheduling classes (tests/sglang/sglang_harness.py),
under every mix of kvadmit's features and SGLang's own priority settings: priority
scheduling with and without preemption, either sign, a preemption threshold; flows
with weights and caps, sheddable requests, TTLs and a maximum queue age, queue caps,
bypass, chunked prefill and mixed chunks. On random small workloads every request
either finishes with its whole output or is aborted with kvadmit's named reason, and
every KV slot comes back to SGLang's allocator or its radix cache."""
import pytest

pytest.importorskip("sglang.srt")

from hypothesis import given, strategies as st  # noqa: E402

from kvadmit import AdmissionConfig  # noqa: E402
from kvadmit._arrival_gate import REJECT_REASONS  # noqa: E402

POOL = 600

# (steps after the previous arrival, prompt, output, max_new beyond it, priority, flow,
#  sheddable, ttl_s)
REQUEST = st.tuples(st.integers(0, 6), st.integers(1, 250), st.integers(1, 120),
                    st.integers(0, 60), st.integers(-2, 20), st.sampled_from([None, "a", "b"]),
                    st.booleans(), st.sampled_from([None, 0.0, 0.05, 1.0]))
CONFIG = st.fixed_dictionaries({
    "policy": st.sampled_from(["overcommit", "reserve", "peak", "predict", "adaptive", "auto"]),
    "victim": st.sampled_from(["lifo", "priority", "lcf", "length"]),
    "queue_order": st.sampled_from(["fcfs", "priority", "deadline"]),
    "head_of_line": st.sampled_from(["auto", "strict", "bypass"]),
    "max_queued_requests": st.sampled_from([0, 3, 10]),
    "max_queue_age_s": st.sampled_from([0.0, 0.3]),
    "max_queue_delay_s": st.sampled_from([0.0, 0.5]),
    "shed_lower_priority": st.booleans(),
    "flows": st.sampled_from([{}, {"a": {"weight": 3}},
                              {"b": {"max_queued_requests": 2, "weight": 0.5}}]),
})


@given(st.lists(REQUEST, min_size=1, max_size=30), CONFIG, st.booleans(), st.booleans(),
       st.booleans(), st.sampled_from([0, 10]), st.sampled_from([None, 64]), st.booleans())
def test_every_request_ends_and_every_slot_comes_back(reqs, config, priority_scheduling,
                                                      low_values_first, no_preemption,
                                                      threshold, chunk, mixed):
    from sglang_harness import Harness, make_req

    h = Harness(AdmissionConfig.from_dict(config), pool_tokens=POOL, max_running=8,
                max_context=512, enable_priority_scheduling=priority_scheduling,
                low_priority_values_first=low_values_first,
                disable_priority_preemption=no_preemption, preemption_threshold=threshold,
                step_model=(0.01, 0.0001, 0.0), chunk_tokens=chunk,
                mixed_chunk=mixed and chunk is not None)
    plan, step, sent = {}, 0, []
    for i, (gap, prompt, out, slack, prio, flow, sheddable, ttl) in enumerate(reqs):
        step += gap
        fields = {k: v for k, v in (("flow", flow), ("sheddable", sheddable or None),
                                    ("ttl_s", ttl)) if v is not None}
        req = make_req(f"r{i}", prompt, out + slack, out_len=out,
                       priority=prio if priority_scheduling else None,
                       custom_params={"kvadmit": fields} if fields else None)
        plan.setdefault(step, []).append(req)
        sent.append(req)
    h.run(plan)
    aborted = {o.rid: o.finished_reason for o in h.outbox.aborts()}
    for req in sent:
        if req.rid in aborted:
            assert aborted[req.rid]["kvadmit_reason"] in REJECT_REASONS, aborted[req.rid]
            assert aborted[req.rid]["message"]
        else:
            assert req.finished(), req.rid
            assert len(req.output_ids) == req.kvadmit_test_out_len, req.rid
    assert h.allocator.available_size() + h.tree_cache.evictable_size() == POOL
    assert h.adapter.port.core.num_waiting == 0

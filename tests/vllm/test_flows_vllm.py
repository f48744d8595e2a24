"""The flow field through vLLM's real V1 scheduler (in-process, fake model outputs):
kvadmit_flow (flat or nested extra_args) reaches the core; a flow's own cap refuses
naming the flow; the flows' stats count what vLLM ran."""
from kvadmit.request_fields import flow_int
from kvadmit.vllm import Scheduler
from kvadmit.vllm.inprocess import InProcessEngine


def test_the_flow_field_reaches_the_core_and_its_cap_names_it(model_dir):
    eng = InProcessEngine(model_dir, scheduler_cls=Scheduler, num_blocks=24, max_model_len=512,
                          additional_config={"kvadmit": {
                              "policy": "peak", "flows": {"a": {"max_queued_requests": 1}}}})
    a1 = eng.add([9] * 30, 8, extra_args={"kvadmit_flow": "a"})
    a2 = eng.add([9] * 30, 8, extra_args={"kvadmit": {"flow": "a"}})    # over a's cap of 1
    b1 = eng.add([8] * 30, 8, extra_args={"kvadmit_flow": 7})
    eng.run()
    assert eng.log.stop_reasons[a2] == "kvadmit:queue_full"
    core = eng.scheduler.kvadmit.core
    stats = core.flow_stats()
    assert stats["a"]["flow"] == flow_int("a") and stats["a"]["refused"] == 1
    assert (stats["a"]["admitted"], stats["7"]["admitted"]) == (1, 1)
    assert all(len(eng.log.outputs[i]) == 8 for i in (a1, b1))
    assert stats["a"]["kv_block_steps"] > 0 and stats["7"]["kv_block_steps"] > 0
    assert abs(stats["a"]["kv_share"] + stats["7"]["kv_share"] - 1.0) < 1e-9

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
    core = eng.scheduler.kvadmit.port.core
    stats = core.flow_stats()
    assert stats["a"]["flow"] == flow_int("a") and stats["a"]["refused"] == 1
    assert (stats["a"]["admitted"], stats["7"]["admitted"]) == (1, 1)
    assert all(len(eng.log.outputs[i]) == 8 for i in (a1, b1))
    assert stats["a"]["kv_block_steps"] > 0 and stats["7"]["kv_block_steps"] > 0
    assert abs(stats["a"]["kv_share"] + stats["7"]["kv_share"] - 1.0) < 1e-9


def test_a_flow_within_its_share_starts_on_the_kv_of_a_flow_over_it(model_dir):
    """Flow displacement on vLLM's real scheduler (FCFS, kvadmit's default + two flows):
    b's two requests (7 blocks each, prompt and output) leave 2 of the 16 blocks; a's
    request (4 blocks) does not fit. a is within its share (8 blocks) and b, over its
    share, still holds more without its latest: the adapter preempts b's latest for it
    and a's request starts on the next step; everything completes. Without flows it
    waits for b's to finish."""
    def run(flows):
        eng = InProcessEngine(model_dir, scheduler_cls=Scheduler, num_blocks=17, block_size=16,
                              max_model_len=512, additional_config={"kvadmit": (
                                  {"flows": {"a": {}, "b": {}}} if flows else {})})
        b = [eng.add([9 + i] * 100, 12, extra_args={"kvadmit_flow": "b"} if flows else None)
             for i in range(2)]
        for _ in range(2):
            eng.step()
        assert all(eng.scheduler.requests[r].num_computed_tokens > 0 for r in b)
        chat = eng.add([3] * 60, 20, extra_args={"kvadmit_flow": "a"} if flows else None)
        out = eng.step()
        started = chat in out.num_scheduled_tokens
        preempted = [eng.scheduler.requests[r].num_preemptions for r in b]
        eng.run()
        assert len(eng.log.outputs[chat]) == 20
        assert all(len(eng.log.outputs[r]) == 12 for r in b)
        core = eng.scheduler.kvadmit.port.core
        assert core.num_waiting == 0 and core.num_running == 0
        return started, preempted, core.flow_stats(), core.stats()

    started, preempted, stats, totals = run(flows=True)
    assert started and preempted == [0, 1]
    assert stats["b"]["preempted"] == 1 and stats["a"]["preempted"] == 0
    # the adapter told the core: no forecast miss for the length quantile
    assert totals["preempted"] == totals["displaced"] == 1
    started, preempted, *_ = run(flows=False)
    assert not started and preempted == [0, 0]

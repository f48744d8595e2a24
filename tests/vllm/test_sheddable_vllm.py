"""Sheddable traffic through vLLM's real V1 scheduler (in-process, fake model
outputs): kvadmit_sheddable reaches the core; a sheddable request waits behind one
that is not, even at the head of vLLM's FCFS queue, and is dropped with
kvadmit:shed, before any prefill, while another waits for KV."""
from kvadmit.vllm import Scheduler
from kvadmit.vllm.inprocess import InProcessEngine

# policy reserve: a request holds its prompt + max_tokens, so the pool's fill is exact
RESERVE = {"kvadmit": {"policy": "reserve"}}


def first_scheduled(eng, rids):
    """The step at which each request first got tokens."""
    seen = {}
    while eng.scheduler.has_requests():
        out = eng.step()
        for rid in out.num_scheduled_tokens:
            if rid in rids:
                seen.setdefault(rid, eng.log.steps)
    return seen


def test_a_sheddable_request_at_the_head_of_vllms_queue_waits_behind_the_next(model_dir):
    eng = InProcessEngine(model_dir, scheduler_cls=Scheduler, num_blocks=6, block_size=16,
                          max_model_len=256, additional_config=RESERVE)
    batch = eng.add([9] * 40, 30, extra_args={"kvadmit_sheddable": "true"})   # 5 blocks
    chat = eng.add([8] * 40, 30)                                              # 5 blocks
    seen = first_scheduled(eng, {batch, chat})
    assert seen[chat] < seen[batch]
    assert all(len(eng.log.outputs[r]) == 30 for r in (batch, chat))
    assert eng.log.preemptions == 0


def test_while_a_request_waits_for_kv_a_sheddable_one_is_dropped_unprefilled(model_dir):
    eng = InProcessEngine(model_dir, scheduler_cls=Scheduler, num_blocks=6, block_size=16,
                          max_model_len=256, additional_config=RESERVE)
    long = eng.add([7] * 40, 40)                                              # 5 blocks
    eng.step()
    batch = eng.add([9] * 20, 8, extra_args={"kvadmit": {"sheddable": True}})
    chat = eng.add([8] * 40, 30)                                              # held
    seen = first_scheduled(eng, {batch, chat})
    assert eng.log.stop_reasons[batch] == "kvadmit:shed"
    assert batch not in seen and eng.log.outputs[batch] == []
    assert len(eng.log.outputs[chat]) == 30 and len(eng.log.outputs[long]) == 40
    core = eng.scheduler.kvadmit.port.core
    assert core.stats()["rejected"]["shed"] == 1
    pool = eng.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_under_vllms_priority_scheduling_a_better_value_does_not_put_sheddable_first(model_dir):
    # vLLM's heap puts priority -5 first; kvadmit serves the request that is not
    # sheddable (priority 3) before it
    eng = InProcessEngine(model_dir, scheduler_cls=Scheduler, num_blocks=6, block_size=16,
                          max_model_len=256, additional_config=RESERVE,
                          scheduling_policy="priority")
    batch = eng.add([9] * 40, 30, priority=-5, extra_args={"kvadmit_sheddable": 1})
    chat = eng.add([8] * 40, 30, priority=3)
    seen = first_scheduled(eng, {batch, chat})
    assert seen[chat] < seen[batch]
    assert all(len(eng.log.outputs[r]) == 30 for r in (batch, chat))

"""Priority retraction on vLLM's real scheduler (in-process, fake model outputs) with
--scheduling-policy priority and kvadmit's empty config: a waiting request that does
not fit starts at once on the KV of running requests less important than it (the
least important preempted first, as few as its prompt needs); equal or more
important ones are never preempted for it; every request completes."""
from kvadmit.vllm import Scheduler
from kvadmit.vllm.inprocess import InProcessEngine


def engine(model_dir):
    return InProcessEngine(model_dir, scheduler_cls=Scheduler, num_blocks=17, block_size=16,
                           max_model_len=512, additional_config={"kvadmit": {}},
                           scheduling_policy="priority")


def run_until_started(eng, rid, steps=3):
    for _ in range(steps):
        out = eng.step()
        if rid in out.num_scheduled_tokens:
            return True
    return False


def test_a_more_important_request_starts_on_the_kv_of_less_important_ones(model_dir):
    eng = engine(model_dir)
    # two less important requests of 7 blocks each (prompt and output) leave 2 of 16
    batch = [eng.add([9 + i] * 100, 12, priority=5 + i) for i in range(2)]
    for _ in range(2):
        eng.step()
    assert all(eng.scheduler.requests[r].num_computed_tokens > 0 for r in batch)
    chat = eng.add([3] * 60, 20, priority=0)                     # 4 blocks: does not fit
    assert run_until_started(eng, chat, steps=1)                 # stock vLLM: 10 steps
    reqs = eng.scheduler.requests
    # the least important (priority 6) gave way, the other kept running
    assert reqs[batch[1]].num_preemptions == 1 and reqs[batch[0]].num_preemptions == 0
    eng.run()
    assert len(eng.log.outputs[chat]) == 20
    assert all(len(eng.log.outputs[r]) == 12 for r in batch)
    core = eng.scheduler.kvadmit.port.core
    assert core.num_waiting == 0 and core.num_running == 0


def test_an_equal_priority_waits_and_displaces_no_one(model_dir):
    eng = engine(model_dir)
    batch = [eng.add([9 + i] * 100, 12, priority=0) for i in range(2)]
    for _ in range(2):
        eng.step()
    chat = eng.add([3] * 60, 20, priority=0)
    assert not run_until_started(eng, chat, steps=5)
    assert eng.log.preemptions == 0
    eng.run()
    assert len(eng.log.outputs[chat]) == 20



def test_a_displacement_leaves_vllms_watermark_free(model_dir):
    """With --watermark vLLM starts a waiting request only if the watermark's blocks
    stay free beside it while another request runs: the displacement preempts enough
    for both (here both less important requests: after 150 tokens each holds 11
    blocks and 10 are free; the prompt needs 13 and the watermark 9, so one victim
    is not enough, and with none left running the watermark no longer applies), not
    one that leaves the request waiting."""
    eng = InProcessEngine(model_dir, scheduler_cls=Scheduler, num_blocks=33, block_size=16,
                          max_model_len=512, additional_config={"kvadmit": {}},
                          scheduling_policy="priority", engine_args={"watermark": 0.28})
    kvm = eng.scheduler.kv_cache_manager
    assert kvm.watermark_blocks == 9
    batch = [eng.add([9 + i] * 16, 200, priority=5 + i) for i in range(2)]
    for _ in range(151):
        eng.step()
    assert kvm.block_pool.get_num_free_blocks() == 10
    chat = eng.add([3] * 200, 20, priority=0)
    assert run_until_started(eng, chat, steps=1)
    reqs = eng.scheduler.requests
    assert [reqs[r].num_preemptions for r in batch] == [1, 1]
    eng.run()
    assert len(eng.log.outputs[chat]) == 20
    assert all(len(eng.log.outputs[r]) == 200 for r in batch)

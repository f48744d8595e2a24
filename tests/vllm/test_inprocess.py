"""vLLM's real V1 scheduler, in-process with fake model outputs: exact checks of
kvadmit's gate, victims, caps, accounting and native free-block queue."""
import random

import pytest

from kvadmit import ConfigError
from kvadmit.vllm import KvadmitAsyncScheduler, KvadmitScheduler, Scheduler
from kvadmit.vllm.inprocess import InProcessEngine


def engine(model_dir, kvadmit=None, **kw):
    kw.setdefault("num_blocks", 24)
    return InProcessEngine(model_dir, scheduler_cls=Scheduler if kvadmit is not None else None,
                           additional_config={"kvadmit": kvadmit} if kvadmit is not None else None,
                           max_model_len=512, **kw)


def workload(n=64, seed=0, stop_early=False):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = [rng.randrange(3, 1000) for _ in range(rng.randint(16, 128))]
        m = rng.randint(16, 200)
        out.append((p, m, rng.randint(1, m) if stop_early else None))
    return out


def ordered_workload(n=64, seed=0, shared_prefix=False):
    """`workload` plus what vLLM's priority queue orders by: priorities, and arrival
    times that differ from the add order with ties on both (so its request-id tie-break
    decides some), each request's as a 4th item (`InProcessEngine.add` keywords). With
    `shared_prefix`, half the prompts start with the same two blocks (prefix hits)."""
    rng = random.Random(seed + 1)
    shared = [rng.randrange(3, 1000) for _ in range(64)]
    return [((shared if shared_prefix and i % 2 else []) + p, m, o,
             {"priority": rng.randint(0, 2), "arrival_time": 100.0 + rng.randrange(16)})
            for i, (p, m, o) in enumerate(workload(n, seed))]


def run(eng, reqs, record=None):
    ids = [eng.add(p, m, output_tokens=o, **(kw[0] if kw else {})) for p, m, o, *kw in reqs]
    while eng.scheduler.has_requests():
        out = eng.step()
        if record is not None:
            record.append((sorted(out.num_scheduled_tokens.items()), sorted(out.preempted_req_ids or ()),
                           {r: eng.scheduler.kv_cache_manager.get_block_ids(r)
                            for r in out.num_scheduled_tokens}))
    return ids


def test_factory_picks_the_flavour(model_dir):
    assert type(engine(model_dir, {}).scheduler) is KvadmitScheduler
    assert type(engine(model_dir, {}, async_scheduling=True).scheduler) is KvadmitAsyncScheduler


def test_async_flavour_runs_and_passes_through(model_dir):
    """The AsyncScheduler flavour (GPUs default to async scheduling), driven one
    step at a time: pass-through equals vLLM's AsyncScheduler, peak never preempts."""
    reqs = workload(48)
    ref, ours = [], []
    base = engine(model_dir, async_scheduling=True)
    run(base, reqs, ref)
    eng = engine(model_dir, {"policy": "overcommit"}, async_scheduling=True)
    run(eng, reqs, ours)
    assert type(base.scheduler).__name__ == "AsyncScheduler" and base.log.preemptions > 0
    assert ours == ref and eng.log.outputs == base.log.outputs
    peak = engine(model_dir, {"policy": "peak"}, async_scheduling=True)
    ids = run(peak, reqs)
    assert peak.log.preemptions == 0
    assert all(len(peak.log.outputs[r]) == m for r, (_, m, _) in zip(ids, reqs))
    pool = peak.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


@pytest.mark.parametrize("async_scheduling,prefix_caching", [
    (False, False), (True, False), (False, True)], ids=["sync", "async", "prefix-caching"])
def test_pause_keeps_kv_instead_of_preempting(model_dir, async_scheduling, prefix_caching):
    """shortfall: pause, in both scheduler flavours and with prefix caching: the same
    workload with fewer preemptions, paused requests resume, every request gets
    exactly its tokens, and every block comes back."""
    reqs = workload(48)
    cfg = {"policy": "overcommit"}
    kw = dict(async_scheduling=async_scheduling, enable_prefix_caching=prefix_caching)
    base = engine(model_dir, cfg, **kw)
    ids = run(base, reqs)
    eng = engine(model_dir, dict(cfg, shortfall="pause"), **kw)
    assert run(eng, reqs) == ids
    assert base.log.preemptions > 10
    assert eng.scheduler.kvadmit.port.core.stats()["paused"] > 0
    assert eng.log.preemptions < base.log.preemptions
    assert eng.log.outputs == base.log.outputs     # the fake model's tokens: complete and exact
    pool = eng.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_pause_needs_a_full_attention_pool(model_dir):
    """The pause plan counts blocks of one full-attention group: another layout stops
    start-up with an error naming the key."""
    import torch
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    spec = SlidingWindowSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32,
                             sliding_window=128)
    with pytest.raises(ConfigError, match="shortfall='pause'.*SlidingWindowSpec"):
        engine(model_dir, {"shortfall": "pause"}, kv_cache_spec=spec)
    engine(model_dir, {"shortfall": "preempt"}, kv_cache_spec=spec)   # preempting works anywhere


PASS_THROUGH = {"policy": "overcommit", "victim": "lifo"}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-cache", "prefix-caching"])
@pytest.mark.parametrize("scheduling_policy", ["fcfs", "priority"])
def test_overcommit_lifo_is_a_pass_through(model_dir, scheduling_policy, prefix_caching,
                                           async_scheduling):
    """The pass-through config gives vLLM's own schedule, step by step (scheduled tokens,
    preemptions, block ids) and token for token, under both scheduling policies (arrival
    times shuffled against the add order, ties included), with prefix caching, and in
    the AsyncScheduler flavour."""
    reqs = ordered_workload(shared_prefix=prefix_caching)
    kw = dict(scheduling_policy=scheduling_policy, enable_prefix_caching=prefix_caching,
              async_scheduling=async_scheduling)
    ref, ours = [], []
    base = engine(model_dir, **kw)
    run(base, reqs, ref)
    eng = engine(model_dir, PASS_THROUGH, **kw)
    run(eng, reqs, ours)
    assert base.log.preemptions > 10          # the workload does overload the pool
    assert (base.log.prefix_hit_tokens > 0) == prefix_caching
    assert ours == ref                         # same schedule, preemptions and block ids, step by step
    assert eng.log.outputs == base.log.outputs


@pytest.mark.parametrize("kvadmit", [None, PASS_THROUGH], ids=["vllm", "kvadmit"])
def test_priority_order_is_arrival_time_then_request_id(model_dir, kvadmit):
    """--scheduling-policy priority serves equal priorities by Request.arrival_time, then
    request id (as strings: "b10" < "b9"), whatever order they were added in."""
    eng = engine(model_dir, kvadmit, scheduling_policy="priority", max_num_seqs=1)
    for rid, t in (("c", 3.0), ("a", 1.0), ("b9", 2.0), ("b10", 2.0)):
        eng.add([5] * 40, 4, request_id=rid, arrival_time=t)
    started = []
    while eng.scheduler.has_requests():
        started += [r.req_id for r in eng.step().scheduled_new_reqs]
    assert started == ["a", "b10", "b9", "c"]


@pytest.mark.parametrize("scheduling_policy", ["fcfs", "priority"])
def test_waiting_queue_is_indexable(model_dir, scheduling_policy):
    """`scheduler.waiting[i]` is the i-th request in the queue's order, as in vLLM's deque."""
    eng = engine(model_dir, {"policy": "reserve"}, scheduling_policy=scheduling_policy)
    eng.add([5] * 100, 300)
    eng.step()                                  # reserves most of the pool: the rest wait
    ids = [eng.add([6] * 200, 200, priority=p) for p in (1, 0, 1)]   # each needs 13 blocks
    eng.step()
    order = ids if scheduling_policy == "fcfs" else [ids[1], ids[0], ids[2]]
    w = eng.scheduler.waiting
    assert [w[i].request_id for i in range(len(w))] == [r.request_id for r in w] == order
    assert w[-1].request_id == order[-1]
    with pytest.raises(IndexError):
        w[3]


def test_remove_requests_leaves_the_core_too(model_dir):
    """vLLM's queue protocol: `remove_requests` takes requests out of the waiting queue;
    the core forgets them too, so the gate never picks one that is gone (a stall). A
    request put back afterwards is taken as a new arrival and runs."""
    from vllm.v1.request import RequestStatus
    eng = engine(model_dir, {"policy": "overcommit"})
    ids = [eng.add([6] * 50, 20) for _ in range(4)]
    s = eng.scheduler
    s.waiting.remove_requests([s.requests[ids[0]], s.requests[ids[1]]])
    s.waiting.remove_request(s.requests[ids[2]])
    assert len(s.waiting) == 1 and s.waiting and s.kvadmit.port.core.stats()["waiting"] == 1
    assert ids[3] in eng.step().num_scheduled_tokens
    s.finish_requests(ids[:2], RequestStatus.FINISHED_ABORTED)   # what vLLM's callers do next
    s.waiting.add_request(s.requests[ids[2]])                    # or: it comes back
    eng.run()
    assert all(len(eng.log.outputs[r]) == 20 for r in ids[2:])
    stats = s.kvadmit.port.core.stats()
    assert stats["finished"] == 2 and stats["waiting"] == stats["running"] == 0
    assert not s.kvadmit.slots
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_a_request_put_back_that_the_core_refuses_is_served_untracked(model_dir):
    """vLLM already holds a request it puts back: if the core's caps refuse it as an
    arrival, it is served first and ungated, not dropped."""
    eng = engine(model_dir, {"policy": "overcommit", "max_queued_requests": 2})
    r0, r1 = eng.add([6] * 50, 20), eng.add([7] * 50, 20)
    s = eng.scheduler
    back = s.requests[r0]
    s.waiting.remove_request(back)
    r2 = eng.add([8] * 50, 20)                 # the queue is full again (r1, r2)
    s.waiting.add_request(back)
    assert len(s.waiting) == 3 and s.waiting[0] is back and s.kvadmit.port.core.stats()["waiting"] == 2
    eng.run()
    assert all(len(eng.log.outputs[r]) == 20 for r in (r0, r1, r2))
    assert s.kvadmit.port.core.stats()["finished"] == 2 and not s.kvadmit.slots
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_no_configuration_runs_auto(model_dir):
    """--scheduler-cls alone (no additional_config) and {} both give auto, pausing
    (the tiny Llama has one full-attention KV group) and bypassing."""
    for eng in (InProcessEngine(model_dir, scheduler_cls=Scheduler, max_model_len=512, num_blocks=24),
                engine(model_dir, {})):
        cfg = eng.scheduler.kvadmit.config
        assert (cfg.policy, cfg.pause_on_shortfall, cfg.bypass_head_of_line) == ("auto", True, True)


@pytest.mark.parametrize("policy", ["overcommit", "reserve", "peak", "predict", "adaptive", "auto"])
@pytest.mark.parametrize("stop_early", [False, True])
def test_every_policy_finishes_everything_and_leaks_nothing(model_dir, policy, stop_early):
    reqs = workload(stop_early=stop_early)
    eng = engine(model_dir, {"policy": policy})
    ids = run(eng, reqs)
    for rid, (_, m, o) in zip(ids, reqs):
        assert len(eng.log.outputs[rid]) == (o or m), rid
    assert len(eng.log.finished) == len(reqs)
    if policy in ("reserve", "peak") or (policy == "auto" and not stop_early):
        assert eng.log.preemptions == 0     # auto: every request runs to max_tokens (honest caps)
    s = eng.scheduler
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    stats = s.kvadmit.port.core.stats()
    assert stats["waiting"] == stats["running"] == 0 and not s.kvadmit.slots
    assert stats["finished"] == len(reqs) and stats["preempted"] == eng.log.preemptions


def test_strict_fifo_holds_small_requests_behind_a_held_head(model_dir):
    eng = engine(model_dir, {"policy": "reserve"})
    eng.add([5] * 100, 300)                # reserves ceil(400/32) = 13 of 23 blocks
    eng.step()
    big = eng.add([6] * 200, 200)          # needs 13 more: held
    small = eng.add([7] * 10, 10)          # would fit (1 block)
    out = eng.step()
    assert big not in out.num_scheduled_tokens and small not in out.num_scheduled_tokens
    assert not eng.scheduler.waiting and len(eng.scheduler.waiting) == 2
    assert eng.scheduler.kvadmit.port.core.stats()["held"]["hold_capacity"] >= 1


def test_bypass_lets_the_small_request_pass(model_dir):
    eng = engine(model_dir, {"policy": "reserve", "head_of_line": "bypass", "max_bypass": 1})
    eng.add([5] * 100, 300)
    eng.step()
    big = eng.add([6] * 200, 200)
    small = eng.add([7] * 10, 10)
    out = eng.step()
    assert small in out.num_scheduled_tokens and big not in out.num_scheduled_tokens
    assert eng.scheduler.kvadmit.port.core.info(eng.scheduler.kvadmit.slots[big])["bypassed"] == 1
    eng.run()
    assert len(eng.log.finished) == 3


VICTIM_KEY = {   # larger = preempted first; arrival order is the request id order
    "lcf": lambda r: (-r.num_computed_tokens, int(r.request_id[1:])),
    "length": lambda r: (-r.num_output_tokens, r.num_prompt_tokens, int(r.request_id[1:])),
    "priority": lambda r: (r.priority, -r.num_computed_tokens, int(r.request_id[1:])),
}


@pytest.mark.parametrize("victim", sorted(VICTIM_KEY))
def test_vllm_preempts_the_cores_victim(model_dir, victim):
    eng = engine(model_dir, {"policy": "overcommit", "victim": victim}, num_blocks=12)
    s = eng.scheduler
    rng = random.Random(1)
    for i in range(8):
        eng.add([rng.randrange(3, 1000) for _ in range(rng.randint(20, 90))], 150, priority=i % 3)
    seen = []
    original = s._preempt_request

    def spy(request, *args, **kwargs):
        # vLLM has just popped its victim off the end of `running`.
        seen.append((request, list(s.running)))
        return original(request, *args, **kwargs)

    s._preempt_request = spy
    firsts = 0
    while s.has_requests():
        seen.clear()
        eng.step()
        if seen:
            victim_req, rest = seen[0]
            assert max(rest + [victim_req], key=VICTIM_KEY[victim]) is victim_req
            firsts += 1
    assert firsts >= 3
    assert len(eng.log.finished) == 8


def test_victim_order_is_applied_to_running(model_dir):
    eng = engine(model_dir, {"policy": "overcommit", "victim": "lcf"}, num_blocks=64)
    a = eng.add([3] * 100, 50)
    eng.step()
    b = eng.add([4] * 20, 50)
    eng.step()
    eng.step()
    # lcf: least computed tokens goes last (first victim): b has 20 + a few, a has 100 + a few.
    assert [r.request_id for r in eng.scheduler.running] == [a, b]
    eng2 = engine(model_dir, {"policy": "overcommit", "victim": "lcf"}, num_blocks=64)
    b2 = eng2.add([4] * 20, 50)
    eng2.step()
    a2 = eng2.add([3] * 100, 50)
    eng2.step()
    eng2.step()   # reordered before scheduling: a2 (more computed) ahead of b2
    assert [r.request_id for r in eng2.scheduler.running] == [a2, b2]


def test_queue_cap_rejects_with_a_visible_reason(model_dir):
    eng = engine(model_dir, {"policy": "peak", "max_queued_requests": 2})
    ids = [eng.add([9] * 30, 20) for _ in range(3)]
    assert ids[2] not in eng.scheduler.requests
    eng.run()
    assert eng.log.finished[ids[2]] == "abort"
    assert eng.log.stop_reasons[ids[2]] == "kvadmit:queue_full"
    assert eng.log.outputs[ids[2]] == []
    assert all(len(eng.log.outputs[i]) == 20 for i in ids[:2])
    assert eng.scheduler.kvadmit.port.core.stats()["rejected"]["queue_full"] == 1


def test_context_and_invalid_input_rejections(model_dir):
    eng = engine(model_dir, {"policy": "peak"})
    too_long = eng.add([9] * 400, 200, request_id="long")       # 600 > max_model_len 512
    ok = eng.add([9] * 10, 5, request_id="ok")
    eng.run()
    assert eng.log.stop_reasons[too_long] == "kvadmit:context_length"
    assert len(eng.log.outputs[ok]) == 5


@pytest.mark.parametrize("prompt, kw, words", [
    ([5, 1024, 7], {}, "prompt_token_ids[1]=1024: outside the model's vocabulary [0, 1024)"),
    ([5, 99999], {}, "prompt_token_ids[1]=99999"),
    ([-1, 5], {}, "prompt_token_ids[0]=-1"),
    ([5] * 10, {"priority": 2 ** 63}, "priority=9223372036854775808: out of range [-2**62, 2**62]"),
    ([5] * 10, {"priority": -2 ** 70}, "priority=-1180591620717411303424: out of range"),
])
def test_a_request_the_model_would_crash_on_is_refused_as_invalid(model_dir, prompt, kw, words):
    """vLLM checks prompt ids only with a tokenizer (not with --skip-tokenizer-init) and
    takes any priority offline: an id outside the vocabulary would crash the embedding
    lookup, a priority beyond int64 the core. Refused as invalid naming the field and the
    limit; the engine goes on."""
    from kvadmit.protocol import Refusal
    from kvadmit_patches.vllm_http_status import error_for
    eng = engine(model_dir, {}, scheduling_policy="priority" if kw else "fcfs")
    bad = eng.add(prompt, 8, **kw)
    ok = eng.add([1023] * 10, 8)       # the vocabulary's last id is fine
    assert bad not in eng.scheduler.requests
    eng.run()
    assert eng.log.stop_reasons[bad] == "kvadmit:invalid" and eng.log.outputs[bad] == []
    assert len(eng.log.outputs[ok]) == 8
    err = error_for(Refusal.from_output(eng.log.stop_reasons[bad],
                                        eng.log.kv_transfer_params.get(bad)))
    assert err.http_status == 400 and words in err.message, err.message


def test_max_tokens_beyond_the_cores_integers_is_refused(model_dir):
    eng = engine(model_dir, {})
    huge = eng.add([5] * 10, 2 ** 63)
    long = eng.add([5] * 10, 2 ** 62)          # fits: refused for the context, not overflowed
    eng.run()
    assert eng.log.stop_reasons[huge] == "kvadmit:invalid"
    assert "max_tokens=9223372036854775808" in eng.log.kv_transfer_params[huge]["kvadmit_detail"]
    assert eng.log.stop_reasons[long] == "kvadmit:context_length"


def test_priority_shedding_aborts_the_shed_request(model_dir):
    eng = engine(model_dir, {"policy": "reserve", "max_queued_requests": 1,
                             "shed_lower_priority": True, "queue_order": "priority"})
    eng.add([5] * 100, 300)
    eng.step()                               # running, reserving most of the pool
    low = eng.add([6] * 200, 200, priority=5)
    high = eng.add([7] * 10, 10, priority=0)
    assert low not in eng.scheduler.requests and high in eng.scheduler.requests
    eng.run()
    assert eng.log.stop_reasons[low] == "kvadmit:shed"
    assert len(eng.log.outputs[high]) == 10
    pool = eng.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1


def test_client_abort_is_accounted(model_dir):
    from vllm.v1.request import RequestStatus
    eng = engine(model_dir, {"policy": "peak"})
    a = eng.add([5] * 50, 100)
    b = eng.add([6] * 50, 100)
    eng.step()
    eng.scheduler.finish_requests([a, b], RequestStatus.FINISHED_ABORTED)
    st = eng.scheduler.kvadmit.port.core.stats()
    assert st["aborted"] == 2 and st["running"] == st["waiting"] == 0
    assert not eng.scheduler.kvadmit.slots


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_native_free_block_queue_gives_identical_block_ids(model_dir, prefix_caching):
    rng = random.Random(3)
    shared = [rng.randrange(3, 1000) for _ in range(64)]   # two full blocks of shared prefix
    reqs = [((shared if i % 2 else []) + [rng.randrange(3, 1000) for _ in range(rng.randint(16, 96))],
             rng.randint(16, 150), None) for i in range(48)]
    ref, ours = [], []
    base = engine(model_dir, enable_prefix_caching=prefix_caching)
    run(base, reqs, ref)
    eng = engine(model_dir, {"policy": "overcommit", "native_allocator": True},
                 enable_prefix_caching=prefix_caching)
    assert type(eng.scheduler.kv_cache_manager.block_pool.free_block_queue).__name__ == "BlockObjectQueue"
    run(eng, reqs, ours)
    assert ours == ref
    pool = eng.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    pool.free_block_queue.native.check_invariants()


def test_kvadmit_state_is_one_attribute_and_takes_json_text(model_dir):
    """kvadmit's state on vLLM's scheduler is `scheduler.kvadmit` and nothing else of
    kvadmit's is hung on it; the vLLM-only keys come with the core's, as a dict or as
    JSON text, and stay out of the core's config."""
    s = engine(model_dir, '{"policy": "peak", "native_allocator": true}').scheduler
    assert [k for k in vars(s) if "kvadmit" in k] == ["kvadmit"]
    assert s.kvadmit.vllm_settings.native_allocator and s.kvadmit.config.policy == "peak"
    assert type(s.kv_cache_manager.block_pool.free_block_queue).__name__ == "BlockObjectQueue"
    assert not engine(model_dir, {}).scheduler.kvadmit.vllm_settings.native_allocator


def test_bad_config_stops_start_up(model_dir):
    with pytest.raises(ConfigError, match="policy='fast'"):
        engine(model_dir, {"policy": "fast"})
    with pytest.raises(ConfigError, match="unknown key 'polic'; did you mean 'policy'"):
        engine(model_dir, {"polic": "peak"})


@pytest.mark.parametrize("additional, words", [
    ({"kvadmitt": {"policy": "peak", "max_queued_requests": 2}}, "unknown key 'kvadmitt'; did you mean 'kvadmit'?"),
    ({"kvadmit": None}, "'kvadmit' must be an object of kvadmit's keys, got null"),
])
def test_a_misspelt_or_null_section_stops_start_up(model_dir, additional, words):
    """Either would run kvadmit on its defaults (no caps) without a word."""
    from kvadmit.vllm.inprocess import InProcessEngine
    with pytest.raises(ConfigError) as e:
        InProcessEngine(model_dir, scheduler_cls=Scheduler, additional_config=additional,
                        max_model_len=512, num_blocks=24)
    assert words in str(e.value)


# -- per-request SLO fields, the step-time fit and the agent window ------------------------

def test_slo_guard_refuses_an_infeasible_ttft_and_runs_a_feasible_one(model_dir):
    import time
    eng = engine(model_dir, {"slo_guard": True})
    now = time.time()
    hopeless = eng.add([9] * 40, 8, extra_args={"kvadmit": {"ttft_slo_s": 1e-6}})
    passed = eng.add([9] * 40, 8, extra_args={"kvadmit_deadline_s": now - 10})   # flat shape
    fine = eng.add([9] * 40, 8, extra_args={"kvadmit": {"ttft_slo_s": 60, "tpot_slo_s": 5}})
    due = eng.add([9] * 40, 8, extra_args={"kvadmit_deadline_s": now + 60})
    none = eng.add([9] * 40, 8)
    eng.run()
    assert eng.log.stop_reasons[hopeless] == eng.log.stop_reasons[passed] == "kvadmit:slo_infeasible"
    assert eng.log.outputs[hopeless] == eng.log.outputs[passed] == []
    assert all(len(eng.log.outputs[r]) == 8 for r in (fine, due, none))
    assert eng.scheduler.kvadmit.port.core.stats()["rejected"]["slo_infeasible"] == 2


def test_deadline_order_follows_the_request_fields(model_dir):
    import time
    eng = engine(model_dir, {"queue_order": "deadline"})
    late = eng.add([9] * 40, 8, extra_args={"kvadmit": {"ttft_slo_s": 60}})
    soon = eng.add([9] * 40, 8, extra_args={"kvadmit_ttft_slo_s": 5})
    sooner = eng.add([9] * 40, 8, extra_args={"kvadmit_deadline_s": time.time() + 1})
    plain = eng.add([9] * 40, 8)   # no target: an hour after arrival
    s = eng.scheduler
    assert [r.request_id for r in s.waiting] == [sooner, soon, late, plain]


def test_tpot_guard_holds_an_admission_until_the_tight_request_finishes(model_dir):
    eng = engine(model_dir, {"slo_guard": True})
    tight = eng.add([9] * 40, 4, extra_args={"kvadmit": {"tpot_slo_s": 1e-6}})
    eng.step()                                    # alone: admitted
    other = eng.add([8] * 40, 4)
    while tight not in eng.log.finished:
        assert other not in eng.step().num_scheduled_tokens
    assert other in eng.step().num_scheduled_tokens
    assert eng.scheduler.kvadmit.port.core.stats()["held"]["hold_slo"] >= 1


@pytest.mark.parametrize("extra, field", [
    ({"kvadmit": {"ttft_slo_s": "soon"}}, "kvadmit.ttft_slo_s"),
    ({"kvadmit_tpot_slo_s": -1}, "kvadmit_tpot_slo_s"),
    ({"kvadmit_deadline_s": 30}, "kvadmit_deadline_s"),            # relative, not a UNIX time
    ({"kvadmit": {"session": 1.5}}, "kvadmit.session"),
    ({"kvadmit": {"ttft_slo": 1}}, "kvadmit.ttft_slo"),             # unknown field
    ({"kvadmit": '{"ttft_slo_s": 1}'}, "extra_args['kvadmit']"),    # not an object
    ({"kvadmit_deadline_s": 1e13}, "kvadmit_deadline_s"),          # milliseconds
])
def test_a_bad_field_is_refused_as_invalid_naming_it(model_dir, caplog, extra, field):
    from kvadmit.protocol import Refusal
    from kvadmit_patches.vllm_http_status import error_for
    eng = engine(model_dir, {})
    with caplog.at_level("WARNING", logger="kvadmit.vllm"):
        bad = eng.add([9] * 40, 8, extra_args=extra)
    ok = eng.add([9] * 40, 8)
    eng.run()
    assert eng.log.stop_reasons[bad] == "kvadmit:invalid" and eng.log.outputs[bad] == []
    assert len(eng.log.outputs[ok]) == 8
    assert any(field in r.getMessage() for r in caplog.records), caplog.text
    # Through `vllm serve` the 400 names the field as well (the engine's message rides
    # in the refused output's kv_transfer_params).
    refusal = Refusal.from_output(eng.log.stop_reasons[bad], eng.log.kv_transfer_params.get(bad))
    err = error_for(refusal)
    assert err.http_status == 400 and field in err.message
    # Counted by the core as every reason is (kvadmit_rejected_total{reason="invalid"}).
    assert eng.scheduler.kvadmit.port.core.stats()["rejected"]["invalid"] == 1


def test_agent_window_holds_other_sessions_without_blocking_the_queue(model_dir):
    """W = 1: session A holds the window while it has work; B's request, although it
    arrived before A's second one, does not block it, and starts once A is idle."""
    from kvadmit.request_fields import session_int
    from prometheus_client import REGISTRY
    eng = engine(model_dir, {"agent_window": True, "agent_window_init": 1, "agent_window_max": 1,
                             "agent_interval_s": 0.0, "agent_idle_s": 0})
    s = eng.scheduler
    core = s.kvadmit.port.core
    a1 = eng.add([3] * 40, 6, extra_args={"kvadmit": {"session": "A"}})
    b1 = eng.add([4] * 40, 6, extra_args={"kvadmit_session": "B"})
    started = {}
    for step in range(1, 20):
        if step == 2:
            a2 = eng.add([5] * 40, 6, session_id="A")   # vLLM's own session id: same session
        for rid in eng.step().num_scheduled_tokens:
            started.setdefault(rid, step)
        if b1 in eng.log.finished:
            break
    # a1: prefill at step 1, 5 decodes, done at step 6; a2: steps 2-7; B gets the window
    # at step 8, when A (idle since step 7, agent_idle_s 0) leaves it.
    assert started == {a1: 1, a2: 2, b1: 8}
    assert not core.session_active(session_int("A")) and core.session_active(session_int("B"))
    st = core.stats()
    assert st["held"]["hold_agent"] >= 1
    assert st["agent_window"]["size"] == 1 and st["agent_window"]["active_sessions"] == 1
    assert REGISTRY.get_sample_value("kvadmit_agent_window") == 1
    assert REGISTRY.get_sample_value("kvadmit_held_total", {"reason": "hold_agent"}) is not None
    assert REGISTRY.get_sample_value("kvadmit_agent_window_exits_total", {"why": "expired"}) >= 1


def test_prefix_hits_fed_to_the_agent_window_match_vllms_counters(model_dir):
    eng = engine(model_dir, {"agent_window": True}, enable_prefix_caching=True)
    shared = list(range(100, 164))                 # two full blocks
    for i in range(3):
        eng.add(shared + [7 + i] * 20, 4, extra_args={"kvadmit_session": i})
        eng.run()
    s = eng.scheduler
    assert eng.log.prefix_hit_tokens == 128 and eng.log.prefix_query_tokens == 3 * 84
    assert (s.kvadmit.port.prefix_hit_tokens, s.kvadmit.port.prefix_query_tokens) == (128, 3 * 84)


def test_every_busy_step_feeds_the_step_time_fit(model_dir):
    from prometheus_client import REGISTRY
    eng = engine(model_dir, {}, max_num_batched_tokens=64)
    eng.add([9] * 100, 5)
    eng.add([8] * 30, 5)
    eng.run()
    core = eng.scheduler.kvadmit.port.core
    steps = eng.log.steps
    assert steps >= 6 and core.step_time.observations == steps - 1   # the last step is unobserved
    eng.add([7] * 30, 3)          # after an idle gap: that gap is not a step time
    eng.step()
    assert core.step_time.observations == steps - 1
    eng.run()
    assert core.step_time.observations == eng.log.steps - 2
    a, b, c = core.step_time.coefficients
    assert a != 0.008             # moved off the prior by the observed (fast, fake) steps
    assert REGISTRY.get_sample_value("kvadmit_step_time_base_seconds") == a


def add_samples(eng, parent, n, prompt, max_tokens, **kw):
    """The engine side of one request with n samples, as vLLM fans it out (ParentRequest:
    "<i>_<parent>", n = 1 each) with the API-server patch's marker."""
    from kvadmit.protocol import samples_marker
    return [eng.add(prompt, max_tokens, request_id=f"{i}_{parent}",
                    extra_args=samples_marker(n, parent), **kw) for i in range(n)]


def test_parallel_samples_are_admitted_or_refused_as_one_request(model_dir):
    """n > 1 is one unit (issue 13 item 2): under a queue cap all samples are refused
    together, counted once; with room all of them run."""
    from kvadmit.protocol import Refusal
    eng = engine(model_dir, {"policy": "peak", "max_queued_requests": 3})
    first = eng.add([9] * 30, 20)
    eng.step()                                       # running: the queue is empty
    fits = add_samples(eng, "fits", 3, [8] * 30, 20)   # 3 waiting: at the cap
    s = eng.scheduler
    assert all(r in s.requests for r in fits)
    refused = add_samples(eng, "refused", 3, [7] * 30, 20)   # 2 of 3 would fit: none does
    assert not any(r in s.requests for r in refused)
    eng.run()
    assert {eng.log.stop_reasons[r] for r in refused} == {"kvadmit:queue_full"}
    refusal = Refusal.from_output(eng.log.stop_reasons[refused[0]],
                                  eng.log.kv_transfer_params[refused[0]])
    assert refusal.retryable and refusal.status == 429       # the config's default
    assert all(len(eng.log.outputs[r]) == 20 for r in [first, *fits])
    st = s.kvadmit.port.core.stats()
    # Counted once: one refusal, one arrival for it (the samples taken back uncounted).
    assert st["rejected"]["queue_full"] == 1
    assert st["arrived"] == 1 + 3 + 1 and st["finished"] == 4 and st["aborted"] == 0
    # More samples than the cap can never be queued together: 400, counted once.
    never = add_samples(eng, "never", 4, [6] * 30, 20)
    eng.run()
    refusal = Refusal.from_output(eng.log.stop_reasons[never[0]], eng.log.kv_transfer_params[never[0]])
    assert refusal.status == 400 and "n=4 samples exceed max_queued_requests=3" in refusal.message
    assert s.kvadmit.port.core.stats()["rejected"]["queue_full"] == 2


def test_samples_wait_for_their_siblings_and_an_abort_drops_them(model_dir):
    from vllm.v1.request import RequestStatus
    eng = engine(model_dir, {"policy": "peak"})
    s = eng.scheduler
    from kvadmit.protocol import samples_marker
    ids = [eng.add([9] * 30, 5, request_id=f"{i}_p", extra_args=samples_marker(3, "p"))
           for i in range(2)]                            # the third sample is late
    assert not any(r in s.requests for r in ids) and s.kvadmit.port.core.stats()["arrived"] == 0
    other = eng.add([8] * 30, 50)
    eng.step()
    # The client went away (vLLM may pass any iterable, read once).
    s.finish_requests(iter(ids + [other]), RequestStatus.FINISHED_ABORTED)
    assert other not in s.requests and s.kvadmit.port.core.stats()["aborted"] == 1
    last = eng.add([9] * 30, 5, request_id="2_p", extra_args=samples_marker(3, "p"))
    assert last not in s.requests                      # its siblings are gone: it waits alone
    s.finish_requests([last], RequestStatus.FINISHED_ABORTED)
    assert not s.kvadmit.samples_awaiting_siblings


def test_a_forged_sample_marker_does_not_group(model_dir):
    """The marker counts only on the sample's own id: a client cannot group requests."""
    eng = engine(model_dir, {"policy": "peak"})
    rid = eng.add([9] * 30, 5, extra_args={"kvadmit_samples": "3/x"})
    assert rid in eng.scheduler.requests


def test_held_counts_steps_not_looks(model_dir):
    """vLLM's queue asks the gate on every bool(); a hold counts once per step."""
    eng = engine(model_dir, {"policy": "peak"}, num_blocks=16)
    eng.add([5] * 200, 200)                    # 400 tokens: 13 of 15 blocks at its peak
    eng.step()
    held = eng.add([6] * 64, 300)              # 12 more: held until the first one is nearly done
    s = eng.scheduler
    steps_held = 0
    while held not in {r.request_id for r in s.running}:
        eng.step()
        steps_held += int(held not in {r.request_id for r in s.running})
    st = s.kvadmit.port.core.stats()["held"]
    assert steps_held > 10
    assert st["hold_capacity"] + st["hold_blocks"] == steps_held, (st, steps_held)


def test_refusals_are_read_through_the_admission_object(model_dir):
    """A replay's public call (`watch_refusals` / `take_refused`): each refusal once,
    arrival refusals and sheds alike, with the reason the client's output carries."""
    eng = engine(model_dir, {"policy": "reserve", "max_queued_requests": 1,
                             "shed_lower_priority": True, "queue_order": "priority"})
    adm = eng.scheduler.kvadmit
    eng.add([5] * 10, 4)
    assert adm.take_refused() == []                       # not watching: nothing kept
    adm.watch_refusals()
    eng.step()
    low = eng.add([6] * 20, 20, priority=5)
    high = eng.add([7] * 10, 10, priority=0)              # the queue is full: low is shed
    full = eng.add([8] * 10, 10, priority=5)              # and this one refused
    assert adm.take_refused() == [(low, "shed"), (full, "queue_full")]
    assert adm.take_refused() == []
    eng.run()
    assert eng.log.stop_reasons[low] == "kvadmit:shed"
    assert eng.log.stop_reasons[full] == "kvadmit:queue_full" and len(eng.log.outputs[high]) == 10


def test_the_cores_clock_is_injected_once_and_read_exactly(model_dir):
    """The adapter's clock is given (`set_clock`; the constructor's `clock`), not
    swapped by assigning a field: a replay's virtual time reaches the core as is."""
    eng = engine(model_dir, {"policy": "peak"})
    adm = eng.scheduler.kvadmit
    with pytest.raises(AttributeError):
        adm.clock = lambda: 0.0
    with pytest.raises(TypeError, match="clock=5.0: must be a callable"):
        adm.set_clock(5.0)
    t = [12.5]
    adm.set_clock(lambda: t[0])
    eng.add([5] * 10, 4)
    t[0] = 13.0
    eng.step()                                      # 10 prompt tokens at 13.0
    t[0] = 13.25
    eng.step()                                      # that step took 0.25 s exactly
    assert adm.port.observed_steps == 1
    from kvadmit import AdmissionCore
    ref = AdmissionCore(adm.config, adm.usable_blocks, adm.port.core.block_size)
    ref.observe_step(10, 10, 0.25)
    assert adm.port.core.stats()["step_time_fit"] == ref.stats()["step_time_fit"]

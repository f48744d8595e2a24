"""vLLM's own priority-scheduling tests, on stock vLLM and under kvadmit's default.

Every `test_priority_scheduling_*` test of vLLM's tests/v1/core/test_scheduler.py
(vllm-project/vllm at commit 003df2961dd8830c317a61f9745ccd557da9fa06, whose helpers
`create_scheduler_with_priority` / `create_requests_with_priority` build vLLM 0.32's
Scheduler, Request, SchedulerConfig and KVCacheConfig as installed here), rewritten
in this project's style: the same scenarios, numbers and assertions, on the tiny model
(kvadmit.vllm.tiny_model; upstream uses facebook/opt-125m, which is not here). Each
runs twice: on vLLM's own Scheduler and on kvadmit's scheduler with the empty config
`{}` (policy auto, shortfall auto), both under `--scheduling-policy priority`.

kvadmit must not invert priorities: a waiting request of higher priority that its
policy would hold for KV may take KV from running requests of strictly lower
priority (docs/vllm.md, "Priority scheduling").
"""
import pytest
from vllm.config import ECTransferConfig, KVTransferConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from kvadmit.vllm.inprocess import InProcessEngine, model_runner_output
from kvadmit.vllm.scheduler import Scheduler
from kvadmit.vllm.tiny_model import EOS_TOKEN_ID

FLAVOURS = {"vllm": None, "kvadmit": {}}


@pytest.fixture(params=list(FLAVOURS))
def flavour(request):
    """Which scheduler the test runs on: vLLM's own, or kvadmit's with the empty config."""
    return request.param


class Rig:
    """A vLLM scheduler under `--scheduling-policy priority`, built as upstream's
    `create_scheduler_with_priority` builds it (chunked prefill on, watermark 0,
    max_model_len = max_num_batched_tokens up to the tiny model's 4096), and
    upstream's request maker."""

    def __init__(self, model_dir, flavour, tmp_path=None, max_num_seqs=16,
                 max_num_batched_tokens=8192, num_blocks=10000, block_size=16,
                 kv_connector=False, ec_role=None, v2_model_runner=None):
        kvadmit = FLAVOURS[flavour]
        engine_args = {}
        if kv_connector:
            engine_args["kv_transfer_config"] = KVTransferConfig(
                kv_connector="ExampleConnector", kv_role="kv_both",
                kv_connector_extra_config={"shared_storage_path": str(tmp_path / "kv")})
        if ec_role is not None:
            engine_args["ec_transfer_config"] = ECTransferConfig(
                ec_connector="ECExampleConnector", ec_role=ec_role,
                ec_connector_extra_config={"shared_storage_path": str(tmp_path / "ec")})
        self.engine = InProcessEngine(
            model_dir, scheduler_cls=Scheduler if kvadmit is not None else None,
            additional_config={"kvadmit": kvadmit} if kvadmit is not None else None,
            # upstream: max_model_len = max_num_batched_tokens; the tiny model stops at 4096
            num_blocks=num_blocks, block_size=block_size,
            max_model_len=min(max_num_batched_tokens, 4096),
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            scheduling_policy="priority", enable_chunked_prefill=True, engine_args=engine_args)
        self.s = self.engine.scheduler
        assert self.s.scheduler_config.watermark == 0.0
        assert (type(self.s).__name__ == "KvadmitScheduler") == (kvadmit is not None)
        if v2_model_runner is not None and hasattr(self.s, "use_v2_model_runner"):
            self.s.use_v2_model_runner = v2_model_runner   # 0.32, 0.33: two model runners

    def requests(self, priorities, arrival_times=None, num_tokens=10, req_ids=None,
                 starting_idx=0, max_tokens=16):
        """Upstream's `create_requests_with_priority`: request i has the prompt
        [i + starting_idx] * num_tokens and id str(i + starting_idx) unless named."""
        if arrival_times is None:
            arrival_times = [float(i) for i in range(len(priorities))]
        if req_ids is None:
            req_ids = [str(i + starting_idx) for i in range(len(priorities))]
        out = []
        for i, (p, t, rid) in enumerate(zip(priorities, arrival_times, req_ids, strict=True)):
            sp = SamplingParams(ignore_eos=False, max_tokens=max_tokens)
            sp.update_from_generation_config({}, EOS_TOKEN_ID)
            out.append(Request(request_id=rid, prompt_token_ids=[i + starting_idx] * num_tokens,
                               sampling_params=sp, pooling_params=None, arrival_time=t,
                               priority=p, block_hasher=self.engine.block_hasher))
        return out

    def add(self, *args, **kw):
        reqs = self.requests(*args, **kw)
        for r in reqs:
            self.s.add_request(r)
        return reqs

    def decode(self, output, tokens):
        """The model's step: request id -> its sampled tokens ([] samples nothing)."""
        ids = list(tokens)
        self.s.update_from_output(output, model_runner_output(
            ids, [tokens[r] for r in ids], logprobs=None, prompt_logprobs_dict={},
            pooler_output=[]))

    def new_ids(self, output):
        return [r.req_id for r in output.scheduled_new_reqs]

    def waiting(self):
        return [(r.request_id, r.priority, r.arrival_time) for r in self.s.waiting]


# -- ordering (upstream: test_priority_scheduling_basic_ordering, _arrival_time_tiebreaker,
#    _mixed_priority_and_arrival, _fcfs_fallback) -------------------------------------------
@pytest.mark.parametrize("priorities,arrival_times,order", [
    ([2, 0, 1], [1.0, 2.0, 3.0], ["1", "2", "0"]),                    # basic_ordering
    ([1, 1, 1], [3.0, 1.0, 2.0], ["1", "2", "0"]),                    # arrival_time_tiebreaker
    ([2, 1, 1, 0], [1.0, 3.0, 2.0, 4.0], ["3", "2", "1", "0"]),       # mixed_priority_and_arrival
    ([1, 1, 1, 1], [4.0, 1.0, 3.0, 2.0], ["1", "3", "2", "0"]),       # fcfs_fallback
], ids=["basic_ordering", "arrival_time_tiebreaker", "mixed_priority_and_arrival",
        "fcfs_fallback"])
def test_priority_scheduling_order_of_one_step(model_dir, flavour, priorities, arrival_times, order):
    """All fit in one step: they start in (priority, arrival_time) order."""
    rig = Rig(model_dir, flavour)
    rig.add(priorities, arrival_times)
    assert rig.new_ids(rig.s.schedule()) == order


# -- test_priority_scheduling_preemption ----------------------------------------------------
def test_priority_scheduling_preemption(model_dir, flavour):
    """Block math (block_size 16, 6 blocks: 5 usable). lo1 (priority 5, 32 tokens) runs
    and decodes to 33 tokens; hi1 (priority 0, 32 tokens) arrives and is admitted
    beside it (lo1 takes a 3rd block, hi1 2: the pool is full); both decode; hi1 then
    needs a 3rd block: lo1, the lowest priority running, is preempted, hi1 runs on.
    kvadmit's default would hold hi1 (both running to max_tokens=16 need 6 blocks):
    it does not hold a higher priority behind lower-priority KV."""
    rig = Rig(model_dir, flavour, max_num_seqs=3, max_num_batched_tokens=200, num_blocks=6)
    (lo1,) = rig.add([5], [1.0], num_tokens=32, req_ids=["lo1"])
    out = rig.s.schedule()
    assert rig.new_ids(out) == ["lo1"]
    rig.decode(out, {"lo1": [100]})
    rig.add([0], [2.0], num_tokens=32, req_ids=["hi1"])
    out = rig.s.schedule()
    assert "hi1" in rig.new_ids(out)
    assert len(rig.s.running) == 2
    rig.decode(out, {"lo1": [101], "hi1": [100]})
    rig.s.schedule()
    assert rig.s.requests["lo1"].status == RequestStatus.PREEMPTED
    assert "hi1" in [r.request_id for r in rig.s.running]


# -- test_priority_scheduling_no_preemption_when_space_available -------------------------
def test_priority_scheduling_no_preemption_when_space_available(model_dir, flavour):
    rig = Rig(model_dir, flavour, max_num_seqs=3, max_num_batched_tokens=200)
    lows = rig.add([5, 5], [1.0, 2.0], num_tokens=30, req_ids=["lo1", "lo2"])
    out = rig.s.schedule()
    rig.decode(out, {r.request_id: [100] for r in lows})
    rig.add([0], [3.0], num_tokens=30, req_ids=["hi1"])
    out = rig.s.schedule()
    assert rig.new_ids(out) == ["hi1"]
    assert len(rig.s.running) == 3 and len(rig.s.waiting) == 0
    assert not out.preempted_req_ids


# -- the waiting queue's order (upstream: test_priority_scheduling_preemption_victim_selection,
#    _equal_priority_preemption, _waiting_queue_order, _with_limited_slots) ------------------
@pytest.mark.parametrize("max_num_seqs,priorities,arrival_times,started,waiting", [
    (1, [3, 2, 0], [1.0, 2.0, 3.0], ["2"], [("1", 2, 2.0), ("0", 3, 1.0)]),   # victim_selection
    (1, [2, 2, 2], [3.0, 1.0, 2.0], ["1"], [("2", 2, 2.0), ("0", 2, 3.0)]),   # equal_priority_preemption
    (1, [3, 1, 2, 0], [1.0, 2.0, 3.0, 4.0], ["3"],
     [("1", 1, 2.0), ("2", 2, 3.0), ("0", 3, 1.0)]),                          # waiting_queue_order
    (2, [3, 1, 2, 0], [1.0, 2.0, 3.0, 4.0], ["3", "1"],
     [("2", 2, 3.0), ("0", 3, 1.0)]),                                         # with_limited_slots
], ids=["preemption_victim_selection", "equal_priority_preemption", "waiting_queue_order",
        "with_limited_slots"])
def test_priority_scheduling_waiting_queue(model_dir, flavour, max_num_seqs, priorities,
                                           arrival_times, started, waiting):
    """max_num_seqs slots: the highest priorities start, the rest wait in order."""
    rig = Rig(model_dir, flavour, max_num_seqs=max_num_seqs, max_num_batched_tokens=1000
              if max_num_seqs == 2 else 8192)
    rig.add(priorities, arrival_times)
    out = rig.s.schedule()
    assert sorted(rig.new_ids(out)) == sorted(started)
    assert rig.waiting() == waiting


# -- test_priority_scheduling_heap_property ----------------------------------------------
def test_priority_scheduling_heap_property(model_dir, flavour):
    """One slot: each request, finished after one step, makes room for the next best."""
    rig = Rig(model_dir, flavour, max_num_seqs=1)
    priorities = [5, 1, 8, 3, 2, 7, 4, 6]
    reqs = rig.add(priorities, [float(i) for i in range(len(priorities))])
    started = []
    while rig.s.waiting:
        out = rig.s.schedule()
        for new in out.scheduled_new_reqs:
            started.append(reqs[int(new.req_id)].priority)
            rig.decode(out, {new.req_id: [100]})
            rig.s.finish_requests(new.req_id, RequestStatus.FINISHED_STOPPED)
    assert started == sorted(priorities)


# -- test_priority_scheduling_preemption_and_resumption_when_out_of_kv -------------------
@pytest.mark.parametrize("v2_model_runner", [False, True], ids=["v1-runner", "v2-runner"])
@pytest.mark.parametrize("ec_role", [None, "ec_consumer"], ids=["no-ec", "ec-consumer"])
def test_priority_scheduling_preemption_and_resumption_when_out_of_kv(
        model_dir, flavour, tmp_path, ec_role, v2_model_runner):
    """5 blocks (4 usable, 64 tokens), a KV connector (and an encoder-cache connector,
    which changes nothing here). low (priority 1, 30 tokens) runs and decodes; high
    (priority 0, 32 tokens) is admitted and fills the pool; after a decode high needs
    a 3rd block: low is preempted; high finishes and low resumes with its 32 tokens."""
    rig = Rig(model_dir, flavour, tmp_path, max_num_seqs=2, max_num_batched_tokens=200,
              num_blocks=5, kv_connector=True, ec_role=ec_role, v2_model_runner=v2_model_runner)
    if not v2_model_runner and not hasattr(rig.s, "use_v2_model_runner"):
        pytest.skip("vLLM 0.34 has one model runner, which gets a resumed request as new")
    (low,) = rig.add([1], [0.0], num_tokens=30)
    out = rig.s.schedule()
    assert len(out.scheduled_new_reqs) == 1
    assert len(rig.s.waiting) == 0 and len(rig.s.running) == 1
    rig.decode(out, {low.request_id: [100]})

    (high,) = rig.add([0], [1.0], num_tokens=32, starting_idx=1)
    out = rig.s.schedule()
    assert rig.s.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    assert len(out.scheduled_new_reqs) == 1 and out.scheduled_cached_reqs.num_reqs == 1
    assert len(rig.s.waiting) == 0 and len(rig.s.running) == 2
    rig.decode(out, {low.request_id: [100], high.request_id: [100]})

    out = rig.s.schedule()   # low needs 32 tokens (2 blocks), high 33 (3): 5 > 4
    assert len(out.scheduled_new_reqs) == 0
    assert out.scheduled_cached_reqs.req_ids == [high.request_id]
    assert rig.s.requests[low.request_id].status == RequestStatus.PREEMPTED
    assert len(rig.s.waiting) == 1 and len(rig.s.running) == 1
    rig.decode(out, {low.request_id: [], high.request_id: [100]})
    rig.s.finish_requests(high.request_id, RequestStatus.FINISHED_STOPPED)

    out = rig.s.schedule()   # low resumes: its 30 prompt tokens and 2 decoded ones
    cached = out.scheduled_cached_reqs
    assert len(rig.s.waiting) == 0 and len(rig.s.running) == 1
    if v2_model_runner:      # V2 gets a resumed request as new, with all its tokens
        assert cached.num_reqs == 0 and len(out.scheduled_new_reqs) == 1
        new = out.scheduled_new_reqs[0]
        assert new.req_id == low.request_id
        assert len(new.prefill_token_ids) == 32 and new.prefill_token_ids[31] == 100
    else:
        assert len(out.scheduled_new_reqs) == 0 and cached.num_reqs == 1
        assert cached.req_ids == [low.request_id]
        assert list(cached.resumed_req_ids) == [low.request_id]
        assert list(cached.all_token_ids) == [low.request_id]
        tokens = cached.all_token_ids[low.request_id]
        assert len(tokens) == 32 and tokens[31] == 100

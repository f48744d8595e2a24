"""vLLM's real V1 scheduler driven in-process, without a model.

`InProcessEngine` builds a scheduler class (vLLM's own, or kvadmit's) with a
hand-made KV cache config, feeds it requests, and completes every scheduled
step with a fake model output (token 7 for each sampled position). This is
vLLM's scheduling code exactly, minus the forward pass: fast, deterministic,
and the way the tests check gating, victims and caps.

A token is sampled for a scheduled request only once its whole prompt (and
output so far) is computed, as vLLM's model runner does: a partial prefill
chunk samples nothing. After each `step`, `last_computed` (num_computed_tokens
of every scheduled request right after `schedule()`, i.e. including the step's
tokens), `last_free_blocks` (the block pool's free blocks right after
`schedule()`) and `last_outputs` (the step's `EngineCoreOutput`s) describe it,
for callers that put the steps on a clock (`kvadmit.simulate.vllm_engine`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvadmit.vllm.tiny_model import EOS_TOKEN_ID

_hash_ready = False


def model_runner_output(req_ids: list[str], sampled: list[list[int]], **fields):
    """vLLM's ModelRunnerOutput of a step: each request's sampled tokens, in order
    (0.32 and 0.33 also take the id -> index map that 0.34 derives from the order)."""
    if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__:
        fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **fields)


@dataclass
class StepLog:
    steps: int = 0
    preemptions: int = 0
    scheduled_tokens: int = 0
    finished: dict[str, str] = field(default_factory=dict)       # request id -> finish reason
    stop_reasons: dict[str, object] = field(default_factory=dict)
    kv_transfer_params: dict[str, dict] = field(default_factory=dict)   # of finished requests
    outputs: dict[str, list[int]] = field(default_factory=dict)   # request id -> tokens
    prefix_query_tokens: int = 0      # vLLM's prefix-cache stats (0 without prefix caching)
    prefix_hit_tokens: int = 0


class InProcessEngine:
    def __init__(self, model_dir: str, scheduler_cls=None, num_blocks: int = 64,
                 block_size: int = 32, max_model_len: int = 1024, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, additional_config: dict | None = None,
                 enable_prefix_caching: bool = False, async_scheduling: bool = False,
                 scheduling_policy: str = "fcfs", enable_chunked_prefill: bool | None = None,
                 engine_args: dict | None = None, kv_cache_spec=None):
        """`enable_chunked_prefill` None keeps vLLM's default; `engine_args` are
        further `EngineArgs` fields (e.g. `hf_overrides`); `kv_cache_spec` replaces
        the one full-attention KV cache group's spec."""
        global _hash_ready
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

        args = EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype="float32",
                          block_size=block_size, max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          enable_prefix_caching=enable_prefix_caching,
                          additional_config=additional_config or {},
                          async_scheduling=async_scheduling, scheduling_policy=scheduling_policy,
                          num_gpu_blocks_override=num_blocks,
                          # Named in the config as `--scheduler-cls` would (kvadmit's start-up
                          # check reads it); the class is built here, below.
                          **({"scheduler_cls": scheduler_cls} if scheduler_cls is not None else {}),
                          **({"enable_chunked_prefill": enable_chunked_prefill}
                             if enable_chunked_prefill is not None else {}),
                          **(engine_args or {}))
        self.vllm_config = args.create_engine_config()
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        # The CPU platform turns async scheduling off; GPUs default it on. Honour the ask.
        self.vllm_config.scheduler_config.async_scheduling = async_scheduling
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], kv_cache_spec or FullAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float32))])
        cls = scheduler_cls or (VllmAsyncScheduler if async_scheduling else VllmScheduler)
        self.scheduler = cls(vllm_config=self.vllm_config, kv_cache_config=kv_cache_config,
                             structured_output_manager=StructuredOutputManager(self.vllm_config),
                             block_size=block_size, log_stats=True)
        if not _hash_ready:
            init_none_hash(sha256)
            _hash_ready = True
        self.block_hasher = get_request_block_hasher(block_size, sha256)
        self.log = StepLog()
        self._ids = itertools.count()
        self._stop_at: dict[str, int] = {}
        self._out_ids: dict[str, list[int]] = {}
        self.last_computed: dict[str, int] = {}
        self.last_free_blocks: int = kv_cache_config.num_blocks - 1
        self.last_outputs: list = []

    def add(self, prompt_token_ids: list[int], max_tokens: int, priority: int = 0,
            request_id: str | None = None, output_tokens: int | None = None,
            output_token_ids: list[int] | None = None, extra_args: dict | None = None,
            session_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queues a request; with `output_tokens` the fake model emits EOS as that token.
        The fake model's other tokens are `output_token_ids` in order (7 past its end or
        without it); they must not contain EOS. `extra_args` become the request's
        `SamplingParams.extra_args` (kvadmit's per-request fields, kvadmit.request_fields),
        `session_id` vLLM's own session id of the request, `arrival_time` its
        `Request.arrival_time` (None: now, as vLLM stamps it)."""
        rid = request_id if request_id is not None else f"r{next(self._ids)}"
        stop_early = output_tokens is not None and output_tokens < max_tokens
        req = Request(request_id=rid, prompt_token_ids=list(prompt_token_ids),
                      sampling_params=SamplingParams(
                          max_tokens=max_tokens, ignore_eos=not stop_early,
                          stop_token_ids=[EOS_TOKEN_ID] if stop_early else None,
                          extra_args=extra_args),
                      pooling_params=None, priority=priority, block_hasher=self.block_hasher,
                      session_id=session_id, arrival_time=arrival_time)
        if stop_early:
            self._stop_at[rid] = output_tokens
        if output_token_ids is not None:
            self._out_ids[rid] = output_token_ids
        self.scheduler.add_request(req)
        self.log.outputs.setdefault(rid, [])
        return rid

    def step(self):
        """One schedule -> fake forward -> update round. Returns the SchedulerOutput."""
        s = self.scheduler
        out = s.schedule()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        computed = {}
        for rid in req_ids:
            req = s.requests[rid]
            # schedule() has already advanced num_computed_tokens by the step's tokens.
            computed[rid] = req.num_computed_tokens
            # A token is sampled once the request's whole prompt (and output) is computed:
            # vLLM's model runner discards the sample of a partial prefill chunk.
            if req.is_prefill_chunk:
                sampled.append([])
                continue
            k = len(req.output_token_ids)
            stop = self._stop_at.get(rid)
            if stop is not None and k + 1 >= stop:
                sampled.append([EOS_TOKEN_ID])
            else:
                ids = self._out_ids.get(rid)
                sampled.append([ids[k] if ids is not None and k < len(ids) else 7])
        self.last_computed = computed
        self.last_free_blocks = s.kv_cache_manager.block_pool.get_num_free_blocks()
        results = s.update_from_output(out, model_runner_output(req_ids, sampled))
        self.log.steps += 1
        self.log.scheduled_tokens += out.total_num_scheduled_tokens
        self.log.preemptions += len(out.preempted_req_ids or ())
        outputs = []
        for eco in results.values():
            stats = eco.scheduler_stats
            pc = stats.prefix_cache_stats if stats is not None else None
            if pc is not None:
                self.log.prefix_query_tokens += pc.queries + pc.preempted_queries
                self.log.prefix_hit_tokens += pc.hits + pc.preempted_hits
            for o in eco.outputs:
                outputs.append(o)
                self.log.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.log.finished[o.request_id] = str(o.finish_reason)
                    self.log.stop_reasons[o.request_id] = o.stop_reason
                    if o.kv_transfer_params is not None:
                        self.log.kv_transfer_params[o.request_id] = o.kv_transfer_params
                    self._stop_at.pop(o.request_id, None)
                    self._out_ids.pop(o.request_id, None)
        self.last_outputs = outputs
        return out

    def run(self, max_steps: int = 100_000) -> StepLog:
        s = self.scheduler
        while s.has_requests() and self.log.steps < max_steps:
            self.step()
        if s.has_requests():
            raise RuntimeError(f"still busy after {max_steps} steps")
        return self.log

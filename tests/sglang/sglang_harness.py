"""Drives SGLang 0.5.23's real scheduling classes on CPU, with a fake forward.

What is real: ``Req``, ``PrefillAdder`` (through the hooked
``Scheduler.get_prefill_adder_class``), ``ScheduleBatch`` (init_new,
prepare_for_extend, prepare_for_decode, check_decode_mem, retract_decode with
the hooked ``_get_decode_retraction_order``, filter_batch, merge_batch),
``TokenToKVPoolAllocator`` (SGLang's allocator for page_size 1),
``ReqToTokenPool``, ``UnifiedRadixCache`` (SGLang's default tree cache) and
``release_kv_cache`` / ``checkpoint_kv_cache``; requests enter through the real
``Scheduler._add_request_to_queue`` (which calls the hooked
``_abort_on_queued_limit``) on a ``Scheduler`` object that carries only the
attributes those methods read, and aborts go out through the real
``send_abort_output`` into an in-memory stand-in for the tokenizer socket.

What is not: a ``Scheduler`` cannot be constructed without a model and GPU, so
``Harness.step`` mirrors the structure of ``Scheduler.get_next_batch_to_run``
(merge the last prefill batch, prefill via the adder loop of
``_get_new_batch_prefill_raw``, else decode via ``update_running_batch``) and is
passed as ``original`` to kvadmit's own hook function for that method. The
"model" emits token 5 until a request's scripted output length, then EOS.
"""
from __future__ import annotations

import random
from array import array
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import AddReqResult, SchedulePolicy
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (
    NewTokenRatioTracker,
)
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from kvadmit import AdmissionConfig
from kvadmit.sglang import SGLangAdmission
from kvadmit.sglang.settings import priority_config
from kvadmit.sglang import plugin

EOS = 999
VOCAB = 1000


def ratio_tracker(schedule_conservativeness: float = 1.0) -> NewTokenRatioTracker:
    """SGLang's NewTokenRatioTracker.from_config under --schedule-conservativeness
    (from_config reads it from the server's global settings, which the harness has
    none of). The ratio starts at 0.7 x it, at most 1, and decays to 0.14 x its
    start over 600 steps, so values above 1/0.7 change nothing."""
    init = min(envs.SGLANG_INIT_NEW_TOKEN_RATIO.get() * schedule_conservativeness, 1.0)
    low = min(init * envs.SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR.get(), 1.0)
    return NewTokenRatioTracker(init=init, min=low, current=init,
                                decay=(init - low) / envs.SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS.get())


class Outbox:
    """Stands in for the scheduler's socket to the tokenizer; keeps what was sent."""

    def __init__(self):
        self.sent = []

    def send_output(self, output, recv_req=None):
        self.sent.append((output, recv_req))

    def aborts(self):
        return [o for o, _ in self.sent]


def make_req(rid: str, prompt_len: int, max_new: int, *, out_len: Optional[int] = None,
             priority=None, ignore_eos: bool = False, seed: int = 0,
             custom_params: Optional[dict] = None) -> Req:
    """A real SGLang Req; the fake model ends it with EOS after ``out_len`` tokens.
    ``custom_params``: SamplingParams.custom_params (kvadmit reads its "kvadmit" key)."""
    rng = random.Random(f"{rid}/{seed}")  # str seeds are stable across processes
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos,
                            custom_params=custom_params)
    params.normalize(None)
    req = Req(rid, "", array("q", [rng.randint(1, 900) for _ in range(prompt_len)]), params,
              eos_token_ids={EOS}, vocab_size=VOCAB, priority=priority)
    req.kvadmit_test_out_len = max_new if out_len is None else out_len
    return req


@dataclass
class StepLog:
    prefill: int = 0
    decode: int = 0
    retracted: int = 0
    finished: int = 0
    mixed: int = 0       # prefill steps that also decoded the running requests
    sat_out: int = 0     # mixed mode: prefill steps whose running requests did not fit
    displaced: int = 0   # running requests evicted for a waiting one (priority preemption)


class Harness:
    def __init__(self, config: Optional[AdmissionConfig], *, pool_tokens: int = 2048,
                 max_running: int = 64, max_prefill_tokens: int = 16384,
                 max_context: int = 4096, max_queued_requests: Optional[int] = None,
                 enable_priority_scheduling: bool = False,
                 low_priority_values_first: bool = False,
                 disable_priority_preemption: bool = False,
                 preemption_threshold: int = 10,
                 step_model: Optional[tuple] = None, clock_skew: float = 0.0,
                 chunk_tokens: Optional[int] = None, mixed_chunk: bool = False,
                 schedule_conservativeness: float = 1.0):
        """``enable_priority_scheduling``, ``low_priority_values_first``,
        ``disable_priority_preemption``, ``preemption_threshold``: SGLang's
        --enable-priority-scheduling, --schedule-low-priority-values-first,
        --disable-priority-preemption, --priority-scheduling-preemption-threshold
        (10 by default, as SGLang's); the waiting queue is then sorted by SGLang's own
        SchedulePolicy (fcfs with priorities), and a batch with no request slot left
        asks the adder's preempt_to_schedule, as SGLang's scheduler does.
        ``chunk_tokens``: SGLang's --chunked-prefill-size (None: no chunking);
        ``mixed_chunk``: --enable-mixed-chunk (a prefill step also decodes the
        running requests, when their next tokens fit). ``schedule_conservativeness``:
        --schedule-conservativeness (scales stock SGLang's new_token_ratio). ``step_model``: (a, b, c) of a virtual clock that advances by
        a + b * tokens + c * context seconds per forward (tokens: scheduled,
        context: the batch's sequence lengths); the adapter reads it (plus
        ``clock_skew``, as another rank's clock would). None: wall time."""
        self.allocator = TokenToKVPoolAllocator(pool_tokens, torch.float16, "cpu", None, False)
        self.req_to_token_pool = ReqToTokenPool(max_running + 8, max_context, "cpu", False)
        params = CacheInitParams(disable=False, req_to_token_pool=self.req_to_token_pool,
                                 token_to_kv_pool_allocator=self.allocator, page_size=1)
        params.tree_components = (ComponentType.FULL,)
        self.tree_cache = UnifiedRadixCache(params)
        self.model_config = SimpleNamespace(vocab_size=VOCAB, is_encoder_decoder=False)
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.chunk_tokens = chunk_tokens
        self.mixed_chunk = mixed_chunk
        self.tracker = ratio_tracker(schedule_conservativeness)
        self.outbox = Outbox()

        s = Scheduler.__new__(Scheduler)  # only what the called methods read
        s.waiting_queue = []
        s.running_batch = ScheduleBatch(reqs=[])
        s.last_batch = None
        s.chunked_req = None
        s.page_size = 1
        s.chunked_prefill_size = chunk_tokens
        s.model_config = self.model_config
        s.tree_cache = self.tree_cache
        s.token_to_kv_pool_allocator = self.allocator
        s.max_total_num_tokens = pool_tokens
        s.max_req_len = max_context
        s.max_queued_requests = max_queued_requests
        s.enable_priority_scheduling = enable_priority_scheduling
        s.schedule_low_priority_values_first = low_priority_values_first
        s.enable_priority_preemption = enable_priority_scheduling and not disable_priority_preemption
        s.priority_scheduling_preemption_threshold = preemption_threshold
        self.policy = SchedulePolicy("fcfs", self.tree_cache, False, enable_priority_scheduling,
                                     low_priority_values_first)
        s.abort_on_priority_when_disabled = False
        s.disaggregation_mode = DisaggregationMode.NULL
        s.enable_hicache_storage = False
        s.enable_lmcache = False
        s.processed_tokens_counter = 0
        s.rust_server = None
        s.ipc_channels = SimpleNamespace(send_to_tokenizer=self.outbox)
        s.beam_coordinator = SimpleNamespace(retire_group=lambda req: None)
        s._kvadmit = None
        self.sched = s
        self.adapter: Optional[SGLangAdmission] = None
        self.step_model = step_model
        self.t = 1.8e9  # virtual clock (step_model): UNIX time, as deadline_s needs
        if config is not None:
            # as SGLangAdmission.for_scheduler builds it (which needs a whole Scheduler)
            self.adapter = SGLangAdmission(priority_config(config, s), num_tokens=pool_tokens,
                                           page_size=1, max_model_len=max_context,
                                           low_priority_values_first=low_priority_values_first,
                                           step_budget=max_prefill_tokens,
                                           vocab_size=VOCAB,
                                           priority_preemption=s.enable_priority_preemption)
            if step_model is not None:
                self.adapter.clock = lambda: self.t + clock_skew
            s._kvadmit = self.adapter
        self.log = StepLog()
        self.finished: list = []
        self.displaced: list = []   # rids evicted by priority preemption, in order
        self.retracted: list = []   # rids retracted at decode, in order

    # ------------------------------------------------------------------
    def submit(self, req: Req) -> bool:
        """Scheduler._add_request_to_queue (real). True when the request was queued."""
        Scheduler._add_request_to_queue(self.sched, req)
        return any(r is req for r in self.sched.waiting_queue)

    def new_adder(self, running_batch):
        adder_cls = self.sched.get_prefill_adder_class()
        return adder_cls(
            1, self.tree_cache, self.allocator, running_batch, self.tracker.current,
            self.max_prefill_tokens, self.chunk_tokens,
            running_batch.batch_size() if self.mixed_chunk and self.chunk_tokens else 0,
            self.sched.priority_scheduling_preemption_threshold,
            max_running_requests=self.max_running, waiting_queue_len=len(self.sched.waiting_queue))

    # ------------------------------------------------------------------
    # Mirror of Scheduler.get_next_batch_to_run (see the module docstring)
    def _get_next_batch_to_run(self, sched, running_batch, last_batch):
        exclude = []
        if sched.chunked_req is not None:
            # The request being chunked stays out of the running batch; its KV so
            # far goes into the radix cache (Scheduler.stash_chunked_request).
            exclude.append(sched.chunked_req)
            if sched.chunked_req.extend_end > sched.chunked_req.prefix_len:
                checkpoint_kv_cache(sched.chunked_req, self.tree_cache)
        if last_batch is not None and last_batch.forward_mode.is_extend():
            if last_batch.chunked_req is not None:
                exclude.append(last_batch.chunked_req)
            last_batch.filter_batch(reqs_to_exclude=exclude)
            if not last_batch.is_empty() and last_batch is not running_batch:
                if running_batch.is_empty():
                    running_batch = last_batch
                else:
                    running_batch.merge_batch(last_batch)
        bs = running_batch.batch_size()
        running_batch.filter_batch()
        if running_batch.batch_size() < bs or running_batch.is_empty():
            running_batch.batch_is_full = False
        new_batch, running_batch = self._prefill(running_batch)
        if new_batch is not None:
            return SimpleNamespace(batch_to_run=new_batch, running_batch=running_batch)
        if running_batch.is_empty():
            return SimpleNamespace(batch_to_run=None, running_batch=running_batch)
        return SimpleNamespace(batch_to_run=self._update_running_batch(running_batch),
                               running_batch=running_batch)

    def _prefill(self, running_batch):
        """Scheduler._get_new_batch_prefill_raw: (the prefill batch or None, the running batch)."""
        sched = self.sched
        if sched.enable_priority_preemption or running_batch.is_empty():
            running_batch.batch_is_full = False   # try preemption with a prefill adder
        if (running_batch.batch_is_full or not sched.waiting_queue) and sched.chunked_req is None:
            return None, running_batch
        if (running_batch.batch_size() >= self.max_running and sched.chunked_req is None
                and not sched.enable_priority_preemption):
            running_batch.batch_is_full = True
            return None, running_batch
        self.policy.calc_priority(sched.waiting_queue, running_batch)
        adder = self.new_adder(running_batch)
        if sched.chunked_req is not None:
            sched.chunked_req.init_next_round_input()
            sched.chunked_req = adder.add_chunked_req(sched.chunked_req)
        for req in sched.waiting_queue:
            if adder.budget_state() == AddReqResult.OTHER:
                break
            if len(adder.can_run_list) + running_batch.batch_size() >= self.max_running:
                running_batch.batch_is_full = True
            if running_batch.batch_is_full:
                if not sched.enable_priority_preemption or not adder.preempt_to_schedule(req):
                    break
            req.init_next_round_input(self.tree_cache)
            res = adder.add_one_req(req, has_chunked_req=sched.chunked_req is not None,
                                    truncation_align_size=None)
            if res != AddReqResult.CONTINUE:
                if res == AddReqResult.NO_TOKEN:
                    running_batch.batch_is_full = (len(adder.can_run_list) > 0
                                                   or not running_batch.is_empty())
                break
        self.log.displaced += len(adder.preempt_list)
        self.displaced.extend(r.rid for r in adder.preempt_list)
        if not adder.can_run_list:
            for req in adder.preempt_list:   # released already: back to the queue
                Scheduler._add_request_to_queue(sched, req)
            return None, running_batch
        chosen = set(adder.can_run_list)
        sched.waiting_queue = [r for r in sched.waiting_queue if r not in chosen]
        for req in adder.preempt_list:
            Scheduler._add_request_to_queue(sched, req)
        if adder.new_chunked_req is not None:
            assert sched.chunked_req is None
            sched.chunked_req = adder.new_chunked_req
        if sched.chunked_req is not None:
            sched.chunked_req.inflight_middle_chunks += 1
        batch = ScheduleBatch.init_new(adder.can_run_list, self.req_to_token_pool, self.allocator,
                                       self.tree_cache, self.model_config, False,
                                       SpeculativeAlgorithm.NONE, chunked_req=sched.chunked_req)
        batch.prepare_for_extend()
        batch.decoding_reqs = None
        if self.mixed_chunk and self.chunk_tokens and not running_batch.is_empty():
            # As SGLang: the running requests decode in the same step when their next
            # tokens fit; otherwise they sit it out (a mixed step does not retract).
            if running_batch.check_decode_mem():
                running_batch.prepare_for_decode()
                batch.mix_with_running(running_batch)
                batch.decoding_reqs = running_batch.reqs
                running_batch = ScheduleBatch(reqs=[], batch_is_full=running_batch.batch_is_full)
            else:
                self.log.sat_out += 1
        return batch, running_batch

    def _update_running_batch(self, batch):
        if not batch.check_decode_mem():
            retracted, ratio, to_abort = batch.retract_decode()
            assert not to_abort, [r.rid for r in to_abort]
            self.log.retracted += len(retracted)
            self.retracted.extend(r.rid for r in retracted)
            self.tracker.current = ratio
            for req in retracted:
                Scheduler._add_request_to_queue(self.sched, req, is_retracted=True)
        else:
            self.tracker.decay_step()
        if batch.is_empty():
            return None
        batch.prepare_for_decode()
        return batch

    # ------------------------------------------------------------------
    @staticmethod
    def batch_shape(batch):
        """(scheduled tokens, context tokens) of a batch, as the virtual clock charges it."""
        context = int(batch.seq_lens.sum())
        if batch.forward_mode.is_extend():
            return sum(batch.extend_lens), context
        return len(batch.reqs), context

    def _forward(self, batch) -> None:
        """Fake model + SGLang's result processing for one batch."""
        if self.step_model is not None:
            a, b, c = self.step_model
            tokens, context = self.batch_shape(batch)
            self.t += a + b * tokens + c * context
        decoding = batch.decoding_reqs or ()
        for req in batch.reqs:
            if req.finished():
                continue
            if req.inflight_middle_chunks > 0:   # a middle chunk samples nothing
                req.inflight_middle_chunks -= 1
                continue
            tok = EOS if len(req.output_ids) + 1 >= req.kvadmit_test_out_len else 5
            req.output_ids.append(tok)
            req.update_finish_state()
            if req.finished():
                release_kv_cache(req, self.tree_cache, checkpoint=True)
                self.finished.append(req)
                self.log.finished += 1
            elif batch.forward_mode.is_extend() and req not in decoding:
                checkpoint_kv_cache(req, self.tree_cache)

    def step(self) -> Optional[ScheduleBatch]:
        """One scheduler iteration (through kvadmit's get_next_batch_to_run hook)."""
        s = self.sched
        plan = plugin.around_get_next_batch_to_run(
            self._get_next_batch_to_run, s, running_batch=s.running_batch, last_batch=s.last_batch)
        s.running_batch = plan.running_batch
        batch = plan.batch_to_run
        if batch is not None:
            if batch.forward_mode.is_mixed():
                self.log.mixed += 1
            if batch.forward_mode.is_extend():
                self.log.prefill += 1
            else:
                self.log.decode += 1
            self._forward(batch)
        s.last_batch = batch
        return batch

    def run(self, arrivals=None, max_steps: int = 100_000) -> StepLog:
        """Steps until every request is done. ``arrivals`` maps a step number
        to the requests submitted just before that step."""
        s = self.sched
        pending = dict(arrivals or {})
        steps = 0
        while pending or s.waiting_queue or not s.running_batch.is_empty() or s.chunked_req or (
                s.last_batch is not None and not s.last_batch.is_empty()
                and any(not r.finished() for r in s.last_batch.reqs)):
            for req in pending.pop(steps, ()):
                self.submit(req)
            self.step()
            steps += 1
            assert steps < max_steps, "workload did not drain"
        self.steps = steps
        self.step()  # let the ledger see the last finishes
        return self.log

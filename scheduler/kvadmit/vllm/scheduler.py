"""kvadmit inside vLLM's V1 scheduler.

vLLM keeps doing everything it does (token budgets, chunked prefill, prefix
caching, allocation); kvadmit's core decides three things and this module only
translates vLLM's objects to the core's numbers and back:

- which waiting request may start: `self.waiting` becomes a `GatedWaitingQueue`
  whose truthiness and head come from `AdmissionCore.next_admissible`; vLLM's
  WAITING loop stops when the queue is falsy, so a held head is never started,
  while `len()` stays truthful so the engine keeps stepping;
- which running request is preempted first: `self.running` is put in the core's
  victim order before each step, so the request vLLM pops (`running[-1]`) is the
  core's victim;
- which arrivals are refused: `add_request` asks `AdmissionCore.arrive`; a refused
  request never enters the scheduler and its client gets a finished output with
  `finish_reason=abort` and `stop_reason="kvadmit:<reason>"`.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator

from vllm.v1.core.sched.async_scheduler import AsyncScheduler as VllmAsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus

from kvadmit._native import AdmissionCore, BlockObjectQueue
from kvadmit.config import AdmissionConfig, ConfigError
from kvadmit.vllm.metrics import process_metrics

logger = logging.getLogger("kvadmit.vllm")

CONFIG_KEY = "kvadmit"
STOP_REASON_PREFIX = "kvadmit:"


def config_from_vllm(vllm_config) -> AdmissionConfig:
    """The `"kvadmit"` object of vLLM's `--additional-config` (a dict or JSON text)."""
    extra = vllm_config.additional_config or {}
    if not isinstance(extra, dict):
        raise ConfigError(f"additional_config must be a JSON object, got {type(extra).__name__}")
    raw = extra.get(CONFIG_KEY, {})
    if isinstance(raw, str):
        return AdmissionConfig.from_json(raw)
    return AdmissionConfig.from_dict(raw)


class GatedWaitingQueue(RequestQueue):
    """vLLM's waiting queue with kvadmit's gate in front of its head.

    The order is the core's (arrival, or priority then arrival). The candidate
    chosen when vLLM first looks (``bool(queue)`` / ``peek_request``) is the one
    ``pop_request`` hands out, so a request vLLM allocated for is the request it
    starts.
    """

    def __init__(self, sched: "_KvadmitMixin"):
        self._sched = sched
        self._by_slot: dict[int, Request] = {}
        self._candidate: Request | None = None

    # -- the gate ---------------------------------------------------------
    def _choose(self) -> Request | None:
        if self._candidate is None and self._by_slot:
            slot = self._sched.kvadmit_core.next_admissible(
                self._sched.kv_cache_manager.block_pool.get_num_free_blocks(), False)
            self._candidate = self._by_slot.get(slot)
        return self._candidate

    def __bool__(self) -> bool:
        return self._choose() is not None

    def peek_request(self) -> Request:
        req = self._choose()
        if req is None:
            raise IndexError("no waiting request may start now")
        return req

    def pop_request(self) -> Request:
        req = self.peek_request()
        self._candidate = None
        slot = self._sched.kvadmit_slot[req.request_id]
        del self._by_slot[slot]
        self._sched.kvadmit_core.admit(slot, time.monotonic())
        return req

    # -- plain queue operations -------------------------------------------
    def add_request(self, request: Request) -> None:
        self._candidate = None
        slot = self._sched.kvadmit_slot[request.request_id]
        core = self._sched.kvadmit_core
        if core.state(slot) == "running":
            # Popped but not started (vLLM skipped it this step): undo the admission.
            core.cancel_admit(slot)
        self._by_slot[slot] = request

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)   # the core's order puts it where it belongs

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for r in requests:
            self.add_request(r)

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        self._candidate = None
        ids = {r.request_id for r in requests}
        for slot, r in list(self._by_slot.items()):
            if r.request_id in ids:
                del self._by_slot[slot]

    def __len__(self) -> int:
        return len(self._by_slot)

    def __iter__(self) -> Iterator[Request]:
        by_slot = self._by_slot
        return iter([by_slot[s] for s in self._sched.kvadmit_core.waiting() if s in by_slot])


class _KvadmitMixin:
    """The kvadmit behaviour, shared by the sync and async scheduler flavours."""

    kvadmit_core: AdmissionCore
    kvadmit_slot: dict[str, int]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cfg = config_from_vllm(self.vllm_config)
        sched_cfg = self.vllm_config.scheduler_config
        if cfg.prefill_chunk_tokens == 0 and sched_cfg.enable_chunked_prefill:
            # Long prompts take several steps to prefill: extend the KV curves by them.
            cfg = cfg.replace(prefill_chunk_tokens=sched_cfg.max_num_batched_tokens)
        if self.policy == SchedulingPolicy.PRIORITY:
            if cfg.queue_order != "priority":
                cfg = cfg.replace(queue_order="priority")
            if cfg.victim != "priority":
                logger.warning("vLLM's priority scheduling picks its own victim (highest "
                               "priority value, latest arrival); kvadmit victim=%r is not used",
                               cfg.victim)
        self.kvadmit_config = cfg
        pool = self.kv_cache_manager.block_pool
        if cfg.native_allocator:
            self._kvadmit_install_native_queue(pool)
        # Block 0 is vLLM's null block: never handed to a request.
        self.kvadmit_core = AdmissionCore(cfg, pool.num_gpu_blocks - 1, self.block_size,
                                          self.vllm_config.model_config.max_model_len)
        self.kvadmit_slot = {}
        self._kvadmit_rejections: list[tuple[int, EngineCoreOutput]] = []
        self.waiting = GatedWaitingQueue(self)
        self._kvadmit_metrics = process_metrics()
        logger.info("kvadmit: policy=%s victim=%s on %d blocks of %d tokens", cfg.policy,
                    cfg.victim, pool.num_gpu_blocks - 1, self.block_size)

    @staticmethod
    def _kvadmit_install_native_queue(pool) -> None:
        if pool.free_block_queue.num_free_blocks != pool.num_gpu_blocks - 1:
            raise RuntimeError("kvadmit: native_allocator must be installed before any allocation")
        queue = BlockObjectQueue(pool.blocks)
        null = queue.popleft()   # what BlockPool.__init__ did with its own queue
        if null is not pool.null_block:
            raise RuntimeError("kvadmit: native queue disagrees with vLLM on the null block")
        pool.free_block_queue = queue

    # -- arrivals -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:   # streaming input for a live request
            return super().add_request(request)
        core = self.kvadmit_core
        try:
            res = core.arrive(request.num_prompt_tokens, request.max_tokens,
                              priority=request.priority, now=time.monotonic())
        except ValueError as e:   # add_request must not raise into the engine loop
            logger.warning("kvadmit: refused %s: %s", request.request_id, e)
            self._kvadmit_rejections.append((request.client_index, EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[],
                finish_reason=FinishReason.ABORT, stop_reason=STOP_REASON_PREFIX + "invalid")))
            return None
        for slot, rejection in res.shed:
            self._kvadmit_shed(slot, rejection)
        if not res.accepted:
            self._kvadmit_reject(request, res.rejection)
            return None
        self.kvadmit_slot[request.request_id] = res.slot
        return super().add_request(request)

    def _kvadmit_reject(self, request: Request, rejection) -> None:
        logger.info("kvadmit: refused %s: %s", request.request_id, rejection.message)
        self._kvadmit_rejections.append((request.client_index, EngineCoreOutput(
            request_id=request.request_id, new_token_ids=[], finish_reason=FinishReason.ABORT,
            stop_reason=STOP_REASON_PREFIX + rejection.reason)))

    def _kvadmit_shed(self, slot: int, rejection) -> None:
        rid = next(r for r, s in self.kvadmit_slot.items() if s == slot)
        request = self.requests[rid]
        del self.kvadmit_slot[rid]   # the core already forgot it
        self.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        self._kvadmit_reject(request, rejection)

    # -- every step ------------------------------------------------------------
    def schedule(self, *args, **kwargs):
        core = self.kvadmit_core
        slots, computed, generated, by_slot = [], [], [], {}
        for req in self.running:
            slot = self.kvadmit_slot.get(req.request_id)
            if slot is None:
                continue
            prompt = req.num_prompt_tokens
            gen = max(req.num_tokens - prompt, req.num_computed_tokens - prompt, 0)
            slots.append(slot)
            generated.append(gen)
            computed.append(min(req.num_computed_tokens, prompt + gen))
            by_slot[slot] = req
        if core.num_running < len(slots):   # started outside the gate (KV-holding queue)
            for slot in slots:
                if core.state(slot) == "waiting":
                    core.admit(slot, time.monotonic())
        core.update_many(slots, computed, generated)
        # vLLM preempts running[-1] first: put the core's victim order in place.
        order = [by_slot[s] for s in core.victim_order() if s in by_slot]
        if len(order) == len(self.running):
            self.running = order
        out = super().schedule(*args, **kwargs)
        core.on_step(time.monotonic())
        if self._kvadmit_metrics is not None:
            self._kvadmit_metrics.update(core.stats())
        return out

    def _preempt_request(self, request: Request, timestamp: float, *args, **kwargs) -> None:
        slot = self.kvadmit_slot.get(request.request_id)
        if slot is not None:
            self.kvadmit_core.preempt(slot, time.monotonic())
        return super()._preempt_request(request, timestamp, *args, **kwargs)

    def _free_request(self, request: Request, *args, **kwargs):
        slot = self.kvadmit_slot.pop(request.request_id, None)
        if slot is not None:
            core = self.kvadmit_core
            natural = request.status in (RequestStatus.FINISHED_STOPPED,
                                         RequestStatus.FINISHED_LENGTH_CAPPED)
            if core.state(slot) == "running" and natural:
                prompt = request.num_prompt_tokens
                gen = request.num_tokens - prompt
                core.update(slot, min(request.num_computed_tokens, prompt + gen), gen)
                core.finish(slot, time.monotonic())
            else:
                core.abort(slot)
        return super()._free_request(request, *args, **kwargs)

    # -- outputs ---------------------------------------------------------------
    def update_from_output(self, *args, **kwargs) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(*args, **kwargs)
        if self._kvadmit_rejections:
            by_client: dict[int, list[EngineCoreOutput]] = defaultdict(list)
            for client, out in self._kvadmit_rejections:
                by_client[client].append(out)
            self._kvadmit_rejections.clear()
            for client, outs in by_client.items():
                eco = outputs.get(client)
                if eco is None:
                    outputs[client] = eco = EngineCoreOutputs()
                eco.outputs = list(eco.outputs) + outs
        return outputs

    def has_finished_requests(self) -> bool:
        # Pending rejections keep the engine stepping until their outputs are sent.
        return bool(self._kvadmit_rejections) or super().has_finished_requests()


class KvadmitScheduler(_KvadmitMixin, VllmScheduler):
    """vLLM's Scheduler with kvadmit admission (synchronous scheduling)."""


class KvadmitAsyncScheduler(_KvadmitMixin, VllmAsyncScheduler):
    """vLLM's AsyncScheduler with kvadmit admission (async scheduling)."""


class Scheduler:
    """What `--scheduler-cls kvadmit.vllm.Scheduler` names: picks the flavour
    matching `async_scheduling`, so the engine keeps its overlap on GPUs."""

    def __new__(cls, *args, **kwargs):
        vllm_config = kwargs.get("vllm_config") or args[0]
        if vllm_config.scheduler_config.async_scheduling:
            return KvadmitAsyncScheduler(*args, **kwargs)
        return KvadmitScheduler(*args, **kwargs)

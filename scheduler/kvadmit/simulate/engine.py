"""The simulator's engines: one run of one policy on one workload.

`run_native` drives the compiled engine model (`kvadmit._native.NativeEngine`);
`kvadmit.simulate.vllm_engine.run_vllm` drives vLLM's real V1 scheduler. Both
return a `RawRun` with the same fields (its totals one `Totals`), so metrics,
tables and plots do not care which engine ran.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvadmit._native import NativeEngine
from kvadmit.config import AdmissionConfig
from kvadmit.simulate.record import Totals
from kvadmit.simulate.steptime import StepTimeModel
from kvadmit.simulate.workload import Workload


@dataclass(frozen=True)
class EngineShape:
    """The engine's limits (vLLM's names): KV pool, context, batch."""
    num_blocks: int
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = True
    prefix_caching: bool = False
    reserve_full_input: bool = True     # vLLM's scheduler_reserve_full_isl: admit only if the whole input fits
    watermark: float = 0.0  # vLLM's --watermark: share of the pool kept free at admission
    max_num_active_seqs: int = 0        # vLLM's --max-num-active-seqs: admission stops here (0: max_num_seqs)
    scheduling_policy: str = "fcfs"     # vLLM's --scheduling-policy: fcfs or priority

    def __post_init__(self) -> None:
        for k, lo in (("num_blocks", 1), ("block_size", 1), ("max_model_len", 1),
                      ("max_num_seqs", 1), ("max_num_batched_tokens", 1)):
            if getattr(self, k) < lo:
                raise ValueError(f"{k}={getattr(self, k)}: must be >= {lo}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark={self.watermark}: must be in [0, 1) (vLLM's range)")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r}: one of 'fcfs', "
                             f"'priority' (vLLM's --scheduling-policy)")
        if not 0 <= self.max_num_active_seqs <= self.max_num_seqs:
            raise ValueError(f"max_num_active_seqs={self.max_num_active_seqs}: must be in "
                             f"[0, max_num_seqs={self.max_num_seqs}] (0: max_num_seqs)")
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(f"num_blocks={self.num_blocks} x block_size={self.block_size} tokens "
                             f"must hold max_model_len={self.max_model_len}")


    @property
    def watermark_blocks(self) -> int:
        """vLLM's `int(watermark * kv_cache_config.num_blocks)`; vLLM's pool counts one
        more block than is usable (its null block)."""
        return int(self.watermark * (self.num_blocks + 1))


@dataclass
class RawRun:
    """What one engine run produced. ``per_request`` columns are in workload order:
    arrival_s, first_token_s, finish_s (-1: never), output_tokens, preemptions,
    rejected (reason or None). ``timeline`` as NativeEngine's."""
    engine: str
    per_request: dict
    totals: Totals
    timeline: dict
    wall_s: float
    extra: dict = field(default_factory=dict)


def native_engine(workload: Workload, config: AdmissionConfig, shape: EngineShape,
                  step: StepTimeModel, sample_interval_s: float | None = None) -> NativeEngine:
    """A NativeEngine of this shape and step time, for this workload's prefix ids
    (no requests added yet): run_native's and the fleet's instances."""
    workload.check_block_size(shape.block_size)
    if sample_interval_s is None:
        sample_interval_s = workload.sample_interval_s()
    return NativeEngine(config, shape.num_blocks, shape.block_size, shape.max_model_len,
                        shape.max_num_seqs, shape.max_num_batched_tokens,
                        chunked_prefill=shape.chunked_prefill, prefix_caching=shape.prefix_caching,
                        step_a=step.a, step_b=step.b, step_c=step.c,
                        hash_block_tokens=workload.hash_block_tokens if shape.prefix_caching else 0,
                        sample_interval_s=sample_interval_s,
                        reserve_full_input=shape.reserve_full_input,
                        watermark_blocks=shape.watermark_blocks,
                        max_num_active_seqs=shape.max_num_active_seqs,
                        vllm_priority_policy=shape.scheduling_policy == "priority")


def run_native(workload: Workload, config: AdmissionConfig, shape: EngineShape,
               step: StepTimeModel, sample_interval_s: float | None = None,
               progress=None) -> RawRun:
    workload = workload.screened(config)
    eng = native_engine(workload, config, shape, step, sample_interval_s)
    t0 = time.perf_counter()
    eng.add_requests(workload.requests(hash_ids=shape.prefix_caching))
    eng.run(progress=progress)
    wall = time.perf_counter() - t0
    return RawRun("native", eng.results(), Totals.from_engine(eng.totals()), eng.timeline(), wall,
                  extra={"core": eng.core_stats()})

"""The kvadmit configuration as a vLLM engine of a given shape runs it.

One function for kvadmit's vLLM scheduler and the simulator's engine model of vLLM
(`kvadmit._native.NativeEngine`, which fits its config with it), so that a simulated
run and a real one make the same decisions from the same config. Imports nothing
from vLLM.
"""
from __future__ import annotations

from kvadmit.config import AdmissionConfig


def fit_to_vllm(cfg: AdmissionConfig, *, chunked_prefill: bool, max_num_batched_tokens: int,
                priority_scheduling: bool) -> AdmissionConfig:
    """``cfg`` with what the engine decides for it: the prefill chunk (with chunked
    prefill a prompt longer than a step's token budget takes several steps, and the
    KV curves must count them) and, under vLLM's ``--scheduling-policy priority``,
    the queue in priority order."""
    if cfg.prefill_chunk_tokens == 0 and chunked_prefill:
        cfg = cfg.replace(prefill_chunk_tokens=max_num_batched_tokens)
    if priority_scheduling and cfg.queue_order != "priority":
        cfg = cfg.replace(queue_order="priority")
    return cfg

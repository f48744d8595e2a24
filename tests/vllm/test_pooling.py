"""Pooling requests (embed, classify) under kvadmit, on vLLM's real Scheduler
in-process: a pooling request never decodes, so kvadmit counts its prompt alone (no
output token), and one of exactly max_model_len prompt tokens is scheduled and
finishes as on stock vLLM (counting one output token refused it: context_length)."""
import pytest
import torch
from vllm.pooling_params import PoolingParams
from vllm.v1.request import Request

from kvadmit.vllm import Scheduler
from kvadmit.vllm.inprocess import InProcessEngine, model_runner_output
from kvadmit.vllm.request import arrival_record

MAX_MODEL_LEN = 256
CHUNK = 96         # max_num_batched_tokens: the prompt's prefill takes three chunks


def pooling_engine(model_dir, kvadmit=None):
    """vLLM's pooling runner (the tiny Llama as an embedding model) with chunked
    prefill, on a pool of two max_model_len sequences (the core's lockstep model counts
    a chunked prefill's extra steps as growth: a prompt that fills the whole pool alone
    is refused for kv_capacity, pooling or not)."""
    return InProcessEngine(model_dir, scheduler_cls=Scheduler if kvadmit is not None else None,
                           additional_config={"kvadmit": kvadmit} if kvadmit is not None else None,
                           num_blocks=2 * MAX_MODEL_LEN // 32 + 1, max_model_len=MAX_MODEL_LEN,
                           max_num_batched_tokens=CHUNK, enable_chunked_prefill=True,
                           engine_args={"runner": "pooling"})


def pooling_request(rid, n_tokens):
    return Request(request_id=rid, prompt_token_ids=[5] * n_tokens, sampling_params=None,
                   pooling_params=PoolingParams(task="embed"))


def run_pooling(eng, rid):
    """Steps the engine as vLLM's pooling model runner would: no sampled token, a pooled
    output once the whole prompt is computed. [(tokens scheduled)], finish reason."""
    s = eng.scheduler
    steps, finished = [], {}
    for _ in range(10):          # bounded: one that never finishes fails the test
        if not s.has_requests():
            break
        out = s.schedule()
        ids = list(out.num_scheduled_tokens)
        if rid in out.num_scheduled_tokens:
            steps.append(out.num_scheduled_tokens[rid])
        pooled = [None if s.requests[r].is_prefill_chunk else torch.zeros(4) for r in ids]
        results = s.update_from_output(out, model_runner_output(
            ids, [[] for _ in ids], pooler_output=pooled))
        for eco in results.values():
            finished.update({o.request_id: (str(o.finish_reason), o.stop_reason)
                             for o in eco.outputs if o.finish_reason is not None})
    return steps, finished.get(rid)


def test_a_pooling_request_counts_no_output_token(model_dir):
    """The arrival record of a pooling request has max_new_tokens 0 (vLLM itself gives
    it max_tokens 1); a generating request keeps its max_tokens."""
    eng = pooling_engine(model_dir, {})
    adm = eng.scheduler.kvadmit
    pooled = pooling_request("p", MAX_MODEL_LEN)
    assert pooled.max_tokens == 1
    record = arrival_record(pooled, adm.config, adm.vocab_size, None)
    assert (record.prompt_tokens, record.max_new_tokens) == (MAX_MODEL_LEN, 0)


@pytest.mark.parametrize("kvadmit", [{}, {"policy": "overcommit", "victim": "lifo"}],
                         ids=["default", "pass-through"])
def test_a_pooling_prompt_of_max_model_len_is_scheduled_and_finishes(model_dir, kvadmit):
    """Chunked prefill up to max_model_len, then the pooled output finishes it: the
    same steps as stock vLLM's, admitted (not refused for context_length), and the
    request leaves kvadmit with every block back in the pool. The pass-through is
    vLLM's upstream test's set-up (tests/vllm/upstream_passthrough.py)."""
    stock = pooling_engine(model_dir)
    stock.scheduler.add_request(pooling_request("pool", MAX_MODEL_LEN))
    expected = run_pooling(stock, "pool")
    assert expected == ([96, 96, 64], ("stop", None))

    eng = pooling_engine(model_dir, kvadmit)
    eng.scheduler.add_request(pooling_request("pool", MAX_MODEL_LEN))
    assert run_pooling(eng, "pool") == expected
    adm = eng.scheduler.kvadmit
    stats = adm.port.stats()
    assert sum(stats["rejected"].values()) == 0 and "pool" not in adm.slots
    pool = eng.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1

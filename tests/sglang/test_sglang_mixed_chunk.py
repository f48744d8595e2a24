"""Mixed chunked prefill (SGLang's --enable-mixed-chunk) on SGLang's real classes:
a prefill step also decodes the running requests when their next tokens fit, and
never retracts; a request longer than the chunk is prefilled over several steps, and
SGLang continues it even when the pool is empty. Under `overcommit` the running
requests' decodes in those steps took the room the chunked request's last chunk
needed: SGLang's allocation raised "Out of memory ... Available full tokens: 0"
inside the scheduler. kvadmit's adder now keeps that room (the chunked prompt's rest
and a token per running request per chunk step) out of the other admissions."""
import random
from array import array

import pytest

pytest.importorskip("sglang.srt")  # not "sglang": see conftest.py

from kvadmit import AdmissionConfig  # noqa: E402

POOL = 2000


def workload(seed, n=300, share=0.4):
    """n requests, three per step; `share` of them start with one of four prefixes."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang_harness import EOS, VOCAB

    rng = random.Random(seed)
    prefixes = [[rng.randint(1, 900) for _ in range(rng.randint(100, 300))] for _ in range(4)]
    plan = {}
    for i in range(n):
        ids = list(rng.choice(prefixes)) if rng.random() < share else []
        ids += [rng.randint(1, 900) for _ in range(rng.randint(20, 200))]
        max_new = rng.randint(32, 400)
        params = SamplingParams(max_new_tokens=max_new)
        params.normalize(None)
        req = Req(f"r{i}", "", array("q", ids), params, eos_token_ids={EOS}, vocab_size=VOCAB)
        req.kvadmit_test_out_len = rng.randint(1, max_new)
        plan.setdefault(i // 3, []).append(req)
    return plan


def run(policy, chunk, mixed, seed=0):
    from sglang_harness import Harness

    config = None if policy is None else AdmissionConfig.from_dict({"policy": policy})
    h = Harness(config, pool_tokens=POOL, chunk_tokens=chunk, mixed_chunk=mixed)
    plan = workload(seed)
    n = sum(len(v) for v in plan.values())
    log = h.run(plan)
    assert log.finished == n and len(h.finished) == n
    assert h.allocator.available_size() + h.tree_cache.evictable_size() == POOL  # no KV leaked
    if mixed:
        assert log.mixed > 0          # the mode really ran: prefill steps that also decoded
    if h.adapter is not None:
        stats = h.adapter.stats()
        assert stats["running"] == 0 and stats["waiting"] == 0
        assert stats["finished"] == n and stats["preempted"] == log.retracted
    return log


@pytest.mark.parametrize("policy", [None, "overcommit", "peak", "predict", "auto"],
                         ids=lambda p: p or "sglang")
@pytest.mark.parametrize("mixed", [False, True], ids=["chunked", "mixed-chunk"])
def test_chunked_prefill_matrix(kvadmit_hooks, policy, mixed):
    """Chunk 128, a 2000-token pool, 300 requests, 40% sharing prefixes: every request
    finishes, every KV token comes back, and kvadmit's ledger drains."""
    run(policy, 128, mixed)


@pytest.mark.parametrize("chunk, seed", [(64, 0), (256, 1)])
def test_overcommit_mixed_chunk_other_chunks(kvadmit_hooks, chunk, seed):
    log = run("overcommit", chunk, True, seed)
    assert log.retracted > 0          # overcommit still retracts, in the decode steps

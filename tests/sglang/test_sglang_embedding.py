"""Embedding (and other prefill-only) requests under kvadmit on SGLang: SGLang gives
them max_new_tokens 0 and never decodes them, so kvadmit counts their prompt alone,
no output token (as vLLM's pooling requests, tests/vllm/test_pooling.py)."""
import pytest

pytest.importorskip("sglang.srt")  # not "sglang": see conftest.py

from kvadmit import AdmissionConfig  # noqa: E402
from kvadmit.sglang.request import arrival_record  # noqa: E402

PROMPT = 1000


def test_an_embedding_request_counts_no_output_token():
    from sglang_harness import VOCAB, make_req
    config = AdmissionConfig()
    embed = arrival_record(make_req("e", PROMPT, 0), 0.0, True, config, False, VOCAB)
    assert (embed.prompt_tokens, embed.max_new_tokens) == (PROMPT, 0)
    generate = arrival_record(make_req("g", PROMPT, 16), 0.0, True, config, False, VOCAB)
    assert generate.max_new_tokens == 16


@pytest.mark.parametrize("policy", ["reserve", "peak", "predict", "auto"])
def test_embedding_requests_start_and_finish_as_on_stock_sglang(policy):
    """Two embedding prompts on a pool just large enough for SGLang's own prefill
    budget to start both at once: under kvadmit both start in the first prefill too,
    as on stock SGLang, none refused, and both finish."""
    from sglang_harness import Harness, make_req

    def first_prefill(config):
        h = Harness(config, pool_tokens=2 * PROMPT + 3)
        reqs = [make_req(f"e{i}", PROMPT, 0) for i in range(2)]
        assert all(h.submit(r) for r in reqs)
        started = sorted(r.rid for r in h.step().reqs)
        h.run()
        assert all(r.finished() for r in reqs)
        return h, started

    _, stock = first_prefill(None)
    assert stock == ["e0", "e1"]
    h, ours = first_prefill(AdmissionConfig.from_dict({"policy": policy}))
    assert ours == stock
    assert sum(h.adapter.stats()["rejected"].values()) == 0

"""StopAtLength, the bench's stop at a request's real length, on the installed vLLM's
logits-processor interface. On vLLM 0.32 (CI's first environment) the real engine runs
it in the bench's tests (tests/vllm/test_engine.py and the bench's). vLLM 0.34 has only
Model Runner V2's interface and no CPU build: no model runs it here, so its flavour is
driven with V2's own LogitsContext (the request state's prompt lengths, a GPU buffer in
vLLM, stand in as the numpy array vLLM mirrors them in)."""
import types

import numpy as np
import pytest
import torch
from vllm.sampling_params import SamplingParams

from kvadmit.bench.vllm.stop_at import STOP_AT_KEY, StopAtLength, forces_eos
from kvadmit.vllm.tiny_model import EOS_TOKEN_ID


def test_the_stop_rule():
    # the token sampled after k outputs is output k + 1
    assert [forces_eos(k, 4) for k in range(6)] == [False, False, False, True, True, True]
    assert not forces_eos(100, 0)          # no stop position: untouched


def _v2() -> bool:
    import importlib.util
    return importlib.util.find_spec("vllm.v1.sample.logits_processor") is None


@pytest.mark.skipif(not _v2(), reason="Model Runner V2's interface (vLLM 0.34)")
def test_model_runner_v2_flavour_forces_eos_at_the_stop_position():
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsContext
    prompt_len = np.zeros(8, dtype=np.int32)
    proc = StopAtLength(None, types.SimpleNamespace(max_num_reqs=8,
                                                    prompt_len=types.SimpleNamespace(np=prompt_len)))
    # slot 5: prompt 10, stops at output 3; slot 2: no key; slot 7: prompt 4, stops at 1
    for slot, prompt, extra in ((5, 10, {STOP_AT_KEY: 3}), (2, 6, None), (7, 4, {STOP_AT_KEY: 1})):
        prompt_len[slot] = prompt
        assert proc.add_request(slot, SamplingParams(max_tokens=50, extra_args=extra)) == bool(extra)

    def step(rows):
        """rows: (slot, visible tokens) per batch position; the rows forced to EOS."""
        slots = np.array([s for s, _ in rows], dtype=np.int32)
        seq = np.array([n for _, n in rows], dtype=np.int32)
        t = torch.from_numpy(slots)
        ctx = LogitsContext(expanded_idx_mapping=t, idx_mapping=t, idx_mapping_np=slots,
                            expanded_local_pos=torch.zeros_like(t), input_ids=torch.zeros_like(t),
                            pos=torch.from_numpy(seq - 1), seq_lens_upper_bound_np=seq)
        logits = torch.zeros(len(rows), 32)
        out = proc.apply(logits, ctx)
        return [i for i in range(len(rows)) if out[i].argmax() == EOS_TOKEN_ID
                and torch.isinf(out[i]).sum() == 31]

    assert step([(2, 6), (5, 10), (7, 4)]) == [2]          # slot 7's first output is its stop
    assert step([(5, 11), (2, 7)]) == []                    # slot 5: output 2 of 3
    assert step([(2, 8), (5, 12)]) == [1]                   # slot 5: output 3, the stop
    # a recycled slot is reset by add_request
    assert not proc.add_request(5, SamplingParams(max_tokens=50))
    assert step([(5, 40)]) == []

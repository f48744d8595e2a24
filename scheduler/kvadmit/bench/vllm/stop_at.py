"""`StopAtLength`: the logits processor of `kvadmit bench vllm` and `kvadmit bench serve`
that forces EOS as output token number `extra_args["kvadmit_stop_at"]`, so a request
stops at its real length while the scheduler sees a `max_tokens` cap it cannot trust.

Requests without the key are untouched. Pair with `min_tokens = stop_at - 1` so the
random model cannot stop earlier by chance. vLLM 0.32 and 0.33 load V1's interface
(`vllm.v1.sample.logits_processor`: batch rows moved by `BatchUpdate`); 0.34 has only
Model Runner V2's (`vllm.v1.worker.gpu.sample.logits_processor.interface`: persistent
request slots). The one rule, `forces_eos`, is shared. vLLM 0.34 has no CPU build, so
its flavour runs only on a GPU; tests/vllm/test_stop_at.py drives it with V2's own
context objects.
"""
from __future__ import annotations

import importlib.util

import torch

from kvadmit.vllm.tiny_model import EOS_TOKEN_ID

STOP_AT_KEY = "kvadmit_stop_at"


def stop_at_of(params) -> int:
    """The request's stop position (0: none)."""
    return int((params.extra_args or {}).get(STOP_AT_KEY) or 0) if params else 0


def forces_eos(output_tokens: int, stop_at: int) -> bool:
    """The token sampled after `output_tokens` outputs is number `stop_at`, or past it."""
    return 0 < stop_at <= output_tokens + 1


def _force_eos(logits: torch.Tensor, row: int) -> None:
    logits[row].fill_(-float("inf"))
    logits[row, EOS_TOKEN_ID] = 0.0


if importlib.util.find_spec("vllm.v1.sample.logits_processor") is not None:   # 0.32, 0.33
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

    class StopAtLength(LogitsProcessor):
        """V1's interface: state per batch row, moved as the batch is condensed."""

        def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
            self.rows: dict[int, tuple[int, list[int]]] = {}   # row -> (stop_at, output ids)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if batch_update is None:
                return
            for index in batch_update.removed:
                self.rows.pop(index, None)
            for index, params, _, output_ids in batch_update.added:
                stop_at = stop_at_of(params)
                if stop_at:
                    self.rows[index] = (stop_at, output_ids)
                else:
                    self.rows.pop(index, None)
            for a, b, direction in batch_update.moved:
                ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
                if ra is not None:
                    self.rows[b] = ra
                if rb is not None and direction.name == "SWAP":
                    self.rows[a] = rb

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            for row, (stop_at, out) in self.rows.items():
                if row < logits.shape[0] and forces_eos(len(out), stop_at):
                    _force_eos(logits, row)
            return logits
else:                                                                         # 0.34
    import numpy as np
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor

    class StopAtLength(LogitsProcessor):
        """Model Runner V2's interface: the stop position per request slot; a row's
        outputs so far are its visible tokens less its prompt. One logits row a request:
        without speculative decoding, which the bench does not use (it raises there)."""

        def __init__(self, vllm_config, req_states):
            self.prompt_len = req_states.prompt_len.np
            self.stop_at = np.zeros(req_states.max_num_reqs, dtype=np.int64)

        def add_request(self, req_idx: int, sampling_params) -> bool:
            self.stop_at[req_idx] = stop_at_of(sampling_params)
            return bool(self.stop_at[req_idx])

        def apply(self, logits: torch.Tensor, ctx) -> torch.Tensor:
            if logits.shape[0] != len(ctx.idx_mapping_np):
                raise RuntimeError("StopAtLength: a logits row per request only; speculative "
                                   "decoding (several rows a request) is not supported")
            for row, slot in enumerate(ctx.idx_mapping_np):
                outputs = int(ctx.seq_lens_upper_bound_np[row]) - int(self.prompt_len[slot])
                if forces_eos(outputs, int(self.stop_at[slot])):
                    _force_eos(logits, row)
            return logits

"""A tiny random-weight Llama saved locally: a real model for vLLM's CPU engine
without any download (tests and `kvadmit bench vllm` use it).

head_dim must be >= 64 for vLLM's CPU attention: hidden 256 with 4 heads.
"""
from __future__ import annotations

import json
import pathlib

EOS_TOKEN_ID = 2
DEFAULT_DIR = pathlib.Path.home() / ".cache" / "kvadmit" / "tiny-llama"   # built once, reused
TINY_LLAMA = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096)


def build_tiny_llama(path: str | pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Writes the model (config.json + safetensors) to `path` unless it is already there."""
    path = pathlib.Path(path)
    marker = path / "kvadmit_tiny.json"
    if marker.exists() and json.loads(marker.read_text()) == {"seed": seed, **TINY_LLAMA}:
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**TINY_LLAMA, torch_dtype="float32", bos_token_id=1,
                      eos_token_id=EOS_TOKEN_ID)
    LlamaForCausalLM(cfg).save_pretrained(path)
    marker.write_text(json.dumps({"seed": seed, **TINY_LLAMA}))
    return path

#!/usr/bin/env bash
# The `kvadmit bench vllm` comparison on one GPU with vLLM's CUDA build: vLLM's own
# scheduler against every kvadmit policy, same workload, one engine at a time.
# Sized for under 10 minutes on one H100/H200.
#
#   MODEL=/path/to/local/model bash bench/gpu_preemption.sh      # a real model (no download)
#   bash bench/gpu_preemption.sh                                 # else: a random-weight Llama
#
# Needs: vllm (CUDA build, 0.32) and kvadmit installed (pip install .). Writes
# bench/results/gpu_preemption.json and .png and prints the table.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
MODEL_ARGS=()
if [ -n "${MODEL:-}" ]; then
  MODEL_ARGS=(--model "$MODEL" --ignore-eos)   # a real model's eos id is its own: run to max_tokens
else
  # Without a local model: Llama-shaped random weights, large enough to make the GPU work.
  python - <<'PY'
import json, pathlib, torch
from transformers import LlamaConfig, LlamaForCausalLM
p = pathlib.Path.home() / ".cache/kvadmit/gpu-llama"
if not (p / "config.json").exists():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096,
                      torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(p)
PY
  MODEL_ARGS=(--model "$HOME/.cache/kvadmit/gpu-llama")
fi
# A pool of 2,000 blocks x 16 tokens (32k tokens) for 1,000 Azure requests scaled to a 4k
# context: tight enough that vLLM's default scheduler preempts.
python -m kvadmit.vllm.bench "${MODEL_ARGS[@]}" --dtype bfloat16 --workload azure \
  --requests 1000 --num-blocks 2000 --block-size 16 --max-model-len 4096 --max-tokens 2048 \
  --max-num-seqs 256 --json bench/results/gpu_preemption.json --plot bench/results/gpu_preemption.png

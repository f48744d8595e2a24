"""kvadmit's counters through `LLM.get_metrics()` (real engine, offline), with
Prometheus multiprocess mode on (PROMETHEUS_MULTIPROC_DIR set before start)."""
import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", block_size=32,
              num_gpu_blocks_override=24, max_model_len=512, enforce_eager=True, seed=0,
              gpu_memory_utilization=0.3, disable_log_stats=False,
              scheduler_cls="kvadmit.vllm.Scheduler",
              additional_config={"kvadmit": {"policy": "peak", "max_queued_requests": 4}})
    prompts = [{"prompt_token_ids": [3 + (i * 31 + j) % 900 for j in range(40)]} for i in range(12)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    refused = sum(o.outputs[0].stop_reason == "kvadmit:queue_full" for o in outs)
    series = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:kvadmit_") and hasattr(m, "value"):
            key = m.name + "".join(f"{{{k}={v}}}" for k, v in sorted(m.labels.items()) if k == "reason")
            series[key] = series.get(key, 0) + m.value
    print("RESULT " + json.dumps({"refused": refused, "series": series}))
"""


def test_get_metrics_lists_kvadmit_counters(model_dir, tmp_path):
    prom = tmp_path / "prom"
    prom.mkdir()
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    p = subprocess.run([sys.executable, str(script), model_dir], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(prom)))
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(line[len("RESULT "):])
    series = res["series"]
    assert res["refused"] >= 1
    assert series.get("vllm:kvadmit_rejected{reason=queue_full}", 0) == res["refused"]
    assert series.get("vllm:kvadmit_admitted", 0) == 12 - res["refused"]
    assert series.get("vllm:kvadmit_paused") == 0      # exported; peak never pauses
    assert series.get("vllm:kvadmit_displacements") == 0   # exported; no flows, FCFS
    assert series.get("vllm:kvadmit_length_quantile") == 0.7   # adaptive_quantile (peak: unused)
    # the router signals, at idle after the run: the whole pool, no pressure, no wait
    assert series.get("vllm:kvadmit_kv_headroom_blocks") == 23       # 24 less vLLM's null block
    assert series.get("vllm:kvadmit_admission_pressure") == 0.0
    assert series.get("vllm:kvadmit_predicted_queue_delay_seconds") == 0.0

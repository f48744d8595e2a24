"""Offline `LLM` (real CPU engine, tiny model, --skip-tokenizer-init) with kvadmit:
a request body that would crash the engine is refused as invalid, and the engine
serves the next requests; a parallel-sampling request (n > 1) is admitted or refused
as one unit."""
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
              gpu_memory_utilization=0.3, scheduler_cls="kvadmit.vllm.Scheduler",
              additional_config={"kvadmit": {"policy": "peak", "max_queued_requests": 3}})
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = [[5, 6, 1024], [5, 99999], [-1, 5], [5, 6, 1023]]
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    after = llm.generate([{"prompt_token_ids": [7] * 20}], sp, use_tqdm=False)
    # n = 3 twice in one call: the first fills the queue cap (3 samples), the second is
    # refused as a whole; n = 4 can never be queued.
    many = SamplingParams(max_tokens=4, ignore_eos=True, n=3, temperature=1.0, seed=1)
    groups = llm.generate([{"prompt_token_ids": [8] * 20}, {"prompt_token_ids": [9] * 20}],
                          many, use_tqdm=False)
    four = llm.generate([{"prompt_token_ids": [8] * 20}],
                        SamplingParams(max_tokens=4, ignore_eos=True, n=4), use_tqdm=False)
    print("RESULT " + json.dumps({
        "groups": [sorted([c.finish_reason, c.stop_reason, len(c.token_ids)] for c in o.outputs)
                   for o in groups + four],
        "first": [[o.outputs[0].finish_reason, o.outputs[0].stop_reason,
                   len(o.outputs[0].token_ids)] for o in first],
        "after": len(after[0].outputs[0].token_ids)}))
"""


def test_out_of_vocabulary_prompt_is_refused_and_the_engine_lives(model_dir, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    # The engine core in this process: LLM.generate then adds both n=3 requests before
    # the first step (in its own process the core may start the first group before the
    # second arrives, and both fit: a race, not the behaviour under test).
    p = subprocess.run([sys.executable, str(script), model_dir], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(line[len("RESULT "):])
    assert res["first"][:3] == [["abort", "kvadmit:invalid", 0]] * 3
    assert res["first"][3] == ["length", None, 4]      # the vocabulary's last id is fine
    assert res["after"] == 4
    assert res["groups"][0] == [["length", None, 4]] * 3
    assert res["groups"][1] == [["abort", "kvadmit:queue_full", 0]] * 3
    assert res["groups"][2] == [["abort", "kvadmit:queue_full", 0]] * 4

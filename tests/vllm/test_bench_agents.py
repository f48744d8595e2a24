"""A small `kvadmit bench agents` (issue 43, item 1): two configs (vLLM's default and
kvadmit's agent window, small enough to hold sessions out), a handful of sessions and
turns, short tool waits, checked through its JSON. Run under the engine lock."""
import json
import os
import subprocess
import sys

import pytest

from kvadmit.bench.agents import ideal_prefill, parse_agent_config
from kvadmit.bench.agents_report import gap_closed, goal_figures

SESSIONS, TURNS, OUTPUT = 6, 3, 32
# W starts at 2 and never grows: sessions wait outside it, at most 1 s each
WINDOW = ('kvadmit-window={"agent_window": true, "agent_window_init": 2, '
          '"agent_window_max": 2, "agent_max_wait_s": 1}')
FIRST_CPU = min(os.sched_getaffinity(0))


def test_ideal_prefill_counts_whole_blocks_and_the_last_prompt_token():
    assert ideal_prefill(320, 256, 32) == 64            # the shared prefix, 8 blocks
    assert ideal_prefill(400, 351, 32) == 400 - 320     # 10 whole blocks of 351 tokens
    assert ideal_prefill(320, 320, 32) == 32            # at most prompt - 1: 9 blocks, not 10
    assert ideal_prefill(20, 0, 32) == 20


def test_the_gap_to_the_bound_each_config_closes():
    """vllm-bound (vLLM on a pool that never evicts, recorded in
    bench/results/agents_serve_hold.json) against vLLM's default: the share of the gap
    a config closes, none where the gap is under 1%."""
    vllm = {"makespan_s": 20.0, "hit_rate_middle": 0.48}
    bound = {"makespan_s": 14.0, "hit_rate_middle": 0.88}
    closed = gap_closed({"makespan_s": 17.0, "hit_rate_middle": 0.58}, vllm, bound)
    assert closed == pytest.approx({"makespan_s": 0.5, "hit_rate_middle": 0.25})
    assert gap_closed(vllm, vllm, {"makespan_s": 19.9, "hit_rate_middle": 0.485}) == {
        "makespan_s": None, "hit_rate_middle": None}
    goals = goal_figures([{**vllm, "config": "vllm-default"}, {**bound, "config": "vllm-bound"},
                          {"config": "k", "makespan_s": 14.0, "hit_rate_middle": 0.88,
                           "turns_lost": 0, "longest_wait_s": 1.0}])
    assert goals["k"]["gap_closed"] == {"makespan_s": 1.0, "hit_rate_middle": 1.0}


def test_configs():
    b = parse_agent_config("vllm-bound")
    assert b.kind == "vllm" and b.flags[-2] == "--num-gpu-blocks-override"
    c = parse_agent_config("vllm-seqs=8")
    assert c.label == "vllm-seqs=8" and c.flags[-2:] == ("--max-num-seqs", "8")
    assert parse_agent_config('w={"agent_window": true}').kind == "kvadmit"
    with pytest.raises(ValueError):
        parse_agent_config("vllm-seqs=0")


@pytest.fixture(scope="module")
def result(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agents")
    out, png = tmp / "agents.json", tmp / "agents.png"
    cmd = [sys.executable, "-m", "kvadmit.cli", "bench", "agents", "--sessions", str(SESSIONS),
           "--turns", str(TURNS), "--tool-wait", "0.2", "--sample-s", "0.2",
           "--configs", "vllm-default", WINDOW, "--model-dir", model_dir,
           "--engine-cpus", str(FIRST_CPU), "--json", str(out), "--plot", str(png)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text()), p.stdout, png


def test_every_turn_is_done_and_the_counts_add_up(result):
    out, stdout, png = result
    assert [c["config"] for c in out["configs"]] == ["vllm-default", "kvadmit-window"]
    assert out["workload"]["sessions"] == SESSIONS and png.stat().st_size > 0
    for c in out["configs"]:
        s = c["summary"]
        assert s["turns_done"] == s["turns_expected"] == SESSIONS * TURNS, s
        assert s["turns_lost"] == 0 and not s["errors"] and not s["timed_out"]
        assert s["output_tokens"] == SESSIONS * TURNS * OUTPUT
        assert {(t["session"], t["turn"]) for t in c["turns"]} == {
            (i, k) for i in range(SESSIONS) for k in range(TURNS)}
        assert all(t["output_tokens"] == OUTPUT for t in c["turns"])
        # the engine saw every prompt token: its prefix-cache queries cover them
        assert s["prefix_queries"] >= s["prompt_tokens_sent"] > 0
        assert 0 <= s["hit_rate"] <= 1 and s["prefix_hits"] > 0     # the shared prefix hits
        assert s["makespan_s"] > 0 and s["output_tok_per_s"] > 0
        assert s["recomputed_tokens"] >= 0 and s["preemptions"] >= 0
        assert 0 < s["ttft_p50_s"] <= s["longest_wait_s"] <= s["latency_p99_s"]
        assert c["series"] and all(0 <= p["kv_usage"] <= 1 for p in c["series"])
        assert c["series"][-1]["turns_done"] == SESSIONS * TURNS
        assert f"| {c['config']} |" in stdout
    assert "speedup_vs_vllm_default" in out["goals"]["kvadmit-window"]
    assert "gap_closed" not in out["goals"]["kvadmit-window"]     # no vllm-bound run
    window = out["configs"][1]["summary"]
    # W stayed 2 with 6 sessions (finished ones keep their place for agent_idle_s):
    # held sessions were let in over it after their 1 s, finished ones leaving for
    # them, and the server's counters say so
    assert window["agent_window_min"] == window["agent_window_max"] == 2
    assert window["window_overdue"] >= 1 and window["window_exits"] >= 1

"""`kvadmit simulate` end to end on the native engine (seconds)."""
import json
import pathlib

import pytest

from kvadmit.cli import main

DATA = pathlib.Path(__file__).parent.parent / "data"
AZURE = str(DATA / "azure2023_conv_head200.csv")
SMALL_POOL = ["--num-blocks", "700", "--block-size", "16", "--max-model-len", "4096",
              "--max-tokens-rule", "cap", "--quiet"]


def test_sweep_table_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    assert main(["simulate", "--trace", AZURE, *SMALL_POOL, "--sweep", "0.5", "1.5",
                 "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "capacity (saturated" in text and "load 1.5x capacity" in text
    res = json.loads(out.read_text())
    assert [r["load"] for r in res["runs"]] == [0.5, 1.5]
    for run in res["runs"]:
        rows = {r["policy"]: r for r in run["rows"]}
        assert set(rows) == {"vllm-default", "sglang", "trtllm-no-evict", "trtllm-max-util",
                             "peak", "adaptive", "auto", "oracle"}
        assert rows["peak"]["preemptions"] == rows["trtllm-no-evict"]["preemptions"] == 0
        assert rows["oracle"]["preemptions"] == 0
        for r in rows.values():
            assert r["finished"] + sum(r["rejected"].values()) == 200
        # TensorRT-LLM's MAX_UTILIZATION rule is vLLM's: the same decisions
        assert rows["trtllm-max-util"]["steps"] == rows["vllm-default"]["steps"]
    high = {r["policy"]: r for r in res["runs"][1]["rows"]}
    assert high["vllm-default"]["preemptions"] > 0          # the small pool is really short
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 10_000


def test_queue_delay_cap_lifts_goodput_at_overload(tmp_path):
    out = tmp_path / "sim.json"
    assert main(["simulate", "--trace", AZURE, *SMALL_POOL, "--load", "2",
                 "--policies", "vllm-default", "adaptive",
                 "--config", '{"max_queue_delay_s": 0.5}', "--json", str(out)]) == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())["runs"][0]["rows"]}
    assert rows["adaptive"]["rejected"].get("queue_delay", 0) > 0
    assert "queue_delay" not in rows["vllm-default"]["rejected"]     # baselines run as shipped
    assert rows["adaptive"]["goodput"] > rows["vllm-default"]["goodput"]


def test_custom_policy_and_errors(capsys):
    assert main(["simulate", "--trace", AZURE, *SMALL_POOL, "--policies",
                 'lcf={"policy": "overcommit", "victim": "lcf"}']) == 0
    assert "lcf" in capsys.readouterr().out
    assert main(["simulate", "--trace", AZURE, "--policies", "nope"]) == 2
    assert "policy 'nope'" in capsys.readouterr().err
    assert main(["simulate", "--trace", AZURE, "--policies", 'x={"policy": "fast"}']) == 2
    assert "policy" in capsys.readouterr().err
    assert main(["simulate", "--trace", AZURE, "--num-blocks", "10"]) == 2
    assert "max_model_len" in capsys.readouterr().err


def test_agents_with_prefix_caching_hit_their_history(tmp_path):
    out = tmp_path / "a.json"
    assert main(["simulate", "--synthetic", "agents", "--requests", "40", "--rate", "0.5",
                 "--prefix-caching", "--policies", "vllm-default", "peak", "--quiet",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["runs"][0]["rows"]
    assert all(r["prefix_hit_rate"] > 0.5 for r in rows)


def test_clients_saying_a_session_is_done_keep_the_others_cached(tmp_path):
    """Issue 55's shape, small: agents at the edge of an H100's pool cut to 10,000
    blocks. With kv_hold_s 0 on each session's last turn, kvadmit evicts done sessions'
    KV first and the returning turns hit more; vLLM's default ignores the field."""
    rows = {}
    for hold in ("none", "done"):
        out = tmp_path / f"{hold}.json"
        assert main(["simulate", "--synthetic", "agents", "--requests", "150", "--rate", "1.5",
                     "--turns", "10", "--tool-wait", "5", "--prefix-caching", "--preset", "h100-8b",
                     "--num-blocks", "10000", "--seed", "3", "--slo-ttft", "5", "--kv-hold", hold,
                     "--policies", "vllm-default", "auto", "--quiet", "--json", str(out)]) == 0
        rows[hold] = {r["policy"]: r for r in json.loads(out.read_text())["runs"][0]["rows"]}
    for by in rows.values():
        assert all(r["finished"] == r["requests"] for r in by.values())
    assert rows["done"]["vllm-default"] == {**rows["none"]["vllm-default"],
                                            "wall_s": rows["done"]["vllm-default"]["wall_s"]}
    assert rows["done"]["auto"]["prefix_hit_rate"] > rows["none"]["auto"]["prefix_hit_rate"] + 0.04
    assert rows["done"]["auto"]["ttft_p99_s"] <= rows["none"]["auto"]["ttft_p99_s"]


def test_a_burst_is_a_workload_like_any_other(tmp_path, capsys):
    """Every request of the trace at one instant: the table and the JSON (it has no
    rate to report), not an error."""
    lines = pathlib.Path(AZURE).read_text().splitlines()
    burst = tmp_path / "burst.csv"
    burst.write_text("\n".join([lines[0]] + [f"2023-11-16 18:15:46.0000000,{ln.split(',', 1)[1]}"
                                             for ln in lines[1:61]]) + "\n")
    out = tmp_path / "burst.json"
    assert main(["simulate", "--trace", str(burst), *SMALL_POOL, "--policies", "vllm-default",
                 "auto", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    run, = res["runs"]
    assert run["offered_rps"] is None
    for r in run["rows"]:
        assert r["finished"] + sum(r["rejected"].values()) == 60, r
    assert {r["policy"] for r in run["rows"]} == {"vllm-default", "auto"}


def test_vllm_priority_scheduling_serves_the_interactive_class_first(tmp_path, capsys):
    """--scheduling-policy priority runs every row under vLLM's priority scheduling:
    the mixed workload's interactive requests (priority 0, tight TTFT) go before its
    batch ones (priority 1), which at overload lifts the goodput FCFS loses to queueing."""
    args = ["simulate", "--synthetic", "mixed", "--requests", "400", "--load", "1.5", *SMALL_POOL,
            "--policies", "vllm-default", "auto"]
    goodput = {}
    for policy in ("fcfs", "priority"):
        out = tmp_path / f"{policy}.json"
        assert main([*args, "--scheduling-policy", policy, "--json", str(out)]) == 0
        res = json.loads(out.read_text())
        assert res["shape"]["scheduling_policy"] == policy
        rows = {r["policy"]: r for r in res["runs"][0]["rows"]}
        for r in rows.values():
            assert r["finished"] + sum(r["rejected"].values()) == 400, r
        goodput[policy] = {k: r["goodput"] for k, r in rows.items()}
    assert "priority scheduling" in capsys.readouterr().out
    for name in ("vllm-default", "auto"):
        assert goodput["priority"][name] > goodput["fcfs"][name] + 0.2, goodput
    with pytest.raises(SystemExit):
        main([*args, "--scheduling-policy", "lifo"])
    assert "--scheduling-policy" in capsys.readouterr().err

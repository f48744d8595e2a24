"""`kvadmit bench scorecard`: every workload x config cell, ratios and goals."""
import json
import pathlib
import subprocess
import sys

import pytest

from kvadmit.simulate.scorecard import (Case, azure_burst, equal_burst, score, tiny_shape,
                                        print_scorecard)
from kvadmit.simulate.steptime import CPU_TINY

DATA = pathlib.Path(__file__).resolve().parent.parent / "data"
CONFIGS = ["vllm-default", "vllm-watermark=0.05", "vllm-watermark=0.1", "peak", "default={}"]


def tiny_suite():
    return [Case("azure", "Azure excerpt, no max_tokens", azure_burst(
                DATA / "azure2023_conv_head200.csv", 0, 96, "context", "azure"), tiny_shape(32), CPU_TINY),
            Case("honest", "Azure excerpt, honest caps", azure_burst(
                DATA / "azure2023_conv_head200.csv", 100, 96, "real", "honest"), tiny_shape(32), CPU_TINY),
            Case("equal", "equal lengths", equal_burst(16, 100), tiny_shape(24, 512), CPU_TINY),
            Case("loose", "a pool vLLM never runs dry", azure_burst(
                DATA / "azure2023_conv_head200.csv", 0, 192, "context", "loose"), tiny_shape(512), CPU_TINY)]


def test_every_cell_and_its_ratios(capsys):
    out = score(tiny_suite(), CONFIGS)
    json.dumps(out)                                  # the JSON the command saves
    names = ["vllm-default", "vllm-watermark=0.05", "vllm-watermark=0.1", "peak", "default"]
    for e in out["workloads"]:
        assert list(e["cells"]) == names
        for name, cell in e["cells"].items():
            assert cell["finished"] + cell["rejected"] == e["requests"], (e["name"], name)
            assert 0 < cell["tpot_p99_s"] < 1.0, (e["name"], name)   # decoded: a time per token
            assert e["vs_vllm_default"][name]["steps"] == pytest.approx(
                cell["steps"] / e["cells"]["vllm-default"]["steps"])
        wm = e["best_watermark"]
        assert (e["cells"][wm]["preemptions"], e["cells"][wm]["steps"]) == min(
            (e["cells"][n]["preemptions"], e["cells"][n]["steps"]) for n in names if "watermark" in n)
        assert e["vs_best_watermark"]["default"]["preemptions"] == pytest.approx(
            e["cells"]["default"]["preemptions"] / e["cells"][wm]["preemptions"]
            if e["cells"][wm]["preemptions"] else (1.0 if e["cells"]["default"]["preemptions"] == 0
                                                   else float("inf")))
    goals = {e["name"]: e["goals"] for e in out["workloads"]}
    # Honest caps: the default never preempts; a loose pool: it takes vLLM's steps.
    assert goals["honest"]["honest_caps_no_preemption"] and goals["equal"]["honest_caps_no_preemption"]
    assert out["workloads"][1]["cells"]["default"]["preemptions"] == 0
    assert goals["loose"]["loose_pool_same_steps"]
    assert "honest_caps_no_preemption" not in goals["azure"]
    # Requests far below their caps: the default packs far better than peak, and
    # preempts less than vLLM.
    azure = out["workloads"][0]["cells"]
    assert azure["default"]["steps"] < azure["peak"]["steps"]
    assert azure["default"]["preemptions"] < azure["vllm-default"]["preemptions"]
    print_scorecard(out)
    assert "default config goals" in capsys.readouterr().out


def test_command_saves_json_and_heat_map(tmp_path):
    """From the bundled traces (no --traces), as a clone without ../shared runs it."""
    js, png = tmp_path / "s.json", tmp_path / "s.png"
    p = subprocess.run([sys.executable, "-m", "kvadmit.cli", "bench", "scorecard", "--quick",
                        "--only", "azure-context", "equal-burst",
                        "--configs", *CONFIGS, "--json", str(js), "--plot", str(png)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(js.read_text())
    assert [e["name"] for e in out["workloads"]] == ["azure-context", "equal-burst"]
    assert all(len(e["cells"]) == len(CONFIGS) for e in out["workloads"])
    assert "equal-burst" in p.stdout and "steps/vllm" in p.stdout
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 10_000


def test_unknown_workload_is_a_clear_error():
    p = subprocess.run([sys.executable, "-m", "kvadmit.cli", "bench", "scorecard", "--only", "nope"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "nope" in p.stderr


def test_vllms_real_scheduler_gives_the_same_cells(model_dir):
    """--engine vllm: vLLM's real V1 scheduler in-process, the same cells as the
    native engine model (the simulator's verdicts hold on vLLM's scheduler)."""
    pytest.importorskip("vllm.v1", reason="vLLM is not installed (see .ci/run)")
    cases = tiny_suite()[:3]
    configs = ["vllm-default", "vllm-watermark=0.1", "default={}"]
    native = score(cases, configs)
    real = score(cases, configs, model_dir=model_dir)
    assert real["engine"] == "vllm"
    for a, b in zip(native["workloads"], real["workloads"]):
        for name in a["cells"]:
            for k in ("steps", "preemptions", "recomputed_tokens", "paused", "finished"):
                assert a["cells"][name][k] == b["cells"][name][k], (a["name"], name, k)


def test_sglang_conservativeness_is_sglangs_rule_with_its_ratio():
    from kvadmit.simulate.policies import parse_policy
    spec = parse_policy("sglang-conservativeness=0.5")
    cfg = spec.config(None)
    assert (cfg.policy, cfg.victim, cfg.predict_init_ratio) == ("predict", "length", 0.35)
    assert parse_policy("sglang-conservativeness=2").config(None).predict_init_ratio == 1.0
    with pytest.raises(ValueError, match="must be > 0"):
        parse_policy("sglang-conservativeness=0")
    # On a loose pool a less conservative SGLang packs more at once, a more
    # conservative one less: fewer and more steps than its default.
    loose = score([tiny_suite()[3]], ["sglang", "sglang-conservativeness=0.3",
                                      "sglang-conservativeness=2"])["workloads"][0]["cells"]
    assert loose["sglang-conservativeness=0.3"]["steps"] < loose["sglang"]["steps"] < \
        loose["sglang-conservativeness=2"]["steps"]


@pytest.mark.parametrize("row, needle", [("default", "policy 'default': not one of"),
                                         ('x={"polcy": 1}', "unknown key 'polcy'")])
def test_a_bad_config_row_is_named_before_anything_runs(row, needle, capsys):
    from kvadmit.simulate.scorecard import main
    assert main(["--configs", "vllm-default", row, "--json", "", "--plot", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvadmit bench scorecard: --configs: ") and needle in err


def test_ratios_to_vllm_default_need_no_watermark_rows():
    out = score(tiny_suite()[2:3], ["vllm-default", "peak"])
    e = out["workloads"][0]
    assert e["vs_vllm_default"]["vllm-default"]["steps"] == 1.0
    assert e["vs_vllm_default"]["peak"]["steps"] == e["cells"]["peak"]["steps"] / e["cells"]["vllm-default"]["steps"]
    assert "vs_best_watermark" not in e and "goals" not in e


def test_step_time_regimes_price_the_same_workloads(tmp_path):
    """--step-time: one scorecard per step-time model over the same requests and pools,
    and one table of the default against vLLM across them. A burst's schedule under
    vLLM's rule does not depend on the price; its modelled time does."""
    js = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "kvadmit.cli", "bench", "scorecard", "--quick",
                        "--only", "equal-burst", "gamma-bursty", "--step-time", "cpu-tiny", "h100-8b",
                        "--configs", "vllm-default", "vllm-active=4", "default={}", "--json", str(js),
                        "--plot", "", "--frontier", str(tmp_path / "f.png")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(js.read_text())
    cpu, gpu = out["regimes"]
    assert (cpu["step_time"], gpu["step_time"]) == ("cpu-tiny", "h100-8b")
    names = {reg["step_time"]: {e["name"]: e for e in reg["workloads"]} for reg in out["regimes"]}
    eq_cpu, eq_gpu = names["cpu-tiny"]["equal-burst"], names["h100-8b"]["equal-burst"]
    assert eq_cpu["step_time"] == "vLLM CPU, tiny Llama (fitted)" and "H100" in eq_gpu["step_time"]
    v_cpu, v_gpu = eq_cpu["cells"]["vllm-default"], eq_gpu["cells"]["vllm-default"]
    assert v_cpu["steps"] == v_gpu["steps"] and v_cpu["makespan_s"] < v_gpu["makespan_s"]
    # the open-loop workload arrives at each regime's own capacity, so both run it loaded
    for reg in ("cpu-tiny", "h100-8b"):
        g = names[reg]["gamma-bursty"]["cells"]["vllm-default"]
        assert g["finished"] == names[reg]["gamma-bursty"]["requests"] and g["preemptions"] > 0, reg
    for k in ("throughput", "ttft_p99", "tpot_p99", "makespan"):
        assert k in eq_gpu["vs_vllm_default"]["default"]
    assert "per step-time regime" in p.stdout and "h100-8b" in p.stdout
    pytest.importorskip("matplotlib")
    for regime in ("cpu-tiny", "h100-8b"):               # a frontier chart per regime
        assert (tmp_path / f"f_{regime}.png").stat().st_size > 10_000


def test_an_unknown_step_time_preset_is_refused():
    p = subprocess.run([sys.executable, "-m", "kvadmit.cli", "bench", "scorecard", "--step-time", "h100"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--step-time" in p.stderr and "h100-8b" in p.stderr

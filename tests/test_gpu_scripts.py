"""The GPU scripts, rehearsed on the CPU (DRY_RUN=1) so that they cannot rot:
bench/gpu_preemption.sh runs its real bench command on vLLM's CPU engine at a tiny
size; bench/gpu_sglang.sh does what runs without a GPU (each script's header says
what its dry run leaves out). Both write the files a GPU run writes."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def dry_run(script: str, **env):
    """Runs a script as a user of this environment would: its python (and the `python`,
    `kvadmit`, `vllm` commands the scripts call) is the one running the tests, whatever
    PATH says (a plain PATH would find the system's python, without vLLM or SGLang)."""
    bin_dir = os.path.dirname(sys.executable)
    path = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    p = subprocess.run(["bash", f"bench/{script}"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PATH": path, "PYTHON": sys.executable,
                            "DRY_RUN": "1", **env}, timeout=900)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.skipif(not have("vllm.v1"), reason="vLLM is not installed (see .ci/run)")
def test_gpu_preemption_dry_run(tmp_path):
    rc, out = dry_run("gpu_preemption.sh", OUT_DIR=str(tmp_path))
    assert rc == 0, out[-4000:]
    doc = json.loads((tmp_path / "gpu_preemption.json").read_text())
    rows = {r["config"]: r for r in doc["rows"]}
    assert list(rows) == ["vllm-default", "adaptive"]
    assert doc["args"]["requests"] == 24 and doc["args"]["model"] == str(tmp_path / "random-llama")
    for name, r in rows.items():
        assert r["rejected"] == {} and r["wrong_length"] == 0, name
        assert r["output_tokens"] > 0 and r["steps"] > 0, name
    assert (tmp_path / "gpu_preemption.png").stat().st_size > 0
    assert "vLLM 0.32" in out


@pytest.mark.skipif(not have("sglang.srt"), reason="SGLang is not installed (see .ci/run)")
def test_gpu_sglang_dry_run(tmp_path):
    out_json = tmp_path / "gpu_sglang.json"
    rc, out = dry_run("gpu_sglang.sh", WORK=str(tmp_path), OUT_JSON=str(out_json))
    assert rc == 0, out[-4000:]
    doc = json.loads(out_json.read_text())
    assert doc["dry_run"] and doc["requests"] == 8
    assert [r["config"] for r in doc["results"]] == ["default", "peak", "reserve"]
    for r in doc["results"]:
        assert r["dry_run"] and r["requests"] == 8 and r["prompt_tokens"] >= 8 * 64
        assert r["ok"] is None and r["retracted"] is None          # nothing was measured
    # SGLang's own ServerArgs took each configuration's flags; kvadmit's was validated.
    assert out.count("ServerArgs: model") == 3
    assert 'kvadmit: {"policy": "peak"}' in out and "kvadmit: off" in out


@pytest.mark.skipif(not have("sglang.srt"), reason="SGLang is not installed (see .ci/run)")
def test_gpu_sglang_dry_run_stops_on_a_bad_configuration(tmp_path):
    """A configuration name that is no kvadmit policy fails before any GPU would start."""
    rc, out = dry_run("gpu_sglang.sh", WORK=str(tmp_path), CONFIGS="peek")
    assert rc != 0
    assert "--kvadmit-config" in out and "peek" in out

"""The command line, run as a user would; and bench/lockstep_compare.py, which
replaced `kvadmit lockstep` (the lockstep model is a test oracle now)."""
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent
DATA = pathlib.Path(__file__).parent / "data"


def run(*args):
    return subprocess.run([sys.executable, "-m", "kvadmit.cli", *args],
                          capture_output=True, text=True, timeout=120)


def lockstep_compare(*args):
    return subprocess.run([sys.executable, str(ROOT / "bench" / "lockstep_compare.py"), *args],
                          capture_output=True, text=True, timeout=120)


def test_lockstep_compare_runs_every_policy(tmp_path):
    out = tmp_path / "r.json"
    p = lockstep_compare("--trace", str(DATA / "azure2023_conv_head200.csv"), "--requests", "200",
                         "--num-blocks", "256", "--json", str(out))
    assert p.returncode == 0, p.stderr
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"overcommit", "reserve", "peak", "predict", "adaptive", "auto"}
    for r in rows.values():
        assert r["finished"] + sum(r["rejected"].values()) == 200 and r["leaked_blocks"] == 0
    assert rows["reserve"]["preemptions"] == rows["peak"]["preemptions"] == 0
    assert rows["overcommit"]["preemptions"] > 0
    assert "overcommit" in p.stdout and "preempt" in p.stdout


def test_kvadmit_lockstep_points_to_simulate():
    p = run("lockstep", "--trace", str(DATA / "azure2023_conv_head200.csv"))
    assert p.returncode == 2
    assert "`kvadmit lockstep` was removed" in p.stderr and "kvadmit simulate --trace" in p.stderr
    assert "tests/oracle/lockstep.py" in p.stderr and "bench/lockstep_compare.py" in p.stderr


def test_bad_config_is_a_clear_error():
    for p in (run("simulate", "--trace", str(DATA / "azure2023_conv_head200.csv"),
                  "--config", '{"victim": "oldest"}'),
              lockstep_compare("--trace", str(DATA / "azure2023_conv_head200.csv"),
                               "--config", '{"victim": "oldest"}')):
        assert p.returncode == 2
        assert "victim='oldest': must be one of lifo, priority, lcf, length" in p.stderr


def test_missing_trace():
    for p in (run("simulate", "--trace", "/nonexistent.csv"),
              lockstep_compare("--trace", "/nonexistent.csv")):
        assert p.returncode == 2 and "trace not found" in p.stderr

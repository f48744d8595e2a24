"""The command line, run as a user would."""
import json
import pathlib
import subprocess
import sys

DATA = pathlib.Path(__file__).parent / "data"


def run(*args):
    return subprocess.run([sys.executable, "-m", "kvadmit.cli", *args],
                          capture_output=True, text=True, timeout=120)


def test_lockstep_compares_every_policy(tmp_path):
    out = tmp_path / "r.json"
    p = run("lockstep", "--trace", str(DATA / "azure2023_conv_head200.csv"), "--requests", "200",
            "--num-blocks", "256", "--json", str(out))
    assert p.returncode == 0, p.stderr
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"overcommit", "reserve", "peak", "predict", "adaptive", "auto"}
    for r in rows.values():
        assert r["finished"] + sum(r["rejected"].values()) == 200 and r["leaked_blocks"] == 0
    assert rows["reserve"]["preemptions"] == rows["peak"]["preemptions"] == 0
    assert rows["overcommit"]["preemptions"] > 0
    assert "overcommit" in p.stdout and "preempt" in p.stdout


def test_bad_config_is_a_clear_error():
    p = run("lockstep", "--trace", str(DATA / "azure2023_conv_head200.csv"),
            "--config", '{"victim": "oldest"}')
    assert p.returncode == 2
    assert "victim='oldest': must be one of lifo, priority, lcf, length" in p.stderr


def test_missing_trace():
    p = run("lockstep", "--trace", "/nonexistent.csv")
    assert p.returncode == 2 and "trace not found" in p.stderr

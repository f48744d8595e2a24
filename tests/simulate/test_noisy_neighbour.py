"""bench/noisy_neighbour.py on the native engine: a batch flow offering 10x its share
beside an interactive flow. With flows the interactive flow keeps most of the goodput
it gets alone (at least the goal's 95%; FCFS loses nearly all of it), the batch flow still fills the pool, no
request is lost and every KV block comes back (asserted in every run)."""
import argparse
import importlib.util
import pathlib
import sys

from kvadmit.simulate.engine import EngineShape
from kvadmit.simulate.steptime import get_preset

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))          # its `_common`
spec = importlib.util.spec_from_file_location("noisy_neighbour", ROOT / "bench" / "noisy_neighbour.py")
nn = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nn)


def test_flows_keep_the_interactive_goodput_and_the_pool_full():
    args = argparse.Namespace(seconds=60.0, interactive_load=0.3, batch_offer=10.0, ttft=1.0,
                              tpot=0.1, model_dir=None, interactive_lengths=[600, 150],
                              batch_lengths=[3000, 500])
    shape = EngineShape(num_blocks=2048, block_size=16, max_model_len=8192, max_num_seqs=256,
                        max_num_batched_tokens=8192)
    rows = {r["run"]: r for r in nn.one_seed(args, shape, get_preset("h100-8b"), 0)["rows"]}
    fcfs = rows["FCFS, no flows (kvadmit default {})"]
    flows = rows["flows, weight 1:1 (kvadmit default + flows)"]
    assert fcfs["goodput_vs_alone"] < 0.2                     # the noisy neighbour wins FCFS
    # the goal: >= 95% of the goodput alone (measured 0.996 on seed 0 with flow
    # displacement; 0.899 with the fair order alone), the pool near batch-only
    # (measured 1.045: docs/flows.md)
    assert flows["goodput_vs_alone"] >= 0.95
    assert flows["util_vs_batch_only"] >= 0.95
    assert flows["batch_finished"] == fcfs["batch_finished"]  # the batch flow is served too
    shares = flows["kv_share"]
    assert abs(sum(shares.values()) - 1.0) < 1e-3 and shares["1"] < shares["2"]

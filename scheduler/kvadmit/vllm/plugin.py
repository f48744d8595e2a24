"""`vllm.general_plugins` entry point: vLLM loads it in every process.

It applies kvadmit's vLLM patches (see patches/README.md; the list of six and what each
brings: kvadmit.vllm.compat.PATCHES), among them: two act only on
requests kvadmit's scheduler refused, one answers routers' `GET /get_load`, one checks kvadmit's settings where vLLM
builds its config (`check_vllm_config`, before any engine process starts), and, in Prometheus multiprocess mode,
makes the engine's kvadmit counters visible to `LLM.get_metrics()`
(kvadmit.vllm.metrics). Without `--scheduler-cls kvadmit.vllm.Scheduler`
nothing changes.
"""
import logging

logger = logging.getLogger("kvadmit.vllm")


SCHEDULER = "kvadmit.vllm.Scheduler"
# vLLM's own scheduler under a bench's counting subclass (kvadmit.bench.serve.recompute):
# vLLM's, not kvadmit's, so its servers get none of kvadmit's checks and middleware.
VLLM_OWN_PREFIX = "kvadmit.bench.serve.recompute.Vllm"


def _names_kvadmit(scheduler_cls) -> bool:
    """Whether vLLM's scheduler_cls (a dotted name or a class) is one of kvadmit's."""
    name = scheduler_cls if isinstance(scheduler_cls, str) else (
        f"{scheduler_cls.__module__}.{scheduler_cls.__qualname__}" if scheduler_cls else "")
    return name.startswith("kvadmit.") and not name.startswith(VLLM_OWN_PREFIX)


def check_vllm_config(vllm_config) -> None:
    """kvadmit's settings of a VllmConfig, checked as the engine will read them
    (ConfigError naming the field): with kvadmit's scheduler, its --additional-config
    object; without it, kvadmit settings are an error too (they would do nothing)."""
    from kvadmit.config import ConfigError, SECTION, looks_like_section

    scheduler_cls = vllm_config.scheduler_config.scheduler_cls
    if _names_kvadmit(scheduler_cls):
        from kvadmit.vllm import compat
        from kvadmit.vllm.scheduler import config_from_vllm
        config, vllm_settings = config_from_vllm(vllm_config)
        compat.check_release(vllm_settings.allow_degraded_vllm)
        compat.check_trust_patch(config)
        return
    settings = vllm_config.additional_config
    if isinstance(settings, dict) and any(k == SECTION or looks_like_section(k) for k in settings):
        current = scheduler_cls or "vLLM's own"
        raise ConfigError(f"--additional-config has kvadmit settings, but the scheduler is "
                          f"{current}: kvadmit is off; add --scheduler-cls {SCHEDULER}")


def register() -> None:
    """Applies every patch that can apply to the installed vLLM. One that cannot is
    logged here and stops start-up where kvadmit is the scheduler (compat.check_release,
    in check_vllm_config and in the engine core), unless allow_degraded_vllm is set;
    without kvadmit's scheduler nothing needs them."""
    import importlib

    from kvadmit_patches import PatchUnavailable

    from kvadmit.vllm.compat import PATCHES
    from kvadmit.vllm.metrics import register_bridge

    register_bridge()
    applied = set()
    for name, lost in PATCHES:
        patch = importlib.import_module(f"kvadmit_patches.{name}")
        if name == "vllm_retry_after" and "vllm_http_status" not in applied:
            continue        # its hint comes from the refusals that patch raises
        try:
            patch.apply(check_vllm_config) if name == "vllm_config_check" else patch.apply()
            applied.add(name)
        except PatchUnavailable as e:
            logger.warning("kvadmit: patch %s not applied, so %s: %s", name, lost,
                           "; ".join(e.problems))

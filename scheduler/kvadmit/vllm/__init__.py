"""kvadmit for vLLM: `--scheduler-cls kvadmit.vllm.Scheduler` plus
`--additional-config '{"kvadmit": {...}}'` (keys: `kvadmit.AdmissionConfig`, and the
vLLM-only `kvadmit.vllm.settings.VllmSettings`).

The scheduler classes are imported on first use (PEP 562), so the parts that need
no vLLM (`kvadmit.vllm.settings`: the vLLM-only keys other engines refuse by name)
import without it."""

__all__ = ["GatedWaitingQueue", "KvadmitAsyncScheduler", "KvadmitScheduler", "Scheduler",
           "VllmAdmission", "config_from_vllm"]


def __getattr__(name: str):
    if name == "VllmAdmission":
        from kvadmit.vllm.admission import VllmAdmission
        return VllmAdmission
    if name in __all__:
        from kvadmit.vllm import scheduler
        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

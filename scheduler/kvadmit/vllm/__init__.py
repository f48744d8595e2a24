"""kvadmit for vLLM: `--scheduler-cls kvadmit.vllm.Scheduler` plus
`--additional-config '{"kvadmit": {...}}'` (keys: `kvadmit.AdmissionConfig`)."""
from kvadmit.vllm.scheduler import (
    GatedWaitingQueue,
    KvadmitAsyncScheduler,
    KvadmitScheduler,
    Scheduler,
    config_from_vllm,
)

__all__ = ["GatedWaitingQueue", "KvadmitAsyncScheduler", "KvadmitScheduler", "Scheduler",
           "config_from_vllm"]

"""pytest plug-in for vLLM's own scheduler tests (tests/v1/core/ of a vLLM release's
source distribution): the scheduler their `create_scheduler` builds when a test names
none, vLLM's `Scheduler` / `AsyncScheduler`, becomes kvadmit's flavour of it with the
pass-through config (`{"policy": "overcommit", "victim": "lifo"}`). Schedulers a test
builds itself, or names, are left as they are. tests/vllm/test_upstream_release.py runs
the upstream files with and without it.

    pytest -p upstream_passthrough tests/v1/core/test_scheduler.py   (in the release's tree,
    with this folder on PYTHONPATH)
"""
import sys

PASS_THROUGH = {"policy": "overcommit", "victim": "lifo"}


def pytest_configure(config):
    sys.path.insert(0, str(config.rootpath))
    import tests.v1.core.utils as upstream

    from kvadmit.vllm.scheduler import KvadmitAsyncScheduler, KvadmitScheduler
    original = upstream.create_scheduler

    def create_scheduler(*args, scheduler_cls=None, **kwargs):
        if scheduler_cls is None:
            flavour = KvadmitAsyncScheduler if kwargs.get("async_scheduling") else KvadmitScheduler

            def scheduler_cls(vllm_config, **rest):
                vllm_config.additional_config = {**(vllm_config.additional_config or {}),
                                                 "kvadmit": dict(PASS_THROUGH)}
                return flavour(vllm_config=vllm_config, **rest)
        return original(*args, scheduler_cls=scheduler_cls, **kwargs)

    upstream.create_scheduler = create_scheduler

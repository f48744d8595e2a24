"""The recomputed prefill of `kvadmit bench serve`'s servers, which vLLM does not count.

vLLM (0.32 to 0.34) counts each request's prompt once, at its first scheduling:
vllm:prompt_tokens, vllm:prompt_tokens_by_source and vllm:prompt_tokens_cached come
from the request's PrefillStats, which its scheduler fills only while the request has
never been preempted ("Track first scheduled prefill, not post-preemption repeat
prefills"); its prefix-cache counters leave preempted requests' look-ups out too. So no
series of its /metrics sees the prefill a preempted request runs again.

The bench's servers therefore run their scheduler, vLLM's own or kvadmit's, as a
subclass here that counts it and changes nothing else: at each preemption it notes how
many tokens the request had computed (its frontier), and after each schedule() it adds
the step's positions below that frontier, min(after, frontier) - before, to the
Prometheus counter kvadmit_bench_recomputed_tokens (the engine process's; /metrics
shows it in multiprocess mode, like kvadmit's own). A request is forgotten once it is
past its frontier or gone. Not counted: positions recomputed for other reasons (KV
that failed to load, rejected speculative tokens), which these servers never have.

`--scheduler-cls kvadmit.bench.serve.recompute.VllmScheduler` (vLLM's own: kvadmit's
start-up check and API-server patches treat it as vLLM's, kvadmit.vllm.plugin) or
`...recompute.KvadmitScheduler` (kvadmit's, as `kvadmit.vllm.Scheduler`); each picks
the sync or async flavour as vLLM's config asks.
"""
from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler as _VllmAsync
from vllm.v1.core.sched.scheduler import Scheduler as _Vllm

from kvadmit.vllm.scheduler import KvadmitAsyncScheduler, KvadmitScheduler as _Kvadmit, by_flavour

METRIC = "kvadmit_bench_recomputed_tokens"     # /metrics: kvadmit_bench_recomputed_tokens_total
_COUNTER = None


def _counter():
    """The process's one counter (prometheus_client refuses a second of a name)."""
    global _COUNTER
    if _COUNTER is None:
        from prometheus_client import Counter
        _COUNTER = Counter(METRIC, "Prefill positions a preempted request computed again "
                           "(below what it had computed before its preemption)")
    return _COUNTER


def recounted(frontier: dict[str, int], scheduled: dict[str, int], requests: dict) -> int:
    """The positions of one step below each request's frontier, i.e. computed again.
    `frontier`: request id -> tokens computed when last preempted (entries past it, or
    of requests gone from `requests`, are dropped); `scheduled`: the step's tokens per
    request; `requests`: id -> request, num_computed_tokens already advanced by the
    step (as after vLLM's schedule())."""
    total = 0
    for rid, top in list(frontier.items()):
        req = requests.get(rid)
        if req is None:
            del frontier[rid]
            continue
        n = scheduled.get(rid, 0)
        if not n:
            continue
        after = req.num_computed_tokens
        total += max(0, min(after, top) - (after - n))
        if after >= top:
            del frontier[rid]
    return total


class _CountsRecompute:
    """Counts recomputed positions (the module's docstring); `recomputed` is the total
    so far, for in-process callers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bench_frontier: dict[str, int] = {}
        self.recomputed = 0
        self._bench_counter = _counter()

    def _preempt_request(self, request, timestamp, *args, **kwargs):
        rid = request.request_id
        self.bench_frontier[rid] = max(self.bench_frontier.get(rid, 0), request.num_computed_tokens)
        return super()._preempt_request(request, timestamp, *args, **kwargs)

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        if self.bench_frontier:
            n = recounted(self.bench_frontier, out.num_scheduled_tokens, self.requests)
            if n:
                self.recomputed += n
                self._bench_counter.inc(n)
        return out


class VllmCountingScheduler(_CountsRecompute, _Vllm):
    """vLLM's own Scheduler, counting recomputed prefill."""


class VllmCountingAsyncScheduler(_CountsRecompute, _VllmAsync):
    """vLLM's own AsyncScheduler, counting recomputed prefill."""


class KvadmitCountingScheduler(_CountsRecompute, _Kvadmit):
    """kvadmit's scheduler, counting recomputed prefill."""


class KvadmitCountingAsyncScheduler(_CountsRecompute, KvadmitAsyncScheduler):
    """kvadmit's async scheduler, counting recomputed prefill."""


class VllmScheduler:
    """What `--scheduler-cls kvadmit.bench.serve.recompute.VllmScheduler` names."""

    def __new__(cls, *args, **kwargs):
        return by_flavour(VllmCountingScheduler, VllmCountingAsyncScheduler, *args, **kwargs)


class KvadmitScheduler:
    """What `--scheduler-cls kvadmit.bench.serve.recompute.KvadmitScheduler` names."""

    def __new__(cls, *args, **kwargs):
        return by_flavour(KvadmitCountingScheduler, KvadmitCountingAsyncScheduler, *args, **kwargs)

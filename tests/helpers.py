"""Builders for core states used by the decision-table tests, and an ASGI middleware's
answer for the HTTP patches' tests."""
import asyncio

from kvadmit import AdmissionConfig, AdmissionCore
from kvadmit.arrival import ArrivalRecord


def make_core(policy="peak", num_blocks=20, block_size=4, max_model_len=0, **cfg):
    return AdmissionCore(AdmissionConfig(policy=policy, **cfg), num_blocks, block_size, max_model_len)


def add_running(core, prompt, max_new, generated=0, priority=0, now=0.0):
    """A request that arrived, was admitted and has generated `generated` tokens."""
    res = core.arrive(ArrivalRecord(prompt, max_new, priority=priority), now=now)
    assert res.accepted, res
    core.admit(res.slot, now)
    if generated:
        core.update(res.slot, prompt + generated - 1, generated)
    return res.slot


def add_waiting(core, prompt, max_new, priority=0, now=0.0):
    res = core.arrive(ArrivalRecord(prompt, max_new, priority=priority), now=now)
    assert res.accepted, res
    return res.slot


def fail_on_call(monkeypatch, owner, name: str, n: int) -> list:
    """``owner.<name>`` (a method) raises RuntimeError on its n-th call, counted from 1;
    the list of calls so far is returned (the fault tests of kvadmit failing open)."""
    original, calls = getattr(owner, name), []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError(f"injected into {name}, call {n}")
        return original(self, *args, **kwargs)
    monkeypatch.setattr(owner, name, failing)
    return calls


def asgi_answer(middleware, path, method="GET", query=b"", app_status=404):
    """`middleware` in front of an app that answers `app_status` "app" to everything:
    (status, headers, body) of the answer to `method path?query`."""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": app_status,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"app"})

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "method": method, "query_string": query}
    asyncio.run(middleware(app)(scope, None, send))
    return (sent[0]["status"], dict(sent[0]["headers"]),
            b"".join(m.get("body", b"") for m in sent[1:]))

"""Stale work: a waiting request that has not started within its TTL (its ttl_s,
else the config's max_queue_age_s) is dropped with reason `expired` before any
prefill, its slot and place freed; one that started (even if preempted since) is not."""
import pytest

from helpers import make_core
from kvadmit import ArrivalRecord, Requests
from kvadmit._native import NativeEngine
from kvadmit.config import AdmissionConfig, ConfigError
from kvadmit.protocol import Refusal


def arrive(core, now, **kw):
    res = core.arrive(ArrivalRecord(8, 4, **kw), now=now)
    assert res.accepted, res.rejection
    return res.slot


def test_a_request_past_its_ttl_is_dropped_with_its_own_reason():
    core = make_core("reserve", num_blocks=100, max_queue_age_s=10.0)
    own = arrive(core, 0.0, ttl_s=2.0)        # its own TTL
    default = arrive(core, 0.0)               # the config's 10 s
    never = arrive(core, 0.0, ttl_s=0.0)      # 0: none
    assert core.drop_waiting(1.99) == []
    [(slot, rej)] = core.drop_waiting(2.0)
    assert slot == own and rej.reason == "expired" and rej.retry_after_s is None
    assert (rej.limit, rej.limit_value) == ("ttl_s", 2.0)
    assert "waited 2 s in the queue without starting, past its ttl_s=2 s" in rej.message
    assert core.waiting() == [default, never] and core.state(own) == "free"
    [(slot, rej)] = core.drop_waiting(12.0)
    assert slot == default and (rej.limit, rej.limit_value) == ("max_queue_age_s", 10.0)
    assert core.drop_waiting(1e6) == [] and core.waiting() == [never]
    assert core.stats()["rejected"]["expired"] == 2
    refusal = Refusal.of(rej)
    assert not refusal.retryable and refusal.status == 400


def test_a_request_that_started_never_expires():
    core = make_core("reserve", num_blocks=100)
    s = arrive(core, 0.0, ttl_s=1.0)
    core.admit(s, 0.5)
    core.preempt(s, 0.6)                      # waiting again, with work done
    assert core.drop_waiting(5.0) == [] and core.waiting() == [s]


def test_ttl_input_is_checked():
    with pytest.raises(ValueError, match="ttl_s=inf: must be at most 86400 s"):
        ArrivalRecord(8, 4, ttl_s=float("inf"))
    with pytest.raises(ConfigError, match="max_queue_age_s"):
        AdmissionConfig.from_dict({"max_queue_age_s": -1})


def test_the_native_engine_drops_stale_work_before_prefill():
    # One request fills the pool for 50 steps; the two behind it wait. The one with a
    # 0.2 s TTL is dropped at the first step past it, never prefilled; the other runs.
    cfg = AdmissionConfig.from_dict({"policy": "reserve"})
    e = NativeEngine(cfg, 20, 4, 256, 8, 256, step_a=0.01)
    e.add_requests(Requests([0.0, 0.0, 0.0], [40, 30, 30], [40, 2, 2], [40, 2, 2],
                            ttl_s=[0.0, 0.2, 0.0]))
    e.run()
    r = e.results()
    assert r["rejected"] == [None, "expired", None]
    assert r["first_token_s"][1] == -1 and r["output_tokens"][1] == 0
    assert 0.2 <= r["finish_s"][1] < 0.22
    assert r["first_token_s"][2] > 0.4
    assert e.totals()["free_blocks_at_end"] == 20

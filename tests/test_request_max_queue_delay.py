"""A request's own cap on its queueing delay, the request field max_queue_delay_s: at
arrival it is refused as queue_delay when the core's predicted queueing delay exceeds
the tighter of its cap and the config's max_queue_delay_s; it never loosens the
config's. Declared once (kvadmit.request_fields.SCHEMA and the arrival record), it
reaches the core from vLLM's flat key, the object form, SGLang's custom_params, the
gateway header and the simulator's columns."""
import pytest

from helpers import make_core
from kvadmit import ArrivalRecord, Requests
from kvadmit._native import NativeEngine
from kvadmit.config import AdmissionConfig
from kvadmit.request_fields import FieldError, from_extra_args, record_columns
from kvadmit_patches.vllm_slo_headers import slo_fields


def draining_core(config_cap: float):
    """5 arrivals at 0, 4 admitted over 4 s (1 request and 8 prompt tokens a second):
    an arrival of 8 prompt tokens behind the one still waiting is predicted 2 s."""
    core = make_core("overcommit", num_blocks=1000, max_queue_delay_s=config_cap,
                     drain_window_s=100)
    for _ in range(5):
        assert core.arrive(ArrivalRecord(8, 4), now=0.0).accepted
    for t in (1.0, 2.0, 3.0, 4.0):
        core.admit(core.waiting()[0], t)
    return core


@pytest.mark.parametrize("own, config_cap, limit", [
    (1.5, 0.0, "kvadmit_max_queue_delay_s"),   # its own cap, where the config has none
    (1.5, 5.0, "kvadmit_max_queue_delay_s"),   # the tighter of the two
    (5.0, 1.5, "max_queue_delay_s"),           # it cannot loosen the config's
    (2.5, 0.0, None),                          # 2 s predicted: within its cap
    (-1.0, 0.0, None),                         # not given: the config's (none)
    (0.0, 0.0, None),
])
def test_the_tighter_cap_refuses(own, config_cap, limit):
    core = draining_core(config_cap)
    res = core.arrive(ArrivalRecord(8, 4, max_queue_delay_s=own), now=4.0)
    if limit is None:
        assert res.accepted
        return
    cap = min(c for c in (own, config_cap) if c > 0)
    assert not res.accepted and res.rejection.reason == "queue_delay"
    assert res.rejection.limit == limit
    assert res.rejection.retry_after_s == pytest.approx(2.0 - cap)
    assert f"exceeds {limit}={cap:g}" in res.rejection.message


def test_the_record_names_a_bad_cap():
    with pytest.raises(ValueError, match="max_queue_delay_s=inf"):
        ArrivalRecord(8, 4, max_queue_delay_s=float("inf"))


@pytest.mark.parametrize("extra_args", [{"kvadmit_max_queue_delay_s": 0.5},
                                        {"kvadmit": {"max_queue_delay_s": 0.5}}])
def test_vllms_request_fields_carry_it(extra_args):
    assert record_columns(from_extra_args(extra_args), -1.0)["max_queue_delay_s"] == 0.5


def test_a_bad_value_names_the_field():
    with pytest.raises(FieldError, match="kvadmit_max_queue_delay_s='soon'"):
        from_extra_args({"kvadmit_max_queue_delay_s": "soon"})


def test_the_gateway_header_is_a_duration():
    assert slo_fields([(b"X-Kvadmit-Max-Queue-Delay", b"500ms")]) == \
        {"kvadmit_max_queue_delay_s": 0.5}


def test_sglangs_custom_params_carry_it():
    pytest.importorskip("sglang")
    from kvadmit.sglang.request import parse_request_params
    fields = parse_request_params({"kvadmit": {"max_queue_delay_s": 0.25}}, 1.7e9)
    assert record_columns(fields, -1.0)["max_queue_delay_s"] == 0.25


def test_the_simulators_column_reaches_the_core():
    """Forty requests at 0 fill a small pool; at 2 s two more arrive: the one whose
    own cap is 10 ms is refused (queue_delay), the one without it is served."""
    e = NativeEngine(AdmissionConfig(policy="overcommit", drain_window_s=100), 16, 4, 64, 8, 64,
                     step_a=0.1)
    n = 42
    e.add_requests(Requests([0.0] * 40 + [2.0, 2.0], [8] * n, [8] * n, [8] * n,
                            max_queue_delay_s=[-1.0] * 40 + [0.01, -1.0]))
    e.run()
    rejected = e.results()["rejected"]
    assert rejected[40] == "queue_delay" and rejected[41] is None
    assert rejected[:40] == [None] * 40

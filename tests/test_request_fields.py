"""kvadmit.request_fields: the per-request SLO/session fields an engine adapter
reads from a request's extra arguments (vLLM: SamplingParams.extra_args)."""
import pytest

from kvadmit.request_fields import (NONE, PAST_DEADLINE_TTFT_S, SESSION_INT_LIMIT, FieldError,
                                    RequestFields, from_extra_args, session_int, ttft_target)

NOW = 1.8e9


def test_absent_fields_are_none():
    assert from_extra_args(None) is NONE and from_extra_args({}) is NONE
    assert from_extra_args({"kv_transfer_params": {"x": 1}}) is NONE
    # Other "kvadmit_*" keys belong to someone else (kvadmit's vLLM bench: kvadmit_stop_at).
    assert from_extra_args({"kvadmit_stop_at": 5}) is NONE
    assert NONE == RequestFields(-1.0, -1.0, -1, None)
    assert ttft_target(NONE, 3.0) == -1.0          # the core applies its default


def test_both_shapes_give_the_same_fields():
    nested = from_extra_args({"kvadmit": {"ttft_slo_s": 2, "tpot_slo_s": 0.05, "session": "a"}})
    flat = from_extra_args({"kvadmit_ttft_slo_s": 2.0, "kvadmit_tpot_slo_s": 0.05,
                            "kvadmit_session": "a"})
    assert nested == flat == RequestFields(2.0, 0.05, session_int("a"))
    assert from_extra_args({"kvadmit": {"ttft_slo_s": 0}}).ttft_slo_s == 0.0   # 0: no target


def test_deadline_becomes_a_ttft_target():
    def target(extra, default=0.0):
        return ttft_target(from_extra_args(extra, now_unix=NOW), default, now_unix=NOW)

    assert target({"kvadmit_deadline_s": NOW + 1.5}) == 1.5
    # The tighter of deadline and ttft_slo_s (or, without ttft_slo_s, the config default).
    assert target({"kvadmit_deadline_s": NOW + 1.5, "kvadmit_ttft_slo_s": 1}) == 1.0
    assert target({"kvadmit_deadline_s": NOW + 1.5, "kvadmit_ttft_slo_s": 2}) == 1.5
    assert target({"kvadmit_deadline_s": NOW + 1.5}, default=1.0) == 1.0
    assert target({"kvadmit_deadline_s": NOW + 1.5, "kvadmit_ttft_slo_s": 0}, default=1.0) == 1.5
    # Already passed: a target nobody meets (0 would mean "none").
    assert target({"kvadmit_deadline_s": NOW - 5}) == PAST_DEADLINE_TTFT_S


def test_sessions_map_to_stable_disjoint_ints():
    assert session_int(0) == 0 and session_int(SESSION_INT_LIMIT - 1) == SESSION_INT_LIMIT - 1
    s = session_int("agent-7")
    assert s == session_int("agent-7") and SESSION_INT_LIMIT <= s < 2 * SESSION_INT_LIMIT
    assert s != session_int("agent-8")
    assert s == 0x4000000000000000 | (s & (SESSION_INT_LIMIT - 1))


@pytest.mark.parametrize("extra, words", [
    ({"kvadmit": {"ttft_slo_s": "soon"}}, "kvadmit.ttft_slo_s='soon'"),
    ({"kvadmit_ttft_slo_s": float("nan")}, "kvadmit_ttft_slo_s"),
    ({"kvadmit_ttft_slo_s": True}, "kvadmit_ttft_slo_s"),
    ({"kvadmit_ttft_slo_s": 1e6}, "out of range"),
    ({"kvadmit_tpot_slo_s": -0.1}, "kvadmit_tpot_slo_s"),
    ({"kvadmit_deadline_s": 30}, "absolute UNIX time"),
    ({"kvadmit_deadline_s": NOW * 1000}, "milliseconds"),
    ({"kvadmit_session": ""}, "kvadmit_session"),
    ({"kvadmit_session": -1}, "[0, 2**62)"),
    ({"kvadmit_session": 2.0}, "integer or a string"),
    ({"kvadmit": {"sesion": 1}}, "unknown kvadmit field 'kvadmit.sesion'"),
    ({"kvadmit": "x"}, "must be an object"),
    ({"kvadmit": {"session": 1}, "kvadmit_session": 1}, "given twice"),
])
def test_bad_fields_name_themselves(extra, words):
    with pytest.raises(FieldError) as e:
        from_extra_args(extra, now_unix=NOW)
    assert words in str(e.value)


def test_the_schema_keeps_its_order():
    """RequestFields' positional order is the schema's; a new field goes at the end."""
    from kvadmit.request_fields import FIELDS, SCHEMA
    assert FIELDS == tuple(f.name for f in SCHEMA) == RequestFields._fields
    assert FIELDS[:7] == ("ttft_slo_s", "tpot_slo_s", "session", "deadline_s", "ttl_s", "flow",
                          "sheddable")

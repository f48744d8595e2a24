"""The arrival record: one request's numbers, defined once (native/kvadmit/_arrival.pxd)
with its Python twin (kvadmit.arrival.ArrivalRecord), checked when built, and the
columnar Requests the native engine takes."""
import dataclasses

import pytest

from helpers import make_core
from kvadmit import ArrivalRecord, Requests
from kvadmit._native import ARRIVAL_FIELDS, NativeEngine
from kvadmit.config import AdmissionConfig
from kvadmit.simulate.workload import Workload


def test_the_python_record_has_the_structs_fields_in_its_order():
    assert tuple(f.name for f in dataclasses.fields(ArrivalRecord)) == ARRIVAL_FIELDS


def test_the_record_is_frozen_and_checked_when_built():
    r = ArrivalRecord(10, 5, priority=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.priority = 0
    with pytest.raises(ValueError, match=r"cached_tokens=11: must be in \[0, prompt_tokens=10\]"):
        ArrivalRecord(10, 5, cached_tokens=11)
    with pytest.raises(ValueError, match="ttft_slo_s=nan"):
        ArrivalRecord(10, 5, ttft_slo_s=float("nan"))
    with pytest.raises(OverflowError):
        ArrivalRecord(1 << 63, 5)


def test_the_core_takes_every_field_of_the_record():
    core = make_core("reserve", num_blocks=100, block_size=4, queue_order="priority",
                     agent_window=True)
    s = core.arrive(ArrivalRecord(10, 6, priority=3, cached_tokens=4, ttft_slo_s=9.0,
                                  tpot_slo_s=0.5, session=7, arrival_time=2.0, arrival_tie=1.0),
                    now=1.0).slot
    r = core.info(s)
    assert (r["prompt_tokens"], r["max_new_tokens"], r["priority"], r["cached_tokens"],
            r["ttft_target_s"], r["tpot_target_s"], r["session"], r["arrival_time"],
            r["arrival_tie"]) == (10, 6, 3, 4, 9.0, 0.5, 7, 2.0, 1.0)
    # equal priority, earlier engine arrival_time: served first
    t = core.arrive(ArrivalRecord(10, 6, priority=3, arrival_time=1.0), now=1.0).slot
    assert core.waiting() == [t, s]


def test_anything_else_is_a_type_error_naming_the_record():
    with pytest.raises(TypeError, match="kvadmit.ArrivalRecord.*a dict has no 'prompt_tokens'"):
        make_core().arrive({"prompt_tokens": 4, "max_new_tokens": 4}, now=0.0)


def test_requests_are_checked_once_and_name_column_and_row():
    with pytest.raises(ValueError, match=r"ttft_slo_s\[1\]=inf"):
        Requests([0.0, 0.0], [4, 4], [1, 1], [2, 2], ttft_slo_s=[-1.0, float("inf")])
    with pytest.raises(ValueError, match="priority: 1 entries, expected 2"):
        Requests([0.0, 0.0], [4, 4], [1, 1], [2, 2], priority=[0])
    with pytest.raises(ValueError, match="parent and delay_s go together"):
        Requests([0.0], [4], [1], [2], parent=[-1])
    rows = Requests([0.0, 1.0], [4, 5], [1, 2], [2, 3], priority=[1, 0], session=[-1, 9])
    assert len(rows) == 2
    assert rows.record(1) == dict(prompt_tokens=5, max_new_tokens=3, priority=0, cached_tokens=0,
                                  ttft_slo_s=-1.0, tpot_slo_s=-1.0, session=9, arrival_time=0.0,
                                  arrival_tie=0.0, ttl_s=-1.0, flow=-1, sheddable=False,
                                  prompt_hash=0, max_queue_delay_s=-1.0, kv_hold_s=-1.0)
    with pytest.raises(IndexError, match=r"row 2: out of range \[0, 2\)"):
        rows.record(2)


def test_a_workloads_bad_entry_names_the_workload_and_the_row():
    w = Workload("w", [0.0, 1.0], [4, 4], [1, 7], [2, 2])
    with pytest.raises(ValueError, match=r"workload w: output_tokens\[1\]=7: must be in "
                                         r"\[1, max_new_tokens\[1\]=2\]"):
        w.requests()


def test_the_engine_serves_what_the_requests_say():
    e = NativeEngine(AdmissionConfig.from_dict({}), 100, 4, 64, 8, 64, step_a=0.01)
    e.add_requests(Requests([0.0, 0.0], [8, 8], [3, 2], [4, 4], priority=[0, 1]))
    e.run()
    r = e.results()
    assert r["rejected"] == [None, None] and r["output_tokens"] == [3, 2]
    assert e.totals()["free_blocks_at_end"] == 100


def test_prompt_hash_tells_prompts_apart_with_bounded_work():
    """The adapters' prompt_hash (the retry line's way to tell a retry, the same body
    again, from another client with the same lengths): equal prompts hash equal,
    others differ, a long prompt is hashed by its first and last 1024 tokens, and a
    prompt's hash is never the record's 0 (unknown)."""
    from kvadmit.arrival import prompt_hash
    a = list(range(3, 63))
    assert prompt_hash(a) == prompt_hash(list(a)) == prompt_hash(tuple(a))
    assert prompt_hash(a) != prompt_hash(a[::-1]) and prompt_hash(a) != prompt_hash(a[:-1])
    assert prompt_hash(None) == prompt_hash([]) == 0
    assert prompt_hash([0]) != 0
    long = [7] * 5000
    middle = long[:2000] + [9] + long[2001:]
    assert prompt_hash(middle) == prompt_hash(long)          # past the ends: not read
    assert prompt_hash(long[:-1] + [9]) != prompt_hash(long)
    assert ArrivalRecord(5000, 4, prompt_hash=prompt_hash(long)).prompt_hash == prompt_hash(long)

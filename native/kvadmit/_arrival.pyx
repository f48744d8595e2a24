# The arrival record (see _arrival.pxd): its fields' names, the conversion from
# the Python twin, and the check of its numbers (ValueError naming the field).

from libc.math cimport isfinite
from libc.string cimport memset


cdef ArrivalRecord _zero() noexcept nogil:
    cdef ArrivalRecord r
    memset(&r, 0, sizeof(r))
    return r


MAX_TTL_S = 86400.0    # as the config's max_queue_age_s

# The struct's fields in declaration order (Cython turns a struct into a dict).
FIELDS = tuple(_zero())
# Each field's value when not given: what "none" or "the config's" means for it.
# prompt_tokens and max_new_tokens have none: every request gives them.
DEFAULTS = {"priority": 0, "cached_tokens": 0, "ttft_slo_s": -1.0, "tpot_slo_s": -1.0,
            "session": -1, "arrival_time": 0.0, "arrival_tie": 0.0, "ttl_s": -1.0,
            "flow": -1, "sheddable": False, "prompt_hash": 0, "max_queue_delay_s": -1.0,
            "kv_hold_s": -1.0}
# The fields a workload gives per request (kvadmit._requests.Requests' columns, the
# simulator's Workload): all but the engine's own stamps and its cache's count.
COLUMNS = tuple(f for f in FIELDS if f not in ("cached_tokens", "arrival_time", "arrival_tie"))
assert set(FIELDS) == set(DEFAULTS) | {"prompt_tokens", "max_new_tokens"}, \
    "every arrival record field has a default (kvadmit._arrival.DEFAULTS)"


cdef ArrivalRecord record_of(object record) except *:
    """The struct of any object with the record's fields as attributes
    (kvadmit.arrival.ArrivalRecord); a missing field raises TypeError, a value C
    cannot hold OverflowError or TypeError."""
    cdef dict values = {}
    for name in FIELDS:
        try:
            values[name] = getattr(record, name)
        except AttributeError:
            raise TypeError(f"an arrival record (kvadmit.ArrivalRecord) has the fields "
                            f"{', '.join(FIELDS)}; a {type(record).__name__} has no "
                            f"{name!r}") from None
    return values


cdef str _name(str field, Py_ssize_t row):
    return field if row < 0 else f"{field}[{row}]"


cdef int check_record(const ArrivalRecord* r, Py_ssize_t row=-1) except -1:
    """ValueError naming the first field out of its range (``row`` >= 0: a column's
    entry, named field[row])."""
    if r.prompt_tokens < 1:
        raise ValueError(f"{_name('prompt_tokens', row)}={r.prompt_tokens}: must be >= 1")
    if r.max_new_tokens < 0:
        raise ValueError(f"{_name('max_new_tokens', row)}={r.max_new_tokens}: must be >= 0 "
                         f"(0: a pooling request, its prompt alone)")
    if r.cached_tokens < 0 or r.cached_tokens > r.prompt_tokens:
        raise ValueError(f"{_name('cached_tokens', row)}={r.cached_tokens}: must be in "
                         f"[0, prompt_tokens={r.prompt_tokens}]")
    if not isfinite(r.ttft_slo_s) or not isfinite(r.tpot_slo_s):
        raise ValueError(f"{_name('ttft_slo_s', row)}={r.ttft_slo_s}, "
                         f"{_name('tpot_slo_s', row)}={r.tpot_slo_s}: must be finite "
                         f"(negative: the config's defaults; 0: none)")
    if not (isfinite(r.ttl_s) and r.ttl_s <= MAX_TTL_S):
        raise ValueError(f"{_name('ttl_s', row)}={r.ttl_s}: must be at most {MAX_TTL_S:g} s "
                         f"(negative: the config's max_queue_age_s; 0: none)")
    if not (isfinite(r.max_queue_delay_s) and r.max_queue_delay_s <= MAX_TTL_S):
        raise ValueError(f"{_name('max_queue_delay_s', row)}={r.max_queue_delay_s}: must be at "
                         f"most {MAX_TTL_S:g} s (<= 0: the config's max_queue_delay_s)")
    if not (isfinite(r.kv_hold_s) and r.kv_hold_s <= MAX_TTL_S):
        raise ValueError(f"{_name('kv_hold_s', row)}={r.kv_hold_s}: must be at most {MAX_TTL_S:g} s "
                         f"(0: the session is done; negative: none)")
    if r.flow < -1:
        raise ValueError(f"{_name('flow', row)}={r.flow}: must be a flow id >= 0 (-1: none)")
    if not isfinite(r.arrival_time) or not isfinite(r.arrival_tie):
        raise ValueError(f"{_name('arrival_time', row)}={r.arrival_time}, "
                         f"{_name('arrival_tie', row)}={r.arrival_tie}: must be finite")
    return 0


def check(record) -> None:
    """Checks an arrival record's numbers as the core will (ValueError naming the
    field; OverflowError: an integer beyond int64)."""
    cdef ArrivalRecord r = record_of(record)
    check_record(&r)

"""The arrival record: one request's numbers as the admission core takes them.

`ArrivalRecord` is the Python twin of the native struct in native/kvadmit/_arrival.pxd,
made from it (its fields in its order, its defaults: kvadmit._arrival.FIELDS and
DEFAULTS), so a new field is declared in the struct alone. The engine adapters
build one from an engine's request (`kvadmit.vllm.request`, `kvadmit.sglang.request`),
the port (`kvadmit.port.CorePort`) hands it to `AdmissionCore.arrive`, and the simulator's columnar `Requests`
holds one per request. Building one checks its numbers as the core will: a ValueError
names the field and its limit.
"""
from __future__ import annotations

import dataclasses

from kvadmit._arrival import DEFAULTS, FIELDS
from kvadmit._arrival import check as _check_record


def _post_init(self) -> None:
    _check_record(self)


# The native struct's fields, in its order, with its defaults (kvadmit._arrival: each
# field's meaning is written there, once); prompt_tokens and max_new_tokens have none.
ArrivalRecord = dataclasses.make_dataclass(
    "ArrivalRecord",
    [(f, type(DEFAULTS[f]), DEFAULTS[f]) if f in DEFAULTS else (f, int) for f in FIELDS],
    namespace={"__post_init__": _post_init, "__module__": __name__,
               "__doc__": "One request's numbers as the admission core takes them "
                          "(native/kvadmit/_arrival.pxd); built checked."},
    frozen=True, slots=True)


_HASHED_ENDS = 1024    # tokens hashed at each end of a long prompt: bounded work an arrival


def prompt_hash(token_ids) -> int:
    """An arrival record's prompt_hash of a prompt's token ids (0: none given). Its
    first and last 1024 tokens are hashed (the length is in the record already);
    Python's hash of integers is the same in every process. Never 0 for a prompt."""
    if not token_ids:
        return 0
    n = len(token_ids)
    ids = (tuple(token_ids) if n <= 2 * _HASHED_ENDS
           else (*token_ids[:_HASHED_ENDS], *token_ids[n - _HASHED_ENDS:]))
    return hash(ids) or 1

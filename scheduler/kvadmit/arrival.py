"""The arrival record: one request's numbers as the admission core takes them.

`ArrivalRecord` is the Python twin of the native struct in native/kvadmit/_arrival.pxd
(same fields, same order: tests/test_arrival_record.py checks). The engine adapters
build one from an engine's request (`kvadmit.vllm.admission`, `kvadmit.sglang.request`),
the port (`kvadmit.port.CorePort`) hands it to `AdmissionCore.arrive`, and the simulator's columnar `Requests`
holds one per request. Building one checks its numbers as the core will: a ValueError
names the field and its limit.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvadmit._arrival import check as _check_record


@dataclass(frozen=True, slots=True)
class ArrivalRecord:
    prompt_tokens: int          # prompt tokens (>= 1)
    max_new_tokens: int         # its output cap (>= 1)
    priority: int = 0           # lower is more important (vLLM's order)
    cached_tokens: int = 0      # prompt tokens already cached, in [0, prompt_tokens]
    ttft_slo_s: float = -1.0    # TTFT target, seconds (negative: the config's default; 0: none)
    tpot_slo_s: float = -1.0    # TPOT target, seconds (the same)
    session: int = -1           # its agent/session id (-1: none)
    arrival_time: float = 0.0   # the engine's own arrival stamp (any clock) and its
    arrival_tie: float = 0.0    # tie-break: the order of equal priorities (queue_order priority)
    ttl_s: float = -1.0         # seconds it may wait before it first starts, else it is dropped
                                # unserved (negative: the config's max_queue_age_s; 0: none)
    flow: int = -1              # its flow (tenant, workload) for the fair share (-1: none)
    sheddable: bool = False     # best-effort: served after all others, first to give way, and
                                # dropped while others wait for KV (GIE's negative priority)
    prompt_hash: int = 0        # a hash of its prompt's tokens (0: unknown): a retry repeats it,
                                # a new client with the same numbers seldom does (the retry line)

    def __post_init__(self) -> None:
        _check_record(self)


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

"""Per-request kvadmit fields: SLO targets and the agent session of one request.

A request carries them in its engine's free-form per-request arguments; for
vLLM that is `SamplingParams.extra_args`, in either of two shapes:

- an object under "kvadmit": `extra_args={"kvadmit": {"ttft_slo_s": 0.5}}`
  (offline `LLM` / `SamplingParams`);
- flat keys "kvadmit_<field>": `extra_args={"kvadmit_ttft_slo_s": 0.5}`. The
  OpenAI-compatible server copies `vllm_xargs` into `extra_args` as is, and
  `vllm_xargs` values may only be strings, numbers or lists of them (an object
  fails vLLM's request validation), so HTTP clients use this shape. Only the
  field names below are read: other "kvadmit_*" keys are left to whoever uses
  them (kvadmit's own vLLM bench passes "kvadmit_stop_at"), so a misspelt flat
  key is ignored, where a misspelt field in the object is refused.

`check_prompt_tokens` and `check_int` check what every request body carries
(its prompt's token ids, its priority and max_tokens) against limits the model would otherwise hit
as a crash; the adapters call them at arrival.

Every field is declared once, in `SCHEMA` (one `Field` each: its name, which is
also the flat key `kvadmit_<name>` and SGLang's `custom_params` key, its parser and
range, its default, the arrival record column it fills and the gateway header that
may carry it). Validation (`parse`), the flat keys, the headers the vLLM header
patch reads (`HEADERS`), the arrival record's columns (`record_columns`) and the
simulator's columns follow from it. The fields (all optional) are listed there;
`deadline_s` (absolute UNIX time by which the first token is due) has no column of
its own: `ttft_target` turns it into a TTFT target at arrival, the tighter of it
and ttft_slo_s. A bad value raises `FieldError` naming the field; the adapter
refuses the request as `invalid`.
"""
from __future__ import annotations

import hashlib
import math
import time
from collections import namedtuple
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

KEY = "kvadmit"
FLAT_PREFIX = "kvadmit_"
MAX_TTFT_S = 86400.0          # as config default_ttft_slo_s
MAX_TTL_S = 86400.0           # as config max_queue_age_s
MAX_TPOT_S = 3600.0           # as config default_tpot_slo_s
MIN_DEADLINE_UNIX = 1e9       # 2001-09-09: anything smaller is not an absolute time
PAST_DEADLINE_TTFT_S = 1e-6   # a deadline already passed: a target no request meets
SESSION_INT_LIMIT = 1 << 62   # integer sessions: [0, 2**62); strings map into [2**62, 2**63)
INT_LIMIT = 1 << 62           # a request's integers at most: the core's int64, negated by SGLang


class FieldError(ValueError):
    """A kvadmit request field (or a request's prompt, priority, max_tokens) is
    malformed; the message names it, `field` too where the caller needs it apart."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def check_prompt_tokens(token_ids, vocab_size: int, name: str = "prompt_token_ids",
                        multimodal: bool = False) -> None:
    """Raises FieldError naming the first prompt token id outside the model's vocabulary
    [0, vocab_size): the embedding lookup would index past its table and take the engine
    down (vLLM checks ids only with a tokenizer; SGLang not at all). A multimodal
    prompt's placeholder ids may lie above the vocabulary (the engine replaces them by
    the encoder's embeddings): only negative ids are refused there. `vocab_size` <= 0:
    unknown, only negative ids are refused."""
    if token_ids is None or len(token_ids) == 0:
        return
    lo, hi = min(token_ids), max(token_ids)
    upper = vocab_size if vocab_size > 0 and not multimodal else None
    if lo >= 0 and (upper is None or hi < upper):
        return
    for i, t in enumerate(token_ids):
        if t < 0 or (upper is not None and t >= upper):
            span = f"[0, {upper})" if upper is not None else "[0, ...)"
            raise FieldError(f"{name}[{i}]={int(t)}: outside the model's vocabulary {span} "
                             f"(vocab_size={vocab_size})", name)


def check_int(value, name: str, lo: int = -INT_LIMIT, hi: int = INT_LIMIT) -> int:
    """A request's integer (priority, max_tokens) as the core takes it: FieldError
    naming it outside [lo, hi] (default [-2**62, 2**62]: the core's int64, with room
    for SGLang's negation of priorities)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(f"{name}={value!r}: must be an integer", name)
    if not lo <= value <= hi:
        raise FieldError(f"{name}={value}: out of range [{_bound(lo)}, {_bound(hi)}]", name)
    return value


def _bound(v: int) -> str:
    return {INT_LIMIT: "2**62", -INT_LIMIT: "-2**62"}.get(v, str(v))


def session_int(value: Any, name: str = "session") -> int:
    """A session id as the core's integer: an integer in [0, 2**62) as is, a
    non-empty string as a stable 62-bit hash above 2**62 (so the two never collide
    and the same string maps to the same id in every process and run)."""
    if isinstance(value, str):
        if not value:
            raise FieldError(f"kvadmit field {name}='': must be a non-empty string or an integer")
        digest = hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        return SESSION_INT_LIMIT | (int.from_bytes(digest, "little") & (SESSION_INT_LIMIT - 1))
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value < SESSION_INT_LIMIT:
            raise FieldError(f"kvadmit field {name}={value!r}: an integer session must be in "
                             f"[0, 2**62)")
        return value
    raise FieldError(f"kvadmit field {name}={value!r}: must be an integer or a string")


def flow_int(value: Any, name: str = "flow") -> int:
    """A flow id as the core's integer, as session_int makes it, except that a string
    of decimal digits is that integer: the header x-gateway-inference-fairness-id:
    7, the field flow: "7" or 7 and the config's flows key "7" are one flow."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        if len(value.lstrip("0")) > 19:    # past 2**62 (int() refuses 4300 digits, unnamed)
            raise FieldError(f"kvadmit field {name}={value[:24]!r}... ({len(value)} digits): "
                             f"an integer flow must be in [0, 2**62)")
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value < SESSION_INT_LIMIT:
        raise FieldError(f"kvadmit field {name}={value!r}: an integer flow must be in [0, 2**62)")
    return session_int(value, name)


def flag(value: Any, name: str) -> bool:
    """A yes/no field: a JSON boolean, 0/1, or "true"/"false" (HTTP headers and
    vllm_xargs carry strings and numbers)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise FieldError(f"kvadmit field {name}={value!r}: must be true or false")


def _finite_number(value: Any) -> bool:
    """A number a float holds (not a bool, NaN, an infinity, or an int past float's range,
    which math.isfinite and arithmetic with floats meet with OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return abs(value) < 2**1023 if isinstance(value, int) else math.isfinite(value)


def _seconds(value: Any, name: str, hi: float, zero: str = "no target") -> float:
    if not _finite_number(value):
        raise FieldError(f"kvadmit field {name}={value!r}: must be a number of seconds in "
                         f"[0, {hi:g}] (0: {zero})")
    if not 0 <= value <= hi:
        raise FieldError(f"kvadmit field {name}={value!r}: out of range [0, {hi:g}] (0: {zero})")
    return float(value)


def _deadline(value: Any, name: str, now_unix: float) -> float:
    if not _finite_number(value):
        raise FieldError(f"kvadmit field {name}={value!r}: must be a UNIX time in seconds")
    if value < MIN_DEADLINE_UNIX:
        raise FieldError(f"kvadmit field {name}={value!r}: must be an absolute UNIX time in "
                         f"seconds (a relative target is ttft_slo_s)")
    if value - now_unix > MAX_TTFT_S:
        raise FieldError(f"kvadmit field {name}={value!r}: more than {MAX_TTFT_S:g} s away "
                         f"(a UNIX time in seconds, not milliseconds?)")
    return float(value)


@dataclass(frozen=True)
class Field:
    """One per-request field, declared once (see the module docstring)."""
    name: str                     # the object key, flat key kvadmit_<name>, SGLang's custom_params key
    parse: Callable[[Any, str, float], Any]   # (value, its name as spelled, now_unix) -> the core's value
    default: Any                  # not given
    column: Optional[str]         # the arrival record column it fills (None: folded into another)
    header: Optional[bytes] = None   # a gateway's header carrying it (patches/vllm_slo_headers.py)
    header_unit: str = "text"     # the header's value: "ms" (milliseconds), "duration" ("30s"), "text"
    doc: str = ""
    # Whether a parsed value raises the request's claim over the server's default
    # (value, config, now_unix) -> bool; None: it never does (it can only lower the
    # claim). Who may raise one: kvadmit.trust.
    raises: Optional[Callable[[Any, Any, float], bool]] = None

    def is_given(self, value) -> bool:
        """Whether a record column's value is one a request gave, not the default
        (any negative value where the default is negative: "none", "the config's")."""
        if isinstance(self.default, bool):
            return bool(value) != self.default
        if isinstance(self.default, (int, float)) and self.default < 0:
            return value >= 0
        return value != self.default


def _seconds_field(hi: float, zero: str):
    return lambda v, name, now: _seconds(v, name, hi, zero)


# The claim rules (Field.raises): each compares a parsed value with the config's default.
def _given(v, config, now) -> bool:
    return v >= 0


def _tighter(default_key: str):
    """A target is a raise when it is tighter than the config's default (0: none)."""
    def raises(v, config, now) -> bool:
        default = getattr(config, default_key)
        return v > 0 and (default == 0 or v < default)
    return raises


def _deadline_raises(v, config, now) -> bool:
    default = config.default_ttft_slo_s
    return v is not None and (default == 0 or v - now < default)


def _longer_ttl(v, config, now) -> bool:
    """A TTL longer than the config's max_queue_age_s (0 in either: none) is a raise."""
    cap = config.max_queue_age_s
    return v >= 0 and cap > 0 and (v == 0 or v > cap)


# In RequestFields' order: a new field goes at the end (positional uses stay valid).
SCHEMA = (
    Field("ttft_slo_s", _seconds_field(MAX_TTFT_S, "no target"), -1.0, "ttft_slo_s",
          b"x-slo-ttft-ms", "ms", "its TTFT target, seconds (-1: the config's default)",
          _tighter("default_ttft_slo_s")),
    Field("tpot_slo_s", _seconds_field(MAX_TPOT_S, "no target"), -1.0, "tpot_slo_s",
          b"x-slo-tpot-ms", "ms", "its TPOT target, seconds (-1: the config's default)",
          _tighter("default_tpot_slo_s")),
    Field("session", lambda v, name, now: session_int(v, name), -1, "session", None, "text",
          "its agent/session id, integer or string (-1: none)", _given),
    Field("deadline_s", _deadline, None, None, None, "text",
          "absolute UNIX time its first token is due by (tightens ttft_slo_s at arrival)",
          _deadline_raises),
    Field("ttl_s", _seconds_field(MAX_TTL_S, "none"), -1.0, "ttl_s", b"x-llm-d-inference-ttl",
          "duration", "seconds it may wait before it starts, else dropped as expired "
          "(-1: the config's max_queue_age_s; 0: none)", _longer_ttl),
    Field("flow", lambda v, name, now: flow_int(v, name), -1, "flow",
          b"x-gateway-inference-fairness-id", "text",
          "its tenant or workload for the fair share of the KV pool (docs/flows.md)", _given),
    Field("sheddable", lambda v, name, now: flag(v, name), False, "sheddable",
          b"x-kvadmit-sheddable", "text",
          "best-effort traffic: served after all other, dropped while other waits for KV "
          "(docs/capacity.md)"),
    Field("max_queue_delay_s", _seconds_field(MAX_TTFT_S, "the config's"), -1.0,
          "max_queue_delay_s", b"x-kvadmit-max-queue-delay", "duration",
          "its own cap on its predicted queueing delay at arrival, seconds: refused "
          "(queue_delay) past the tighter of it and the config's max_queue_delay_s"),
    Field("kv_hold_s", _seconds_field(MAX_TTL_S, "the session is done"), -1.0, "kv_hold_s",
          b"x-kvadmit-kv-hold", "duration",
          "seconds its session is expected back after this turn (a tool call's expected "
          "duration): not back by then, its cached KV is evicted first; 0: the session is done "
          "(docs/slo-agents.md)"),
)
FIELDS = tuple(f.name for f in SCHEMA)
# Header -> field, for the vLLM header patch (lower-case header names)
HEADERS = {f.header: f for f in SCHEMA if f.header is not None}
# The arrival record's columns the fields fill
COLUMN_FIELDS = tuple(f for f in SCHEMA if f.column is not None)

# A request's validated fields, in SCHEMA's order: each the core's value, or its
# default when not given (-1: "not given": the config's default target, no session).
RequestFields = namedtuple("RequestFields", FIELDS, defaults=[f.default for f in SCHEMA])
NONE = RequestFields()


def parse(values: Mapping[str, Any], now_unix: float | None = None,
          names: Mapping[str, str] | None = None) -> RequestFields:
    """Validates a mapping of field -> value. `now_unix` (default time.time()) is the
    time deadline_s is checked against; `names` maps fields to how the caller spelled
    them (for messages)."""
    names = names or {}

    def name(f):
        return names.get(f, f)

    unknown = sorted(set(values) - set(FIELDS), key=repr)   # keys may be any type offline
    if unknown:
        raise FieldError(f"unknown kvadmit field {name(unknown[0])!r}; known: {', '.join(FIELDS)}")
    now_unix = time.time() if now_unix is None else now_unix
    return NONE._replace(**{f.name: f.parse(values[f.name], name(f.name), now_unix)
                            for f in SCHEMA if f.name in values})


def record_columns(fields: RequestFields, ttft_target_s: float) -> dict:
    """The arrival record's columns of a request's fields (kvadmit.ArrivalRecord's
    keywords): each field's own column, with ``ttft_target_s`` (`ttft_target`: the
    deadline folded in) for ttft_slo_s."""
    out = {f.column: getattr(fields, f.name) for f in SCHEMA if f.column is not None}
    out["ttft_slo_s"] = ttft_target_s
    return out


def ttft_target(fields: RequestFields, default_ttft_s: float, now_unix: float | None = None) -> float:
    """The TTFT target to give the core: ttft_slo_s (or, not given, the config's
    default), tightened by deadline_s - now when a deadline is given (the tighter of
    the two). A deadline already passed is a target no request meets (0 would mean
    "none"): the SLO guard refuses it as slo_infeasible. -1: not given (the core
    applies its default)."""
    if fields.deadline_s is None:
        return fields.ttft_slo_s
    left = fields.deadline_s - (time.time() if now_unix is None else now_unix)
    left = max(left, PAST_DEADLINE_TTFT_S)
    base = fields.ttft_slo_s if fields.ttft_slo_s >= 0 else default_ttft_s
    return min(base, left) if base > 0 else left


def from_extra_args(extra_args: Mapping[str, Any] | None,
                    now_unix: float | None = None) -> RequestFields:
    """The kvadmit fields of vLLM's `SamplingParams.extra_args` (either shape, see the
    module docstring; both at once must not name a field twice). NONE without any."""
    if not extra_args:
        return NONE
    values: dict[str, Any] = {}
    names: dict[str, str] = {}
    nested = extra_args.get(KEY)
    if nested is not None:
        if not isinstance(nested, Mapping):
            raise FieldError(
                f"extra_args[{KEY!r}]={nested!r}: must be an object of kvadmit fields (through "
                f"the OpenAI API, whose vllm_xargs values cannot be objects, use flat keys "
                f"{', '.join(FLAT_PREFIX + f for f in FIELDS)})")
        for k, v in nested.items():
            values[k] = v
            names[k] = f"{KEY}.{k}"
    for f in FIELDS:
        k = FLAT_PREFIX + f
        if k in extra_args:
            if f in values:
                raise FieldError(f"kvadmit field {f!r} given twice ({names[f]} and {k})")
            values[f] = extra_args[k]
            names[f] = k
    if not values:
        return NONE
    return parse(values, now_unix, names)

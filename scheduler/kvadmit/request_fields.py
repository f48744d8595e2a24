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

Fields (all optional): `ttft_slo_s`, `tpot_slo_s`, `deadline_s` (absolute UNIX
time by which the first token is due; `ttft_target` turns it into a TTFT target
at arrival, the tighter of it and ttft_slo_s), `session` (an agent/session
id, integer or string) and `ttl_s` (seconds it may wait before it starts; past it,
it is dropped unserved as `expired`; 0: none; not given: the config's
max_queue_age_s), `flow` (its tenant or workload for the fair share of the
KV pool, integer or string; see docs/flows.md) and `sheddable` (true: best-effort
traffic, served after all other and dropped while other waits for KV; see
docs/capacity.md). A bad value raises `FieldError`
naming the field; the adapter refuses the request as `invalid`.
"""
from __future__ import annotations

import hashlib
import math
import time
from typing import Any, Mapping, NamedTuple

KEY = "kvadmit"
FLAT_PREFIX = "kvadmit_"
FIELDS = ("ttft_slo_s", "tpot_slo_s", "deadline_s", "session", "ttl_s", "flow", "sheddable")
MAX_TTFT_S = 86400.0          # as config default_ttft_slo_s
MAX_TTL_S = 86400.0           # as config max_queue_age_s
MAX_TPOT_S = 3600.0           # as config default_tpot_slo_s
MIN_DEADLINE_UNIX = 1e9       # 2001-09-09: anything smaller is not an absolute time
PAST_DEADLINE_TTFT_S = 1e-6   # a deadline already passed: a target no request meets
SESSION_INT_LIMIT = 1 << 62   # integer sessions: [0, 2**62); strings map into [2**62, 2**63)


class FieldError(ValueError):
    """A kvadmit request field (or a request's prompt, priority, max_tokens) is
    malformed; the message names it, `field` too where the caller needs it apart."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class RequestFields(NamedTuple):
    """A request's validated fields: -1 means "not given" (the config's default
    target; no session), as `AdmissionCore.arrive` takes them; deadline_s None: none."""
    ttft_slo_s: float = -1.0
    tpot_slo_s: float = -1.0
    session: int = -1
    deadline_s: float | None = None
    ttl_s: float = -1.0         # -1: the config's max_queue_age_s; 0: none
    flow: int = -1              # its flow for the fair share (-1: none)
    sheddable: bool = False     # best-effort traffic (docs/capacity.md)


NONE = RequestFields()


INT_LIMIT = 1 << 62          # a request's integers at most: the core's int64, negated by SGLang


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


def _seconds(value: Any, name: str, hi: float, zero: str = "no target") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise FieldError(f"kvadmit field {name}={value!r}: must be a number of seconds in "
                         f"[0, {hi:g}] (0: {zero})")
    if not 0 <= value <= hi:
        raise FieldError(f"kvadmit field {name}={value!r}: out of range [0, {hi:g}] (0: {zero})")
    return float(value)


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
    ttft = tpot = -1.0
    session = -1
    deadline = None
    if "ttft_slo_s" in values:
        ttft = _seconds(values["ttft_slo_s"], name("ttft_slo_s"), MAX_TTFT_S)
    if "tpot_slo_s" in values:
        tpot = _seconds(values["tpot_slo_s"], name("tpot_slo_s"), MAX_TPOT_S)
    if "deadline_s" in values:
        d = values["deadline_s"]
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d):
            raise FieldError(f"kvadmit field {name('deadline_s')}={d!r}: must be a UNIX time in "
                             f"seconds")
        if d < MIN_DEADLINE_UNIX:
            raise FieldError(f"kvadmit field {name('deadline_s')}={d!r}: must be an absolute UNIX "
                             f"time in seconds (a relative target is ttft_slo_s)")
        now_unix = time.time() if now_unix is None else now_unix
        if d - now_unix > MAX_TTFT_S:
            raise FieldError(f"kvadmit field {name('deadline_s')}={d!r}: more than {MAX_TTFT_S:g} s "
                             f"away (a UNIX time in seconds, not milliseconds?)")
        deadline = float(d)
    if "session" in values:
        session = session_int(values["session"], name("session"))
    ttl = _seconds(values["ttl_s"], name("ttl_s"), MAX_TTL_S, "none") if "ttl_s" in values else -1.0
    flow = flow_int(values["flow"], name("flow")) if "flow" in values else -1
    sheddable = flag(values["sheddable"], name("sheddable")) if "sheddable" in values else False
    return RequestFields(ttft, tpot, session, deadline, ttl, flow, sheddable)


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

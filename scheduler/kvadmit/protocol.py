"""How kvadmit refuses a request, defined once for every engine and patch.

A refusal has a reason (one of `REASONS`), a message naming the limit and the
numbers behind it, and a Retry-After hint in seconds when retrying can help.
The core decides all three (`kvadmit.Rejection`); this module says what each
engine shows the client, so vLLM and SGLang answer the same refusal the same way:

- HTTP status: the config's ``overload_status`` for a retryable refusal (overload:
  the queue, the backlog, the predicted wait or TTFT, shedding), 429 Too Many
  Requests by default, or 503 Service Unavailable (both engines give every
  `Refusal` the config's; one built without it has the config's default, 429,
  `DEFAULT_OVERLOAD_STATUS`), 400 Bad Request for
  a request this server can never take (context, KV pool, a prompt larger than
  ``max_queued_tokens``, more samples (n) than ``max_queued_requests``, an
  invalid request field). Retryability belongs to the
  refusal, not only to its reason: ``queued_tokens_full`` is retryable when the
  backlog is full, not when the prompt alone exceeds the cap.
- Every retryable refusal carries ``Retry-After: N`` (whole seconds, at least 1),
  and the same N as a number, ``retry_after_s``, beside the message in its JSON
  error body (for clients behind a router that drops the header); a non-retryable
  one carries neither.
- The client's message is ``kvadmit:<reason>: <message> (retry after N s)`` (or
  ``(retrying will not help)``), the same text in both engines.
- An adapter refuses by itself, without the core, with one reason of its own
  (`ADAPTER_REASONS`): ``failed_closed``, once kvadmit failed inside the engine
  under ``on_internal_error: closed``: always 503, no Retry-After, the message
  ending ``(retry on another instance)`` (docs/trust-and-failure.md).

vLLM's engine core cannot raise to the client: it finishes a refused request with
``stop_reason = "kvadmit:<reason>"`` and the refusal in the output's
``kv_transfer_params`` (`Refusal.to_params`), and the API-server patch
(kvadmit_patches/vllm_http_status.py) rebuilds it there (`Refusal.from_output`).

No engine import (only the core's list of reasons): the patches and both adapters
import it.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Mapping, Optional

from kvadmit._arrival_gate import REJECT_REASONS
from kvadmit.config import AdmissionConfig

# A refused vLLM output's stop_reason, and the start of every client message.
PREFIX = "kvadmit:"
# Keys of a refused vLLM output's kv_transfer_params (the one free-form field of an
# engine output that reaches the API server).
RETRY_AFTER_KEY = "kvadmit_retry_after_s"   # the hint in seconds; present iff retryable
STATUS_KEY = "kvadmit_status"               # a retryable refusal's status (429 or 503)
DETAIL_KEY = "kvadmit_detail"               # the refusal's message (limit and numbers)

# In a vLLM sample's SamplingParams.extra_args: "<n>/<parent request id>", set by the
# API-server patch when vLLM fans a parallel-sampling request (n > 1) out into n
# engine requests "<i>_<parent request id>" (each says n = 1 itself).
SAMPLES_KEY = "kvadmit_samples"

# What kvadmit_held_total / kvadmit:held_total count, in both engines
# (AdmissionCore.next_admissible counts a hold once per request and step).
HELD_HELP = ("Steps a waiting request spent at the head of the queue unable to start, "
             "by reason: a request held for k engine steps counts k, however often the "
             "engine looked within a step")

# The agent window's counts (AgentWindow.stats()), in both engines: sessions taken out
# of the window, by why, and sessions let in over a full one after agent_max_wait_s.
AGENT_EXITS_HELP = ("Agent sessions taken out of the agent window, by why: paused (over W, "
                    "between generations), expired (idle agent_idle_s, or 4 mean return "
                    "gaps while another waits)")
AGENT_OVERDUE_HELP = ("Agent sessions let into a full agent window after waiting "
                      "agent_max_wait_s or half their own TTFT target")

# The statuses a retryable refusal may have (AdmissionConfig.overload_status), and the
# one it has when nothing says otherwise: the config's default (429), defined there once.
OVERLOAD_STATUSES = (HTTPStatus.SERVICE_UNAVAILABLE, HTTPStatus.TOO_MANY_REQUESTS)
DEFAULT_OVERLOAD_STATUS = HTTPStatus(AdmissionConfig().overload_status)
FINAL_STATUS = HTTPStatus.BAD_REQUEST


@dataclass(frozen=True)
class ReasonInfo:
    """One refusal reason: whether it is retryable (True: always, False: never,
    None: it depends on the refusal) and the message a client sees when the engine
    did not say more; an adapter's own reason (`ADAPTER_REASONS`) also has a fixed
    ``status`` and its own ``tail`` in place of the retry hint."""
    retryable: Optional[bool]
    message: str
    status: Optional[int] = None
    tail: Optional[str] = None


# What a client is told for each reason. The reasons themselves are the core's
# (kvadmit._arrival_gate.REJECT_REASONS, their one list): REASONS has exactly those, in
# the core's order, and this module does not import if a reason lacks its entry here.
_INFO: dict[str, ReasonInfo] = {
    "queue_full": ReasonInfo(None, "the engine's waiting queue is full, or the request's samples "
                                   "exceed it (kvadmit max_queued_requests)"),
    "queued_tokens_full": ReasonInfo(
        None, "the engine's prefill backlog is full, or the prompt alone exceeds it "
              "(kvadmit max_queued_tokens)"),
    "queue_delay": ReasonInfo(True, "the predicted wait in the engine's queue exceeds kvadmit "
                                    "max_queue_delay_s (the config's, or the request's own)"),
    "shed": ReasonInfo(True, "the request was shed from a full queue for a higher-priority request"),
    "slo_infeasible": ReasonInfo(True, "the predicted time to first token exceeds the request's "
                                       "TTFT target (ttft_slo_s / deadline_s, or the server's default)"),
    "context_length": ReasonInfo(False, "prompt tokens + max_tokens exceed the model's context length"),
    "kv_capacity": ReasonInfo(False, "the request needs more KV cache than this server's whole pool holds"),
    "invalid": ReasonInfo(False, "the request's token counts or kvadmit fields are invalid"),
    "expired": ReasonInfo(False, "the request waited past its TTL without starting (kvadmit ttl_s "
                                 "or max_queue_age_s): dropped before prefill"),
}
if set(_INFO) != set(REJECT_REASONS):
    raise ImportError(f"kvadmit.protocol: refusal reasons {sorted(set(_INFO) ^ set(REJECT_REASONS))} "
                      f"are not both the core's (kvadmit._arrival_gate.REJECT_REASONS) and "
                      f"described here")
# Every reason the core refuses with: its REJECT_REASONS, none other, in its order.
REASONS: dict[str, ReasonInfo] = {reason: _INFO[reason] for reason in REJECT_REASONS}

# The reasons an engine adapter refuses with by itself, without the core (not the
# core's: its stats and counters do not know them). failed_closed: kvadmit's own code
# raised inside the engine and the config says on_internal_error: closed. Always 503
# (whatever overload_status says: the instance is out of service, not rate-limiting this
# client; 503 is what takes it out of a router's rotation) and no Retry-After: this
# instance will not serve before a restart, of which nobody knows the time.
# untrusted_field: a field that would raise the request's claim, from a client that
# is not a trusted source, under untrusted_fields: refuse (kvadmit.trust): 400.
FAILED_CLOSED = "failed_closed"
UNTRUSTED_FIELD = "untrusted_field"
ADAPTER_REASONS: dict[str, ReasonInfo] = {
    FAILED_CLOSED: ReasonInfo(
        False, "kvadmit failed inside this engine and, configured with on_internal_error: "
               "closed, admits no request until the engine is restarted",
        status=HTTPStatus.SERVICE_UNAVAILABLE, tail="(retry on another instance)"),
    UNTRUSTED_FIELD: ReasonInfo(
        False, "a field would raise this request's claim on capacity, and it does not come "
               "from a trusted source", status=HTTPStatus.BAD_REQUEST,
        tail="(retrying will not help)"),
}
if set(ADAPTER_REASONS) & set(REASONS):
    raise ImportError("kvadmit.protocol: an adapter's reason is also the core's")


def failed_closed() -> "Refusal":
    """The refusal of every held and every new request once kvadmit failed closed."""
    return Refusal(FAILED_CLOSED, ADAPTER_REASONS[FAILED_CLOSED].message)

RETRY_TAIL = "(retry after {} s)"
FINAL_TAIL = "(retrying will not help)"
# What patches/vllm_retry_after.py finds in a retryable refusal's body (429 or 503) to
# set the Retry-After header.
RETRY_HINT_RE = re.compile(rb"kvadmit:[a-z_]+:[^\"]*?\(retry after (\d+) s\)")
# The hint as a number in a refusal's JSON body, beside the message (vLLM: in the
# "error" object; SGLang: its flat error body): the Retry-After value, for a client
# behind a router that forwards the body but drops the header.
RETRY_AFTER_FIELD = "retry_after_s"


def body_with_retry_after(body: bytes, seconds: int) -> Optional[bytes]:
    """A refusal's JSON error body with `RETRY_AFTER_FIELD` beside its message (the
    message and every other field unchanged), or None when the body is not such an
    error object or already has the field."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    error = data.get("error") if isinstance(data.get("error"), dict) else data
    if not str(error.get("message", "")).startswith(PREFIX) or RETRY_AFTER_FIELD in error:
        return None
    error[RETRY_AFTER_FIELD] = int(seconds)
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def retry_after_header(seconds: Optional[float]) -> Optional[int]:
    """A hint in seconds as a Retry-After value: whole seconds, at least 1 (None: none)."""
    if seconds is None:
        return None
    return max(1, math.ceil(float(seconds)))


@dataclass(frozen=True)
class Refusal:
    """What a client is told about a refused request."""
    reason: str
    message: str
    retry_after_s: Optional[float] = None   # None: retrying cannot help
    # The status when retryable (OVERLOAD_STATUSES): the config's overload_status,
    # its default (DEFAULT_OVERLOAD_STATUS, 429) when not given.
    overload_status: int = DEFAULT_OVERLOAD_STATUS

    def __post_init__(self):
        if self.overload_status not in OVERLOAD_STATUSES:
            raise ValueError(f"overload_status={self.overload_status!r}: must be one of "
                             f"{', '.join(str(int(s)) for s in OVERLOAD_STATUSES)}")

    @classmethod
    def of(cls, rejection, overload_status: int = DEFAULT_OVERLOAD_STATUS) -> "Refusal":
        """From the core's `kvadmit.Rejection` (or anything with its three fields)."""
        return cls(rejection.reason, rejection.message, rejection.retry_after_s,
                   overload_status)

    @property
    def retryable(self) -> bool:
        return self.retry_after_s is not None

    @property
    def status(self) -> HTTPStatus:
        fixed = ADAPTER_REASONS.get(self.reason)
        if fixed is not None:
            return HTTPStatus(fixed.status)
        return HTTPStatus(self.overload_status) if self.retryable else FINAL_STATUS

    @property
    def retry_after(self) -> Optional[int]:
        """The Retry-After header's value (None: no header)."""
        return retry_after_header(self.retry_after_s)

    @property
    def stop_reason(self) -> str:
        return PREFIX + self.reason

    def client_message(self) -> str:
        """The one text both engines send: reason, the limit and numbers, retry hint."""
        fixed = ADAPTER_REASONS.get(self.reason)
        if fixed is not None:
            tail = fixed.tail
        else:
            tail = RETRY_TAIL.format(self.retry_after) if self.retryable else FINAL_TAIL
        return f"{PREFIX}{self.reason}: {self.message} {tail}"

    def log_line(self, request_id: Any) -> str:
        return f"kvadmit refused {request_id}: {self.client_message()}"

    # -- vLLM: engine core -> API server -------------------------------------
    def to_params(self) -> dict:
        """The refusal as a vLLM output's kv_transfer_params: a retryable one
        always names its status (no default to agree on across the trip)."""
        params = {DETAIL_KEY: self.message}
        if self.retry_after_s is not None:
            params[RETRY_AFTER_KEY] = float(self.retry_after_s)
            params[STATUS_KEY] = int(self.overload_status)
        return params

    @classmethod
    def from_output(cls, stop_reason: Any, params: Optional[Mapping]) -> Optional["Refusal"]:
        """The refusal a vLLM completion carries (stop_reason "kvadmit:<reason>" and
        its kv_transfer_params), or None when it is not a kvadmit refusal."""
        if not isinstance(stop_reason, str) or not stop_reason.startswith(PREFIX):
            return None
        reason = stop_reason[len(PREFIX):]
        params = params if isinstance(params, Mapping) else {}
        info = REASONS.get(reason) or ADAPTER_REASONS.get(reason)
        message = params.get(DETAIL_KEY) or (info.message if info else "refused by kvadmit")
        retry = params.get(RETRY_AFTER_KEY)
        status = params.get(STATUS_KEY, DEFAULT_OVERLOAD_STATUS)
        if status not in OVERLOAD_STATUSES:
            status = DEFAULT_OVERLOAD_STATUS
        return cls(reason, str(message), None if retry is None else float(retry), status)


def samples_marker(n: int, parent_id: str) -> dict:
    """The extra_args entry that tells the engine a request is one of n samples."""
    return {SAMPLES_KEY: f"{int(n)}/{parent_id}"}


def sample_group(request_id: str, extra_args: Optional[Mapping]) -> Optional[tuple[str, int]]:
    """(parent id, n) when this engine request is one of n > 1 samples of one client
    request, else None. The id must be the sample's own ("<i>_<parent>", i < n), so a
    client cannot group requests by sending the key itself."""
    value = extra_args.get(SAMPLES_KEY) if isinstance(extra_args, Mapping) else None
    if not isinstance(value, str) or "/" not in value:
        return None
    n_text, parent = value.split("/", 1)
    index, sep, rest = request_id.partition("_")
    if not (n_text.isdigit() and index.isdigit() and sep and rest == parent):
        return None
    n = int(n_text)
    return (parent, n) if n > 1 and int(index) < n else None

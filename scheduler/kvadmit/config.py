"""AdmissionConfig: the settings every engine flag and the simulator take.

Each field carries its rule and its documentation in one place (the field's
metadata); validation, the error messages and the key table in docs/configuration.md are
all derived from it.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvadmit._native import POLICIES, VICTIMS
from kvadmit.flow_settings import (MAX_FLOW_WEIGHT, check_addresses, check_flows,
                                   describe_flow_keys)

QUEUE_ORDERS = ("fcfs", "priority", "deadline")
HEAD_OF_LINE = ("auto", "strict", "bypass")
SHORTFALLS = ("auto", "preempt", "pause", "cost")
FAILURE_MODES = ("open", "closed")
UNTRUSTED_FIELDS = ("auto", "honour", "ignore", "refuse")


class ConfigError(ValueError):
    """A kvadmit setting is unknown or out of range; the message names it."""


def choice_rule(options: tuple[str, ...], doc: str) -> dict:
    return {"kind": "choice", "options": options, "doc": doc}


def int_rule(lo: int, hi: int, doc: str) -> dict:
    return {"kind": "int", "lo": lo, "hi": hi, "doc": doc}


def float_rule(lo: float, hi: float, doc: str, lo_open: bool = False) -> dict:
    return {"kind": "float", "lo": lo, "hi": hi, "lo_open": lo_open, "doc": doc}


def bool_rule(doc: str) -> dict:
    return {"kind": "bool", "doc": doc}


def flows_rule(doc: str) -> dict:
    return {"kind": "flows", "doc": doc}


def addresses_rule(doc: str) -> dict:
    return {"kind": "addresses", "doc": doc}


@dataclass(frozen=True)
class AdmissionConfig:
    """Validated kvadmit settings. Build with `from_dict` / `from_json`."""

    policy: str = field(default="auto", metadata=choice_rule(
        POLICIES, "admission rule (see the policy table)"))
    victim: str = field(default="lifo", metadata=choice_rule(
        VICTIMS, "which running request is preempted first when memory runs out"))
    shortfall: str = field(default="auto", metadata=choice_rule(
        SHORTFALLS, "a running request that finds no free KV block for its next step: preempt the "
        "victim (recompute, as vLLM and SGLang do), or pause it, keeping its KV, while another can "
        "progress (vLLM, simulator, lockstep model); cost: whichever loses less (the cost model); "
        "auto: pause under policy auto where the engine can, else preempt"))
    queue_order: str = field(default="fcfs", metadata=choice_rule(
        QUEUE_ORDERS, "waiting order: arrival; priority (lower value first) then arrival; or "
        "deadline (arrival + TTFT target, earliest first)"))
    head_of_line: str = field(default="auto", metadata=choice_rule(
        HEAD_OF_LINE, "strict: stop at the first held request; bypass: later ones may pass it "
        "(not one that has waited max_queue_delay_s); auto: bypass under policy auto, not past "
        "twice the mean queue wait of recent admissions (docs/policies.md), else strict"))
    max_bypass: int = field(default=4, metadata=int_rule(
        0, 1_000_000, "bypass: how often a held request may be passed before it blocks the queue"))
    bypass_lookahead: int = field(default=32, metadata=int_rule(
        1, 1_000_000, "bypass: how many requests behind a held head are examined"))
    max_queued_requests: int = field(default=0, metadata=int_rule(
        0, 1_000_000_000, "refuse arrivals beyond this many waiting requests (0: no cap)"))
    max_queued_tokens: int = field(default=0, metadata=int_rule(
        0, 10**15, "refuse arrivals beyond this many prompt tokens waiting for prefill (0: no cap)"))
    max_queue_delay_s: float = field(default=0.0, metadata=float_rule(
        0.0, 86400.0, "refuse arrivals whose predicted queueing delay (requests and prompt tokens "
        "waiting, at the admission rate of the last drain_window_s) exceeds this; a request that has "
        "waited this long is passed by none (instead of auto's learned bound; 0: no cap; TTFT target: half)"))
    max_queue_age_s: float = field(default=0.0, metadata=float_rule(
        0.0, 86400.0, "a waiting request that has not started this long after it arrived is "
        "dropped unserved, before any prefill (reason expired); a request's own ttl_s overrides "
        "it (0: none)"))
    flows: dict = field(default_factory=dict, metadata=flows_rule(
        "per-flow settings, by flow id (a string as the x-gateway-inference-fairness-id header "
        "or the flow field gives it; digits: that integer): {\"<flow>\": {\"weight\": w, "
        "\"max_queued_requests\": n, \"max_queued_tokens\": t, \"api_keys\": [\"sha256:<hex>\"], "
        "\"min_priority\": p}}, each key optional; flows of the same priority share the KV pool by "
        "weight (block-steps), and a flow's caps refuse its arrivals beyond them (0: no cap); a "
        "request with one of its API keys (the engine's --api-key) is the flow's, at priority "
        "min_priority or less important. See docs/flows.md and docs/trust-and-failure.md"))
    flow_default_weight: float = field(default=1.0, metadata=float_rule(
        0.0, MAX_FLOW_WEIGHT, "weight of a flow not in flows (and of requests without a flow, "
        "as one flow)", lo_open=True))
    shed_lower_priority: bool = field(default=False, metadata=bool_rule(
        "when a cap is hit, evict strictly lower-priority waiting requests instead of refusing"))
    priority_preemption_threshold: int = field(default=0, metadata=int_rule(
        0, (1 << 63) - 1, "queue_order priority: a waiting request takes KV (priority retraction) only "
        "from running requests whose priority value is larger than its own by more than this "
        "(0: any strictly lower priority; SGLang's adapter sets SGLang's "
        "--priority-scheduling-preemption-threshold)"))
    prefill_chunk_tokens: int = field(default=0, metadata=int_rule(
        0, 1_000_000_000, "engine's prefill chunk; extends the KV curves by the prefill steps (0: one step)"))
    predict_init_ratio: float = field(default=0.7, metadata=float_rule(
        0.0, 1.0, "predict: SGLang's initial new_token_ratio", lo_open=True))
    predict_min_ratio_factor: float = field(default=0.14, metadata=float_rule(
        0.0, 1.0, "predict: floor of the ratio, as a fraction of the initial ratio"))
    predict_decay_steps: int = field(default=600, metadata=int_rule(
        1, 1_000_000_000, "predict: steps for the ratio to decay from initial to floor"))
    predict_clip_tokens: int = field(default=4096, metadata=int_rule(
        1, 1_000_000_000, "predict: max_new tokens counted per request at most"))
    predict_retract_steps: int = field(default=20, metadata=int_rule(
        0, 1_000_000, "predict: decode steps per kept request in the post-preemption ratio"))
    adaptive_quantile: float = field(default=0.7, metadata=float_rule(
        0.0, 1.0, "adaptive: quantile of the output-length model used for remaining lengths",
        lo_open=True))
    adaptive_max_quantile: float = field(default=0.999, metadata=float_rule(
        0.0, 1.0, "adaptive: ceiling for the automatically raised quantile", lo_open=True))
    adaptive_target_preemption_rate: float = field(default=0.01, metadata=float_rule(
        0.0, 1.0, "adaptive: preemptions per admission above which the quantile is raised"))
    adaptive_interval: int = field(default=64, metadata=int_rule(
        1, 1_000_000_000, "adaptive: admissions per quantile adjustment window"))
    adaptive_window: int = field(default=4096, metadata=int_rule(
        1, 10_000_000, "adaptive: finished requests the length model remembers"))
    adaptive_min_samples: int = field(default=8, metadata=int_rule(
        1, 10_000_000, "adaptive: lengths needed before predictions replace max_new"))
    adaptive_bucket_tokens: int = field(default=16, metadata=int_rule(
        1, 1_000_000, "adaptive: histogram bucket width of the length model (tokens)"))
    overload_status: int = field(default=429, metadata=choice_rule(
        (429, 503), "HTTP status of a refusal retrying can help (overload), with Retry-After: "
        "429 Too Many Requests by default, since vllm-router and SMG count a 5xx, not a 429, "
        "against a worker's circuit breaker; 503 Service Unavailable behind HAProxy "
        "(`retry-on 503`, which cannot name 429; see docs/router.md); a request the server "
        "can never take is 400 either way"))
    retry_after_default_s: float = field(default=1.0, metadata=float_rule(
        0.0, 86400.0, "Retry-After hint when no drain rate has been observed yet"))
    retry_after_max_s: float = field(default=300.0, metadata=float_rule(
        0.0, 86400.0, "ceiling of the Retry-After hint"))
    drain_window_s: float = field(default=30.0, metadata=float_rule(
        0.0, 86400.0, "window over which the queue's drain rate is measured", lo_open=True))
    slo_guard: bool = field(default=False, metadata=bool_rule(
        "refuse arrivals whose predicted TTFT misses their target (slo_infeasible) and hold "
        "admissions that would push a running request's step time past its TPOT target"))
    default_ttft_slo_s: float = field(default=0.0, metadata=float_rule(
        0.0, 86400.0, "TTFT target of requests that carry none (0: none)"))
    default_tpot_slo_s: float = field(default=0.0, metadata=float_rule(
        0.0, 3600.0, "TPOT target of requests that carry none (0: none)"))
    step_time_a: float = field(default=0.008, metadata=float_rule(
        0.0, 10.0, "initial step-time model: seconds a step (refined online from observed steps)"))
    step_time_b: float = field(default=3.25e-5, metadata=float_rule(
        0.0, 1.0, "initial step-time model: seconds per scheduled token"))
    step_time_c: float = field(default=4.9e-8, metadata=float_rule(
        0.0, 1.0, "initial step-time model: seconds per context token of the batch"))
    step_time_forgetting: float = field(default=0.995, metadata=float_rule(
        0.5, 1.0, "forgetting factor of the online (RLS) step-time fit"))
    agent_window: bool = field(default=False, metadata=bool_rule(
        "admit requests of at most W active sessions (agents); W follows KV usage and prefix "
        "hits (AIMD)"))
    agent_window_init: float = field(default=8.0, metadata=float_rule(
        1.0, 1e9, "agent window: initial W"))
    agent_window_min: float = field(default=1.0, metadata=float_rule(1.0, 1e9, "agent window: floor of W"))
    agent_window_max: float = field(default=4096.0, metadata=float_rule(
        1.0, 1e9, "agent window: ceiling of W"))
    agent_alpha: float = field(default=2.0, metadata=float_rule(
        0.0, 1e6, "agent window: additive increase while KV usage < agent_usage_low"))
    agent_beta: float = field(default=0.5, metadata=float_rule(
        0.0, 1.0, "agent window: multiplicative decrease when usage > agent_usage_high and hits "
        "< agent_hit_threshold", lo_open=True))
    agent_usage_low: float = field(default=0.2, metadata=float_rule(0.0, 1.0, "agent window: U_low"))
    agent_usage_high: float = field(default=0.5, metadata=float_rule(0.0, 1.0, "agent window: U_high"))
    agent_hit_threshold: float = field(default=0.2, metadata=float_rule(
        0.0, 1.0, "agent window: H_thresh (prefix hit rate)"))
    agent_interval_s: float = field(default=0.5, metadata=float_rule(
        0.0, 3600.0, "agent window: engine seconds per AIMD update (signals are averaged over its "
        "steps; 0: every step)"))
    agent_cooldown_intervals: int = field(default=2, metadata=int_rule(
        0, 1_000_000, "agent window: intervals after a decrease during which W does not grow"))
    agent_idle_s: float = field(default=60.0, metadata=float_rule(
        0.0, 86400.0, "agent window: a session with nothing queued or running this long leaves it "
        "(while another is held: at most 4 mean return gaps, once 8 are seen)"))
    agent_max_wait_s: float = field(default=10.0, metadata=float_rule(
        0.0, 86400.0, "agent window: a session held outside it this long enters over a full window "
        "and W grows to take it, up to agent_window_max (0: no bound); a session with its own TTFT "
        "target is held at most half of it"))
    on_internal_error: str = field(default="open", metadata=choice_rule(
        FAILURE_MODES, "when kvadmit's own code raises inside the engine: open (hand every held "
        "request to the engine's own scheduling and pass everything through from then on) or "
        "closed (refuse every held and every new request with a named 503 until restart; running "
        "requests finish). See docs/trust-and-failure.md"))
    untrusted_fields: str = field(default="auto", metadata=choice_rule(
        UNTRUSTED_FIELDS, "a request field that raises its claim (flow, session, a priority above "
        "the default, a tighter SLO or deadline, a longer TTL) from a client that is not a trusted "
        "source: honour it, ignore it (counted per field), or refuse the request with 400; auto: "
        "honour until flows, a priority or deadline queue_order, or a trusted source is "
        "configured, then ignore. See docs/trust-and-failure.md"))
    trusted_proxies: list = field(default_factory=list, metadata=addresses_rule(
        "addresses (IP or CIDR) of the gateways or proxies whose requests may raise their claim "
        "(the HTTP connection's own peer address, never one a header such as X-Forwarded-For "
        "claims); the other trusted source is a gateway "
        "carrying the shared secret of KVADMIT_GATEWAY_SECRET in x-kvadmit-gateway-secret"))

    def __post_init__(self) -> None:
        check_fields(self)
        if self.policy == "auto":
            self._check_fixed_under_auto()
        if self.adaptive_max_quantile < self.adaptive_quantile:
            raise ConfigError(
                f"kvadmit config: adaptive_max_quantile={self.adaptive_max_quantile} must be >= "
                f"adaptive_quantile={self.adaptive_quantile}")
        if self.agent_usage_low >= self.agent_usage_high:
            raise ConfigError(
                f"kvadmit config: agent_usage_low={self.agent_usage_low} must be < "
                f"agent_usage_high={self.agent_usage_high}")
        if self.agent_window_min > self.agent_window_max:
            raise ConfigError(
                f"kvadmit config: agent_window_min={self.agent_window_min} must be <= "
                f"agent_window_max={self.agent_window_max}")
        if self.retry_after_max_s < self.retry_after_default_s:
            raise ConfigError(
                f"kvadmit config: retry_after_max_s={self.retry_after_max_s} must be >= "
                f"retry_after_default_s={self.retry_after_default_s}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "AdmissionConfig":
        """Builds a config from a mapping of keys to values; unknown keys are errors."""
        if values is None:
            return cls()
        if not isinstance(values, Mapping):
            raise ConfigError(
                f"kvadmit config must be a JSON object / dict, got {type(values).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known), key=repr)
        if unknown:
            key = unknown[0]
            if key in _ADAPTER_KEYS:       # an engine adapter's own key (register_adapter_keys)
                raise ConfigError(f"kvadmit config: {key!r} {_ADAPTER_KEYS[key]}")
            if key in _REPLACED_KEYS:
                raise ConfigError(f"kvadmit config: {key!r} was replaced: {_REPLACED_KEYS[key]}")
            if key == SECTION:
                hint = (f"this is already kvadmit's object: give its keys without the "
                        f"{SECTION!r} wrapper")
            else:
                hint = _did_you_mean(str(key), known) or "see `kvadmit config` for the keys"
            raise ConfigError(f"kvadmit config: unknown key {key!r}; {hint}")
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> "AdmissionConfig":
        """Builds a config from a JSON object; `null` or any other JSON value is an
        error (it would otherwise mean "defaults", i.e. no caps, by accident)."""
        return cls.from_dict(json_object(text))

    def _check_fixed_under_auto(self) -> None:
        """auto's length model and bypass limits are fixed (one setting for every
        workload): a key that would tune them is an error, not silently ignored."""
        fixed = ["adaptive_quantile", "adaptive_max_quantile", "adaptive_target_preemption_rate",
                 "adaptive_interval", "adaptive_min_samples"]
        if self.head_of_line == "auto":
            fixed += ["max_bypass", "bypass_lookahead"]
        for f in dataclasses.fields(self):
            if f.name in fixed and getattr(self, f.name) != f.default:
                hint = ("set head_of_line: \"bypass\" to choose the bypass limits"
                        if f.name in ("max_bypass", "bypass_lookahead")
                        else "use policy \"adaptive\" to tune the length model")
                raise ConfigError(f"kvadmit config: {f.name}={getattr(self, f.name)!r} has no effect "
                                  f"under policy 'auto' (its settings are fixed); {hint}")

    @property
    def pause_on_shortfall(self) -> bool:
        """Whether a running request short of blocks pauses (shortfall, with "auto" resolved)."""
        return self.shortfall in ("pause", "cost") or (self.shortfall == "auto" and self.policy == "auto")

    def for_engine(self, cannot_pause: str | None) -> "AdmissionConfig":
        """The configuration on an engine that can pause a running request
        (`cannot_pause` None) or cannot (it says why): there shortfall "auto" is
        "preempt", and "pause" or "cost" a ConfigError. The one place "auto" is resolved."""
        if cannot_pause is None or self.shortfall == "preempt":
            return self
        if self.shortfall in ("pause", "cost"):
            raise ConfigError(f"shortfall={self.shortfall!r}: {cannot_pause}; use shortfall='preempt'")
        return self.replace(shortfall="preempt")

    @property
    def bypass_head_of_line(self) -> bool:
        """Whether later requests may pass a held head (head_of_line, "auto" resolved)."""
        return self.head_of_line == "bypass" or (self.head_of_line == "auto" and self.policy == "auto")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __hash__(self) -> int:       # `flows` is a dict: hash it as sorted items
        return hash(tuple((f.name, json.dumps(getattr(self, f.name), sort_keys=True))
                          for f in dataclasses.fields(self)))

    def replace(self, **changes: Any) -> "AdmissionConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def markdown_table(cls) -> str:
        """The key table of docs/configuration.md: key, default, allowed values, meaning."""
        return key_table(cls)


def json_object(text: str) -> dict:
    """kvadmit's settings given as JSON text: an object, else a ConfigError."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"kvadmit config is not valid JSON: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"kvadmit config must be a JSON object of kvadmit's keys, got "
                          f"{json.dumps(values)[:80]}")
    return values


def check_fields(settings) -> None:
    """Each field of a settings dataclass against its metadata rule (ConfigError naming it)."""
    for f in dataclasses.fields(settings):
        _check(f, getattr(settings, f.name))


def key_table(cls) -> str:
    """A settings dataclass's keys as a Markdown table: key, default, allowed values, meaning."""
    rows = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append(f"| `{f.name}` | `{json.dumps(default)}` | {_allowed(f.metadata)} | "
                    f"{f.metadata['doc']} |")
    return "\n".join(rows)


SECTION = "kvadmit"    # kvadmit's key in an engine's shared plug-in settings

# Keys an engine adapter reads itself from the same "kvadmit" object (its own settings,
# the vLLM adapter's settings module), each with why the core's config refuses it. The adapters
# register them (register_adapter_keys); this module knows none of them. The package's
# __init__ imports every adapter's settings module, so each engine names them.
_REPLACED_KEYS = {  # keys of earlier releases, with what took their place
    "agent_interval_steps": "use agent_interval_s, seconds of engine time per update (0: every step)"}
_ADAPTER_KEYS: dict[str, str] = {}


def register_adapter_keys(keys, why: str) -> None:
    """Keys an engine adapter takes from kvadmit's object itself: AdmissionConfig.from_dict
    refuses each with "kvadmit config: '<key>' <why>" (not "unknown key"). A key of the
    core's config cannot be an adapter's."""
    core = {f.name for f in dataclasses.fields(AdmissionConfig)}
    for key in keys:
        if key in core:
            raise ValueError(f"{key!r} is a key of the core's AdmissionConfig, not an adapter's")
        _ADAPTER_KEYS[key] = why


def _did_you_mean(name: str, options) -> str | None:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else None


def _normalized(key: str) -> str:
    return key.lower().replace("_", "").replace("-", "").replace(" ", "")


def looks_like_section(key: Any) -> bool:
    """Whether a settings key other than "kvadmit" is a misspelling of it ("kvadmitt",
    "KVAdmit", "kv_admit", "kvadmit_config"), which would leave kvadmit on defaults."""
    if not isinstance(key, str) or key == SECTION:
        return False
    n = _normalized(key)
    ratio = difflib.SequenceMatcher(None, n, SECTION).ratio()
    return n.startswith(SECTION) or ratio >= 0.85 or (n.startswith("kv") and ratio >= 0.75)


def section_from(settings: Any, where: str) -> Mapping[str, Any] | str:
    """kvadmit's object in an engine's shared plug-in settings (vLLM's
    `--additional-config`, named `where` in messages): {} when absent (defaults).
    A key that looks like a misspelt "kvadmit", or a "kvadmit" that is null or not an
    object (or JSON text of one), is a ConfigError: either would run without caps."""
    if settings is None:
        return {}
    if not isinstance(settings, Mapping):
        raise ConfigError(f"{where} must be a JSON object, got {type(settings).__name__}")
    for key in settings:
        if looks_like_section(key):
            raise ConfigError(f"{where}: unknown key {key!r}; did you mean {SECTION!r}? "
                              f"(kvadmit would run on its defaults, without caps)")
    if SECTION not in settings:
        return {}
    raw = settings[SECTION]
    if not isinstance(raw, (Mapping, str)):
        raise ConfigError(f"{where}: {SECTION!r} must be an object of kvadmit's keys, got "
                          f"{json.dumps(raw) if raw is None else type(raw).__name__}")
    return raw


def _allowed(rule: Mapping[str, Any]) -> str:
    kind = rule["kind"]
    if kind == "choice":
        return " \\| ".join(f"`{o}`" for o in rule["options"])
    if kind == "bool":
        return "`true` \\| `false`"
    if kind == "addresses":
        return "list of IP addresses or CIDR networks"
    if kind == "flows":
        return describe_flow_keys()
    left = "(" if rule.get("lo_open") else "["
    return f"{left}{rule['lo']}, {rule['hi']}]"


def _check(f: dataclasses.Field, value: Any) -> None:
    rule = f.metadata
    kind = rule["kind"]
    where = f"kvadmit config: {f.name}={value!r}"
    if kind == "choice":
        # bool is an int in Python: true must not pass for a numeric option
        if isinstance(value, bool) or value not in rule["options"]:
            raise ConfigError(f"{where}: must be one of {', '.join(map(str, rule['options']))}")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: must be true or false")
    elif kind in ("flows", "addresses"):
        try:
            (check_flows if kind == "flows" else check_addresses)(f.name, value)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: must be an integer in [{rule['lo']}, {rule['hi']}]")
        if not rule["lo"] <= value <= rule["hi"]:
            raise ConfigError(f"{where}: out of range [{rule['lo']}, {rule['hi']}]")
    elif kind == "float":
        lo, hi = rule["lo"], rule["hi"]
        span = f"{'(' if rule['lo_open'] else '['}{lo}, {hi}]"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{where}: must be a number in {span}")
        if value > hi or value < lo or (rule["lo_open"] and value == lo):
            raise ConfigError(f"{where}: out of range {span}")

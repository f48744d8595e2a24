"""The `flows` config object and `trusted_proxies`: their rules, and the API keys bound
to flows.

A flow's settings: its share of the KV pool (`weight`), its caps, and the API keys of
the engine's own `--api-key` that authenticate its tenant (`api_keys`, as
"sha256:<hex digest of the key>": vLLM logs its config, so the key itself never
goes in it) with the most important priority those keys may ask for
(`min_priority`, vLLM's scale: lower is more important; 0, the default, allows none
above the default). A request that presents one of a flow's keys is that flow's,
whatever its headers or body claim (kvadmit.trust.Trust.bound).

The checks raise ValueError with the whole message; kvadmit.config turns it into its
ConfigError.
"""
from __future__ import annotations

import hashlib
import ipaddress
import math
import re
from typing import Any, Mapping, NamedTuple

MAX_FLOW_WEIGHT = 1e6
MAX_PRIORITY = 1 << 31
# A flow's numeric settings: each key's kind and (lo, hi).
FLOW_KEYS = {"weight": ("float", 0.0, MAX_FLOW_WEIGHT),
             "max_queued_requests": ("int", 0, 1_000_000_000),
             "max_queued_tokens": ("int", 0, 10**15),
             "min_priority": ("int", -MAX_PRIORITY, 0)}
API_KEYS = "api_keys"
KEY_HASH = re.compile(r"sha256:[0-9a-f]{64}\Z")


class KeyBinding(NamedTuple):
    """What an API key binds its requests to."""
    flow: str
    min_priority: int


def key_digest(key: str) -> str:
    """"sha256:<hex>" of an API key, as `api_keys` lists it (the key as vLLM reads it
    from the Authorization header, UTF-8)."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_bindings(flows: Mapping[str, Any]) -> dict[str, KeyBinding]:
    """"sha256:<hex>" -> the flow (and its min_priority) each listed API key binds to."""
    return {h: KeyBinding(flow, spec.get("min_priority", 0))
            for flow, spec in flows.items() for h in spec.get(API_KEYS, ())}


def describe_flow_keys() -> str:
    """The allowed values of `flows`, for the key table."""
    return "object: flow -> {" + ", ".join(
        f"`{k}`: {'(' if k == 'weight' else '['}{lo}, {hi}]"
        for k, (_, lo, hi) in FLOW_KEYS.items()) + f", `{API_KEYS}`: [\"sha256:<hex>\", ...]}}"


def check_flows(name: str, value: Any) -> None:
    """The `flows` object: flow ids (non-empty strings) to objects of FLOW_KEYS and
    api_keys, each in range; an API key in one flow only."""
    from kvadmit.request_fields import FieldError, flow_int
    if not isinstance(value, Mapping):
        raise ValueError(f"kvadmit config: {name}={value!r}: must be an object of flow id -> "
                         f"{{{', '.join((*FLOW_KEYS, API_KEYS))}}}")
    ids: dict[int, str] = {}
    owners: dict[str, str] = {}
    for key, spec in value.items():
        where = f"kvadmit config: {name}[{key!r}]"
        if not isinstance(key, str) or not key:
            raise ValueError(f"{where}: a flow id must be a non-empty string")
        try:
            fid = flow_int(key, f"{name}[{key!r}]")
        except FieldError as e:
            raise ValueError(f"kvadmit config: {e}") from None
        if fid in ids:
            raise ValueError(f"{where}: the same flow as {ids[fid]!r}")
        ids[fid] = key
        if not isinstance(spec, Mapping):
            raise ValueError(f"{where}={spec!r}: must be an object with keys "
                             f"{', '.join((*FLOW_KEYS, API_KEYS))}")
        for k, v in spec.items():
            if k == API_KEYS:
                _check_api_keys(f"{where}.{k}", v, key, owners)
            elif k not in FLOW_KEYS:
                raise ValueError(f"{where}: unknown key {k!r}; known: "
                                 f"{', '.join((*FLOW_KEYS, API_KEYS))}")
            else:
                _check_number(f"{where}.{k}={v!r}", v, *FLOW_KEYS[k], cap=k.startswith("max_"))


def _check_number(at: str, v: Any, kind: str, lo: float, hi: float, cap: bool) -> None:
    if kind == "int":
        note = " (0: no cap)" if cap else ""
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{at}: must be an integer in [{lo}, {hi}]{note}")
        if not lo <= v <= hi:
            raise ValueError(f"{at}: out of range [{lo}, {hi}]{note}")
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{at}: must be a number in ({lo}, {hi:g}]")
    if not lo < v <= hi:
        raise ValueError(f"{at}: out of range ({lo}, {hi:g}]")


def _check_api_keys(at: str, value: Any, flow: str, owners: dict[str, str]) -> None:
    if not isinstance(value, list):
        raise ValueError(f"{at}: must be a list of \"sha256:<hex>\" API key digests (the value "
                         f"is not shown: it may be a key)")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not KEY_HASH.match(item):
            raise ValueError(       # the value is not shown: it may be the key itself
                f"{at}[{i}]: must be \"sha256:\" and the key's 64-digit lowercase hex "
                f"SHA-256 (printf %s \"$KEY\" | sha256sum), not the key itself: vLLM logs its "
                f"config")
        if owners.setdefault(item, flow) != flow:
            raise ValueError(f"{at}[{i}]: this API key is already bound to flow "
                             f"{owners[item]!r}; a key binds one flow")


def check_addresses(name: str, value: Any) -> None:
    """A list of IP addresses or CIDR networks (strings)."""
    if not isinstance(value, list):
        raise ValueError(f"kvadmit config: {name}={value!r}: must be a list of IP addresses "
                         f"or CIDR networks, as strings")
    for i, item in enumerate(value):
        try:
            if not isinstance(item, str):
                raise ValueError("not a string")
            ipaddress.ip_network(item, strict=False)
        except ValueError as e:
            raise ValueError(f"kvadmit config: {name}[{i}]={item!r}: not an IP address or CIDR "
                             f"network ({e})") from None

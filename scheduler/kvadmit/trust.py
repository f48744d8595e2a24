"""Who may raise a request's claim on capacity (docs/trust-and-failure.md).

Every scheduling field comes from the request. A client may always lower its own
claim (mark itself sheddable, a lower priority, a shorter TTL, a looser target); a
field that raises it (`request_fields.Field.raises`: a flow, a session, a tighter
TTFT/TPOT target or deadline than the config's default, a longer TTL than its
max_queue_age_s; and the engine's own `priority` above its default) is honoured
only from a trusted source:

- a gateway that adds the shared secret of ``KVADMIT_GATEWAY_SECRET`` (the HTTP
  server's environment) in the header ``x-kvadmit-gateway-secret`` (stripped before
  the engine sees the request), or
- a connection whose own peer address (the socket's, never one a header claims:
  ``PEER_SCOPE_KEY``) is in the config's ``trusted_proxies``.

A request that presents one of the API keys a flow lists (``flows[...].api_keys``,
the engine's own ``--api-key`` values) is that flow's, whatever its headers or body
claim, at priority ``min_priority`` or less important (`Trust.bound`).

Offline use (vLLM's ``LLM``, SGLang's ``Engine``) has no client: the caller is the
operator, and everything is trusted. An untrusted raise is ignored and counted per
field, or refused with 400 (``untrusted_fields``). ``auto`` honours every field
until flows, a priority or deadline order, or a trusted source is configured:
single-user set-ups (an agent window's sessions included) keep working unchanged.

`Trust` is the pure rule (no engine, no HTTP); the engines' HTTP layers apply it
(patches/vllm_slo_headers.py, kvadmit.sglang.trust) and the simulator's workloads
too (`kvadmit.simulate.workload.Workload.trusted`).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

from kvadmit.flow_settings import KeyBinding, key_bindings, key_digest
from kvadmit.protocol import UNTRUSTED_FIELD, Refusal
from kvadmit.request_fields import SCHEMA, FieldError, flow_int

SECRET_ENV = "KVADMIT_GATEWAY_SECRET"
SECRET_HEADER = b"x-kvadmit-gateway-secret"
PRIORITY = "priority"            # the engine's own field, screened beside the schema's
# The ASGI scope key under which the HTTP server's patch (kvadmit_patches.asgi_socket_peer)
# keeps the socket's own peer host: uvicorn rewrites scope["client"] from X-Forwarded-For.
PEER_SCOPE_KEY = "kvadmit.socket_peer"
AUTHORIZATION = b"authorization"
SECRET, PROXY = "secret", "proxy"       # the trusted sources (Trust.source)
# vllm_xargs mark of a screened request: kvadmit does not take vLLM's own session id
# (X-Session-ID) as its session. Setting it can only lower a client's own claim.
UNTRUSTED_KEY = "kvadmit_untrusted"
_BY_NAME = {f.name: f for f in SCHEMA}


def resolved_mode(config, has_source: bool) -> str:
    """untrusted_fields with "auto" resolved: honour while no flows, no priority or
    deadline order and no trusted source are configured (a single user's server, an
    agent window's sessions included), else ignore."""
    if config.untrusted_fields != "auto":
        return config.untrusted_fields
    protects = bool(config.flows) or config.queue_order != "fcfs" or has_source
    return "ignore" if protects else "honour"


@dataclass(frozen=True)
class Trust:
    """The trust rule of one server: its mode (honour, ignore or refuse), its
    trusted sources and the config the claim rules compare with."""
    mode: str
    config: Any
    secret: Optional[bytes] = None      # its SHA-256: compared in constant time
    proxies: tuple = ()
    keys: Mapping[str, KeyBinding] = None   # "sha256:<hex>" of an API key -> its flow

    @classmethod
    def of(cls, config, environ: Optional[Mapping[str, str]] = None) -> "Trust":
        environ = os.environ if environ is None else environ
        secret = environ.get(SECRET_ENV) or None
        proxies = tuple(ipaddress.ip_network(p, strict=False) for p in config.trusted_proxies)
        mode = resolved_mode(config, bool(secret or proxies))
        digest = hashlib.sha256(secret.encode()).digest() if secret else None
        return cls(mode, config, digest, proxies, key_bindings(config.flows))

    @property
    def screens(self) -> bool:
        """Whether untrusted requests are screened at all (mode not honour)."""
        return self.mode != "honour"

    def source(self, headers: Iterable[tuple[bytes, bytes]], peer: Optional[str]) -> Optional[str]:
        """Which trusted source an HTTP request is from: SECRET (the gateway secret in its
        headers: the gateway vouches for the whole request), PROXY (`peer`, the socket's
        own peer address, `socket_peer`, in trusted_proxies: the proxy vouches for the
        headers it sets, not for the body it forwards), or None."""
        if self.secret is not None:
            for name, value in headers:
                if name.lower() == SECRET_HEADER and hmac.compare_digest(
                        hashlib.sha256(value.strip()).digest(), self.secret):
                    return SECRET
        if self.proxies and peer:
            try:
                address = ipaddress.ip_address(peer)
            except ValueError:
                return None
            if address.version == 6 and address.ipv4_mapped is not None:
                address = address.ipv4_mapped           # a dual-stack listener's IPv4 peer
            return PROXY if any(address in net for net in self.proxies) else None
        return None

    def trusted(self, headers: Iterable[tuple[bytes, bytes]], peer: Optional[str]) -> bool:
        """Whether an HTTP request is from a trusted source of either kind (`source`)."""
        return self.source(headers, peer) is not None

    def bound(self, headers: Iterable[tuple[bytes, bytes]]) -> Optional[KeyBinding]:
        """The flow and priority bound to the request's API key, None without one: the
        first Authorization header's Bearer key, read as vLLM's and SGLang's own
        authentication reads it."""
        if not self.keys:
            return None
        for name, value in headers:
            if name.lower() == AUTHORIZATION:
                scheme, _, key = value.decode("latin-1").partition(" ")
                return self.keys.get(key_digest(key)) if scheme.lower() == "bearer" else None
        return None

    def check_server_keys(self, server_keys: Iterable[Optional[str]]) -> None:
        """ConfigError unless every API key a flow lists is one of the server's own
        (--api-key): a key the server does not check proves nothing."""
        from kvadmit.config import ConfigError
        if not self.keys:
            return
        known = {key_digest(k) for k in server_keys if k}
        if not known:
            raise ConfigError(
                "kvadmit config: flows bind API keys (api_keys), but the server checks none: "
                "start it with --api-key (vLLM: or VLLM_API_KEY), one key per tenant")
        for digest, binding in self.keys.items():
            if digest not in known:
                raise ConfigError(
                    f"kvadmit config: flows[{binding.flow!r}].api_keys has {digest[:15]}..., "
                    f"which is not the SHA-256 of any of the server's --api-key values")

    def raised(self, values: Mapping[str, Any], now_unix: float) -> list[str]:
        """The fields of `values` (field name -> value as the client sent it) that
        raise the request's claim. A value that does not parse is left to the engine,
        which refuses it as invalid naming the field."""
        out = []
        for name, raw in values.items():
            field = _BY_NAME.get(name)
            if field is None or field.raises is None:
                continue
            try:
                value = field.parse(raw, name, now_unix)
            except FieldError:
                continue
            if field.raises(value, self.config, now_unix):
                out.append(name)
        return out

    def raised_columns(self, columns: Mapping[str, Any], priority: int) -> list[str]:
        """The same rule on an arrival record's parsed columns (the simulator's rows):
        the fields whose column value raises the claim, and "priority" below 0."""
        out = [f.name for f in SCHEMA if f.column is not None and f.raises is not None
               and f.column in columns and f.raises(columns[f.column], self.config, 0.0)]
        if priority < 0:
            out.append(PRIORITY)
        return out


def socket_peer(scope) -> Optional[str]:
    """The socket's own peer host of an ASGI scope (PEER_SCOPE_KEY), None where the
    HTTP server's patch did not record it: never scope["client"], which uvicorn
    rewrites from X-Forwarded-For."""
    return scope.get(PEER_SCOPE_KEY) if isinstance(scope, Mapping) else None


def same_flow(claimed: Any, flow: str) -> bool:
    """Whether a request's flow claim names `flow` (as kvadmit reads flow ids)."""
    try:
        return flow_int(claimed, "flow") == flow_int(flow, "flow")
    except FieldError:
        return False


def require_socket_peer(trust: "Trust", installed: bool) -> None:
    """ConfigError where trusted_proxies are configured and the HTTP server's patch
    that records the socket's peer (kvadmit_patches.asgi_socket_peer) is not in place."""
    from kvadmit.config import ConfigError
    if trust.proxies and not installed:
        raise ConfigError(
            "kvadmit config: trusted_proxies needs the connection's own peer address, and "
            "kvadmit could not wrap uvicorn's app loading (kvadmit_patches.asgi_socket_peer) "
            "to read it: uvicorn rewrites the peer from X-Forwarded-For, which any client can "
            "send. Use the gateway secret (KVADMIT_GATEWAY_SECRET) instead")


def refusal_message(names: list[str]) -> str:
    """The 400 message of a request refused for untrusted raises (mode refuse):
    kvadmit.protocol's untrusted_field refusal, naming the fields."""
    return Refusal(UNTRUSTED_FIELD, (
        f"{', '.join(names)} would raise this request's claim on capacity, and it does not "
        f"come from a trusted source (a gateway with {SECRET_HEADER.decode()}, or an address "
        f"in trusted_proxies; see docs/trust-and-failure.md)")).client_message()


_COUNTERS: dict[str, Any] = {}


def count(names: Iterable[str], metric: str = "kvadmit_untrusted_fields") -> None:
    """Counts ignored or refused raises per field in this process's Prometheus
    registry (`<metric>_total{field}`: in vLLM's and SGLang's API server, where
    their /metrics is served)."""
    names = list(names)
    if not names:
        return
    try:
        counter = _COUNTERS.get(metric)
        if counter is None:
            from prometheus_client import Counter
            counter = _COUNTERS[metric] = Counter(
                metric, "Request fields that would raise a request's claim, from a client "
                "that is not a trusted source: ignored or refused (docs/trust-and-failure.md)",
                ["field"])
    except ImportError:      # no Prometheus client: nothing to count into
        return
    for name in names:
        counter.labels(field=name).inc()

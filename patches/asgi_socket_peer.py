"""uvicorn (the HTTP server of vLLM and SGLang): the connection's own peer address, for
kvadmit's `trusted_proxies`.

uvicorn's ProxyHeadersMiddleware rewrites `scope["client"]` from `X-Forwarded-For` for
every connection from `FORWARDED_ALLOW_IPS` (127.0.0.1 by default). Behind a sidecar
proxy, a router on the same host or `kubectl port-forward` every client connects from
127.0.0.1, so any client could claim a trusted proxy's address in that header. This
patch wraps the app uvicorn loads, outside that middleware, so that every HTTP scope
carries the socket's own peer host under `kvadmit.trust.PEER_SCOPE_KEY` before
anything can rewrite `client`. kvadmit's trust check reads only that key: a request
without it is from no trusted proxy, and a server with `trusted_proxies` does not
start unless this patch is in place (`installed`).
"""
from __future__ import annotations

from kvadmit.trust import PEER_SCOPE_KEY
from kvadmit_patches import PatchUnavailable, Target, wrap, wrapped_by

TARGET = Target("uvicorn.config:Config.load", ("self",))


class SocketPeer:
    """The outermost ASGI app: records the socket's peer host, then the app uvicorn loaded."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            client = scope.get("client")
            scope[PEER_SCOPE_KEY] = client[0] if client else None
        return await self.app(scope, receive, send)


def _make_load(original):
    def load(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if not isinstance(self.loaded_app, SocketPeer):
            self.loaded_app = SocketPeer(self.loaded_app)
        return result
    return load


def installed() -> bool:
    """Whether uvicorn's app loading is wrapped in this process."""
    try:
        from uvicorn.config import Config
    except ImportError:
        return False
    return wrapped_by(Config, "load", _make_load)


def apply() -> bool:
    """Wraps uvicorn's Config.load once; PatchUnavailable (nothing done) where it cannot."""
    problems = TARGET.problems()
    if problems:
        raise PatchUnavailable(__name__.rsplit(".", 1)[-1], problems)
    from uvicorn.config import Config
    wrap(Config, "load", _make_load)
    return True

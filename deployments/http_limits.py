"""The HTTP server's own limits: a connection cap, keep-alive, and a deadline on each request head,
for every HTTP server pdserve's app runs in.

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`) and answers 503 past
`limit_concurrency`, but it waits forever for a request head: a socket that connects and sends
nothing, or half a header line, is held until the client leaves. `HeadDeadline` closes a connection
whose head (request line and headers) is not whole within `http_header_timeout_s` of connecting or of
its previous response. The body has its own deadline in the app (frontend/http_body.py: 408).

Where they apply:

    single-process layout     the uvicorn server `pdserve serve` runs (local_server.py): all three
    Ray, direct ingress       the ingress replica's own uvicorn server, which Serve builds from its
                              HTTPOptions only: `apply_to_direct_ingress` gives it all three
    Ray, Serve's proxy        Serve's proxy actor: only keep-alive (Serve's `keep_alive_timeout_s`, whole
                              seconds), set by `pdserve serve`; a connection cap or head deadline other
                              than the default is refused (`proxy_limits_error`), never ignored
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

if TYPE_CHECKING:
    from deployments.config import ServeConfig

# The settings only a server pdserve builds itself can honour (Serve's proxy takes neither).
OWN_SERVER_SETTINGS = ("http_limit_concurrency", "http_header_timeout_s")


def head_deadline_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools or h11, as uvicorn picks) with a head deadline of `timeout_s`."""

    class HeadDeadline(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(timeout_s, self._head_expired)

        def _head_expired(self) -> None:
            self._head_timer = None
            waiting_for_head = self.cycle is None or self.cycle.response_complete
            if waiting_for_head and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

    return HeadDeadline


def uvicorn_limits(cfg: ServeConfig) -> dict[str, Any]:
    """`uvicorn.Config` arguments for `cfg`'s HTTP limits."""
    return {"limit_concurrency": cfg.http_limit_concurrency, "timeout_keep_alive": cfg.http_keepalive_timeout_s,
            "http": head_deadline_protocol(cfg.http_header_timeout_s)}


def proxy_keepalive_s(cfg: ServeConfig) -> int:
    """Serve's `http_options.keep_alive_timeout_s` for `cfg`: Serve takes whole seconds (rounded up)."""
    return max(1, math.ceil(cfg.http_keepalive_timeout_s))


def proxy_limits_error(cfg: ServeConfig) -> str | None:
    """Why `cfg` cannot be served behind Serve's proxy (None: it can): the proxy's uvicorn takes no
    connection cap and no head deadline, so a value other than the default would be ignored there."""
    from deployments.config import ServeConfig

    default = ServeConfig.__dataclass_fields__
    given = [n for n in OWN_SERVER_SETTINGS if getattr(cfg, n) != default[n].default]
    if not given:
        return None
    return (f"{', '.join(f'{n}={getattr(cfg, n)}' for n in given)}: Ray Serve's HTTP proxy serves this app and takes "
            "no such option (Ray 2.60's HTTPOptions has keep_alive_timeout_s only). Serve it with direct ingress "
            "(direct_ingress: true; `pdserve serve` turns it on by itself with one ingress replica), or the "
            f"single-process layout, or leave {' and '.join(given)} unset")


def apply_to_direct_ingress(cfg: ServeConfig) -> None:
    """Give the HTTP server Ray Serve's direct ingress starts in this process (an ingress replica's,
    after its constructor returns) `cfg`'s limits.

    Serve builds that server in `ray.serve._private.http_util.start_asgi_http_server` from its
    HTTPOptions alone (`uvicorn.Config(..., timeout_keep_alive=...)`), which has no connection cap and
    no protocol choice. So that module's `uvicorn` is swapped, in this process only, for one whose
    `Config` adds `uvicorn_limits(cfg)`. A Ray whose module is laid out otherwise is refused here
    (ServeConfigError, naming the settings) rather than served without the limits.
    """
    import uvicorn

    from deployments.config import ServeConfigError

    try:
        from ray.serve._private import http_util
    except ImportError:  # pragma: no cover - a Ray without it
        http_util = None
    current = getattr(http_util, "uvicorn", None)
    if not hasattr(http_util, "start_asgi_http_server") or \
            not (current is uvicorn or isinstance(current, _UvicornWithLimits)):
        raise ServeConfigError(
            f"{', '.join(OWN_SERVER_SETTINGS)}, http_keepalive_timeout_s: this Ray's direct ingress builds its HTTP "
            "server where pdserve cannot reach it (ray.serve._private.http_util changed); serve with Serve's "
            "proxy (direct_ingress: false, leaving http_limit_concurrency and http_header_timeout_s unset) or "
            "the single-process layout")
    http_util.uvicorn = _UvicornWithLimits(uvicorn_limits(cfg))


class _UvicornWithLimits:
    """The `uvicorn` module as Serve's http_util sees it after `apply_to_direct_ingress`: the same
    module, except that every `Config` it builds carries pdserve's limits."""

    def __init__(self, limits: dict[str, Any]):
        self._limits = limits

    def Config(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - the name Serve calls
        import uvicorn

        return uvicorn.Config(*args, **{**kwargs, **self._limits})

    def __getattr__(self, name: str) -> Any:
        import uvicorn

        return getattr(uvicorn, name)

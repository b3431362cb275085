"""The HTTP server's own limits, for the servers pdserve runs uvicorn for itself (the single-process
layout): a connection cap, keep-alive, and a deadline on each request head.

uvicorn closes an idle keep-alive connection (`timeout_keep_alive`) and answers 503 past
`limit_concurrency`, but it waits forever for a request head: a socket that connects and sends
nothing, or half a header line, is held until the client leaves. `HeadDeadline` closes a connection
whose head (request line and headers) is not whole within `http_header_timeout_s` of connecting or of
its previous response. The body has its own deadline in the app (frontend/http_body.py: 408).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

if TYPE_CHECKING:
    from deployments.config import ServeConfig


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

"""API-key check for the HTTP app: `Authorization: Bearer <key>` when a key (or a keys file: tenants.py)
is configured; the key's tenant goes to the routes in `request.state.tenant`."""

from __future__ import annotations

from deployments.frontend.http_errors import error_response
from deployments.frontend.openai_protocol import APIError


class BearerAuth:
    """ASGI middleware: checks the key on everything but /health (probes carry no key; /health shows
    its details only with the key, see http_app._health).

    The keys are read per request from `app.state.pdserve` (`api_key`, `tenants`), so
    `configure_openai_app` can set them after the app is built.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not scope["path"].endswith("/health"):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            ok, tenant = scope["app"].state.pdserve.authorize(header)
            if ok:
                scope.setdefault("state", {})["tenant"] = tenant
            else:
                err = APIError(401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                               "invalid_request_error", code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)

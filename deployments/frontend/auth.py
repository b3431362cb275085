"""The API-key check both doors share: HTTP's `Authorization` header, gRPC's `authorization` metadata."""

from __future__ import annotations

import hmac


def bearer_matches(header: str | None, api_key: str | None) -> bool:
    """Whether `header` ("Bearer <key>") carries `api_key`; always true when no key is set."""
    if not api_key:
        return True
    scheme, _, token = (header or "").partition(" ")
    # NOTE: constant-time compare, so response timing does not leak the key.
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("utf-8", "surrogatepass"),
                                                           api_key.encode("utf-8", "surrogatepass"))

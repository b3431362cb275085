"""Tenants: several API keys (`--api-keys-file`), each a tenant with its own share of the server.

A tenant has a name (what logs and the scheduler see, never the key), a `weight` (its share when
tenants compete: the engines order their queues by weighted fair queueing and preempt the heaviest
tenant first, engine/fair_share.py), limits on what it may have in flight at once (`max_requests`:
backend requests, i.e. prompts x n of every open call; `max_tokens`: their prompt tokens and the output
they may still generate), a request rate (`requests_per_s` with a `burst`), and a prefix-cache scope:
by default each tenant's requests get a cache salt of their own, so prefix-cache hits (`cached_tokens`)
and the suffix speculator's shared state never cross tenants; `share_prefix_cache: true` puts the
tenant back into the shared, unsalted cache (a request's own `cache_salt` still applies within it).

The file is JSON:

```json
{"tenants": [
  {"name": "alice", "key": "sk-alice-...", "weight": 2, "max_requests": 64, "max_tokens": 200000,
   "requests_per_s": 20, "burst": 40},
  {"name": "batch", "key_env": "BATCH_KEY", "weight": 1, "max_requests": 16, "share_prefix_cache": false}
]}
```

`key_env` reads the key from an environment variable instead of the file. Every field but `name` and a
key is optional (unset: no limit, weight 1). `--api-key` alone is one tenant named `default`.

The limits are counted per ingress replica (each replica admits on its own): with R replicas a
tenant may have up to R x its limits in flight.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from deployments.frontend.openai_protocol import APIError
from deployments.frontend.prepare import PreparedRequest

MAX_NAME_CHARS = 64
_FIELDS = {"name", "key", "key_env", "weight", "max_requests", "max_tokens", "requests_per_s", "burst",
           "cache_salt", "share_prefix_cache"}


class TenantFileError(ValueError):
    """The API keys file is unreadable or a tenant in it is invalid; the message names the entry."""


@dataclass(frozen=True)
class Tenant:
    name: str
    key: str = field(repr=False)
    weight: float = 1.0
    max_requests: int | None = None
    max_tokens: int | None = None
    requests_per_s: float | None = None
    burst: int = 1
    cache_salt: str | None = None  # the tenant's prefix-cache scope; None: its name's
    share_prefix_cache: bool = False

    def salt_for(self, request_salt: str | None) -> str | None:
        """The cache salt a request of this tenant runs with: the tenant's scope (unless it shares the
        cache), with the request's own salt inside it."""
        if self.share_prefix_cache:
            return request_salt
        scope = self.cache_salt or f"tenant:{self.name}"
        if request_salt is None:
            return scope
        return f"{scope}/{hashlib.sha256(request_salt.encode('utf-8', 'surrogatepass')).hexdigest()}"


@dataclass
class _Use:
    requests: int = 0
    tokens: int = 0
    allowance: float = 0.0  # the rate limit's token bucket
    refilled: float = 0.0


class Admission:
    """What one admitted call holds of its tenant's limits; `release` (idempotent) gives it back."""

    def __init__(self, book: TenantBook | None, tenant: Tenant | None, requests: int, tokens: int):
        self._book, self.tenant, self.requests, self.tokens = book, tenant, requests, tokens

    def release(self) -> None:
        book, self._book = self._book, None
        if book is not None and self.tenant is not None:
            book._give_back(self.tenant, self.requests, self.tokens)


class TenantBook:
    """The tenants, keyed for lookup by API key, and what each has in flight on this replica."""

    def __init__(self, tenants: list[Tenant]):
        names = [t.name for t in tenants]
        if len(set(names)) != len(names):
            raise TenantFileError(f"tenant names must be unique, got {names}")
        keys = [t.key for t in tenants]
        if len(set(keys)) != len(keys):
            raise TenantFileError("two tenants have the same key")
        self.tenants = list(tenants)
        self._lock = threading.Lock()
        self._use: dict[str, _Use] = {t.name: _Use(allowance=float(t.burst), refilled=time.monotonic())
                                      for t in tenants}

    @classmethod
    def single(cls, api_key: str) -> TenantBook:
        return cls([Tenant("default", api_key, share_prefix_cache=True)])

    @classmethod
    def from_file(cls, path: str) -> TenantBook:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise TenantFileError(f"api_keys_file {path!r}: {e}") from None
        entries = data.get("tenants") if isinstance(data, dict) else None
        if not isinstance(entries, list) or not entries:
            raise TenantFileError(f"api_keys_file {path!r}: expected {{\"tenants\": [...]}} with at least one tenant")
        return cls([_tenant(i, e) for i, e in enumerate(entries)])

    def identify(self, authorization: str | None) -> Tenant | None:
        """The tenant whose key `authorization` ("Bearer <key>") carries, or None. Every key is compared
        (in constant time each), so the answer's timing says nothing about which key nearly matched."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        given = token.strip().encode("utf-8", "surrogatepass")
        found = None
        for t in self.tenants:
            if hmac.compare_digest(given, t.key.encode("utf-8", "surrogatepass")) and found is None:
                found = t
        return found

    def admit(self, tenant: Tenant | None, requests: int, tokens: int) -> Admission:
        """Take `requests` backend requests and `tokens` tokens of `tenant`'s share, or raise a 429
        APIError saying which limit (with Retry-After)."""
        if tenant is None:
            return Admission(None, None, requests, tokens)
        with self._lock:
            use = self._use[tenant.name]
            if tenant.requests_per_s is not None:
                now = time.monotonic()
                use.allowance = min(float(tenant.burst), use.allowance + (now - use.refilled) * tenant.requests_per_s)
                use.refilled = now
                if use.allowance < 1.0:
                    wait = (1.0 - use.allowance) / tenant.requests_per_s
                    raise _busy(f"tenant {tenant.name!r} is over its rate limit ({tenant.requests_per_s:g} "
                                "requests/s); retry later", wait)
            if tenant.max_requests is not None and use.requests + requests > tenant.max_requests:
                raise _busy(f"tenant {tenant.name!r} has {use.requests} requests in flight and this call adds "
                            f"{requests} (its max_requests is {tenant.max_requests}); retry later")
            if tenant.max_tokens is not None and use.tokens + tokens > tenant.max_tokens:
                raise _busy(f"tenant {tenant.name!r} has {use.tokens} tokens in flight and this call adds "
                            f"{tokens} (its max_tokens is {tenant.max_tokens}); retry later")
            if tenant.requests_per_s is not None:
                use.allowance -= 1.0
            use.requests += requests
            use.tokens += tokens
        return Admission(self, tenant, requests, tokens)

    def in_flight(self, name: str) -> tuple[int, int]:
        """(requests, tokens) tenant `name` has in flight here."""
        with self._lock:
            use = self._use[name]
            return use.requests, use.tokens

    def _give_back(self, tenant: Tenant, requests: int, tokens: int) -> None:
        with self._lock:
            use = self._use[tenant.name]
            use.requests -= requests
            use.tokens -= tokens


def admit_call(book: TenantBook | None, tenant: Tenant | None, prepared: list[PreparedRequest], n: int,
               max_request_tokens: int | None) -> tuple[list[PreparedRequest], Admission]:
    """Count one call (its prompts `prepared`, `n` samples each) against the per-call token cap (400
    naming max_tokens) and its tenant's share (429), and give its requests the tenant's name, weight and
    prefix-cache scope. Both doors call it; `Admission.release` when the call ends."""
    tokens = n * sum(len(p.prompt_token_ids) + p.params.max_tokens for p in prepared)
    if max_request_tokens is not None and tokens > max_request_tokens:
        raise APIError(400, f"this call asks for {tokens} tokens (prompts x n x (prompt + max_tokens)), more than "
                            f"the server's max_request_tokens {max_request_tokens}: send fewer prompts, a smaller "
                            "n or max_tokens", "invalid_request_error", param="max_tokens")
    if tenant is None or book is None:
        return prepared, Admission(None, None, 0, 0)
    admission = book.admit(tenant, n * len(prepared), tokens)
    return [p._replace(cache_salt=tenant.salt_for(p.cache_salt), tenant=tenant.name, tenant_weight=tenant.weight)
            for p in prepared], admission


def _busy(message: str, retry_after_s: float = 1.0) -> APIError:
    return APIError(429, message, "rate_limit_error", code="tenant_limit",
                    headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def _tenant(i: int, e: Any) -> Tenant:
    where = f"api_keys_file: tenants[{i}]"
    if not isinstance(e, dict):
        raise TenantFileError(f"{where}: expected an object, got {type(e).__name__}")
    unknown = set(e) - _FIELDS
    if unknown:
        raise TenantFileError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(_FIELDS)}")
    name = e.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS or not name.isprintable():
        raise TenantFileError(f"{where}.name: expected a printable string of 1..{MAX_NAME_CHARS} characters")
    where = f"api_keys_file: tenant {name!r}"
    if ("key" in e) == ("key_env" in e):
        raise TenantFileError(f"{where}: give exactly one of key, key_env")
    key = e["key"] if "key" in e else os.environ.get(str(e["key_env"]))
    if not isinstance(key, str) or len(key) < 8 or any(c.isspace() for c in key):
        src = "key" if "key" in e else f"key_env ${e['key_env']}"
        raise TenantFileError(f"{where}.{src}: expected a key of at least 8 characters without spaces "
                              "(is the variable set?)" if "key_env" in e else
                              f"{where}.key: expected a string of at least 8 characters without spaces")

    def number(field_name: str, integer: bool, default: Any) -> Any:
        v = e.get(field_name, default)
        if v is None:
            return None
        ok = isinstance(v, int) if integer else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok or not (v > 0 and math.isfinite(v)):
            raise TenantFileError(f"{where}.{field_name}: expected a positive {'integer' if integer else 'number'}, "
                                  f"got {v!r}")
        return v

    salt = e.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= 256):
        raise TenantFileError(f"{where}.cache_salt: expected a string of 1..256 characters")
    share = e.get("share_prefix_cache", False)
    if not isinstance(share, bool):
        raise TenantFileError(f"{where}.share_prefix_cache: expected true or false")
    rate = number("requests_per_s", False, None)
    burst = number("burst", True, None)
    return Tenant(name, key, float(number("weight", False, 1.0)), number("max_requests", True, None),
                  number("max_tokens", True, None), None if rate is None else float(rate),
                  burst if burst is not None else max(1, math.ceil(rate or 1)), salt, share)

"""Optional bearer API keys (`--api-key`, repeatable, or WICORE_API_KEYS=key1,key2). With no key
configured the API is open; with keys, every /v1 route wants `Authorization: Bearer <key>`.
Health probes, /metrics and the docs stay open. Keys are compared in constant time and never
logged or echoed."""

from __future__ import annotations

import hmac

from fastapi import Request

from wicore.gateway.errors import ApiError

CHALLENGE = {"WWW-Authenticate": "Bearer"}


# async: FastAPI runs a plain `def` dependency on its thread pool, a hop per request for a dict lookup.
async def require_key(request: Request) -> None:
    keys: frozenset[str] = request.app.state.gateway.config.api_keys
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>'", headers=CHALLENGE)
    if not any(hmac.compare_digest(token.strip().encode(), key.encode()) for key in keys):
        raise ApiError(401, "the API key is not valid for this gateway", headers=CHALLENGE)

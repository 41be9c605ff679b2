"""Optional API key (``http.api_key`` / ``http.api_key_env``): every route but ``/health`` then needs
``Authorization: Bearer <key>``. Off by default (no key configured).

The key is compared in constant time (``hmac.compare_digest``), so response timing does not reveal how
much of a guess was right. The check runs before the request body is read: a client without the key
cannot make the server buffer a body.
"""

from __future__ import annotations

import hmac
import os
from typing import Any

from dgpp.errors import ConfigError
from dgpp.serve.errors import APIError

OPEN_PATHS = frozenset({"/health"})


def configured_key(http_cfg: Any) -> str | None:
    """The key from ``http.api_key``, else from the environment variable ``http.api_key_env`` names; None
    when neither is set (no authentication). A named variable that is unset or empty is a config error."""
    key = str(getattr(http_cfg, "api_key", "") or "")
    env = str(getattr(http_cfg, "api_key_env", "") or "")
    if key and env:
        raise ConfigError("http.api_key and http.api_key_env are both set; give the key one way")
    if env:
        key = os.environ.get(env, "")
        if not key:
            raise ConfigError(
                f"http.api_key_env names {env!r}, but that environment variable is unset or empty"
            )
    return key or None


class ApiKey:
    """Checks ``Authorization: Bearer <key>`` on an ASGI scope."""

    def __init__(self, key: str) -> None:
        self._key = key.encode("utf-8")

    def refusal(self, scope: dict[str, Any]) -> APIError | None:
        """None when the request may pass; a 401 otherwise. CORS preflights carry no credentials by design."""
        if scope.get("path") in OPEN_PATHS or scope.get("method") == "OPTIONS":
            return None
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given = token.strip()
        if given and hmac.compare_digest(given, self._key):
            return None
        why = (
            "no API key was given (Authorization: Bearer <key>)" if not given else "the API key is not valid"
        )
        return APIError(401, why, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

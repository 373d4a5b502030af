"""Who may send what, checked before a route reads a byte of the body (a pure ASGI middleware):

- `--api-key`: every `/v1/*` request (and `/metrics` with `--metrics-need-key`) needs
  `Authorization: Bearer <key>`, compared in constant time (digests of equal length); else 401 in OpenAI's
  error shape. `/health` stays open (load balancers probe it without a key).
- bodies over `--max-body-bytes` get 413, by Content-Length or while streaming in;
- while the server drains for shutdown, new `/v1/*` requests get 503.
Imports starlette's types and kvq.serve.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from typing import Any

from kvq.serve.api_errors import ApiError
from kvq.serve.server_config import ServerConfig

Scope = dict[str, Any]
Message = dict[str, Any]


@dataclass
class ServeState:
    is_draining: bool = False


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class AccessMiddleware:
    def __init__(self, app: Any, config: ServerConfig, state: ServeState) -> None:
        self.app, self.config, self.state = app, config, state
        self._key = None if config.api_key is None else _digest(config.api_key.encode())

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            self._check(scope)
            receive = await self._bounded_body(scope, receive)
        except ApiError as e:
            return await _send_error(send, e)
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> None:
        path = scope["path"]
        is_api = path.startswith("/v1/")
        if self._key is not None and (is_api or (path == "/metrics" and self.config.metrics_need_key)):
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, given = header.partition(b" ")
            if scheme.lower() != b"bearer" or not given:
                raise ApiError(
                    401,
                    "no API key: send it as the header 'Authorization: Bearer YOUR_KEY'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            if not hmac.compare_digest(_digest(given.strip()), self._key):
                raise ApiError(
                    401,
                    "incorrect API key provided",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        if is_api and scope["method"] == "POST" and self.state.is_draining:
            raise ApiError(503, "the server is shutting down; send the request to another one")

    async def _bounded_body(self, scope: Scope, receive: Any) -> Any:
        """The body read in full (refused past the limit), then replayed to the app; later messages (the
        client's disconnect) come from the connection as before."""
        limit = int(self.config.max_body_bytes)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise _too_large(int(length), limit)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return receive
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                replay = [message]
                break
            size += len(message.get("body", b""))
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        else:
            replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> Message:
            return replay.pop(0) if replay else await receive()

        return replayed


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body has {size} bytes; this server takes at most {limit} (--max-body-bytes)",
        param="body",
    )


async def _send_error(send: Any, error: ApiError) -> None:
    body = json.dumps(error.body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

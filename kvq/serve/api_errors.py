"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, and the exception that
carries one to the client with its HTTP status (and headers, e.g. Retry-After). Imports nothing of kvq.
"""

from __future__ import annotations

STATUS_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "server_error",
}


def error_body(
    message: str, status: int = 400, param: str | None = None, code: str | int | None = None
) -> dict:
    kind = STATUS_TYPES.get(status, "server_error")
    return {
        "error": {"message": message, "type": kind, "param": param, "code": status if code is None else code}
    }


class ApiError(Exception):
    """A refused request: its status, OpenAI error body and headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers or {}
        self.body = error_body(message, status, param, code)

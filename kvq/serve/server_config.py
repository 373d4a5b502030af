"""The HTTP server's settings: one flat dataclass, validated on creation, whose defaults the CLI and the
config files (`kvq.config_file`) read. Imports kvq.errors and kvq.runtime.config (the size parser).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kvq.errors import KvqError
from kvq.runtime.config import parse_bytes  # TODO(lead): unify with the one byte-size parser

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass
class ServerConfig:
    """Everything `kvq serve` needs besides the engine. Invalid values raise `KvqError` at creation.

    max_waiting: most requests accepted but not yet started (no output yet); one more gets 429 with
      Retry-After. None: unbounded.
    max_tokens: the max_tokens of a chat request that sets none (capped by the context left).
    max_prompt_tokens / max_completion_tokens: the most prompt tokens / max_tokens one request may send
      (None: the context is the only bound); a request over them gets 400 naming the field.
    max_body_bytes: larger request bodies get 413 before they are read in full.
    shutdown_timeout: seconds running requests get to finish after SIGTERM; the rest are then ended with
      an error (event), and the process exits 0.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    metrics_need_key: bool = False
    max_waiting: int | None = None
    max_tokens: int = 256
    max_prompt_tokens: int | None = None
    max_completion_tokens: int | None = None
    max_body_bytes: str | int = "4MiB"
    shutdown_timeout: float = 30.0
    retry_after: int = 1  # seconds, the Retry-After of a 429
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise KvqError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_waiting", "max_prompt_tokens", "max_completion_tokens"):
            value = getattr(self, name)
            if value is not None and value < (0 if name == "max_waiting" else 1):
                raise KvqError(f"{name} must be >= {0 if name == 'max_waiting' else 1}, got {value}")
        if self.max_tokens < 1:
            raise KvqError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.shutdown_timeout < 0:
            raise KvqError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.retry_after < 0:
            raise KvqError(f"retry_after must be >= 0 seconds, got {self.retry_after}")
        if self.api_key is not None and not self.api_key.strip():
            raise KvqError("api_key is empty; pass a key or leave it unset")
        if self.log_level not in LOG_LEVELS:
            raise KvqError(f"log_level is {self.log_level!r}; pick one of {', '.join(LOG_LEVELS)}")
        self.max_body_bytes = parse_bytes(self.max_body_bytes, "max_body_bytes")

    @property
    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name
            return False

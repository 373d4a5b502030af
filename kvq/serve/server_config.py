"""The HTTP server's settings: one flat dataclass, validated on creation, that declares `kvq serve`'s server
options (default and help text) and the keys of a config file's `server` section (`kvq.config_file`).
Imports kvq.errors, kvq.byte_sizes and kvq.runtime.config (`option`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from kvq.byte_sizes import parse_bytes
from kvq.errors import KvqError
from kvq.runtime.config import option

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

    # a field made by `option` is also `kvq serve`'s option --field-name (`kvq.commands.field_options`)
    host: str = option(
        "127.0.0.1", "Address to listen on: 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)."
    )
    port: int = option(8000, "TCP port (0: any free one).")
    served_model_name: str | None = option(None, "The model name clients send (default: the directory name).")
    api_key: str | None = option(
        None,
        "Every /v1/* request must send 'Authorization: Bearer KEY' (else 401). /health stays open.",
        envvar="KVQ_API_KEY",
    )
    metrics_need_key: bool = option(False, "/metrics needs the API key too.")
    max_waiting: int | None = option(
        None, "Most requests accepted but not started; more get 429 with Retry-After (default: no bound)."
    )
    max_tokens: int = option(256, "max_tokens of a chat request that sets none (completions: 16, as OpenAI).")
    max_prompt_tokens: int | None = option(
        None, "Most prompt tokens per request (default: the context); more get 400."
    )
    max_completion_tokens: int | None = option(
        None, "Most max_tokens per request (default: the context); more get 400."
    )
    max_body_bytes: str | int = option("4MiB", "Largest request body, e.g. 4MiB; larger ones get 413.")
    shutdown_timeout: float = option(
        30.0, "Seconds running requests get to finish after SIGTERM; the rest end with an error."
    )
    retry_after: int = 1  # seconds, the Retry-After of a 429
    log_level: str = option("info", "critical, error, warning, info or debug.")

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

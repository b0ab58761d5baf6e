"""ServerConfig: the HTTP server's knobs (the engine's are in EngineArgs), same names as the CLI."""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1024 * 1024


@dataclass
class ServerConfig:
    """Where to listen, who may call, and the caps that keep one request from hurting the rest.

    The caps bound the work a single request can ask for before any of it is queued: ``max_n``
    choices per prompt, ``max_prompts`` prompts per completion request, ``max_stop`` stop strings
    of at most ``max_stop_length`` characters, and ``max_body_bytes``/``max_header_bytes`` of
    HTTP input. ``retry_after_s`` is what a 503 tells a client to wait.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    shutdown_timeout: float = 30.0
    max_body_bytes: int = 8 * MIB
    max_header_bytes: int = 32 * 1024
    max_n: int = 16
    max_prompts: int = 16
    max_stop: int = 16
    max_stop_length: int = 256
    retry_after_s: int = 1
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to disable auth)")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        for name in ("max_body_bytes", "max_header_bytes", "max_n", "max_prompts", "max_stop"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

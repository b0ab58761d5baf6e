"""Running the app under uvicorn, with a graceful drain on SIGTERM.

uvicorn on its own stops listening at the first SIGTERM, so a client arriving during shutdown
gets "connection refused" rather than an answer, and it re-raises the signal at the end, so the
process dies by the signal instead of exiting 0. ``DrainingServer`` changes both:

1. first SIGTERM (or Ctrl-C): keep listening, but answer new generation requests 503 with
   Retry-After (and /health 503), so a load balancer moves on;
2. let in-flight requests finish, up to ``shutdown_timeout`` seconds;
3. then abort the rest (their streams end with an error event, their blocks are freed), and
   exit through uvicorn's normal shutdown: close connections, run the lifespan (engine shutdown),
   return 0.

A second signal skips the wait.
"""

from __future__ import annotations

import logging
import socket
import time

import uvicorn

from pagedserve.server.app import build_app
from pagedserve.server.config import ServerConfig
from pagedserve.server.state import ServerState

logger = logging.getLogger("pagedserve.server")

# After the aborts, how long requests get to send their last bytes before uvicorn takes over.
ABORT_GRACE_S = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float):
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self._deadline: float | None = None
        self._aborted_at: float | None = None
        self._hurry = False

    def handle_exit(self, sig, frame) -> None:
        """Signal handler (main thread): start the drain, or on a second signal, stop now."""
        if self._deadline is None:
            self.state.draining = True
            self._deadline = time.monotonic() + self.shutdown_timeout
            logger.info(
                "draining: %d request(s) in flight, waiting up to %.0fs",
                len(self.state.in_flight),
                self.shutdown_timeout,
            )
        else:
            self._hurry = True

    async def on_tick(self, counter: int) -> bool:
        if self._deadline is not None and not self.should_exit:
            await self._drain_tick()
        return await super().on_tick(counter)

    async def _drain_tick(self) -> None:
        now = time.monotonic()
        if self._hurry:
            await self.state.abort_all()
            self.should_exit = True
        elif not self.state.in_flight:
            self.should_exit = True
        elif self._aborted_at is None and now >= self._deadline:
            logger.warning(
                "shutdown timeout: aborting %d request(s) still in flight",
                len(self.state.in_flight),
            )
            self._aborted_at = now
            await self.state.abort_all()
        elif self._aborted_at is not None and now - self._aborted_at >= ABORT_GRACE_S:
            self.should_exit = True


def run_server(
    engine, config: ServerConfig, model_name: str | None = None, sock: socket.socket | None = None
) -> int:
    """Serve ``engine`` until a signal drains and stops it; returns the exit status (0).

    ``sock``, when given, is the socket already bound to ``config.host:config.port``.
    """
    app = build_app(engine, config, model_name)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=not config.disable_uvicorn_access_log,
        http="h11",
        # h11 refuses request heads past this with a bare 400; leave room above our own cap so
        # that moderately large headers get the 431 in OpenAI's shape from the gate.
        h11_max_incomplete_event_size=2 * config.max_header_bytes + 16384,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=int(ABORT_GRACE_S),
        lifespan="on",
    )
    server = DrainingServer(uv_config, app.state.server, config.shutdown_timeout)
    server.run(sockets=[sock] if sock is not None else None)
    return 0

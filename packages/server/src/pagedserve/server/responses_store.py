"""Stored responses: /v1/responses with ``store`` keeps each response, and the conversation that
led to it, in a SQLite file, so that ``previous_response_id`` can continue it (across a restart
of the server too) and ``GET``/``DELETE /v1/responses/{id}`` can find it.

The file is ``--responses-store`` (default ``$PAGEDSERVE_HOME/responses.sqlite3``); it is opened
on first use, so a server that never stores a response never creates it. The store is bounded:
past ``--responses-store-max`` responses, the oldest are deleted as new ones come in.

Each operation opens its own connection in a worker thread (SQLite's connections are cheap, and
the event loop never waits on the disk); WAL journaling lets several servers share one file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_FILE_NAME = "responses.sqlite3"
OFF = "off"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    response TEXT NOT NULL,      -- the response object, as returned
    conversation TEXT NOT NULL   -- its chat messages: the input, then the output
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created_at);
"""


def default_store_path() -> Path:
    home = os.environ.get("PAGEDSERVE_HOME") or str(Path.home() / ".cache" / "pagedserve")
    return Path(home) / DEFAULT_FILE_NAME


@dataclass
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]


class ResponseStore:
    """A bounded table of responses in one SQLite file (``path``), ``max_entries`` at most."""

    def __init__(self, path: str | Path, max_entries: int) -> None:
        self.path = Path(path)
        self.max_entries = max_entries
        self._created = False
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, path: str | None, max_entries: int) -> ResponseStore | None:
        """The store ``--responses-store`` names (None when it is ``off``)."""
        if path == OFF:
            return None
        return cls(path or default_store_path(), max_entries)

    def _connect(self) -> sqlite3.Connection:
        with self._lock:
            if not self._created:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.closing(sqlite3.connect(self.path, timeout=30)) as connection:
                    connection.execute("PRAGMA journal_mode=WAL")
                    connection.executescript(_SCHEMA)
                self._created = True
        return sqlite3.connect(self.path, timeout=30)

    def _put(self, response_id: str, stored: StoredResponse) -> None:
        connection = self._connect()
        try:
            with connection:
                connection.execute(
                    "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?)",
                    (
                        response_id,
                        time.time(),
                        json.dumps(stored.response),
                        json.dumps(stored.conversation),
                    ),
                )
                connection.execute(
                    "DELETE FROM responses WHERE id IN (SELECT id FROM responses "
                    "ORDER BY created_at DESC LIMIT -1 OFFSET ?)",
                    (self.max_entries,),
                )
        finally:
            connection.close()

    def _get(self, response_id: str) -> StoredResponse | None:
        connection = self._connect()
        try:
            row = connection.execute(
                "SELECT response, conversation FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
        finally:
            connection.close()
        if row is None:
            return None
        return StoredResponse(json.loads(row[0]), json.loads(row[1]))

    def _delete(self, response_id: str) -> bool:
        connection = self._connect()
        try:
            with connection:
                cursor = connection.execute("DELETE FROM responses WHERE id = ?", (response_id,))
        finally:
            connection.close()
        return cursor.rowcount > 0

    async def put(self, response_id: str, stored: StoredResponse) -> None:
        await asyncio.to_thread(self._put, response_id, stored)

    async def get(self, response_id: str) -> StoredResponse | None:
        return await asyncio.to_thread(self._get, response_id)

    async def delete(self, response_id: str) -> bool:
        return await asyncio.to_thread(self._delete, response_id)

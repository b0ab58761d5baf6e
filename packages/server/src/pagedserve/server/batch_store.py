"""The Batch API's state: files and batches in SQLite (the standard library's sqlite3), the files'
bytes on disk.

The store is a folder: ``batches.sqlite3`` (tables ``files``, ``batches``, ``batch_answers``),
``files/<file id>`` (each file's bytes, written to a temporary name and renamed, so a file is
whole or absent) and ``lock``. One server at a time: ``BatchStore.open`` takes an exclusive
``flock`` on ``lock`` for the life of the process (the kernel drops it when the process dies,
even by SIGKILL), so a second server on the same folder is refused instead of running the same
batches twice.

Exactly once: a line's answer is a row of ``batch_answers`` keyed by (batch id, line number),
committed as it arrives; a restarted server runs only the lines without a row, and the output
and error files are written from the rows when the batch ends (``finish_batch``, one
transaction that also drops the rows). The database runs in WAL mode with ``synchronous=NORMAL``:
a commit survives the process being killed (not a power cut) without an fsync per answer.

The connection is shared by the event loop and the threads that write whole files
(``asyncio.to_thread``); a lock serialises them.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    object TEXT NOT NULL,               -- the File object, as JSON
    purpose TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    object TEXT NOT NULL,               -- the Batch object, as JSON
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batch_answers (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,              -- 1-based line number in the input file
    succeeded INTEGER NOT NULL,         -- 1: a 2xx response (the output file), 0: the error file
    output TEXT NOT NULL,               -- the output line
    PRIMARY KEY (batch_id, line)
);
"""
# statuses of a batch that a worker still has to move on
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")


class StoreLockedError(RuntimeError):
    """Another process serves the Batch API from this store folder."""


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


class BatchStore:
    """Files and batches of the Batch API in one folder (see the module docstring)."""

    def __init__(self, folder: Path, connection: sqlite3.Connection, lock_fd: int) -> None:
        self.folder = folder
        self._db = connection
        self._lock_fd = lock_fd
        self._mutex = threading.Lock()

    @classmethod
    def open(cls, folder: str | os.PathLike) -> BatchStore:
        """The store in ``folder`` (created if new), locked for this process."""
        folder = Path(folder)
        (folder / "files").mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise StoreLockedError(
                f"the batch store {folder} is in use by another pagedserve server; give this "
                "one its own with --batch-store"
            ) from None
        db = sqlite3.connect(folder / "batches.sqlite3", check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        return cls(folder, db, lock_fd)

    def close(self) -> None:
        with self._mutex:
            self._db.close()
            os.close(self._lock_fd)

    # ---- files ---------------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.folder / "files" / file_id

    def add_file(self, source: BinaryIO, filename: str, purpose: str, created_at: int) -> dict:
        """Copy ``source`` into the store as a new file; its File object."""
        file_id = new_file_id()
        path = self.file_path(file_id)
        partial = path.with_suffix(".partial")
        with open(partial, "wb") as out:
            shutil.copyfileobj(source, out)
        os.replace(partial, path)
        return self._register_file(file_id, filename, purpose, created_at)

    def _register_file(self, file_id: str, filename: str, purpose: str, created_at: int) -> dict:
        size = self.file_path(file_id).stat().st_size
        file = file_object(file_id, size, filename, purpose)
        file["created_at"] = created_at
        with self._mutex, self._db:
            self._db.execute(
                "INSERT INTO files (id, object, purpose, created_at) VALUES (?, ?, ?, ?)",
                (file_id, json.dumps(file), purpose, created_at),
            )
        return file

    def get_file(self, file_id: str) -> dict | None:
        with self._mutex:
            row = self._db.execute("SELECT object FROM files WHERE id = ?", (file_id,)).fetchone()
        return json.loads(row[0]) if row else None

    def list_files(self, purpose: str | None, after: str | None, limit: int, order: str) -> list:
        """Files newest first (``order`` desc) or oldest first, after the file ``after``."""
        direction = "DESC" if order == "desc" else "ASC"
        query = "SELECT object FROM files WHERE (? IS NULL OR purpose = ?)"
        params: list = [purpose, purpose]
        if after is not None:
            sign = "<" if direction == "DESC" else ">"
            query += f" AND (created_at, id) {sign} (SELECT created_at, id FROM files WHERE id = ?)"
            params.append(after)
        query += f" ORDER BY created_at {direction}, id {direction} LIMIT ?"
        with self._mutex:
            rows = self._db.execute(query, (*params, limit)).fetchall()
        return [json.loads(row[0]) for row in rows]

    def delete_file(self, file_id: str) -> bool:
        with self._mutex, self._db:
            deleted = self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        self.file_path(file_id).unlink(missing_ok=True)
        return bool(deleted)

    def read_lines(self, file_id: str) -> list[str]:
        """A file's lines, decoded (raises UnicodeDecodeError for a file that is not UTF-8)."""
        return self.file_path(file_id).read_bytes().decode("utf-8").splitlines()

    # ---- batches -------------------------------------------------------------------------

    def add_batch(self, batch: dict) -> None:
        with self._mutex, self._db:
            self._db.execute(
                "INSERT INTO batches (id, object, status, created_at) VALUES (?, ?, ?, ?)",
                (batch["id"], json.dumps(batch), batch["status"], batch["created_at"]),
            )

    def update_batch(self, batch: dict) -> None:
        with self._mutex, self._db:
            self._db.execute(
                "UPDATE batches SET object = ?, status = ? WHERE id = ?",
                (json.dumps(batch), batch["status"], batch["id"]),
            )

    def get_batch(self, batch_id: str) -> dict | None:
        """The Batch object; while it runs, its request_counts are counted from the answers."""
        with self._mutex:
            row = self._db.execute("SELECT object FROM batches WHERE id = ?", (batch_id,))
            row = row.fetchone()
        if row is None:
            return None
        batch = json.loads(row[0])
        if batch["status"] in ACTIVE_STATUSES:
            completed, failed = self.answer_counts(batch_id)
            batch["request_counts"].update(completed=completed, failed=failed)
        return batch

    def list_batches(self, after: str | None, limit: int) -> list[dict]:
        """Batches newest first, after the batch ``after``."""
        query = "SELECT id FROM batches"
        params: list = []
        if after is not None:
            query += " WHERE (created_at, id) < (SELECT created_at, id FROM batches WHERE id = ?)"
            params.append(after)
        query += " ORDER BY created_at DESC, id DESC LIMIT ?"
        with self._mutex:
            ids = [row[0] for row in self._db.execute(query, (*params, limit)).fetchall()]
        return [self.get_batch(batch_id) for batch_id in ids]

    def active_batch_ids(self) -> list[str]:
        """The batches not yet in a final status, oldest first (a restart resumes them)."""
        marks = ", ".join("?" * len(ACTIVE_STATUSES))
        query = f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY created_at, id"
        with self._mutex:
            return [row[0] for row in self._db.execute(query, ACTIVE_STATUSES).fetchall()]

    # ---- answers -------------------------------------------------------------------------

    def record_answer(self, batch_id: str, line: int, succeeded: bool, output: str) -> None:
        """Keep one line's answer; a second answer to the same line is an IntegrityError."""
        with self._mutex, self._db:
            self._db.execute(
                "INSERT INTO batch_answers (batch_id, line, succeeded, output) VALUES (?, ?, ?, ?)",
                (batch_id, line, int(succeeded), output),
            )

    def answered_lines(self, batch_id: str) -> set[int]:
        with self._mutex:
            rows = self._db.execute(
                "SELECT line FROM batch_answers WHERE batch_id = ?", (batch_id,)
            )
            return {row[0] for row in rows.fetchall()}

    def answer_counts(self, batch_id: str) -> tuple[int, int]:
        """(answers that succeeded, answers that did not) of a running batch."""
        query = "SELECT succeeded, COUNT(*) FROM batch_answers WHERE batch_id = ? GROUP BY 1"
        with self._mutex:
            counts = dict(self._db.execute(query, (batch_id,)).fetchall())
        return counts.get(1, 0), counts.get(0, 0)

    def answers(self, batch_id: str) -> Iterator[tuple[bool, str]]:
        """(succeeded, output line) of each answer, in the input file's order."""
        query = "SELECT succeeded, output FROM batch_answers WHERE batch_id = ? ORDER BY line"
        with self._mutex:
            rows = self._db.execute(query, (batch_id,)).fetchall()
        return ((bool(ok), output) for ok, output in rows)

    def finish_batch(self, batch: dict, files: dict[str, tuple[str, str]], now: int) -> None:
        """End a batch in one transaction: register its written result files (``files``: the
        Batch field, ``output_file_id`` or ``error_file_id``, -> (file id, filename)), store
        ``batch`` with their ids, and drop its answers."""
        rows = []
        for field, (file_id, filename) in files.items():
            size = self.file_path(file_id).stat().st_size
            file = file_object(file_id, size, filename, "batch_output")
            file["created_at"] = now
            rows.append((file_id, json.dumps(file), "batch_output", now))
            batch[field] = file_id
        with self._mutex, self._db:
            self._db.executemany(
                "INSERT INTO files (id, object, purpose, created_at) VALUES (?, ?, ?, ?)", rows
            )
            self._db.execute(
                "UPDATE batches SET object = ?, status = ? WHERE id = ?",
                (json.dumps(batch), batch["status"], batch["id"]),
            )
            self._db.execute("DELETE FROM batch_answers WHERE batch_id = ?", (batch["id"],))

    def write_file(self, lines: list[str]) -> str:
        """Write ``lines`` (JSONL) as a new file's bytes; its id (``finish_batch`` registers it)."""
        file_id = new_file_id()
        path = self.file_path(file_id)
        partial = path.with_suffix(".partial")
        with open(partial, "w", encoding="utf-8") as out:
            out.writelines(line + "\n" for line in lines)
        os.replace(partial, path)
        return file_id


def file_object(file_id: str, size: int, filename: str, purpose: str) -> dict:
    """OpenAI's File object (its ``created_at`` set by the caller)."""
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": 0,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }

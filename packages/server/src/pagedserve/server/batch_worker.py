"""Running the Batch API's batches through OpenAI's statuses, one task per batch, resumed after a
restart.

    validating -> in_progress -> finalizing -> completed
    validating -> failed                 (the input file cannot be read as a batch file)
    validating | in_progress -> cancelling -> cancelled   (POST /v1/batches/{id}/cancel)
    in_progress -> finalizing -> expired (the completion window ended first)

Each active batch is driven by a task of its own; all of them share one ``SequenceBudget``, so
batch lines never hold more than their share of the engine's sequences whatever the number of
batches. A line's answer is committed to the store as it arrives (``BatchStore.record_answer``),
and only lines without an answer are run, so ``start`` after a restart picks every batch up
where it stopped: a validating batch is validated again, an in-progress one runs its remaining
lines, a finalizing or cancelling one writes its files. ``stop`` (the server's shutdown) cancels
the tasks: lines in flight are aborted and give no answer, to run again after the restart.

Malformed lines do not fail a batch (OpenAI fails the whole batch at validation): each gets an
error line in the error file, as ``pagedserve run-batch`` gives it, and the rest run.
Cancelling keeps the answers so far (in the output and error files) and gives none for the
lines not run; expiring gives each line not run an error line with code ``batch_expired``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Collection

from pagedserve.server.batch_lines import MAX_LINES, LineError, error_record, plan_lines
from pagedserve.server.batch_runner import LineAnswer, LineRunner, SequenceBudget, run_lines
from pagedserve.server.batch_store import BatchStore

logger = logging.getLogger("pagedserve.server")

COMPLETION_WINDOWS_S = {"24h": 24 * 3600}  # OpenAI's only window
EXPIRY_CHECK_S = 1.0  # how often a running batch looks at the clock
EXPIRED = LineError(
    "batch_expired", "This request could not be executed before the completion window expired."
)


class BatchNotCancellable(Exception):
    """A batch past the point where it can be cancelled (finalizing or final)."""


def new_batch(
    input_file_id: str, endpoint: str, window: str, metadata: dict | None, now: int
) -> dict:
    """OpenAI's Batch object for a batch just created (status ``validating``)."""
    return {
        "id": f"batch_{uuid.uuid4().hex}",
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": None,
        "expires_at": now + COMPLETION_WINDOWS_S[window],
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
    }


class BatchWorker:
    """Drives the batches of ``store`` with ``runner`` under ``budget`` (module docstring).

    ``served_urls``: the app's POST routes (what a line may name). ``clock``: seconds since the
    epoch, looked at every ``expiry_check_s`` while a batch runs (a test moves it on past a
    batch's window).
    """

    def __init__(
        self,
        store: BatchStore,
        runner: LineRunner,
        budget: SequenceBudget,
        served_urls: Collection[str],
        clock: Callable[[], float] = time.time,
        expiry_check_s: float = EXPIRY_CHECK_S,
    ) -> None:
        self.store = store
        self.runner = runner
        self.budget = budget
        self.served_urls = served_urls
        self.clock = clock
        self.expiry_check_s = expiry_check_s
        self._tasks: dict[str, asyncio.Task] = {}
        self._cancelled: dict[str, asyncio.Event] = {}

    def now(self) -> int:
        return int(self.clock())

    def start(self) -> None:
        """Drive every batch the store holds unfinished (a restart resumes them)."""
        for batch_id in self.store.active_batch_ids():
            self._drive(batch_id)

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def wait(self, batch_id: str) -> None:
        """Until the batch's task is done (its final status, or stopped)."""
        task = self._tasks.get(batch_id)
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    # ---- what the routes ask ----------------------------------------------------------

    def create(self, input_file_id: str, endpoint: str, window: str, metadata: dict | None):
        batch = new_batch(input_file_id, endpoint, window, metadata, self.now())
        self.store.add_batch(batch)
        self._drive(batch["id"])
        return batch

    def cancel(self, batch_id: str) -> dict:
        """Move a validating or in-progress batch to ``cancelling`` (its task stops its lines
        and writes what was answered); a cancelling one is returned as it is."""
        batch = self.store.get_batch(batch_id)
        if batch["status"] in ("validating", "in_progress"):
            batch = self._transition(batch_id, batch["status"], status="cancelling")
            self._cancelled.setdefault(batch_id, asyncio.Event()).set()
        elif batch["status"] != "cancelling":
            raise BatchNotCancellable(f"a batch that is {batch['status']} cannot be cancelled")
        return batch

    # ---- driving a batch ----------------------------------------------------------------

    def _drive(self, batch_id: str) -> None:
        task = asyncio.create_task(self._run_batch(batch_id), name=f"batch {batch_id}")
        self._tasks[batch_id] = task
        task.add_done_callback(lambda done: self._done(batch_id, done))

    def _done(self, batch_id: str, task: asyncio.Task) -> None:
        self._tasks.pop(batch_id, None)
        self._cancelled.pop(batch_id, None)
        if not task.cancelled() and task.exception() is not None:
            logger.error(
                "batch %s stopped; it resumes when the server restarts",
                batch_id,
                exc_info=task.exception(),
            )

    async def _run_batch(self, batch_id: str) -> None:
        while True:
            status = self.store.get_batch(batch_id)["status"]
            if status == "validating":
                await self._validate(batch_id)
            elif status == "in_progress":
                await self._answer_lines(batch_id)
            elif status in ("finalizing", "cancelling"):
                await self._finalize(batch_id)
            else:
                return

    def _transition(self, batch_id: str, expected: str, **changes) -> dict | None:
        """Apply ``changes`` if the batch is still ``expected`` (a cancel may have come in
        while its task awaited); a new status stamps its ``<status>_at`` the first time. The
        stored batch, or None.

        Runs without an await, so no other coroutine changes the batch in between."""
        batch = self.store.get_batch(batch_id)
        if batch["status"] != expected:
            return None
        batch.update(changes)
        status = changes.get("status")
        if status is not None and batch.get(f"{status}_at") is None:
            batch[f"{status}_at"] = self.now()
        self.store.update_batch(batch)
        return batch

    async def _validate(self, batch_id: str) -> None:
        batch = self.store.get_batch(batch_id)
        try:
            lines = await asyncio.to_thread(self.store.read_lines, batch["input_file_id"])
        except (OSError, UnicodeDecodeError) as e:
            return self._fail(batch_id, "invalid_file", f"the input file cannot be read: {e}")
        total = sum(1 for line in lines if line.strip())
        if total == 0:
            return self._fail(batch_id, "empty_file", "the input file has no request lines")
        if total > MAX_LINES:
            message = f"the input file has {total} requests; a batch holds at most {MAX_LINES}"
            return self._fail(batch_id, "too_many_requests", message)
        counts = {"total": total, "completed": 0, "failed": 0}
        self._transition(batch_id, "validating", status="in_progress", request_counts=counts)

    def _fail(self, batch_id: str, code: str, message: str) -> None:
        error = {"code": code, "message": message, "param": "input_file_id", "line": None}
        errors = {"object": "list", "data": [error]}
        self._transition(batch_id, "validating", status="failed", errors=errors)

    def _expired(self, batch: dict) -> bool:
        return self.now() >= batch["expires_at"]

    async def _plan(self, batch: dict):
        lines = await asyncio.to_thread(self.store.read_lines, batch["input_file_id"])
        return plan_lines(lines, self.served_urls, batch["endpoint"], priority_is_fixed=True)

    async def _answer_lines(self, batch_id: str) -> None:
        """Run the lines without an answer until they are done, the batch is cancelled or its
        window ends; then on to finalizing (unless cancelling)."""
        batch = self.store.get_batch(batch_id)
        cancelled = self._cancelled.setdefault(batch_id, asyncio.Event())
        if not self._expired(batch):
            answered = self.store.answered_lines(batch_id)
            todo = [line for line in await self._plan(batch) if line.number not in answered]

            def record(answer: LineAnswer) -> None:
                line = answer.line.number
                self.store.record_answer(batch_id, line, answer.succeeded, answer.json())

            run = asyncio.create_task(run_lines(todo, self.runner, self.budget, record))
            stop = asyncio.create_task(cancelled.wait())
            try:
                while not run.done() and not stop.done() and not self._expired(batch):
                    await asyncio.wait(
                        {run, stop},
                        timeout=self.expiry_check_s,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
            finally:
                stop.cancel()
                run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            if run.done() and not run.cancelled() and run.exception() is not None:
                raise run.exception()
        self._transition(batch_id, "in_progress", status="finalizing")

    async def _finalize(self, batch_id: str) -> None:
        """Write the output and error files from the answers and end the batch: cancelled,
        expired (each line not run gets a batch_expired error line) or completed.

        A finalizing batch has every line answered unless its window ended first
        (``_answer_lines`` moves it on only then), so lines without an answer mean expired."""
        batch = self.store.get_batch(batch_id)
        unanswered = []
        if batch["status"] == "finalizing":
            answered = self.store.answered_lines(batch_id)
            unanswered = [line for line in await self._plan(batch) if line.number not in answered]
        final = {"cancelling": "cancelled"}.get(batch["status"])
        final = final or ("expired" if unanswered else "completed")
        outputs: list[str] = []
        errors: list[str] = []
        for succeeded, output in self.store.answers(batch_id):
            (outputs if succeeded else errors).append(output)
        errors += [json.dumps(error_record(line, EXPIRED)) for line in unanswered]
        files = {}
        for field, lines, kind in (
            ("output_file_id", outputs, "output"),
            ("error_file_id", errors, "error"),
        ):
            if lines:
                file_id = await asyncio.to_thread(self.store.write_file, lines)
                files[field] = (file_id, f"{batch_id}_{kind}.jsonl")
        batch = self.store.get_batch(batch_id)
        batch["request_counts"].update(completed=len(outputs), failed=len(errors))
        batch["status"] = final
        batch[f"{final}_at"] = self.now()
        self.store.finish_batch(batch, files, self.now())

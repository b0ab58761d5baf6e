"""OpenAI's batch file format: one request per input line, one answer per output line.

An input line is ``{"custom_id", "method": "POST", "url", "body"}``. Its answer is one of

- ``{"id": "batch_req_...", "custom_id", "response": {"status_code", "request_id", "body"},
  "error": null}`` when the server answered the request, whatever the status (a 400's body is
  the error in OpenAI's shape, as OpenAI's own error files hold it);
- ``{"id", "custom_id", "response": null, "error": {"code", "message", "line"}}`` when the line
  itself could not be run: not JSON, no ``custom_id``, a url this server does not serve, a
  streamed body... (``line``, its 1-based line number, is pagedserve's: it names lines that have
  no usable ``custom_id``).

Both runners of batch files, ``pagedserve run-batch`` and the server's Batch API, read files
with ``plan_lines`` and answer the lines with ``batch_runner.LineRunner``, so that one file gives
the same answers through either. Every line is answered exactly once: a runnable line is known
by its ``custom_id`` (a ``custom_id`` seen earlier in the file makes the later line an error
line), an error line by its line number (``answer_key``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

# OpenAI's batch endpoints that a pagedserve server may serve (a line may name only these)
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
MAX_LINES = 50_000  # OpenAI's cap on the requests of one batch


@dataclass(frozen=True)
class LineError:
    """Why a line cannot be run: answered with an error line instead of a response."""

    code: str
    message: str


@dataclass
class BatchLine:
    """One request line of a batch file, planned: runnable (``error`` is None) or not."""

    number: int  # 1-based line number in the file
    custom_id: str | None
    url: str = ""
    body: dict = field(default_factory=dict)
    error: LineError | None = None

    @property
    def key(self) -> str:
        """What identifies this line's answer in an output: its custom_id, or for an error
        line its line number (``answer_key`` reads the same from an output line)."""
        return f"line:{self.number}" if self.error is not None else f"id:{self.custom_id}"

    @property
    def num_sequences(self) -> int:
        """The engine sequences this line asks for: its prompts (a completion's list of
        prompts) times its choices (``n``, or the beam width ``best_of``)."""
        if self.error is not None:
            return 0
        choices = max(_positive_int(self.body.get("n")), _positive_int(self.body.get("best_of")))
        prompt = self.body.get("prompt")
        prompts = 1
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompts = len(prompt)
        return choices * prompts


def _positive_int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def plan_lines(
    lines: Iterable[str],
    served_urls: Collection[str],
    endpoint: str | None = None,
    priority_is_fixed: bool = False,
) -> list[BatchLine]:
    """Each non-blank line of a batch file as a ``BatchLine``, checked.

    ``served_urls``: the POST routes of the server that will answer the lines (a line naming
    one of OpenAI's batch urls that it does not serve, such as /v1/embeddings without an
    embedding model, is an error line). ``endpoint``: the Batch API's batch endpoint, which every
    line's url must be. ``priority_is_fixed``: the runner sets each request's priority (the Batch
    API's), so a body that sets its own is an error line rather than silently overridden.
    """
    planned: list[BatchLine] = []
    seen: set[str] = set()
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        line = _plan_line(number, text, served_urls, endpoint, priority_is_fixed)
        if line.error is None and line.custom_id in seen:
            message = f"custom_id {line.custom_id!r} is used by an earlier line of the file"
            line.error = LineError("duplicate_custom_id", message)
        if line.error is None:
            seen.add(line.custom_id)
        planned.append(line)
    return planned


def _plan_line(
    number: int, text: str, served_urls: Collection[str], endpoint: str | None, fixed: bool
) -> BatchLine:
    try:
        request = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        return BatchLine(number, None, error=LineError("invalid_json", f"not JSON: {e}"))
    if not isinstance(request, dict):
        return BatchLine(number, None, error=LineError("invalid_json", "not a JSON object"))
    custom_id = request.get("custom_id")
    line = BatchLine(number, custom_id if isinstance(custom_id, str) else None)
    line.error = _line_error(request, line.custom_id, served_urls, endpoint, fixed)
    if line.error is None:
        line.url, line.body = request["url"], request["body"]
    return line


def _line_error(
    request: dict,
    custom_id: str | None,
    served_urls: Collection[str],
    endpoint: str | None,
    fixed: bool,
) -> LineError | None:
    """The first thing wrong with a parsed line, in the order a reader would check them."""
    if not custom_id:
        return LineError("missing_custom_id", "custom_id must be a non-empty string")
    if request.get("method") != "POST":
        return LineError("invalid_method", f"method must be 'POST', got {request.get('method')!r}")
    url, body = request.get("url"), request.get("body")
    if url not in BATCH_URLS:
        return LineError("invalid_url", f"url must be one of {', '.join(BATCH_URLS)}; got {url!r}")
    if url not in served_urls:
        message = f"{url} is not served here: this server has no route POST {url}"
        if url == "/v1/embeddings":
            message += " (pagedserve serves no embedding models yet)"
        return LineError("unsupported_url", message)
    if endpoint is not None and url != endpoint:
        return LineError(
            "mismatched_endpoint", f"the line's url {url} is not the batch's endpoint {endpoint}"
        )
    if not isinstance(body, dict):
        return LineError("invalid_body", "body must be a JSON object (the request's body)")
    if body.get("stream"):
        return LineError("invalid_body", "stream is not supported in a batch: leave it out")
    if fixed and "priority" in body:
        return LineError(
            "invalid_body",
            "priority is set by the server for Batch API requests (--batch-priority): leave it "
            "out of the line's body",
        )
    return None


def new_answer_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def error_record(line: BatchLine, error: LineError | None = None) -> dict:
    """The output line of a line that was not run (``error``, or the line's own)."""
    error = error or line.error
    return {
        "id": new_answer_id(),
        "custom_id": line.custom_id,
        "response": None,
        "error": {"code": error.code, "message": error.message, "line": line.number},
    }


def response_record(line: BatchLine, status_code: int, body: object) -> dict:
    """The output line of a request the server answered (any status)."""
    request_id = body.get("id") if isinstance(body, dict) else None
    return {
        "id": new_answer_id(),
        "custom_id": line.custom_id,
        "response": {
            "status_code": status_code,
            "request_id": request_id if isinstance(request_id, str) else new_answer_id(),
            "body": body,
        },
        "error": None,
    }


def answer_key(record: dict) -> str | None:
    """The ``BatchLine.key`` an output line answers (None for a line that is not an answer)."""
    error = record.get("error")
    if isinstance(error, dict) and isinstance(error.get("line"), int):
        return f"line:{error['line']}"
    custom_id = record.get("custom_id")
    return f"id:{custom_id}" if isinstance(custom_id, str) else None


def answered_keys(output_lines: Iterable[str]) -> set[str]:
    """The keys of the lines an earlier run answered, from its output (a resumed run skips
    them). A line that is not a whole answer (a run killed mid-write) answers nothing."""
    keys = set()
    for text in output_lines:
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            continue
        key = answer_key(record) if isinstance(record, dict) else None
        if key is not None:
            keys.add(key)
    return keys

"""``pagedserve run-batch``: a file of OpenAI batch requests answered offline, with no server.

    pagedserve run-batch -i requests.jsonl -o results.jsonl [MODEL] [engine and server options]

Each input line is OpenAI's batch request (``custom_id``, ``method``, ``url``: /v1/chat/completions,
/v1/completions or /v1/responses, ``body``); each gets one output line in OpenAI's format
(batch_lines.py), written as it is answered, so the output's order is the order the answers
came in: match them by ``custom_id``. A bad line gets an error line and the run goes on.

Resumable: run again on the same output and the lines it already answers are skipped (a line
half written by a killed run is dropped and answered again). ``-`` reads the input from stdin or
writes the output to stdout (which cannot be resumed). A tqdm bar on stderr shows the lines and
the completion tokens per second.

The lines are answered by the server's own app, in process (``LineRunner``), exactly as
``pagedserve serve`` answers the same requests and as its Batch API answers the same file, with
up to twice ``--max-num-seqs`` sequences submitted at once (the engine's waiting queue stays
full).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from pagedserve.engine import EngineArgs
from pagedserve.server.batch_lines import answered_keys, plan_lines
from pagedserve.server.batch_runner import (
    LineAnswer,
    LineRunner,
    SequenceBudget,
    run_lines,
    served_post_paths,
)
from pagedserve.server.config import ServerConfig

# the server options that shape answers (the rest are about listening and have no use here)
ANSWER_OPTIONS = (
    "served_model_name",
    "chat_template",
    "tool_call_parser",
    "reasoning_parser",
    "return_tokens_as_token_ids",
    "max_body_bytes",
    "max_n",
    "max_prompts",
    "max_stop",
    "max_stop_length",
    "lora_modules",
    "responses_store",
    "responses_store_max",
    "otlp_traces_endpoint",
)


def read_input(path: str) -> list[str]:
    if path == "-":
        return sys.stdin.read().splitlines()
    return Path(path).read_text(encoding="utf-8").splitlines()


def resume_output(path: str) -> set[str]:
    """The keys of the lines an earlier run wrote to ``path`` (after dropping a last line that
    a killed run left half written); nothing for stdout or a new file."""
    if path == "-" or not os.path.exists(path):
        return set()
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)
            data = data[: data.rfind(b"\n") + 1]
    return answered_keys(data.decode("utf-8", errors="replace").splitlines())


async def answer_file(app, lines: list[str], output: str, capacity: int) -> dict[str, int]:
    """Answer the batch ``lines`` through ``app`` into ``output`` (appending to what an earlier
    run answered); counts of what was done."""
    from tqdm import tqdm

    plan = plan_lines(lines, served_post_paths(app))
    done = resume_output(output)
    todo = [line for line in plan if line.key not in done]
    counts = {"lines": len(plan), "skipped": len(plan) - len(todo), "succeeded": 0, "failed": 0}
    runner = LineRunner(app)
    out = sys.stdout if output == "-" else open(output, "a", encoding="utf-8")
    bar = tqdm(total=len(plan), initial=counts["skipped"], unit="req", desc="run-batch")
    start, tokens = time.monotonic(), 0

    def write(answer: LineAnswer) -> None:
        nonlocal tokens
        out.write(answer.json() + "\n")
        out.flush()
        counts["succeeded" if answer.succeeded else "failed"] += 1
        tokens += answer.completion_tokens
        rate = tokens / max(time.monotonic() - start, 1e-9)
        bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)
        bar.update()

    try:
        await run_lines(todo, runner, SequenceBudget(capacity), write)
    finally:
        bar.close()
        await runner.aclose()
        if out is not sys.stdout:
            out.close()
    counts["completion_tokens"] = tokens
    counts["seconds"] = round(time.monotonic() - start, 2)
    return counts


async def run_batch(
    engine_args: EngineArgs, config: ServerConfig, name: str, input_file: str, output_file: str
) -> int:
    """``pagedserve run-batch``: the engine, the app serving it as ``name``, every line of
    ``input_file`` answered into ``output_file``; a summary on stderr."""
    from pagedserve.engine import AsyncLLM
    from pagedserve.server.app import build_app
    from pagedserve.server.serving_models import load_startup_adapters

    lines = read_input(input_file)
    engine = AsyncLLM(engine_args)
    app = build_app(engine, config, name)
    try:
        await load_startup_adapters(app.state.server)
        counts = await answer_file(app, lines, output_file, 2 * engine_args.max_num_seqs)
    finally:
        await engine.shutdown()
        if app.state.server.tracer is not None:
            app.state.server.tracer.shutdown()
    print(
        f"{counts['lines']} lines: {counts['succeeded']} answered, {counts['failed']} failed, "
        f"{counts['skipped']} answered by an earlier run; {counts['completion_tokens']} "
        f"completion tokens in {counts['seconds']}s",
        file=sys.stderr,
    )
    return 0

"""OpenAI's batch line format as both runners read it (every line planned, bad ones as error
lines, custom_ids unique), the keys a resumed run skips by, and the sequence budget that caps
how many lines run at once."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedserve.server.batch_lines import (
    BatchLine,
    answer_key,
    answered_keys,
    error_record,
    plan_lines,
    response_record,
)
from pagedserve.server.batch_runner import LineAnswer, SequenceBudget, run_lines
from pagedserve.server.testing import batch_line

SERVED = {"/v1/chat/completions", "/v1/completions", "/v1/responses"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def codes(lines: list[BatchLine]) -> list[str | None]:
    return [line.error.code if line.error else None for line in lines]


def test_every_non_blank_line_is_planned_and_each_bad_one_says_why():
    text = [
        batch_line("a", "/v1/chat/completions", CHAT),
        "",
        "{not json",
        "[1, 2]",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
        json.dumps({"custom_id": "b", "method": "GET", "url": "/v1/completions", "body": {}}),
        batch_line("c", "/v1/images/generations", {}),
        batch_line("d", "/v1/embeddings", {"input": "x"}),
        batch_line("e", "/v1/completions", ["not", "an", "object"]),
        batch_line("f", "/v1/completions", {"prompt": "x", "stream": True}),
        batch_line("a", "/v1/completions", {"prompt": "x"}),
        batch_line("g", "/v1/completions", {"prompt": "x"}),
    ]
    lines = plan_lines(text, SERVED)
    assert [line.number for line in lines] == [1, *range(3, 13)]  # the blank line 2 is no line
    assert codes(lines) == [
        None,
        "invalid_json",
        "invalid_json",
        "missing_custom_id",
        "invalid_method",
        "invalid_url",
        "unsupported_url",
        "invalid_body",
        "invalid_body",
        "duplicate_custom_id",
        None,
    ]
    assert "embedding" in lines[6].error.message
    assert lines[0].url == "/v1/chat/completions" and lines[0].body == CHAT


def test_the_batch_api_holds_lines_to_its_endpoint_and_its_priority():
    text = [
        batch_line("a", "/v1/chat/completions", CHAT),
        batch_line("b", "/v1/completions", {"prompt": "x"}),
        batch_line("c", "/v1/chat/completions", {**CHAT, "priority": -5}),
    ]
    lines = plan_lines(text, SERVED, endpoint="/v1/chat/completions", priority_is_fixed=True)
    assert codes(lines) == [None, "mismatched_endpoint", "invalid_body"]
    assert "priority" in lines[2].error.message
    assert codes(plan_lines(text, SERVED)) == [None, None, None]  # run-batch: the line's own


@pytest.mark.parametrize(
    ("body", "sequences"),
    [
        ({"prompt": "x"}, 1),
        ({"prompt": ["x", "y", "z"], "n": 2}, 6),
        ({"prompt": [[1, 2], [3]]}, 2),
        ({"prompt": [1, 2, 3]}, 1),  # one prompt of token ids
        ({"prompt": "x", "n": 2, "best_of": 4}, 4),
        ({"prompt": "x", "n": "many"}, 1),
    ],
)
def test_a_line_counts_the_sequences_it_asks_for(body, sequences):
    (line,) = plan_lines([batch_line("a", "/v1/completions", body)], SERVED)
    assert line.num_sequences == sequences


def test_output_lines_name_the_line_they_answer():
    ok, bad, duplicate = plan_lines(
        [
            batch_line("a", "/v1/completions", {"prompt": "x"}),
            "oops",
            batch_line("a", "/v1/completions", {}),
        ],
        SERVED,
    )
    answered = response_record(ok, 200, {"id": "cmpl-1", "choices": []})
    assert answered["response"]["request_id"] == "cmpl-1" and answered["error"] is None
    assert answer_key(answered) == ok.key == "id:a"
    failed = error_record(bad)
    assert failed["response"] is None and failed["error"]["line"] == 2
    assert answer_key(failed) == bad.key == "line:2"
    # a repeated custom_id is known by its line, so it does not pass for the first one's answer
    assert answer_key(error_record(duplicate)) == duplicate.key == "line:3"
    half_written = json.dumps(answered)[:40]
    outputs = [json.dumps(answered), json.dumps(failed), half_written]
    assert answered_keys(outputs) == {"id:a", "line:2"}


class CountingRunner:
    """Answers after a short wait, counting how many lines it holds at once."""

    def __init__(self, budget: SequenceBudget) -> None:
        self.budget = budget
        self.running = self.most = 0
        self.order: list[int] = []

    async def answer(self, line: BatchLine) -> LineAnswer:
        self.order.append(line.number)
        if line.error is not None:
            return LineAnswer(line, error_record(line), succeeded=False)
        self.running += line.num_sequences
        self.most = max(self.most, self.running)
        assert self.budget.in_use <= self.budget.capacity
        await asyncio.sleep(0.01)
        self.running -= line.num_sequences
        return LineAnswer(line, response_record(line, 200, {}), succeeded=True)


def test_run_lines_keeps_to_the_budget_and_starts_lines_in_file_order():
    text = [
        batch_line(f"c{i}", "/v1/completions", {"prompt": "x", "n": 1 + i % 3}) for i in range(30)
    ]
    text.insert(5, "bad line")
    lines = plan_lines(text, SERVED)
    budget = SequenceBudget(4)
    runner = CountingRunner(budget)
    answers: list[LineAnswer] = []
    asyncio.run(run_lines(lines, runner, budget, answers.append))
    assert sorted(a.line.number for a in answers) == [line.number for line in lines]
    assert runner.order == [line.number for line in lines]
    assert runner.most == 4  # full, never over
    assert budget.in_use == 0


def test_a_line_wider_than_the_budget_runs_alone():
    lines = plan_lines(
        [batch_line(f"c{i}", "/v1/completions", {"prompt": "x", "n": 9}) for i in range(3)], SERVED
    )
    budget = SequenceBudget(4)
    runner = CountingRunner(budget)
    asyncio.run(run_lines(lines, runner, budget, lambda answer: None))
    assert runner.most == 9 and len(runner.order) == 3  # one at a time


def test_a_failing_answer_stops_the_run_and_cancels_the_lines_in_flight():
    class FailingRunner(CountingRunner):
        async def answer(self, line):
            if line.number == 3:
                raise RuntimeError("the engine died")
            return await super().answer(line)

    lines = plan_lines(
        [batch_line(f"c{i}", "/v1/completions", {"prompt": "x"}) for i in range(20)], SERVED
    )
    budget = SequenceBudget(2)
    answers: list[LineAnswer] = []
    with pytest.raises(RuntimeError, match="engine died"):
        asyncio.run(run_lines(lines, FailingRunner(budget), budget, answers.append))
    assert len(answers) < 5 and budget.in_use == 0

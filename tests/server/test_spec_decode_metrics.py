"""Speculative decoding's counters and rates on /metrics, as the engine's stats give them."""

from __future__ import annotations

from types import SimpleNamespace

from pagedserve.engine import EngineStats
from pagedserve.server.metrics import EngineMetrics


class _Engine:
    scheduler_config = SimpleNamespace(max_model_len=64)

    def get_stats(self, drain: bool = True) -> EngineStats:
        return EngineStats(
            spec_decode_num_drafts=10,
            spec_decode_num_draft_tokens=40,
            spec_decode_num_accepted_tokens=30,
            spec_decode_num_emitted_tokens=40,
        )


def test_spec_decode_metrics_are_exported():
    body = EngineMetrics(_Engine(), "m").render().decode()
    lines = {line.split("{")[0]: line.split()[-1] for line in body.splitlines() if line[:1] != "#"}
    assert float(lines["pagedserve:spec_decode_num_draft_tokens_total"]) == 40
    assert float(lines["pagedserve:spec_decode_num_accepted_tokens_total"]) == 30
    assert float(lines["pagedserve:spec_decode_acceptance_rate"]) == 0.75
    assert float(lines["pagedserve:spec_decode_mean_acceptance_length"]) == 4.0

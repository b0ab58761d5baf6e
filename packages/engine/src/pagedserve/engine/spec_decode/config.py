"""SpeculativeConfig: how tokens are proposed for the target model to verify, as vLLM spells it.

The same dict from Python (``LLM(..., speculative_config={...})``) and from the command line
(``--speculative-config '{"method": "ngram", ...}'``)::

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}
    {"model": PATH, "num_speculative_tokens": 4}     # vLLM's older spelling: method inferred

Without "method", vLLM infers it from "model": "ngram" (or "[ngram]") is the n-gram proposer,
anything else a draft model's folder.

Every check runs at start-up, and each failure names the field at fault as
``speculative_config.<field>``: a bad configuration never reaches a request.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagedserve.engine.config import ConfigFieldError, config_dict, option

METHODS = ("ngram", "draft_model")


class SpeculativeConfigError(ConfigFieldError):
    """An invalid speculative configuration; ``param`` is the field at fault."""

    config_name = "speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = option("ngram", "how tokens are proposed: ngram (prompt lookup) or draft_model")
    num_speculative_tokens: int = option(4, "tokens proposed per sequence per step (k)")
    prompt_lookup_min: int | None = option(
        None, "ngram: shortest suffix matched against the sequence (default: prompt_lookup_max)"
    )
    prompt_lookup_max: int | None = option(
        None, "ngram: longest suffix matched (default: prompt_lookup_min, or 5 if neither)"
    )
    model: str | None = option(None, "draft_model: the draft model's folder")

    @classmethod
    def from_dict(cls, value: dict[str, Any] | str | SpeculativeConfig) -> SpeculativeConfig:
        """Parse vLLM's dict (or its JSON text); unknown keys are refused by name."""
        if isinstance(value, SpeculativeConfig):
            return value
        value = config_dict(value, SpeculativeConfigError)
        known = {f.name for f in fields(cls)}
        for key in value:
            if key not in known:
                raise SpeculativeConfigError(key, f"unknown field; known: {sorted(known)}")
        if "method" not in value:
            value = {**value, "method": _inferred_method(value)}
            if value["method"] == "ngram":
                del value["model"]
        return cls(**value)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(
                "method", f"unknown method {self.method!r}: one of {list(METHODS)}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise SpeculativeConfigError(
                "num_speculative_tokens", f"must be an int >= 1, got {k!r}"
            )
        if self.method == "ngram":
            self._resolve_lookup()
        elif not self.model:
            raise SpeculativeConfigError("model", "draft_model needs the draft model's folder")

    def _resolve_lookup(self) -> None:
        """vLLM's defaults: one bound given sets the other; neither gives 5 and 5."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        for name, n in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
                raise SpeculativeConfigError(name, f"must be an int >= 1, got {n!r}")
        if low is None and high is None:
            low = high = 5
        low = high if low is None else low
        high = low if high is None else high
        if low > high:
            raise SpeculativeConfigError(
                "prompt_lookup_min", f"must be <= prompt_lookup_max ({low} > {high})"
            )
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)


def _inferred_method(value: dict[str, Any]) -> str:
    """vLLM's older spelling names no method: ``model`` says which proposer is meant."""
    model = value.get("model")
    if not model:
        raise SpeculativeConfigError(
            "method", f"required (or a draft 'model' to infer it from): one of {list(METHODS)}"
        )
    return "ngram" if model in ("ngram", "[ngram]") else "draft_model"

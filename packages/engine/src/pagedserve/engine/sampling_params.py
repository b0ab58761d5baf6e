"""SamplingParams: how to pick each next token and when to stop, with vLLM's names.

Every field is validated here, at the edge, with an ``InvalidRequestError`` (a ValueError) whose
``param`` names the field, so the server can turn it into a 400 that says which parameter is
wrong. What needs the model (token ids inside the vocabulary) is the engine's check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.structured_output.params import StructuredOutputsParams
from pagedserve.kernels.sampling import GREEDY_TEMPERATURE

# vLLM's seed range: a signed 64-bit integer (torch.long), refused beyond as its server does
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20  # the engine's default cap (EngineArgs.max_logprobs), checked at add_request


class RequestOutputKind(IntEnum):
    """What each RequestOutput of a request carries (vLLM's ``SamplingParams.output_kind``).

    CUMULATIVE: every output is a snapshot of the whole text and tokens so far (costs O(length)
    per step to copy). DELTA: each output carries only what is new since the request's last
    output (text, token ids, logprobs; ``cumulative_logprob`` stays cumulative, the finish
    reason comes on the last): what a streaming server sends. FINAL_ONLY: no output until the
    request finishes, then one cumulative output: what offline ``LLM.generate`` and a
    non-streaming server need.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these tokens may be drawn
    allowed_token_ids: list[int] | None = None
    # vLLM's: words that are never written (each word's tokens, with and without a leading
    # space: the last token of one is masked once the ones before it are out)
    bad_words: list[str] | None = None
    # vLLM's thinking budget: after this many tokens inside the thinking, the end of the
    # thinking is forced; the thinking's start and end are token ids a reasoning parser names
    # (the server sets them from --reasoning-parser), and ``thinking_starts_open`` says the
    # output starts inside the thinking though no start tag opened it (a model that thinks
    # without writing its start tag)
    thinking_token_budget: int | None = None
    thinking_start_token_ids: list[int] | None = None
    thinking_end_token_ids: list[int] | None = None
    thinking_starts_open: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's arguments for plugins; pagedserve reads one: "kv_transfer_params" (a dict for the
    # engine's KV connector: a disaggregated prefill's or decode's part, tcp_connector.py)
    extra_args: dict | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k in (-1, None):
            self.top_k = 0
        self.structured_outputs = _structured_outputs(self.structured_outputs)
        self.output_kind = _output_kind(self.output_kind)
        self._validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def _require(self, ok: bool, name: str, message: str) -> None:
        if not ok:
            raise InvalidRequestError(f"{name} {message}, got {getattr(self, name)!r}", name)

    def _validate(self) -> None:
        check = self._require
        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        if self.best_of is not None:
            check(
                isinstance(self.best_of, int) and self.best_of >= self.n, "best_of", "must be >= n"
            )
        check(self.temperature >= 0.0, "temperature", "must be non-negative")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(
            isinstance(self.top_k, int) and self.top_k >= 0,
            "top_k",
            "must be 0 or -1 (disabled), or a positive integer",
        )
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(self.repetition_penalty > 0.0, "repetition_penalty", "must be positive")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        self._validate_lengths()
        self._validate_outputs_and_stops()
        self._validate_token_constraints()
        if self.extra_args is not None:
            self._validate_extra_args()
        if self.use_beam_search:
            self._validate_beam_search()
        elif self.best_of not in (None, self.n):
            raise InvalidRequestError(
                f"best_of is only used by beam search (its beam width); got best_of={self.best_of} "
                f"with n={self.n}: use n to ask for several samples",
                "best_of",
            )

    def _validate_lengths(self) -> None:
        if self.max_tokens is not None:
            self._require(
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                "max_tokens",
                "must be at least 1",
            )
        self._require(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be >= 0"
        )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}",
                "min_tokens",
            )

    def _validate_outputs_and_stops(self) -> None:
        check = self._require
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                check(isinstance(value, int) and value >= 0, name, "must be an integer >= 0")
        if self.seed is not None:
            check(
                isinstance(self.seed, int) and SEED_MIN <= self.seed <= SEED_MAX,
                "seed",
                "must be a signed 64-bit integer, in [-2**63, 2**63 - 1]",
            )
        check(
            all(isinstance(s, str) and s for s in self.stop_strings),
            "stop",
            "must be non-empty strings",
        )
        check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be token ids",
        )
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or token < 0 or not -100.0 <= float(bias) <= 100.0:
                raise InvalidRequestError(
                    "logit_bias must map token ids to values in [-100, 100], "
                    f"got {token!r}: {bias!r}",
                    "logit_bias",
                )

    def _validate_token_constraints(self) -> None:
        check = self._require
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            check(
                isinstance(ids, list)
                and bool(ids)
                and all(isinstance(t, int) and t >= 0 for t in ids),
                "allowed_token_ids",
                "must be a non-empty list of token ids",
            )
        if self.bad_words is not None:
            check(
                all(isinstance(w, str) and w.strip() for w in self.bad_words),
                "bad_words",
                "must be non-empty strings",
            )
        if self.thinking_token_budget is not None:
            check(
                isinstance(self.thinking_token_budget, int) and self.thinking_token_budget >= 0,
                "thinking_token_budget",
                "must be an integer >= 0",
            )
            for name in ("thinking_start_token_ids", "thinking_end_token_ids"):
                ids = getattr(self, name)
                check(
                    bool(ids) and all(isinstance(t, int) and t >= 0 for t in ids),
                    name,
                    "must name the thinking's tokens when thinking_token_budget is set (a "
                    "reasoning parser gives them)",
                )

    @property
    def kv_transfer_params(self) -> dict | None:
        """vLLM's ``extra_args["kv_transfer_params"]``: the request's words to a KV connector."""
        return (self.extra_args or {}).get("kv_transfer_params")

    def _validate_extra_args(self) -> None:
        extra = self.extra_args
        self._require(isinstance(extra, dict), "extra_args", "must be a dict")
        unknown = sorted(set(extra) - {"kv_transfer_params"})
        if unknown:
            raise InvalidRequestError(
                f"extra_args {unknown} are read by no part of pagedserve (it reads "
                "kv_transfer_params only)",
                "extra_args",
            )
        if not isinstance(extra["kv_transfer_params"], dict):
            raise InvalidRequestError("kv_transfer_params must be a dict", "kv_transfer_params")

    def _validate_beam_search(self) -> None:
        """Beam search is deterministic: it takes no sampling knobs, stop strings or logprobs.
        Its ``stop_token_ids`` end a hypothesis as EOS does."""
        if self.temperature != 0.0:
            raise InvalidRequestError(
                "temperature must be 0 with beam search (it is deterministic)", "temperature"
            )
        unsupported = {
            "top_p": self.top_p != 1.0,
            "top_k": self.top_k != 0,
            "min_p": self.min_p != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "logit_bias": bool(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words),
            "thinking_token_budget": self.thinking_token_budget is not None,
            "stop": bool(self.stop_strings),
            "min_tokens": self.min_tokens != 0,
            "logprobs": self.logprobs is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "structured_outputs": self.structured_outputs is not None,
        }
        for name, used in unsupported.items():
            if used:
                raise InvalidRequestError(f"{name} is not supported with beam search", name)
        if self.max_tokens is None:
            raise InvalidRequestError("max_tokens must be set for beam search", "max_tokens")
        if self.output_kind is RequestOutputKind.DELTA:
            raise InvalidRequestError(
                "output_kind DELTA is not supported with beam search: its beams reorder and "
                "drop as they go, so text already sent could be taken back; use CUMULATIVE or "
                "FINAL_ONLY",
                "output_kind",
            )

    @property
    def beam_width(self) -> int:
        return self.best_of or self.n


def _output_kind(value) -> RequestOutputKind:
    """``output_kind`` as a RequestOutputKind, from the enum, its value or its name."""
    try:
        if isinstance(value, str):
            return RequestOutputKind[value.upper()]
        return RequestOutputKind(value)
    except (KeyError, ValueError):
        names = ", ".join(kind.name for kind in RequestOutputKind)
        raise InvalidRequestError(
            f"output_kind must be one of {names}, got {value!r}", "output_kind"
        ) from None


def _structured_outputs(value) -> StructuredOutputsParams | None:
    """``structured_outputs`` as given, or built from a dict of its fields."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = set(value) - set(StructuredOutputsParams.__dataclass_fields__)
        if unknown:
            raise InvalidRequestError(
                f"structured_outputs has no field {sorted(unknown)[0]!r}", "structured_outputs"
            )
        return StructuredOutputsParams(**value)
    raise InvalidRequestError(
        f"structured_outputs must be a StructuredOutputsParams, got {value!r}", "structured_outputs"
    )

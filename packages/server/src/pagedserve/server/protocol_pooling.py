"""Request and response bodies of the pooling routes, in the shapes their clients expect:
OpenAI's /v1/embeddings, vLLM's /pooling, /classify and /score, and the Jina/Cohere /rerank
(also /v1/rerank). Every declared field is handled by serving_pooling.py or refused with a
400 naming it (field_coverage.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictInt, StrictStr, model_validator

from pagedserve.server.protocol import OpenAIBaseModel, TokenIds, UsageInfo

PoolingInput = StrictStr | list[StrictStr] | TokenIds | list[TokenIds]


class PoolingBaseRequest(OpenAIBaseModel):
    """What every pooling request shares (vLLM's ``PoolingBasicRequestMixin``)."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    request_id: str | None = None
    priority: StrictInt = 0
    use_activation: bool | None = None
    padding: Literal["max_length", "do_not_pad"] | None = None
    cache_salt: str | None = None
    mm_processor_kwargs: dict | None = None


class EmbeddingRequest(PoolingBaseRequest):
    """POST /v1/embeddings (OpenAI's, with vLLM's extras)."""

    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    add_special_tokens: bool = True
    embed_dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    endianness: Literal["native", "big", "little"] = "native"


class PoolingRequest(EmbeddingRequest):
    """POST /pooling (vLLM's): the model's own output, or the ``task`` asked for."""

    task: Literal["embed", "classify", "score"] | None = None


class ClassificationRequest(PoolingBaseRequest):
    """POST /classify (vLLM's)."""

    input: PoolingInput
    add_special_tokens: bool = True


ScoreInput = StrictStr | list[StrictStr]


class ScoreRequest(PoolingBaseRequest):
    """POST /score and /v1/score (vLLM's): the texts to pair, by any of vLLM's names for them:
    ``text_1``/``text_2``, ``queries``/``documents`` or ``data_1``/``data_2``."""

    text_1: ScoreInput | None = None
    text_2: ScoreInput | None = None
    queries: ScoreInput | None = None
    documents: ScoreInput | None = None
    data_1: ScoreInput | None = None
    data_2: ScoreInput | None = None

    @model_validator(mode="after")
    def _one_pair_of_fields(self) -> ScoreRequest:
        given = [
            names for names in SCORE_FIELDS if any(getattr(self, n) is not None for n in names)
        ]
        if len(given) != 1 or any(getattr(self, n) is None for n in given[0]):
            raise ValueError(
                "give the texts to score as text_1 and text_2 (or queries and documents, or "
                "data_1 and data_2): one pair of them"
            )
        return self

    def pair(self) -> tuple[tuple[str, str], ScoreInput, ScoreInput]:
        """(the two field names, the first texts, the second texts)."""
        names = next(n for n in SCORE_FIELDS if getattr(self, n[0]) is not None)
        return names, getattr(self, names[0]), getattr(self, names[1])


SCORE_FIELDS = (("text_1", "text_2"), ("queries", "documents"), ("data_1", "data_2"))


class RerankRequest(PoolingBaseRequest):
    """POST /rerank, /v1/rerank and /v2/rerank (Jina's and Cohere's shape)."""

    query: StrictStr
    documents: list[StrictStr]
    top_n: Annotated[StrictInt, Field(ge=0)] = 0  # 0: every document
    return_documents: bool = True


# ---- responses ---------------------------------------------------------------------------------


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class PoolingData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: UsageInfo


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class ScoreData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = Field(default=None, exclude_if=lambda v: v is None)
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]

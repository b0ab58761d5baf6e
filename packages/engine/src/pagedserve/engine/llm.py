"""LLM: offline batch generation and pooling, with vLLM's interface.

llm = LLM(model="path/to/hf-folder")
outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=32))
print(outputs[0].outputs[0].text)

A pooling model (an embedder, a classifier, a cross-encoder) answers ``embed``, ``classify``
and ``score`` (and ``encode`` with explicit ``PoolingParams``) instead: one
``PoolingRequestOutput`` per prompt, whose ``outputs.embedding`` / ``.probs`` / ``.score`` is
the result.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from tqdm.auto import tqdm

from pagedserve.engine.beam_search import BeamSearchParams
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.errors import SchedulerOverloadedError
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.lora import LoRARequest
from pagedserve.engine.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.engine.scoring import cosine, pair_prompt, score_pairs, text_prompt
from pagedserve.models import apply_chat_template

PromptType = str | dict[str, Any]


class LLM:
    """Generate for a list of prompts at once; the engine batches them continuously."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown LLM arguments: {sorted(unknown)}")
        self._wrap(LLMEngine(EngineArgs(model=model, **kwargs)))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """The offline API over an engine already built (a test's, or one shared with other
        code that steps it between calls)."""
        llm = cls.__new__(cls)
        llm._wrap(engine)
        return llm

    def _wrap(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._pending: deque[Callable[[], None]] = deque()  # requests the queue had no room for

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's generation_config defaults; ``generate`` uses them when given none."""
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the order given.

        ``prompts``: strings, or ``{"prompt_token_ids": [...]}`` or ``{"prompt": ...}`` dicts,
        with ``"multi_modal_data": {"image": [PIL images]}`` for a model that takes images (one
        placeholder, ``LLM.image_placeholder``, per image in the prompt). ``sampling_params``: one
        for all prompts, or one per prompt; None takes the model's generation_config defaults
        (an explicit SamplingParams is used as given, as in vLLM). ``lora_request``: the LoRA
        adapter of every prompt, or one per prompt (None: the base model), as in vLLM.

        Only each request's final output is wanted, so every request runs as FINAL_ONLY (as
        vLLM's LLM does): the engine makes no per-step snapshots for them.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params_list = _final_only(self._params_per_prompt(len(prompts), sampling_params))
        loras = _loras_per_prompt(len(prompts), lora_request)
        order: list[str] = []
        for prompt, params, lora in zip(prompts, params_list, loras, strict=True):
            text, token_ids = self._tokenize(prompt)
            images = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
            request_id = self.engine.next_request_id()
            self._submit(
                partial(self.engine.add_request, request_id, token_ids, params, prompt=text,
                        lora_request=lora, multi_modal_data=images)
            )  # fmt: skip
            order.append(request_id)
        return self._run(order, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template.

        A message's content is a string or a list of parts: ``{"type": "text", "text": ...}``
        and, for a model that takes images, ``{"type": "image_pil", "image_pil": PIL image}``
        (vLLM's part; each image becomes a placeholder line before the message's text). Any
        other part is refused by name: URLs are the server's to read."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            conv, images = self._with_placeholders(conv)
            placeholder = self.engine.image_placeholder
            ids = apply_chat_template(self.tokenizer, conv, add_generation_prompt, placeholder)
            data = {"multi_modal_data": {"image": images}} if images else {}
            prompts.append({"prompt_token_ids": ids, **data})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _with_placeholders(self, conversation: list[dict]) -> tuple[list[dict], list]:
        """The conversation with string contents (text parts joined, an image placeholder
        line per image part first), and its images in prompt order."""
        flat, images = [], []
        for i, message in enumerate(conversation):
            content = message.get("content")
            if not isinstance(content, list):
                flat.append(message)
                continue
            texts, count = [], 0
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    texts.append(part["text"])
                elif kind == "image_pil":
                    images.append(part["image_pil"])
                    count += 1
                else:
                    raise ValueError(
                        f"messages[{i}].content[{j}]: LLM.chat reads text and image_pil parts, "
                        f"not {kind!r} (decode an image URL yourself and pass the PIL image)"
                    )
            placeholder = self.engine.image_placeholder or "<image>"
            flat.append({**message, "content": "\n".join([placeholder] * count + texts)})
        return flat, images

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Beam search, as vLLM's ``LLM.beam_search``: each output holds the ``beam_width`` best
        hypotheses, best first (score = sum of logprobs / length ** length_penalty)."""
        sampling = SamplingParams(
            n=params.beam_width,
            best_of=params.beam_width,
            temperature=0.0,
            use_beam_search=True,
            max_tokens=params.max_tokens,
            ignore_eos=params.ignore_eos,
            length_penalty=params.length_penalty,
        )
        return self.generate(prompts, sampling, use_tqdm)

    # ---- pooling models -------------------------------------------------------------------

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """One PoolingRequestOutput per prompt, in order: a pooling model's outputs under
        ``pooling_params`` (one for all, or one per prompt). A prompt is a string (truncated
        by the tokenizer when its params say ``truncate_prompt_tokens``), or a dict with
        ``prompt_token_ids`` (and ``token_type_ids``)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        if len(pooling_params) != len(prompts):
            raise ValueError(f"got {len(pooling_params)} pooling params for {len(prompts)} prompts")
        max_len = self.engine.scheduler_config.max_model_len
        order = []
        for prompt, params in zip(prompts, pooling_params, strict=True):
            types = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
            if isinstance(prompt, str):
                ids = text_prompt(self.tokenizer, prompt, params.truncate_prompt_tokens, max_len)
                text = prompt
            else:
                text, ids = self._tokenize(prompt)
            request_id = self.engine.next_request_id()
            self._submit(
                partial(self.engine.add_request, request_id, ids, params, prompt=text,
                        token_type_ids=types)
            )  # fmt: skip
            order.append(request_id)
        return self._run(order, use_tqdm)

    def embed(self, prompts, pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True):  # fmt: skip
        """Each prompt's embedding (``outputs.embedding``), as the model's pooling says."""
        params = _pooling(pooling_params, "embed", truncate_prompt_tokens)
        return self.encode(prompts, params, use_tqdm)

    def classify(self, prompts, pooling_params: PoolingParams | None = None,
                 truncate_prompt_tokens: int | None = None, use_tqdm: bool = True):  # fmt: skip
        """Each prompt's class probabilities (``outputs.probs``)."""
        params = _pooling(pooling_params, "classify", truncate_prompt_tokens)
        return self.encode(prompts, params, use_tqdm)

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[PoolingRequestOutput]:
        """The score of each pair (1:1, 1:N, or N:N zipped; ``outputs.score``): a
        cross-encoder's relevance, or the cosine of two embeddings (scoring.py)."""
        pairs = score_pairs(data_1, data_2, ("data_1", "data_2"))
        params = _pooling(pooling_params, "score", truncate_prompt_tokens)
        if self.engine.model_config.pooling_task == "embed":
            texts = list(dict.fromkeys(text for pair in pairs for text in pair))
            vectors = dict(zip(texts, self.encode(texts, params, use_tqdm), strict=True))
            return [
                _score_output(vectors[a], cosine(vectors[a].outputs.data, vectors[b].outputs.data))
                for a, b in pairs
            ]
        max_len = self.engine.scheduler_config.max_model_len
        prompts = []
        for a, b in pairs:
            ids, types = pair_prompt(self.tokenizer, a, b, params.truncate_prompt_tokens, max_len)
            prompts.append({"prompt_token_ids": ids, "token_type_ids": types})
        return self.encode(prompts, params, use_tqdm)

    def _params_per_prompt(self, count: int, params) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling params for {count} prompts")
        return list(params)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise TypeError("a prompt is a string or a dict with 'prompt' or 'prompt_token_ids'")

    def _submit(self, add: Callable[[], None]) -> None:
        """Add a request to the engine now, or once the running steps have made room: the
        waiting queue's cap (``max_num_waiting``) is how a server sheds load with a 503, and
        an offline call of any number of prompts waits for room instead. Requests go in in
        order: once one waits, every later one waits behind it."""
        if not self._pending:
            try:
                add()
                return
            except SchedulerOverloadedError:
                pass
        self._pending.append(add)

    def _submit_pending(self) -> None:
        """Move waiting submissions into the engine while its queue has room. A request the
        engine refuses for another reason fails the whole call, as it would have at once."""
        while self._pending:
            try:
                self._pending[0]()
            except SchedulerOverloadedError:
                return
            except Exception:
                self._pending.clear()
                self.engine.abort_request(self.engine.unfinished_request_ids())
                raise
            self._pending.popleft()

    def _run(self, order: list[str], use_tqdm: bool) -> list:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(order), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True
        )
        start, generated = time.perf_counter(), 0
        seen: dict[str, int] = {}
        while self.engine.has_unfinished_requests() or self._pending:
            self._submit_pending()
            outputs = self.engine.step()
            errors = self.engine.take_request_errors()
            if errors:  # a constraint that does not compile: the whole call fails, as vLLM's
                self._pending.clear()
                self.engine.abort_request(self.engine.unfinished_request_ids())
                bar.close()
                raise errors[0][1]
            for output in outputs:
                if isinstance(output, RequestOutput):
                    count = sum(len(o.token_ids) for o in output.outputs)
                    generated += max(0, count - seen.get(output.request_id, 0))
                    seen[output.request_id] = count
                if output.finished:
                    finished[output.request_id] = output
                    bar.update(1)
            bar.set_postfix_str(
                f"{generated / max(time.perf_counter() - start, 1e-9):.1f} tok/s", refresh=False
            )
        bar.close()
        return [finished[r] for r in order]


def _pooling(params: PoolingParams | None, task: str, truncate: int | None) -> PoolingParams:
    """The params of an ``embed`` / ``classify`` / ``score`` call: the caller's, with the
    call's task and truncation."""
    params = dataclasses.replace(params) if params is not None else PoolingParams()
    params.task = task
    if truncate is not None:
        params.truncate_prompt_tokens = truncate
    params.__post_init__()
    return params


def _score_output(first: PoolingRequestOutput, score: float) -> PoolingRequestOutput:
    import torch

    return dataclasses.replace(first, outputs=PoolingOutput(torch.tensor([score])))


def _loras_per_prompt(count: int, lora_request) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if len(lora_request) != count:
        raise ValueError(f"got {len(lora_request)} LoRA requests for {count} prompts")
    return list(lora_request)


def _final_only(params_list: list[SamplingParams]) -> list[SamplingParams]:
    """Each SamplingParams as FINAL_ONLY: a copy (the caller's object is left as given), one
    per distinct object."""
    copies: dict[int, SamplingParams] = {}
    final = RequestOutputKind.FINAL_ONLY
    for params in params_list:
        if id(params) not in copies:
            copies[id(params)] = (
                params
                if params.output_kind is final
                else dataclasses.replace(params, output_kind=final)
            )
    return [copies[id(params)] for params in params_list]

"""LLM: offline batch generation, with vLLM's interface.

llm = LLM(model="path/to/hf-folder")
outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=32))
print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagedserve.engine.beam_search import BeamSearchParams
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.lora import LoRARequest
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.models import apply_chat_template

PromptType = str | dict[str, Any]


class LLM:
    """Generate for a list of prompts at once; the engine batches them continuously."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"unknown LLM arguments: {sorted(unknown)}")
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

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

        ``prompts``: strings, or ``{"prompt_token_ids": [...]}`` dicts. ``sampling_params``: one
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
            request_id = self.engine.next_request_id()
            self.engine.add_request(request_id, token_ids, params, prompt=text, lora_request=lora)
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
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": apply_chat_template(self.tokenizer, conv, add_generation_prompt)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

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

    def _run(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=len(order), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True
        )
        start, generated = time.perf_counter(), 0
        seen: dict[str, int] = {}
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            errors = self.engine.take_request_errors()
            if errors:  # a constraint that does not compile: the whole call fails, as vLLM's
                self.engine.abort_request(self.engine.unfinished_request_ids())
                bar.close()
                raise errors[0][1]
            for output in outputs:
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

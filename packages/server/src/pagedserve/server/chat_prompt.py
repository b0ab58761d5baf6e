"""A conversation as one engine request: the chat template (the tools rendered, the thinking
switched on or off), the caps, the output constraint, the sampling parameters; and how its replies
will be read (a ``ReplyPlan``: reasoning mode, tools). The chat, responses and messages routes
all plan their prompts here; the images of a conversation's image parts go with its request
(``PromptRequest.multi_modal_data``), read by media.py.

Planning is a coroutine for one reason: a conversation's images are decoded in a worker thread
(media.py's ``ImageInputs.read``), awaited between the checks that come before them and the
chat template after them. Everything else, the tokenizer above all, stays on the event loop's
thread (a fast tokenizer used from two threads at once errors). A text conversation never leaves
the loop.
"""

from __future__ import annotations

from PIL import Image

from pagedserve.engine import apply_chat_template
from pagedserve.server.errors import bad_request
from pagedserve.server.media import ImageInputs, image_parts
from pagedserve.server.protocol import ChatCompletionRequest, ChatMessage, TokenizeChatRequest
from pagedserve.server.reasoning import (
    PROMPT_TAIL_TOKENS,
    REASONING_PARSERS,
    ReasoningMode,
    answer_only,
    thinking_budget,
)
from pagedserve.server.reply import ReplyPlan
from pagedserve.server.request_params import build_sampling_params, check_caps, truncated_prompt
from pagedserve.server.state import ServerState
from pagedserve.server.streams import PromptRequest
from pagedserve.server.structured import (
    constraint_field,
    structured_output_aliases,
    structured_outputs_of,
)
from pagedserve.server.tools import (
    ToolCallPlan,
    conversation_with_tools,
    plan_tools,
    resolve_tool_parser,
    template_supports_tools,
)
from pagedserve.server.vllm_fields import default_max_tokens, whole_vocabulary

# The engine's names -> the chat API's, so a 400 names the field the client sent.
CHAT_ALIASES = {"logprobs": "top_logprobs", "prompt": "messages", "multi_modal_data": "messages"}


async def chat_prompt_ids(
    state: ServerState,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    template_kwargs: dict | None = None,
    tools: ToolCallPlan | None = None,
) -> list[int]:
    """The conversation's prompt token ids, for /tokenize and the token counts. A conversation
    with images is refused: its ids depend on each image's rows, which the engine's processor
    decides when it runs the request."""
    if parts := image_parts(messages):
        raise bad_request(
            f"{parts[0][0]}: a conversation with images is not tokenized here (each image "
            "becomes as many tokens as its rows, decided when the model runs it); the usage of "
            "a chat completion counts them",
            parts[0][0],
        )
    return (await chat_prompt(state, messages, add_generation_prompt, template_kwargs, tools))[0]


async def chat_prompt(
    state: ServerState,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    template_kwargs: dict | None = None,
    tools: ToolCallPlan | None = None,
) -> tuple[list[int], list[Image.Image]]:
    """Prompt token ids through the chat template (the model's, or ``--chat-template``), the
    tools rendered (tools.py), and the images of the messages' image parts in prompt order
    (each message's content holds the model's placeholder for each of its images: media.py's
    ``ImageInputs.message_content``); template errors are 400s."""
    conversation, images = await conversation_of(state, messages)
    template = state.config.chat_template
    kwargs = dict(template_kwargs or {})
    if template:
        kwargs["chat_template"] = template
    if tools is not None:
        native = template_supports_tools(state.engine.tokenizer, template)
        conversation, extra = conversation_with_tools(conversation, tools, native)
        kwargs.update(extra)
    try:
        placeholder = state.engine.image_placeholder
        ids = apply_chat_template(
            state.engine.tokenizer, conversation, add_generation_prompt, placeholder, **kwargs
        )
    except ValueError as e:
        raise bad_request(str(e), "messages") from e
    except Exception as e:  # jinja2's TemplateError (raise_exception in a template), TypeError
        raise bad_request(f"the chat template rejected the messages: {e}", "messages") from e
    return ids, images


async def conversation_of(
    state: ServerState, messages: list[ChatMessage]
) -> tuple[list[dict], list[Image.Image]]:
    """The messages as the chat template's dicts, and their images in prompt order (decoded in a
    worker thread: ``ImageInputs.read``)."""
    media = None
    images: list[Image.Image] = []
    if parts := image_parts(messages):  # a text conversation asks nothing of the engine
        media = ImageInputs.of(state)
        images = await media.read(parts)
    conversation: list[dict] = []
    for message in messages:
        content = media.message_content(message) if media else message.text()
        entry = {"role": message.role, "content": content}
        for key in ("name", "tool_call_id"):
            if getattr(message, key):
                entry[key] = getattr(message, key)
        if message.tool_calls:
            entry["tool_calls"] = [c.model_dump() for c in message.tool_calls]
        thinking = message.reasoning_content or message.reasoning
        if thinking and message.role == "assistant":
            entry["reasoning_content"] = thinking
        conversation.append(entry)
    return conversation, images


def max_tokens_of(body: ChatCompletionRequest) -> tuple[int | None, str]:
    """``max_completion_tokens`` (OpenAI's new name) or ``max_tokens``, and which was used."""
    new, old = body.max_completion_tokens, body.max_tokens
    if new is not None and old is not None and new != old:
        raise bad_request(
            "max_tokens and max_completion_tokens disagree; give one of them",
            "max_completion_tokens",
        )
    return (new, "max_completion_tokens") if new is not None else (old, "max_tokens")


def template_kwargs_of(body: ChatCompletionRequest) -> dict:
    """What the chat template is given beyond the messages: ``chat_template_kwargs``,
    ``documents``, and ``reasoning_effort`` (which, as in vLLM, also sets ``enable_thinking``
    unless the request set it)."""
    kwargs = dict(body.chat_template_kwargs or {})
    if body.documents is not None:
        kwargs["documents"] = body.documents
    if body.reasoning_effort is not None:
        kwargs["reasoning_effort"] = body.reasoning_effort
        kwargs.setdefault("enable_thinking", body.reasoning_effort != "none")
    return kwargs


def template_options(
    body: ChatCompletionRequest | TokenizeChatRequest, kwargs: dict | None = None
) -> tuple[bool, dict]:
    """``(add_generation_prompt, chat template kwargs)`` of a chat or /tokenize body; ``kwargs``
    the template's kwargs so far (default: the body's ``chat_template_kwargs``).

    ``continue_final_message``: the reply continues the last (assistant) message, left open (no
    end-of-turn marker), so no generation prompt follows it unless the body asks for both, which
    vLLM refuses with the phrase kept here."""
    kwargs = dict(body.chat_template_kwargs or {}) if kwargs is None else kwargs
    if not body.continue_final_message:
        return body.add_generation_prompt, kwargs
    if body.add_generation_prompt and "add_generation_prompt" in body.model_fields_set:
        raise bad_request(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )
    if body.messages[-1].role != "assistant":
        raise bad_request(
            "continue_final_message needs an assistant message last", "continue_final_message"
        )
    kwargs["continue_final_message"] = True
    return False, kwargs


def reasoning_mode(
    state: ServerState, prompt_ids: list[int], template_kwargs: dict
) -> ReasoningMode | None:
    """The request's reasoning mode under ``--reasoning-parser`` (None without one), read from
    the end of its rendered prompt."""
    name = state.config.reasoning_parser
    if name is None:
        return None
    tail = state.engine.tokenizer.decode(
        prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False
    )
    return REASONING_PARSERS[name].mode(tail, template_kwargs)


def planned_max_tokens(state: ServerState, body, prompt_ids: list[int], images: list):
    """``max_tokens`` and the field it came from: what was sent, else generation_config's
    max_new_tokens, else all the room after the prompt as the engine will run it (each
    image's placeholder becomes at most ``max_image_tokens`` rows)."""
    max_tokens, param = max_tokens_of(body)
    was_sent = bool({"max_tokens", "max_completion_tokens"} & body.model_fields_set)
    num_prompt = len(prompt_ids)
    if images:
        num_prompt += len(images) * (state.engine.max_image_tokens - 1)
    max_model_len = state.engine.scheduler_config.max_model_len
    defaults = state.engine.model_config.generation_defaults.sampling
    max_tokens = default_max_tokens(
        max_tokens, was_sent, num_prompt, max_model_len, defaults.get("max_tokens")
    )
    return max_tokens, param


async def plan_prompt(
    state: ServerState, body: ChatCompletionRequest
) -> tuple[PromptRequest, dict[str, str], ReplyPlan]:
    """The conversation as one engine request with the request's n, the API's names of the
    engine's fields (for the engine's refusals), and how its replies are read."""
    check_caps(state, body)
    whole_vocabulary(body, "top_logprobs", state.engine.model_config.vocab_size)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    template = state.config.chat_template
    parser = resolve_tool_parser(state.config.tool_call_parser, state.engine.tokenizer, template)
    tools = plan_tools(body, parser)
    constraint = structured_outputs_of(body)
    tool_constraint = tools.constraint()
    if constraint is not None and tool_constraint is not None:
        what = "a strict tool under tool_choice auto" if tools.mode == "auto" else None
        raise bad_request(
            f"{what or 'tool_choice ' + tools.mode} constrains the reply itself: drop the "
            "output constraint",
            "tool_choice",
        )
    add_generation_prompt, kwargs = template_options(body, template_kwargs_of(body))
    prompt_ids, images = await chat_prompt(
        state, body.messages, add_generation_prompt, kwargs, tools
    )
    prompt_ids = truncated_prompt(body, prompt_ids, len(images))
    mode = reasoning_mode(state, prompt_ids, kwargs)
    max_tokens, param = planned_max_tokens(state, body, prompt_ids, images)
    tokenizer, parser = state.engine.tokenizer, state.config.reasoning_parser
    thinking = thinking_budget(
        tokenizer, parser, mode, body.thinking_token_budget, "thinking_token_budget"
    )
    aliases = {**CHAT_ALIASES, "max_tokens": param, **structured_output_aliases(body)}
    blamed = "tool_choice" if tool_constraint is not None else constraint_field(body)
    if mode is not None and mode is not ReasoningMode.CLOSED and blamed:
        aliases["structured_outputs.structural_tag"] = blamed
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = build_sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=logprobs,
        aliases=aliases,
        defaults=state.engine.model_config.generation_defaults.sampling,
        prompt_logprobs=body.prompt_logprobs,
        structured_outputs=answer_only(tool_constraint or constraint, mode, blamed or ""),
        keep_special_tokens=not tools.skip_special_tokens or mode is ReasoningMode.HARMONY,
        thinking=thinking,
    )
    plan = ReplyPlan(tools, mode, body.include_reasoning)
    multi_modal_data = {"image": images} if images else None
    return PromptRequest(0, prompt_ids, params, multi_modal_data=multi_modal_data), aliases, plan

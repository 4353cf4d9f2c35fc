"""A chat request's messages rendered with the model's chat template, then tokenized."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tokenserve.engine.protocol import EngineClient

from .chat_template import RENDER_VARIABLES, render_chat
from .params import bad_request, check_prompt_chars, encode_text
from .schemas import CHAT_ROLES, ChatMessage


def message_text(message: ChatMessage, param: str) -> str:
    """The text of one message, refusing roles and content parts that are not served.

    Raises:
        InvalidRequestError: naming the message field.
    """
    if message.role not in CHAT_ROLES:
        raise bad_request(f"{param}.role: role '{message.role}' is not supported; use one of "
                          f"{', '.join(CHAT_ROLES)}.",
                          f"{param}.role", "unsupported_parameter")
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        text = message.content
    else:
        for j, part in enumerate(message.content):
            if part.type != "text":
                raise bad_request(f"{param}.content.{j}: content of type '{part.type}' is not "
                                  f"supported; this server takes text only.",
                                  f"{param}.content.{j}", "unsupported_parameter")
            if part.text is None:
                raise bad_request(f"{param}.content.{j}.text: a content part of type 'text' "
                                  f"needs a 'text' string.", f"{param}.content.{j}.text",
                                  "invalid_type")
        text = "".join(part.text for part in message.content)
    return text


def _template_message(message: ChatMessage, text: str) -> dict:
    """A message as HF chat templates take it: tool calls with their arguments parsed."""
    plain = {"role": message.role, "content": text}
    if message.name:
        plain["name"] = message.name
    if message.tool_call_id is not None:
        plain["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:  # templates that show earlier thinking
        plain["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except (ValueError, RecursionError):  # not JSON (or an int over 4,300 digits,
                arguments = call.function.arguments  # or nested too deeply): the text
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        plain["tool_calls"] = calls
    return plain


def check_template_kwargs(template_kwargs: dict | None) -> None:
    """Refuses chat_template_kwargs that would set what the server passes itself.

    Raises:
        InvalidRequestError: naming the key (chat_template_kwargs.messages, ...).
    """
    for key in template_kwargs or ():
        if key in RENDER_VARIABLES:
            where = f"chat_template_kwargs.{key}"
            raise bad_request(f"{where}: the server sets '{key}' itself; chat_template_kwargs "
                              f"may not ({', '.join(RENDER_VARIABLES)} are reserved).", where)


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    """The rendered template: where a reply begins (inside a think block or not) is read here."""
    token_ids: list[int]


def chat_prompt(messages: list[ChatMessage], engine: EngineClient,
                add_generation_prompt: bool = True, check_length: bool = True,
                tools: list[dict] | None = None,
                template_kwargs: dict | None = None) -> ChatPrompt:
    """Renders `messages` with the model's chat template (or the default) and tokenizes it.
    Blocking: servers call it off their event loop.

    Args:
        check_length: refuse a rendered prompt with more characters than the context can
            hold before tokenizing it (off for /tokenize, which counts any text).
        template_kwargs: a request's chat_template_kwargs: further template variables.

    Raises:
        InvalidRequestError: bad text in a message, a reserved chat_template_kwargs key, or
            the template refuses the messages.
        PromptTooLongError: the rendered prompt cannot fit the context (`check_length`).
    """
    check_template_kwargs(template_kwargs)
    plain = [_template_message(message, message_text(message, f"messages.{i}"))
             for i, message in enumerate(messages)]
    tokenizer = engine.tokenizer
    prompt = render_chat(engine.config.chat_template, plain,
                         add_generation_prompt=add_generation_prompt,
                         bos_token=tokenizer.decode([engine.config.bos_token_id],
                                                    skip_special_tokens=False),
                         eos_token=tokenizer.decode([engine.config.eos_token_id],
                                                    skip_special_tokens=False),
                         tools=tools, template_kwargs=template_kwargs)
    if check_length:
        check_prompt_chars(prompt, tokenizer, engine.max_model_len, "messages")
    ids = encode_text(tokenizer, prompt)
    if not ids:
        raise bad_request("messages render to an empty prompt.", "messages", "empty_prompt")
    return ChatPrompt(prompt, ids)


def chat_prompt_ids(messages: list[ChatMessage], engine: EngineClient,
                    add_generation_prompt: bool = True, check_length: bool = True,
                    tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
    """The token ids of `chat_prompt`."""
    return chat_prompt(messages, engine, add_generation_prompt, check_length, tools,
                       template_kwargs).token_ids

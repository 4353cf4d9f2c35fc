"""Chat messages to a prompt string with the model's Jinja chat template (HF conventions).

Templates run in Jinja2's immutable sandbox: a template comes with a model directory, and a
model directory is not trusted code. Rendering is cached per template string.
"""

from __future__ import annotations

import datetime
import functools
import json

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenserve.errors import InvalidRequestError

DEFAULT_CHAT_TEMPLATE = (
    "{% if tools %}# tools: {{ tools | tojson }}\n# to call one, answer <tool_call>\n"
    "{\"name\": ..., \"arguments\": {...}}\n</tool_call>\n{% endif %}"
    "{% for message in messages %}# {{ message['role'] }}: {{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}<tool_call>\n{{ {'name': call.function.name, "
    "'arguments': call.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}# assistant:{% endif %}"
)
"""For models without a template, and the built-in models' own: their format (they are code
models, and a comment-per-turn transcript is what they continue best). Tools are listed first,
and calls are written in the Hermes style that Qwen2's template uses."""
_BUILTIN_CHAT_TEMPLATE = (
    "{% for message in messages %}# {{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}# assistant:{% endif %}"
)
"""The template the built-in models ship: DEFAULT_CHAT_TEMPLATE renders the same text for
it, and tools and calls too."""


class _TemplateRaised(Exception):
    """`raise_exception(...)` called by a template: the messages break the template's rules."""


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        undefined=jinja2.ChainableUndefined)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    env.filters["tojson"] = _tojson  # as transformers: plain JSON, no HTML escaping
    return env.from_string(template)


RENDER_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")
"""What the server itself passes a template: a request's chat_template_kwargs may not set
these (the request has its own fields for them)."""


def render_chat(template: str | None, messages: list[dict], *,
                add_generation_prompt: bool = True, bos_token: str = "",
                eos_token: str = "", tools: list[dict] | None = None,
                template_kwargs: dict | None = None) -> str:
    """Renders `messages` ([{"role", "content"}], plus "tool_calls" and "reasoning_content" on
    assistant turns and "tool_call_id" on tool results) to the prompt text; `tools` as HF
    templates take them. `template_kwargs` are further template variables, as
    transformers' apply_chat_template takes them (e.g. {"enable_thinking": False} for
    Qwen3's); none may be one of RENDER_VARIABLES.

    Raises:
        InvalidRequestError: the template refuses the messages (e.g. roles that do not
            alternate) or fails on them; the message says why.
    """
    try:
        if not template or template == _BUILTIN_CHAT_TEMPLATE:
            template = DEFAULT_CHAT_TEMPLATE
        compiled = _compile(template)
        return compiled.render({**(template_kwargs or {}), "messages": messages,
                                "add_generation_prompt": add_generation_prompt,
                                "bos_token": bos_token, "eos_token": eos_token,
                                "tools": tools})
    except _TemplateRaised as error:
        raise InvalidRequestError(f"The chat template rejected the messages: {error}") from None
    except jinja2.TemplateError as error:
        raise InvalidRequestError(f"The model's chat template failed on these messages: "
                                  f"{error}") from None

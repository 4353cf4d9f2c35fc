"""Chat messages to a prompt string with the model's Jinja chat template (HF conventions).

Templates run in Jinja2's immutable sandbox: a template comes with a model directory, and a
model directory is not trusted code. Rendering is cached per template string.
"""

from __future__ import annotations

import datetime
import functools

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenserve.errors import InvalidRequestError

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}# {{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}# assistant:{% endif %}"
)
"""For models without a template: the built-in models' format (they are code models, and a
comment-per-turn transcript is what they continue best)."""


class _TemplateRaised(Exception):
    """`raise_exception(...)` called by a template: the messages break the template's rules."""


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        undefined=jinja2.ChainableUndefined)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env.from_string(template)


def render_chat(template: str | None, messages: list[dict[str, str]], *,
                add_generation_prompt: bool = True, bos_token: str = "",
                eos_token: str = "") -> str:
    """Renders `messages` ([{"role", "content"}]) to the prompt text.

    Raises:
        InvalidRequestError: the template refuses the messages (e.g. roles that do not
            alternate) or fails on them; the message says why.
    """
    try:
        compiled = _compile(template or DEFAULT_CHAT_TEMPLATE)
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token)
    except _TemplateRaised as error:
        raise InvalidRequestError(f"The chat template rejected the messages: {error}") from None
    except jinja2.TemplateError as error:
        raise InvalidRequestError(f"The model's chat template failed on these messages: "
                                  f"{error}") from None

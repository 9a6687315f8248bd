"""Chat templates: a conversation rendered into the prompt one model was trained on.

Templates are Jinja2 in the Hugging Face `tokenizer_config.json` dialect (variables
`messages` with `role`/`content`, `add_generation_prompt`, `bos_token`, `eos_token`;
`raise_exception` and `strftime_now`; loop controls; undefined variables such as `tools`
render empty), set up as transformers' `apply_chat_template` does, so a model's own
template can be pasted into the gateway config unchanged. They render in a sandbox:
config is trusted, but a template is code and should not reach Python objects.
"""

from __future__ import annotations

from collections.abc import Sequence

import datetime as dt

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from qosgate.generation_types import ChatMessage
from qosgate.errors import InvalidArgument

# ChatML, the format SmolLM2-Instruct (and Qwen, and many others) were tuned on.
CHATML = (
    "{% for message in messages %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BUILTIN_TEMPLATES = {"chatml": CHATML}


class TemplateError(ValueError):
    """A chat template that does not compile; raised at config load, never per request."""


class ChatTemplate:
    """One model's compiled chat template."""

    __slots__ = ("_template", "_bos_token", "_eos_token")

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        """`source` is Jinja2 text or the name of a built-in template (`chatml`)."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(BUILTIN_TEMPLATES.get(source, source))
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template does not compile: {exc.message} (line {exc.lineno})") from None
        self._bos_token = bos_token
        self._eos_token = eos_token

    def render(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt for `messages`, ending with the assistant's turn opened."""
        if not messages:
            raise InvalidArgument("chat.messages is empty")
        try:
            return self._template.render(
                messages=[{"role": m.role.value, "content": m.content} for m in messages],
                add_generation_prompt=True,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
            )
        except _TemplateRefusal as exc:
            raise InvalidArgument(f"chat template refused the conversation: {exc}") from None
        except jinja2.TemplateError as exc:
            # A template bug, not the caller's: surface it as a clear argument error all
            # the same, since the conversation shape is what triggered it.
            raise InvalidArgument(f"chat template failed on this conversation: {exc}") from None


class _TemplateRefusal(Exception):
    pass


def _strftime_now(format: str) -> str:
    # Llama 3.x templates stamp the system prompt with today's date.
    return dt.datetime.now().strftime(format)


def _raise_exception(message: str) -> None:
    # Hugging Face templates call raise_exception() to reject conversation shapes they do
    # not support (e.g. roles out of order).
    raise _TemplateRefusal(message)

r"""Prompts in the tokenizer's chat template (``data.template: chat``) instead of the Alpaca template.

An example's conversation ``messages`` (see :mod:`anlr_jax.data.formats`) with assistant messages
``a_1 .. a_n`` becomes the turns ``(p_i, a_i)`` with

    p_1 = render(messages before a_1, add_generation_prompt=True)
    p_i = render(messages before a_i, add_generation_prompt=True)[len(p_1 + a_1 + e + ... + a_{i-1} + e):]

where ``render`` is ``tokenizer.apply_chat_template(..., tokenize=False)`` and ``e`` is the text of
the template's end-of-turn token (:func:`end_of_turn_id`: the special token the template writes
right after an assistant message, e.g. ``<|im_end|>`` for ChatML models such as SmolLM2 and Qwen2,
``<|eot_id|>`` for LLaMA-3; ``eos`` when the template writes no special token there). Training
appends that token after every response (so the model learns to close its turn) and generation stops
at it. The template supplies its own start tokens, so no ``bos`` is prepended. What the template
writes after the end-of-turn token (ChatML's newline) starts the next prompt and carries no loss.

A template that changes the text of an assistant message, or renders a shorter conversation as
something other than a prefix of a longer one, cannot be split this way: :func:`chat_turns` raises
``ValueError`` saying so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from anlr_jax.data.formats import Message, Turn

if TYPE_CHECKING:  # transformers takes most of a second to import: only tokenizers' type
  from transformers import PreTrainedTokenizerBase

TEMPLATES = ("alpaca", "chat")
"""Prompt formats of ``data.template``: the paper's Alpaca template, or the tokenizer's chat template."""

_SENTINEL = "ANLRSENTINEL7Q"


def require_chat_template(tokenizer: PreTrainedTokenizerBase, context: str, fix: str = "") -> None:
  """Raises ``ValueError("<context>: the tokenizer has no chat template (tokenizer.chat_template is
  empty)[; <fix>]")`` when ``tokenizer`` has none: the one check of every use of the template."""
  if not getattr(tokenizer, "chat_template", None):
    raise ValueError(
        f"{context}: the tokenizer has no chat template (tokenizer.chat_template is empty)"
        + (f"; {fix}" if fix else "")
    )


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    generation: bool,
    context: str = "data.template=chat",
    fix: str = "use data.template=alpaca or a tokenizer that has one",
) -> str:
  """The text of ``(role, content)`` messages in the tokenizer's chat template (up to where the
  assistant's reply starts when ``generation``), after :func:`require_chat_template` (``context``
  and ``fix`` word its error)."""
  require_chat_template(tokenizer, context, fix)
  return tokenizer.apply_chat_template(
      [{"role": role, "content": content} for role, content in messages],
      tokenize=False,
      add_generation_prompt=generation,
  )


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int:
  """The token the chat template writes right after an assistant message (see the module doc).

  It is the first token of what follows the message (leading spaces aside) when that is a special
  or added token, else ``eos_token_id``.
  """
  text = render_chat(tokenizer, [("user", "x"), ("assistant", _SENTINEL)], generation=False)
  if _SENTINEL not in text:
    raise ValueError("the chat template does not write the assistant message's text verbatim")
  suffix = text.split(_SENTINEL, 1)[1].lstrip(" ")
  ids = tokenizer(suffix, add_special_tokens=False).input_ids if suffix else []
  special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
  if ids and ids[0] in special:
    return int(ids[0])
  if tokenizer.eos_token_id is None:
    raise ValueError("the chat template ends a turn with no special token and there is no eos")
  return int(tokenizer.eos_token_id)


def chat_prompt(tokenizer: PreTrainedTokenizerBase, user: str, system: str | None = None) -> str:
  """The prompt of one user message in the chat template, up to where the answer starts."""
  messages = ([("system", system)] if system else []) + [("user", user)]
  return render_chat(tokenizer, messages, generation=True)


def chat_turns(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    end_of_turn: int | None = None,
) -> tuple[Turn, ...]:
  """The `(prompt, response)` turns of a conversation in the chat template (see the module doc).

  Args:
    tokenizer: a tokenizer with a chat template.
    messages: `(role, content)` pairs; every assistant message becomes one turn's response.
    end_of_turn: the id of :func:`end_of_turn_id` (computed when None).

  Raises:
    ValueError: no assistant message, or a template that cannot be split into turns.
  """
  eot = end_of_turn_id(tokenizer) if end_of_turn is None else end_of_turn
  eot_text = tokenizer.convert_ids_to_tokens(eot)
  turns: list[Turn] = []
  consumed = ""
  for i, (role, content) in enumerate(messages):
    if role != "assistant":
      continue
    head = render_chat(tokenizer, messages[:i], generation=True)
    if not head.startswith(consumed):
      raise ValueError(
          "the chat template does not render a conversation as the continuation of its first"
          f" {len(turns)} turn(s) followed by {eot_text!r}: data.template=chat cannot split it"
      )
    turns.append((head[len(consumed) :], content))
    consumed = head + content + eot_text
    last = i
  if not turns:
    raise ValueError("the conversation has no assistant message to train on")
  if not render_chat(tokenizer, messages[: last + 1], generation=False).startswith(consumed):
    raise ValueError(
        f"the chat template does not write an assistant message verbatim followed by {eot_text!r}:"
        " data.template=chat cannot split it into turns"
    )
  return tuple(turns)


__all__ = [
    "TEMPLATES",
    "chat_prompt",
    "chat_turns",
    "end_of_turn_id",
    "render_chat",
    "require_chat_template",
]

r"""Tokenisation of prompt/response turns into token ids and a response-only loss mask.

For an example with turns `(p_1, r_1), ..., (p_n, r_n)` the token sequence is

    x = [bos] + tok(p_1) + tok(r_1) + [eos] + ... + tok(p_n) + tok(r_n) + [eos]

and `loss_mask[t] = 1` exactly where `x[t]` belongs to some `tok(r_i) + [eos]`, else 0. Position `t`
is predicted from position `t - 1` (the engine's loss uses `logits[:, :-1]` against `x[1:]`, weighted
by `loss_mask[1:]`), so position 0 can never carry loss: `loss_mask[0] = 0` always.

Each segment is tokenised on its own with ``add_special_tokens=False``, so the boundary between prompt
and response is exact (no token straddles it) and decoding the masked tokens gives the responses
followed by eos. `bos` is prepended when the tokenizer has a `bos_token_id` (override with `add_bos`).

With ``template="chat"`` the turns are the example's ``messages`` rendered by the tokenizer's chat
template (:mod:`anlr_jax.data.chat`), the token after each response is the template's end-of-turn
token instead of eos (e.g. ``<|im_end|>``), and no bos is prepended (the template has its own).

Truncation to `max_length` keeps the start of the sequence (the prompt's beginning) and cuts the end.
An example whose response tokens are all cut (no `loss_mask = 1` left) is dropped and counted in
`TokenizedExamples.dropped`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from anlr_jax.data.chat import TEMPLATES, chat_turns, end_of_turn_id
from anlr_jax.data.formats import Example, Turn

if TYPE_CHECKING:  # transformers takes most of a second to import: only tokenizers' type
  from transformers import PreTrainedTokenizerBase


@dataclasses.dataclass(frozen=True)
class TokenizedExamples:
  """Variable-length tokenised examples: `input_ids[i]` int32 and `loss_mask[i]` float32, both `(lengths[i],)`."""

  input_ids: list[np.ndarray]
  loss_mask: list[np.ndarray]
  lengths: np.ndarray
  source_lines: np.ndarray
  truncated: int
  dropped: int

  def __len__(self) -> int:
    return len(self.input_ids)


def _special_id(tokenizer: PreTrainedTokenizerBase, name: str) -> int | None:
  value = getattr(tokenizer, f"{name}_token_id", None)
  return None if value is None else int(value)


def _chat_turns_of(example: Example, tokenizer, end_of_turn: int) -> tuple[Turn, ...]:
  if not example.messages:
    raise ValueError(
        f"template='chat' needs the example's messages (line {example.source_line} has none)"
    )
  try:
    return chat_turns(tokenizer, example.messages, end_of_turn=end_of_turn)
  except ValueError as err:
    raise ValueError(f"line {example.source_line}: {err}") from None


def tokenize_examples(
    examples: Sequence[Example],
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int,
    add_bos: bool | None = None,
    template: str = "alpaca",
) -> TokenizedExamples:
  """Tokenises `examples` into ids and response-only loss masks (see the module docstring).

  Args:
    examples: examples from `anlr_jax.data.formats.read_examples`.
    tokenizer: any Hugging Face tokenizer with an `eos_token_id`.
    max_length: maximum sequence length in tokens (bos and eos included).
    add_bos: prepend `bos_token_id`; None means "if the tokenizer has one" with the Alpaca
      template, and no with the chat template.
    template: "alpaca" (the examples' `turns`) or "chat" (their `messages` in the tokenizer's chat
      template, each response closed by the end-of-turn token).

  Returns:
    `TokenizedExamples`, with the number of examples truncated and dropped.
  """
  if not isinstance(max_length, int) or max_length < 2:
    raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")
  if template not in TEMPLATES:
    raise ValueError(f"template must be one of {list(TEMPLATES)}, got {template!r}")
  eos = _special_id(tokenizer, "eos")
  if template == "chat":
    eos = end_of_turn_id(tokenizer)
    turns_of = [_chat_turns_of(example, tokenizer, eos) for example in examples]
  else:
    turns_of = [example.turns for example in examples]
  if eos is None:
    raise ValueError("tokenizer has no eos_token_id; set tokenizer.eos_token before tokenising")
  bos = _special_id(tokenizer, "bos")
  if add_bos is None:
    add_bos = bos is not None and template == "alpaca"
  elif add_bos and bos is None:
    raise ValueError("add_bos=True but the tokenizer has no bos_token_id")
  head = [bos] if add_bos else []

  texts = [text for turns in turns_of for turn in turns for text in turn]
  encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []

  input_ids: list[np.ndarray] = []
  loss_mask: list[np.ndarray] = []
  lines: list[int] = []
  truncated = dropped = 0
  cursor = 0
  for example, turns in zip(examples, turns_of):
    ids: list[int] = list(head)
    mask: list[float] = [0.0] * len(head)
    for _ in turns:
      prompt_ids, response_ids = encoded[cursor], encoded[cursor + 1]
      cursor += 2
      ids += prompt_ids
      mask += [0.0] * len(prompt_ids)
      ids += response_ids
      ids.append(eos)
      mask += [1.0] * (len(response_ids) + 1)
    if len(ids) > max_length:
      truncated += 1
      ids, mask = ids[:max_length], mask[:max_length]
    mask[0] = 0.0
    if not any(mask):
      dropped += 1
      continue
    input_ids.append(np.asarray(ids, dtype=np.int32))
    loss_mask.append(np.asarray(mask, dtype=np.float32))
    lines.append(example.source_line)
  return TokenizedExamples(
      input_ids=input_ids,
      loss_mask=loss_mask,
      lengths=np.asarray([len(x) for x in input_ids], dtype=np.int64),
      source_lines=np.asarray(lines, dtype=np.int64),
      truncated=truncated,
      dropped=dropped,
  )

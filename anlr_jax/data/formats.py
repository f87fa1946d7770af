r"""Readers for the instruction-tuning datasets of the paper, each record turned into prompt/response turns.

A record becomes an `Example`: a tuple of turns `(prompt_i, response_i)`. The training loss covers the
response of every turn (and the eos appended after it); prompts are context only. Single-turn formats
give one turn; chat formats give one turn per assistant message.

Formats (the format name, the keys that identify it, the template):

* ``commonsense`` — Commonsense170K / LLM-Adapters (`instruction`, `input`, `output`, `answer`). The
  Alpaca template (below); the response is `output` (e.g. "the correct answer is answer2"); `answer`
  is the bare label, kept for reference.
* ``metamath`` — MetaMathQA (`query`, `response`, `type`). The Alpaca template without input, with
  `query` as the instruction; the response is `response`.
* ``alpaca`` — WizardLM (70K) / Alpaca (`instruction`, optional `input`, `output`). Alpaca template.
* ``messages`` — Code-Feedback (`messages`: list of `{role, content}`, roles system/user/assistant).
* ``sharegpt`` — WizardLM evol-instruct V2 (`conversations`: list of `{from, value}`, human/gpt).
* ``completion`` — plain `prompt` / `completion`, used verbatim.

Alpaca template (no input)::

    Below is an instruction that describes a task. Write a response that appropriately completes the request.

    ### Instruction:
    {instruction}

    ### Response:
    {response}

With a non-empty `input` the preamble reads "..., paired with an input that provides further context. ..."
and a ``### Input:\n{input}\n\n`` block follows the instruction. Chat formats use the same blocks per
turn: the first prompt starts with the system message (or the Alpaca preamble when there is none),
consecutive user messages are joined by a blank line, and each later prompt is
``### Instruction:\n{user}\n\n### Response:\n``. User messages after the last assistant message carry
no loss and are dropped.

Every record also yields its conversation as ``messages``: `(role, content)` pairs with roles
``system``, ``user``, ``assistant`` (consecutive user messages joined by a blank line, user messages
after the last assistant message dropped, as above). An Alpaca-style record is one user message,
``instruction`` followed by a blank line and ``input`` when there is one (:func:`user_message`), and
one assistant message. ``data.template: chat`` renders these with the tokenizer's chat template
instead of the Alpaca template (see `anlr_jax.data.chat`).

Files are JSON lists (first non-blank character `[`) or JSONL (one object per line; blank lines are
ignored). A malformed record raises `DataFormatError` naming the file and the 1-based line where the
record starts, or with ``on_error="skip"`` is skipped and counted in `ReadResult.skipped`. A syntax
error inside a JSON list always raises: the rest of the list cannot be located reliably.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

logger = logging.getLogger(__name__)

Turn = tuple[str, str]
"""One `(prompt, response)` pair; the loss covers only the response (and its eos)."""

Message = tuple[str, str]
"""One `(role, content)` message of a conversation; role is system, user or assistant."""

OnError = Literal["raise", "skip"]

ALPACA_PREAMBLE = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
)
ALPACA_PREAMBLE_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
)


class DataFormatError(ValueError):
  """A data file or record that cannot be read; the message names the file and line."""


@dataclasses.dataclass(frozen=True)
class Example:
  """One training example: `turns` of `(prompt, response)` in the Alpaca template, the same
  conversation as `messages` of `(role, content)`; `source_line` is its 1-based line."""

  turns: tuple[Turn, ...]
  source_line: int = 0
  messages: tuple[Message, ...] = ()

  @property
  def prompt(self) -> str:
    """The first turn's prompt (what a single-turn model is given at evaluation)."""
    return self.turns[0][0]

  @property
  def response(self) -> str:
    """The first turn's response."""
    return self.turns[0][1]


@dataclasses.dataclass(frozen=True)
class ReadResult:
  """Examples read from a file, the format used, and the records skipped as `(line, reason)`."""

  examples: list[Example]
  format: str
  skipped_records: tuple[tuple[int, str], ...] = ()

  @property
  def skipped(self) -> int:
    """How many malformed records were skipped (only non-zero with ``on_error="skip"``)."""
    return len(self.skipped_records)


@dataclasses.dataclass(frozen=True)
class EvalExample:
  """One test item: the `instruction` (and optional `input`) shown to the model, the gold `answer`."""

  instruction: str
  answer: str
  input: str = ""


def alpaca_prompt(instruction: str, input: str | None = None) -> str:  # noqa: A002 (dataset key)
  """The Alpaca / LLM-Adapters prompt for `instruction` (and optional `input`), up to "### Response:\\n"."""
  if input and input.strip():
    return (
        f"{ALPACA_PREAMBLE_WITH_INPUT}### Instruction:\n{instruction}\n\n"
        f"### Input:\n{input}\n\n### Response:\n"
    )
  return f"{ALPACA_PREAMBLE}### Instruction:\n{instruction}\n\n### Response:\n"


def user_message(instruction: str, input: str | None = None) -> str:  # noqa: A002 (dataset key)
  """The user message of an Alpaca-style record in a chat: `instruction`, then a blank line and
  `input` when it is not blank."""
  if input and input.strip():
    return f"{instruction}\n\n{input}"
  return instruction


# --------------------------------------------------------------------------------------------------
# Per-format record converters: record -> (turns, messages), raising _RecordError(reason) when
# malformed.

Converted = tuple[tuple[Turn, ...], tuple[Message, ...]]


class _RecordError(Exception):
  """A malformed record; the reader adds the file and line."""


def _text(record: Mapping[str, Any], key: str, *, optional: bool = False) -> str:
  if key not in record or record[key] is None:
    if optional:
      return ""
    raise _RecordError(f"missing key {key!r} (keys: {sorted(record)})")
  value = record[key]
  if not isinstance(value, str):
    raise _RecordError(f"key {key!r} must be a string, got {type(value).__name__}")
  if not optional and not value.strip():
    raise _RecordError(f"key {key!r} is empty")
  return value


def _single(prompt: str, user: str, response: str) -> Converted:
  return ((prompt, response),), (("user", user), ("assistant", response))


def _alpaca_turns(record: Mapping[str, Any]) -> Converted:
  instruction, extra = _text(record, "instruction"), _text(record, "input", optional=True)
  output = _text(record, "output")
  return _single(alpaca_prompt(instruction, extra), user_message(instruction, extra), output)


def _commonsense_turns(record: Mapping[str, Any]) -> Converted:
  _text(record, "answer")  # the label must be present, even though `output` is what is trained on
  return _alpaca_turns(record)


def _metamath_turns(record: Mapping[str, Any]) -> Converted:
  query = _text(record, "query")
  return _single(alpaca_prompt(query), query, _text(record, "response"))


def _completion_turns(record: Mapping[str, Any]) -> Converted:
  prompt = _text(record, "prompt", optional=True)
  return _single(prompt, prompt, _text(record, "completion"))


def _chat_turns(
    messages: Any, *, list_key: str, role_key: str, content_key: str, roles: Mapping[str, str]
) -> Converted:
  """Turns and messages from chat messages; `roles` maps the file's role names to
  system/user/assistant."""
  if not isinstance(messages, list) or not messages:
    raise _RecordError(f"key {list_key!r} must be a non-empty list of messages")
  turns: list[Turn] = []
  conversation: list[Message] = []
  system = ""
  users: list[str] = []
  for i, message in enumerate(messages):
    if not isinstance(message, Mapping):
      raise _RecordError(f"{list_key}[{i}] must be an object, got {type(message).__name__}")
    role = message.get(role_key)
    if role not in roles:
      raise _RecordError(f"{list_key}[{i}].{role_key} is {role!r}; expected one of {sorted(roles)}")
    content = message.get(content_key)
    if not isinstance(content, str):
      raise _RecordError(f"{list_key}[{i}].{content_key} must be a string")
    kind = roles[role]
    if kind == "system":
      if turns or users:
        raise _RecordError(f"{list_key}[{i}]: a system message must come first")
      system = content
      conversation[:] = [("system", content)] if content.strip() else []
    elif kind == "user":
      users.append(content)
    else:
      if not content.strip():
        raise _RecordError(f"{list_key}[{i}]: empty assistant message")
      if not turns:
        head = f"{system}\n\n" if system.strip() else ALPACA_PREAMBLE
      else:
        head = ""
      user_text = "\n\n".join(users)
      prompt = head + (f"### Instruction:\n{user_text}\n\n" if users else "")
      turns.append((prompt + "### Response:\n", content))
      if users:
        conversation.append(("user", user_text))
      conversation.append(("assistant", content))
      users = []
  if not turns:
    raise _RecordError(f"key {list_key!r} has no assistant message to train on")
  return tuple(turns), tuple(conversation)


def _messages_turns(record: Mapping[str, Any]) -> Converted:
  roles = {"system": "system", "user": "user", "assistant": "assistant"}
  return _chat_turns(
      record.get("messages"),
      list_key="messages",
      role_key="role",
      content_key="content",
      roles=roles,
  )


def _sharegpt_turns(record: Mapping[str, Any]) -> Converted:
  roles = {
      "system": "system",
      "human": "user",
      "user": "user",
      "gpt": "assistant",
      "assistant": "assistant",
  }
  return _chat_turns(
      record.get("conversations"),
      list_key="conversations",
      role_key="from",
      content_key="value",
      roles=roles,
  )


@dataclasses.dataclass(frozen=True)
class _Format:
  required_keys: frozenset[str]
  convert: Callable[[Mapping[str, Any]], Converted]


FORMATS: dict[str, _Format] = {
    # Detection tries these in order: the first whose keys are all present wins.
    "messages": _Format(frozenset({"messages"}), _messages_turns),
    "sharegpt": _Format(frozenset({"conversations"}), _sharegpt_turns),
    "metamath": _Format(frozenset({"query", "response"}), _metamath_turns),
    "commonsense": _Format(frozenset({"instruction", "output", "answer"}), _commonsense_turns),
    "alpaca": _Format(frozenset({"instruction", "output"}), _alpaca_turns),
    "completion": _Format(frozenset({"prompt", "completion"}), _completion_turns),
}
"""Known formats and the keys that identify them (see the module docstring)."""


VISUAL_BENCHMARKS = ("vqav2", "gqa", "vizwiz", "scienceqa", "textvqa", "pope", "mmbench")
"""The seven visual benchmarks of LLaVA-1.5, in the column order of its results table (their
files and scorers: :mod:`anlr_jax.evals.visual`)."""

VISUAL_FORMATS = (*VISUAL_BENCHMARKS, "llava_qa")
"""Every visual eval format (``eval.tasks.<name>.format``): the seven benchmarks and LLaVA-format
questions with answers."""


def detect_format(record: Mapping[str, Any]) -> str:
  """The name of the first format in `FORMATS` whose identifying keys are all in `record`."""
  for name, spec in FORMATS.items():
    if spec.required_keys <= record.keys():
      return name
  raise _RecordError(
      f"cannot detect the format from keys {sorted(record)}; known formats and their keys: "
      + ", ".join(f"{n}={sorted(s.required_keys)}" for n, s in FORMATS.items())
  )


# --------------------------------------------------------------------------------------------------
# File scanning: (line, record) pairs, or (line, _RecordError) for records that are not valid JSON.


def _line_of(text: str, pos: int) -> int:
  return text.count("\n", 0, pos) + 1


def _scan_json_list(text: str, path: str) -> Iterator[tuple[int, Any]]:
  decoder = json.JSONDecoder()
  pos = len(text) - len(text.lstrip()) + 1  # just after "["
  expect_value = True
  while True:
    while pos < len(text) and text[pos].isspace():
      pos += 1
    if pos >= len(text):
      raise DataFormatError(f"{path}:{_line_of(text, pos)}: unterminated JSON list")
    if text[pos] == "]":
      if text[pos + 1 :].strip():
        raise DataFormatError(f"{path}:{_line_of(text, pos + 1)}: extra data after the JSON list")
      return
    if not expect_value:
      if text[pos] != ",":
        raise DataFormatError(f"{path}:{_line_of(text, pos)}: expected ',' or ']' in the JSON list")
      pos += 1
      expect_value = True
      continue
    try:
      value, end = decoder.raw_decode(text, pos)
    except json.JSONDecodeError as err:
      raise DataFormatError(f"{path}:{err.lineno}: invalid JSON: {err.msg}") from None
    yield _line_of(text, pos), value
    pos, expect_value = end, False


def _scan_jsonl(text: str) -> Iterator[tuple[int, Any]]:
  for line_number, line in enumerate(text.splitlines(), start=1):
    if not line.strip():
      continue
    try:
      yield line_number, json.loads(line)
    except json.JSONDecodeError as err:
      yield line_number, _RecordError(f"invalid JSON: {err.msg} (column {err.colno})")


def scan_records(path: str | os.PathLike[str]) -> Iterator[tuple[int, Any]]:
  """Yields `(line, record)` from a JSON-list or JSONL file; invalid JSONL lines yield an error value."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"data file not found: {path}")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  if text.lstrip().startswith("["):
    yield from _scan_json_list(text, path)
  else:
    yield from _scan_jsonl(text)


def check_on_error(on_error: str) -> None:
  """Raises ValueError unless ``on_error`` is one of :data:`OnError`'s values."""
  if on_error not in ("raise", "skip"):
    raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")


def check_read(path: str, examples: Sequence[Any], skipped: Sequence[tuple[int, str]]) -> None:
  """The end of reading a data file (text or LLaVA records): one warning for the records skipped
  (``(line, reason)``: their count, the first's line and reason), and DataFormatError when no
  record was usable."""
  if skipped:
    logger.warning(
        "%s: skipped %d malformed record(s), first at line %d: %s",
        path,
        len(skipped),
        skipped[0][0],
        skipped[0][1],
    )
  if not examples:
    raise DataFormatError(
        f"{path}: no usable records" + (f" ({len(skipped)} skipped)" if skipped else "")
    )


def read_examples(
    path: str | os.PathLike[str], *, format: str | None = None, on_error: OnError = "raise"  # noqa: A002
) -> ReadResult:
  """Reads `path` into `Example`s.

  Args:
    path: a JSON list or JSONL file of records.
    format: one of `FORMATS`; None detects it from the first record that is a JSON object.
    on_error: "raise" (a `DataFormatError` naming file and line) or "skip" (count and log it).

  Returns:
    A `ReadResult` with the examples, the format used and the skipped records.
  """
  check_on_error(on_error)
  if format is not None and format not in FORMATS:
    raise ValueError(f"format must be one of {sorted(FORMATS)} or None, got {format!r}")
  path = os.fspath(path)
  examples: list[Example] = []
  skipped: list[tuple[int, str]] = []
  for line, record in scan_records(path):
    try:
      if isinstance(record, _RecordError):
        raise record
      if not isinstance(record, Mapping):
        raise _RecordError(f"a record must be a JSON object, got {type(record).__name__}")
      if format is None:
        format = detect_format(record)  # noqa: A001
      turns, messages = FORMATS[format].convert(record)
      examples.append(Example(turns, source_line=line, messages=messages))
    except _RecordError as err:
      if on_error == "raise":
        raise DataFormatError(f"{path}:{line}: {err}") from None
      skipped.append((line, str(err)))
  check_read(path, examples, skipped)
  return ReadResult(examples=examples, format=format or "", skipped_records=tuple(skipped))

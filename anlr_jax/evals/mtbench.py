r"""MT-Bench answers: two turns per question in the model's template, saved as they are made.

For a question with user turns ``q_1, q_2`` the model answers

    a_1 = strip(generate(render([user q_1])))
    a_2 = strip(generate(render([user q_1, assistant a_1, user q_2])))

where ``render`` is the tokenizer's chat template up to where the assistant's reply starts (or, for
a model trained with ``data.template: alpaca``, the multi-turn Alpaca layout of training,
:func:`conversation_prompt`), so turn 2 sees the model's own turn-1 answer as the conversation so
far (as FastChat's ``gen_model_answer`` does). Decoding is greedy by default (``sampling="greedy"``); ``sampling="category"`` uses the
protocol's per-category temperatures (:data:`anlr_jax.data.mtbench.TEMPERATURES`: 0.7 for writing
and roleplay, 0.1 for stem and humanities, greedy for the rest).

Questions go in batches (one temperature per batch); after each batch its records are appended to
the answers file (JSONL, one record per question, FastChat's layout plus ``category``)::

    {"question_id": 81, "category": "writing", "model_id": "anlr",
     "choices": [{"index": 0, "turns": ["<a_1>", "<a_2>"]}], "generation": {...}, "tstamp": ...}

A rerun with the same file answers only the questions it does not hold yet. A record written by
another model or with other generation settings is refused (one line) rather than mixed in.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import tqdm

from anlr_jax import fileio
from anlr_jax.data.chat import render_chat
from anlr_jax.data.formats import DataFormatError, alpaca_prompt
from anlr_jax.data.mtbench import TEMPERATURES, Question

SAMPLING = ("greedy", "category")
"""``eval.dialogue_sampling``: greedy decoding, or the protocol's per-category temperatures."""

ANSWERS_FILE = "mt_bench_answers.jsonl"
"""The answers file of ``anlr eval`` in its output directory."""

SampleFn = Callable[[list[str], float], list[str]]
"""``(prompts, temperature) -> continuations`` (temperature 0: greedy)."""


# ----------------------------------------------------------------------------------- JSONL I/O
def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
  """The JSON objects of a JSONL file written by :func:`append_records` ([] when it is missing).

  A last line cut short by a crash (no newline, not valid JSON) is dropped from the file, so the
  next run makes that record again; any other unreadable line raises DataFormatError naming it.
  """
  if not os.path.isfile(path):
    return []
  return fileio.read_jsonl(path, cut_last="remove", error=DataFormatError)


def append_records(path: str | os.PathLike[str], records: Iterable[Mapping[str, Any]]) -> None:
  """Appends one JSON line per record and flushes it to disk."""
  with open(path, "a", encoding="utf-8") as f:
    for record in records:
      f.write(json.dumps(record, ensure_ascii=False) + "\n")
    f.flush()
    os.fsync(f.fileno())


# ------------------------------------------------------------------------------------ prompts
def conversation_prompt(
    tokenizer, messages: Sequence[tuple[str, str]], template: str = "chat"
) -> str:
  """The text of ``(role, content)`` messages (user first, alternating) up to where the reply
  starts: in the tokenizer's chat template (``chat``), or in the multi-turn Alpaca layout the
  project trains chat data with (``alpaca``, :mod:`anlr_jax.data.formats`): the Alpaca prompt of
  the first message, then per earlier answer ``answer + eos + "### Instruction:\n{next}\n\n###
  Response:\n"``."""
  if template == "alpaca":
    (_, first), *rest = messages
    text = alpaca_prompt(first)
    for (_, answer), (_, user) in zip(rest[::2], rest[1::2]):
      text += f"{answer}{tokenizer.eos_token}### Instruction:\n{user}\n\n### Response:\n"
    return text
  return render_chat(
      tokenizer,
      messages,
      generation=True,
      context="MT-Bench answers are made in the model's chat template",
      fix="",
  )


def answer_turns(
    sample_fn: SampleFn,
    tokenizer,
    questions: Sequence[Question],
    temperature: float = 0.0,
    template: str = "chat",
) -> list[tuple[str, str]]:
  """Both turns' answers of each question (one ``sample_fn`` call per turn, see the module doc)."""
  render = lambda messages: conversation_prompt(tokenizer, messages, template)
  first = [render([("user", q.turns[0])]) for q in questions]
  a1 = [text.strip() for text in sample_fn(first, temperature)]
  second = [
      render([("user", q.turns[0]), ("assistant", a), ("user", q.turns[1])])
      for q, a in zip(questions, a1)
  ]
  a2 = [text.strip() for text in sample_fn(second, temperature)]
  return list(zip(a1, a2))


# ------------------------------------------------------------------------------------ answers
def answers_by_question(records: Iterable[Mapping[str, Any]], where: str) -> dict[int, list[str]]:
  """``{question_id: [a_1, a_2]}`` of answer records (FastChat's ``choices[0].turns``)."""
  out = {}
  for record in records:
    turns = ((record.get("choices") or [{}])[0] or {}).get("turns")
    qid = record.get("question_id")
    if not isinstance(qid, int) or not isinstance(turns, list) or len(turns) != 2:
      raise DataFormatError(f"{where}: question {qid!r}: an answer record needs choices[0].turns")
    out[qid] = [str(t) for t in turns]
  return out


def generate_answers(
    sample_fn: SampleFn,
    tokenizer,
    questions: Sequence[Question],
    path: str | os.PathLike[str],
    *,
    model_id: str,
    batch_size: int,
    sampling: str = "greedy",
    max_new_tokens: int | None = None,
    template: str = "chat",
    progress: bool = True,
) -> dict[int, list[str]]:
  """Answers every question not yet in ``path`` and appends its record (see the module doc).

  Args:
    sample_fn: ``(prompts, temperature) -> continuations``, one string per prompt.
    tokenizer: the model's tokenizer (its chat template builds the prompts).
    questions: the MT-Bench questions to answer.
    path: the answers file (JSONL); created or extended.
    model_id: the name recorded with every answer (a rerun with another name is refused).
    batch_size: questions per generation batch.
    sampling: ``greedy`` or ``category`` (:data:`SAMPLING`).
    max_new_tokens: recorded with the answers (a rerun with another value is refused).
    template: ``chat`` (the tokenizer's chat template) or ``alpaca`` (:func:`conversation_prompt`),
      the template the model was trained with.
    progress: a tqdm bar of the questions answered.

  Returns:
    ``{question_id: [a_1, a_2]}`` of every question of ``questions``.
  """
  if sampling not in SAMPLING:
    raise ValueError(f"sampling must be one of {list(SAMPLING)}, got {sampling!r}")
  path = os.fspath(path)
  settings = {"sampling": sampling, "max_new_tokens": max_new_tokens, "template": template}
  saved = read_records(path)
  for record in saved:
    if record.get("model_id") != model_id or record.get("generation") != settings:
      raise ValueError(
          f"{path} holds answers of model {record.get('model_id')!r} made with"
          f" {record.get('generation')}, not of {model_id!r} with {settings}: use another file"
      )
  answers = answers_by_question(saved, path)
  todo = [q for q in questions if q.question_id not in answers]
  groups: dict[float, list[Question]] = {}
  for q in todo:
    groups.setdefault(TEMPERATURES[q.category] if sampling == "category" else 0.0, []).append(q)
  with tqdm.tqdm(
      total=len(questions),
      initial=len(questions) - len(todo),
      desc="mt_bench answers",
      unit="question",
      disable=not progress,
      leave=False,
  ) as bar:
    for temperature, group in groups.items():
      for start in range(0, len(group), batch_size):
        batch = group[start : start + batch_size]
        turns = answer_turns(sample_fn, tokenizer, batch, temperature, template)
        append_records(
            path,
            [
                {
                    "question_id": q.question_id,
                    "category": q.category,
                    "model_id": model_id,
                    "choices": [{"index": 0, "turns": list(t)}],
                    "temperature": temperature,
                    "generation": settings,
                    "tstamp": time.time(),
                }
                for q, t in zip(batch, turns)
            ],
        )
        for q, t in zip(batch, turns):
          answers[q.question_id] = list(t)
        bar.update(len(batch))
  return {q.question_id: answers[q.question_id] for q in questions}


__all__ = [
    "ANSWERS_FILE",
    "SAMPLING",
    "answer_turns",
    "answers_by_question",
    "append_records",
    "conversation_prompt",
    "generate_answers",
    "read_records",
]

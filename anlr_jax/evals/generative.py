r"""Generation-then-extraction evaluation, independent of the model code.

For test examples `(x_i, y_i)`, `i = 1..N`, of a task, the prompt is `p_i = prompt_fn(x_i)` (by default
the Alpaca template the model was fine-tuned with), the model's continuation is
`g_i = generate_fn([p_i, ...])[.]` (prompts sent in batches of `batch_size`), the prediction is
`ŷ_i = extract(task, g_i)` and

    accuracy = (1/N) · Σ_i [ŷ_i matches y_i]

with the extraction and matching rules of `anlr_jax.evals.extract`. `generate_fn` should return only the
continuation; a generation that starts with its own prompt has that prompt removed first (the prompt
lists the option words, which would otherwise be "found" in it).

Test files use LLM-Adapters' layout: a JSON list of objects with `instruction` and `answer` (an
optional `input` is passed to the template).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tqdm

from anlr_jax import fileio
from anlr_jax.data.formats import EvalExample, alpaca_prompt
from anlr_jax.fileio import read_json
from anlr_jax.evals.extract import Task, extract_prediction, get_task, is_correct, parse_gold

GenerateFn = Callable[[list[str]], list[str]]


@dataclasses.dataclass(frozen=True)
class EvalRecord:
  """What happened on one test item."""

  index: int
  prompt: str
  generation: str
  prediction: str | float | None
  answer: str
  correct: bool


@dataclasses.dataclass(frozen=True)
class EvalResult:
  """Per-item records of one task, and the accuracy (a fraction in [0, 1])."""

  task: str
  records: tuple[EvalRecord, ...]

  @property
  def total(self) -> int:
    return len(self.records)

  @property
  def correct(self) -> int:
    return sum(r.correct for r in self.records)

  @property
  def accuracy(self) -> float:
    return self.correct / self.total if self.records else 0.0

  def save_records(self, path: str | os.PathLike[str]) -> None:
    """Writes one JSON object per record (JSONL), for inspecting what the model said."""
    with fileio.atomic_write(path, "w", encoding="utf-8") as f:
      for record in self.records:
        f.write(json.dumps(dataclasses.asdict(record) | {"task": self.task}) + "\n")


def _as_example(item: Any, where: str) -> EvalExample:
  if isinstance(item, EvalExample):
    return item
  if not isinstance(item, Mapping):
    raise ValueError(f"{where}: a test example must be an object, got {type(item).__name__}")
  for key in ("instruction", "answer"):
    if not isinstance(item.get(key), str):
      raise ValueError(f"{where}: key {key!r} must be a string (keys: {sorted(item)})")
  extra = item.get("input") or ""
  if not isinstance(extra, str):
    raise ValueError(f"{where}: key 'input' must be a string")
  return EvalExample(item["instruction"], item["answer"], extra)


def load_eval_examples(path: str | os.PathLike[str]) -> list[EvalExample]:
  """Reads an LLM-Adapters test file: a JSON list of `{"instruction", "answer"[, "input"]}`."""
  path = os.fspath(path)
  items = read_json(path, list, what="a JSON list of test examples")
  return [_as_example(item, f"{path}: item {i}") for i, item in enumerate(items)]


def default_prompt(example: EvalExample) -> str:
  """The Alpaca prompt used for fine-tuning on Commonsense170K, MetaMathQA and WizardLM."""
  return alpaca_prompt(example.instruction, example.input)


def generate_batched(
    generate_fn: GenerateFn,
    prompts: Sequence[str],
    *,
    batch_size: int,
    desc: str,
    progress: bool | None = None,
) -> list[str]:
  """``generate_fn`` over ``prompts`` in batches of ``batch_size``: one continuation per prompt, in
  order, with the prompt removed when the generation repeats it.

  Args:
    progress: a tqdm bar (``desc``) of the prompts generated so far, on stderr (default: when there
      is more than one batch).

  Raises:
    ValueError: ``generate_fn`` returned the wrong number of items, or an item that is not a str.
  """
  out: list[str] = []
  show = len(prompts) > batch_size if progress is None else progress
  with tqdm.tqdm(
      total=len(prompts), disable=not show, desc=desc, unit="prompt", leave=False
  ) as bar:
    for start in range(0, len(prompts), batch_size):
      batch = list(prompts[start : start + batch_size])
      generations = generate_fn(batch)
      bar.update(len(batch))
      if not isinstance(generations, (list, tuple)) or len(generations) != len(batch):
        got = (
            len(generations)
            if isinstance(generations, (list, tuple))
            else type(generations).__name__
        )
        raise ValueError(
            f"generate_fn returned {got} for {len(batch)} prompts; expected a list of "
            f"{len(batch)} strings"
        )
      for offset, (prompt, text) in enumerate(zip(batch, generations)):
        if not isinstance(text, str):
          raise ValueError(
              f"generate_fn returned a {type(text).__name__} for prompt {start + offset}"
          )
        out.append(text[len(prompt) :] if text.startswith(prompt) else text)
  return out


def evaluate(
    generate_fn: GenerateFn,
    examples: Sequence[EvalExample | Mapping[str, Any]],
    task: str | Task,
    *,
    batch_size: int,
    prompt_fn: Callable[[EvalExample], str] = default_prompt,
    progress: bool | None = None,
) -> EvalResult:
  """Generates for every example, extracts the answers and scores them (see the module docstring).

  Args:
    generate_fn: `prompts -> continuations`, one string per prompt, in order.
    examples: `EvalExample`s or mappings with `instruction` and `answer`.
    task: a task name from `anlr_jax.evals.extract.TASKS` (or an alias), or a `Task`.
    batch_size: prompts per `generate_fn` call.
    prompt_fn: builds the prompt of an example (default: the Alpaca template).
    progress: a tqdm bar of the prompts generated so far, on stderr (default: when there is more
      than one batch).

  Returns:
    An `EvalResult` with one `EvalRecord` per example.
  """
  task = get_task(task)
  if task.kind == "code":
    raise ValueError(
        f"{task.name} is scored by running its unit tests: use anlr_jax.evals.code.evaluate_code"
    )
  if not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
  items = [_as_example(item, f"examples[{i}]") for i, item in enumerate(examples)]
  golds = []
  for i, item in enumerate(items):
    try:
      golds.append(parse_gold(task, item.answer))
    except ValueError as err:
      raise ValueError(f"examples[{i}]: {err}") from None
  prompts = [prompt_fn(item) for item in items]
  generations = generate_batched(
      generate_fn, prompts, batch_size=batch_size, desc=task.name, progress=progress
  )
  records = []
  for index, (item, prompt, text, gold) in enumerate(zip(items, prompts, generations, golds)):
    prediction = extract_prediction(task, text)
    records.append(
        EvalRecord(
            index=index,
            prompt=prompt,
            generation=text,
            prediction=prediction,
            answer=item.answer,
            correct=is_correct(task, prediction, gold),
        )
    )
  return EvalResult(task=task.name, records=tuple(records))


def template_prompt_fn(template: str, tokenizer=None) -> Callable[[EvalExample], str]:
  """The prompt builder of a training template (``data.template``): ``alpaca`` gives
  :func:`default_prompt`; ``chat`` the tokenizer's chat template around one user message,
  ``instruction`` (and a blank line and ``input`` when there is one), up to where the answer starts
  (as :mod:`anlr_jax.data.chat` renders the training prompts)."""
  from anlr_jax.data.chat import TEMPLATES, chat_prompt
  from anlr_jax.data.formats import user_message

  if template not in TEMPLATES:
    raise ValueError(f"template must be one of {list(TEMPLATES)}, got {template!r}")
  if template == "alpaca":
    return default_prompt
  if tokenizer is None:
    raise ValueError("template='chat' needs the tokenizer (its chat template builds the prompt)")
  return lambda example: chat_prompt(tokenizer, user_message(example.instruction, example.input))

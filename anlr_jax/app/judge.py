"""MT-Bench in the app: answers in ``anlr eval``, and the LLM judge of ``eval.judge`` (``anlr judge``).

``anlr eval eval.tasks.mt_bench=benchmark://mt_bench`` writes the model's answers to
``<out>/mt_bench_answers.jsonl`` (:mod:`anlr_jax.evals.mtbench`) and, when ``eval.judge.model`` is
set, grades them (:mod:`anlr_jax.evals.judge`) into ``<out>/mt_bench_single.jsonl`` with the scores
in ``<out>/mt_bench_scores_<model>.json``. ``anlr judge --single DIR ...`` grades saved answers;
``anlr judge --pair DIR_1 DIR_2`` compares two models' answers, both orders, into
``mt_bench_pair.jsonl`` and ``mt_bench_pair_<model 1>_vs_<model 2>.json``. Every file is extended,
not rewritten: a rerun makes only what is missing. With ``eval.judge.url`` the judge is an
OpenAI-compatible chat endpoint (``anlr serve``, :mod:`anlr_jax.app.serve`, or any other) called
through :mod:`anlr_jax.app.judge_client`, which retries passing faults (HTTP 429 / 5xx, timeouts,
dropped connections) up to ``eval.judge.max_retries`` times; one that still fails stops the run
with one line naming the URL, and the judgments saved before are kept.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import re
from collections.abc import Sequence
from typing import Any

from anlr_jax.app.config import ModelSection, RunConfig
from anlr_jax.app.text_generation import make_generate_fn
from anlr_jax.app.judge_client import ChatClient, EndpointError, shown_url
from anlr_jax.app.model import load_base
from anlr_jax.app.paths import require_path
from anlr_jax.app.report import Log, is_writer, say
from anlr_jax.data import chat_prompt, mtbench
from anlr_jax.data.chat import require_chat_template
from anlr_jax.data.formats import DataFormatError
from anlr_jax.evals import judge as judging
from anlr_jax.evals.judge_probs import JudgeProbes, ReplyHolder, local_probes
from anlr_jax.evals.mtbench import ANSWERS_FILE, answers_by_question, generate_answers, read_records
from anlr_jax.fileio import write_json_atomic
from anlr_jax.train.lock import DirectoryLock

SINGLE_FILE = "mt_bench_single.jsonl"
PAIR_FILE = "mt_bench_pair.jsonl"


def _safe(name: str) -> str:
  return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")


def scores_file(model: str) -> str:
  """The file of a model's single-grading summary: ``mt_bench_scores_<model>.json``."""
  return f"mt_bench_scores_{_safe(model)}.json"


def answer_mt_bench(
    model, tokenizer, config: RunConfig, questions, out_dir: str, *, model_id: str, log: Log = say
) -> str:
  """Writes (or completes) ``<out_dir>/mt_bench_answers.jsonl``; returns its path."""
  path = os.path.join(out_dir, ANSWERS_FILE)
  sample_fn = make_generate_fn(
      model,
      tokenizer,
      max_new_tokens=config.eval.dialogue_max_new_tokens,
      batch_size=config.eval.batch_size,
      template=config.data.template,
      seed=config.seed,
  )
  log(
      f"  mt_bench: answering {len(questions)} questions, two turns each in the"
      f" {config.data.template} template ({config.eval.dialogue_sampling}, at most {config.eval.dialogue_max_new_tokens} tokens"
      " per turn)"
  )
  generate_answers(
      sample_fn,
      tokenizer,
      questions,
      path,
      model_id=model_id,
      batch_size=config.eval.batch_size,
      sampling=config.eval.dialogue_sampling,
      max_new_tokens=config.eval.dialogue_max_new_tokens,
      template=config.data.template,
      progress=is_writer(),
  )
  log(f"  mt_bench answers: {path}")
  return path


# --------------------------------------------------------------------------------- the judge
def judge_prompt(tokenizer, system: str, user: str) -> str:
  """The judge's prompt in its chat template: the judge prompt's system message, then the user
  message. A template that refuses a system message gets it at the head of the user message
  (``[Instruction]`` block, as FastChat does for such judges)."""
  try:
    return chat_prompt(tokenizer, user, system=system)
  except Exception as err:  # noqa: BLE001  (jinja2's TemplateError, raised by the template)
    if type(err).__name__ != "TemplateError" and "system" not in str(err).lower():
      raise
    return chat_prompt(tokenizer, f"[Instruction]\n{system}\n\n{user}")


@dataclasses.dataclass
class Judge:
  """A loaded judge: its name (``eval.judge.model`` as given, or the endpoint's model name),
  ``judge_fn``, batch size, a local judge's probabilities (``probes``), and the settings that
  change its replies (``settings``: saved with each judgment, checked when a run goes on)."""

  name: str
  judge_fn: judging.JudgeFn
  batch_size: int
  probes: JudgeProbes | None = None
  settings: dict[str, Any] | None = None


def judge_configured(config: RunConfig) -> bool:
  """Whether ``eval.judge`` names a judge (``model`` or ``url``)."""
  return bool(config.eval.judge.model or config.eval.judge.url)


def load_judge(config: RunConfig) -> Judge:
  """The judge of ``eval.judge``: the model of ``eval.judge.model`` (any model
  :func:`anlr_jax.app.model.load_base` reads), answering greedily in its chat template, or the
  endpoint of ``eval.judge.url`` (:func:`endpoint_judge`); one-line errors name the key."""
  section = config.eval.judge
  if section.url:
    if section.model:
      raise ValueError(
          f"eval.judge.model ({section.model}) and eval.judge.url ({section.url}) are both set:"
          " keep one"
      )
    return endpoint_judge(section, section.batch_size or config.eval.batch_size)
  if not section.model:
    raise ValueError(
        "eval.judge.model is not set: name the judge, a HF model directory, a .gguf file or a"
        " package:// path (eval.judge.model=<path>), or an endpoint (eval.judge.url=<url>)"
    )
  name, path = judge_path(section)
  judge_config = dataclasses.replace(
      config, model=ModelSection(path=path, dtype=section.dtype, quantize=section.quantize)
  )
  try:
    model, _, tokenizer = load_base(judge_config)
  except (OSError, ValueError, KeyError, TypeError) as err:
    message = err.args[0] if err.args else type(err).__name__
    raise ValueError(f"eval.judge.model: {section.model} does not load as a model: {message}")
  require_chat_template(tokenizer, f"eval.judge.model: {section.model}")
  model.eval()
  batch_size = section.batch_size or config.eval.batch_size
  replies = ReplyHolder()  # the probability rating goes on from the replies' KV cache
  generate_fn = make_generate_fn(
      model,
      tokenizer,
      max_new_tokens=section.max_new_tokens,
      batch_size=batch_size,
      template="chat",
      prefill_chunk=section.prefill_chunk,
      hold=replies.hold,
      no_repeat_ngram=section.no_repeat_ngram,
  )

  def judge_fn(prompts: list[tuple[str, str]]) -> list[str]:
    return generate_fn([judge_prompt(tokenizer, system, user) for system, user in prompts])

  probes = local_probes(
      model,
      tokenizer,
      lambda system, user: judge_prompt(tokenizer, system, user),
      batch_size=batch_size,
      max_new_tokens=section.max_new_tokens,
      prefill_chunk=section.prefill_chunk,
      held=replies,
  )
  settings = {
      "dtype": str(section.dtype),
      "quantize": section.quantize,
      "max_new_tokens": section.max_new_tokens,
  }
  if section.no_repeat_ngram:  # recorded when on, so the records made without it still match
    settings["no_repeat_ngram"] = section.no_repeat_ngram
  return Judge(name, judge_fn, batch_size, probes, settings)


def judge_path(section, *, log: Log = say) -> tuple[str, str]:
  """``(name, resolved path)`` of the local judge: ``eval.judge.model``, or ``eval.judge.fallback``
  when the former's files are not installed (said in one line)."""
  try:
    return section.model, require_path(section.model, "eval.judge.model", kind="judge model")
  except FileNotFoundError as err:
    if not section.fallback:
      raise
    log(f"judge: {err.args[0] if err.args else err}; judging with {section.fallback} instead")
  return section.fallback, require_path(section.fallback, "eval.judge.fallback", kind="judge model")


# ------------------------------------------------------------------- a judge behind an endpoint
def endpoint_judge(section, batch_size: int) -> Judge:
  """The judge behind the OpenAI-compatible endpoint ``section.url`` (``eval.judge``): each prompt
  is one ``POST <url>/chat/completions`` with the judge prompt's system and user messages,
  ``temperature: 0`` and ``max_tokens: eval.judge.max_new_tokens``; up to ``batch_size`` requests
  are in flight at once, each retried on passing faults up to ``eval.judge.max_retries`` times
  (:class:`~anlr_jax.app.judge_client.ChatClient`). The judge's name is ``eval.judge.api_model``,
  else the first model of ``GET <url>/models``. The API key is read from the environment variable
  ``api_key_env``."""
  key = None
  if section.api_key_env:
    key = os.environ.get(section.api_key_env)
    if not key:
      raise ValueError(
          f"eval.judge.api_key_env: the environment variable {section.api_key_env} is not set"
      )
  client = ChatClient(
      section.url, key=key, timeout=section.timeout, max_retries=section.max_retries
  )
  name = section.api_model
  if not name:
    listed = client.models()
    try:
      name = client.redact(str(listed["data"][0]["id"]))
    except (KeyError, IndexError, TypeError):
      raise EndpointError(
          f"eval.judge.url: {shown_url(client.models_url)} lists no model: set"
          " eval.judge.api_model"
      ) from None

  def ask(prompt: tuple[str, str]) -> str:
    system, user = prompt
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]
    body = {
        "model": name,
        "messages": messages,
        "temperature": 0,
        "max_tokens": section.max_new_tokens,
    }
    return client.chat(body)

  def judge_fn(prompts: list[tuple[str, str]]) -> list[str]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, batch_size)) as pool:
      return list(pool.map(ask, prompts))

  return Judge(name, judge_fn, batch_size, settings={"max_new_tokens": section.max_new_tokens})


def _kept(error: EndpointError, path: str) -> EndpointError:
  """``error`` saying how many judgments ``path`` keeps (a rerun judges only the rest)."""
  saved = len(read_records(path))
  return EndpointError(f"{error}; the {saved} judgments saved in {path} are kept (rerun to go on)")


def _questions_of(answers: dict[int, list[str]], where: str) -> list[mtbench.Question]:
  """The MT-Bench questions ``answers`` answers, in the question file's order."""
  questions = [q for q in mtbench.load_questions() if q.question_id in answers]
  unknown = sorted(set(answers) - {q.question_id for q in questions})
  if unknown:
    raise DataFormatError(f"{where}: answers to question ids {unknown[:8]} that MT-Bench lacks")
  return questions


def answers_path(value: str) -> str:
  """An answers file, or a directory (an ``anlr eval`` output) holding ``mt_bench_answers.jsonl``."""
  path = os.path.join(value, ANSWERS_FILE) if os.path.isdir(value) else value
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{value}: no MT-Bench answers ({ANSWERS_FILE}) there")
  return path


def read_answers(path: str) -> tuple[str, dict[int, list[str]]]:
  """``(model id, {question_id: [a_1, a_2]})`` of an answers file."""
  records = read_records(path)
  if not records:
    raise DataFormatError(f"{path}: holds no answers")
  ids = {str(r.get("model_id")) for r in records}
  if len(ids) != 1:
    raise DataFormatError(f"{path}: answers of several models {sorted(ids)}")
  return ids.pop(), answers_by_question(records, path)


def format_scores(model: str, summary: dict[str, Any]) -> str:
  """One line of a single-grading summary: overall, per turn, per category, unparsed judgments."""
  num = lambda v: "n/a" if v is None else f"{v:.2f}"
  cats = ", ".join(f"{c} {num(v)}" for c, v in summary["categories"].items())
  ci = summary["ci95"]["overall"]
  ci = "" if ci is None else f" [95% CI {ci[0]:.2f}-{ci[1]:.2f}]"
  return (
      f"mt_bench {model}: score {num(summary['overall'])}/10{ci} (turn 1 {num(summary['turns'][1])},"
      f" turn 2 {num(summary['turns'][2])}; {cats}); {summary['unparsed']} of"
      f" {summary['judgments']} judgments without a rating"
  )


def grade_single(judge: Judge, path: str, out_dir: str, *, log: Log = say) -> dict[str, Any]:
  """Grades the answers in ``path`` into ``out_dir``; writes and returns the score summary."""
  model, answers = read_answers(path)
  questions = _questions_of(answers, path)
  out = os.path.join(out_dir, SINGLE_FILE)
  try:
    records = judging.judge_single(
        judge.judge_fn,
        questions,
        answers,
        out,
        model=model,
        judge_name=judge.name,
        prompts=mtbench.load_judge_prompts(),
        batch_size=judge.batch_size,
        progress=is_writer(),
        probes=judge.probes,
        judge_settings=judge.settings,
        log=log,
    )
  except EndpointError as err:
    raise _kept(err, out) from None
  summary = {"model": model, "judge": judge.name, **judging.single_summary(records)}
  if is_writer():
    write_json_atomic(os.path.join(out_dir, scores_file(model)), summary)
  log(format_scores(model, summary))
  log(judging.format_single_extras(summary))
  return summary


def _label(path: str) -> str:
  return _safe(os.path.normpath(os.path.dirname(os.path.abspath(path))))


def compare_pair(
    judge: Judge, path_1: str, path_2: str, out_dir: str, *, log: Log = say
) -> dict[str, Any]:
  """Pairwise comparison of two answer files on the questions both answer; writes the judgments
  to ``out_dir/mt_bench_pair.jsonl`` and returns (and writes) the win/tie/loss summary."""
  model_1, answers_1 = read_answers(path_1)
  model_2, answers_2 = read_answers(path_2)
  if model_1 == model_2:  # two runs of one name: tell them apart by where they are
    model_1, model_2 = _label(path_1), _label(path_2)
  common = {q: a for q, a in answers_1.items() if q in answers_2}
  if not common:
    raise ValueError(f"{path_1} and {path_2} answer no question in common")
  questions = _questions_of(common, path_1)
  if len(common) < max(len(answers_1), len(answers_2)):
    log(f"  comparing the {len(common)} questions both files answer")
  out = os.path.join(out_dir, PAIR_FILE)
  try:
    records = judging.judge_pair(
        judge.judge_fn,
        questions,
        answers_1,
        answers_2,
        out,
        model_1=model_1,
        model_2=model_2,
        judge_name=judge.name,
        prompts=mtbench.load_judge_prompts(),
        batch_size=judge.batch_size,
        progress=is_writer(),
        probes=judge.probes,
        judge_settings=judge.settings,
        log=log,
    )
  except EndpointError as err:
    raise _kept(err, out) from None
  summary = {
      "model_1": model_1,
      "model_2": model_2,
      "judge": judge.name,
      **judging.pair_summary(records),
  }
  if is_writer():
    name = f"mt_bench_pair_{_safe(model_1)}_vs_{_safe(model_2)}.json"
    write_json_atomic(os.path.join(out_dir, name), summary)
  rate = summary["win_rate_adjusted"]
  log(
      f"mt_bench {model_1} vs {model_2}: {summary['win']} win / {summary['tie']} tie /"
      f" {summary['loss']} loss ({summary['inconsistent']} of the ties inconsistent between the"
      f" two orders; {summary['errors']} pairs without a verdict left out); adjusted win rate"
      f" {'n/a' if rate is None else f'{rate:.3f}'}"
  )
  log(judging.format_pair_extras(summary))
  return summary


def judge_main(
    config: RunConfig,
    *,
    single: Sequence[str] = (),
    pair: Sequence[str] = (),
    out_dir: str | None = None,
    log: Log = say,
) -> list[dict[str, Any]]:
  """``anlr judge``: grades each of ``single`` (answer files or ``anlr eval`` directories) or
  compares the two of ``pair``; outputs go to ``out_dir`` (default: beside each/the first answers
  file). Returns the summaries."""
  if bool(single) == bool(pair):
    raise ValueError("give --single DIR [DIR ...] or --pair DIR_1 DIR_2")
  if pair and len(pair) != 2:
    raise ValueError(f"--pair takes two answer directories or files, got {len(pair)}")
  paths = [answers_path(p) for p in (single or pair)]
  for path in paths:
    read_answers(path)  # every file checked before the judge is loaded
  if out_dir is not None:
    os.makedirs(out_dir, exist_ok=True)
  outs = [out_dir or os.path.dirname(p) for p in (paths[:1] if pair else paths)]
  with contextlib.ExitStack() as stack:  # one writer per output directory
    for out in dict.fromkeys(outs):
      if is_writer():
        stack.enter_context(DirectoryLock(out, what="MT-Bench output directory"))
    judge = load_judge(config)
    if pair:
      return [compare_pair(judge, *paths, outs[0], log=log)]
    return [grade_single(judge, p, out, log=log) for p, out in zip(paths, outs)]


__all__ = [
    "EndpointError",
    "Judge",
    "answer_mt_bench",
    "answers_path",
    "compare_pair",
    "endpoint_judge",
    "format_scores",
    "grade_single",
    "judge_configured",
    "judge_main",
    "judge_path",
    "judge_prompt",
    "load_judge",
    "read_answers",
    "scores_file",
]

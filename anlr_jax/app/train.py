r"""``anlr train``: one method's run, or several compared, from a :class:`RunConfig`.

A run of method ``m`` on base weights ``W_0``:

.. math::

   W = W_0 + c\,A B \ \text{(per targeted module)},\qquad
   \theta_{t+1} = \theta_t + \mathrm{tx}_m\big(\mathrm{clip}(\nabla_\theta L(\theta_t; \text{batch}_t)); \eta_t\big),
   \quad t = 0 .. T-1,

with ``L`` the response-token cross-entropy, ``\eta_t`` the linear warmup/decay schedule, then
greedy generation on each eval task (:mod:`anlr_jax.app.evaluate`). The run directory's files are
listed in :mod:`anlr_jax.rundir`; with ``compare`` each method gets a sub-directory and the top level
holds the comparison; the compared methods and the base row share what they read (the eval sets,
read and checked once; the training file, read and tokenised once). Every process trains and
evaluates; only process 0 writes files (a ``{timestamp}`` in ``run_dir`` is process 0's on every
process).

Method-specific parts: AdaLoRA's orthogonal regulariser is added to the loss (``regularizer``
metric) and its allocator runs over the run's updates; LoRA-Dash chooses its directions after
``loradash.launch_step`` updates, and a run resumed past it keeps the checkpoint's.

A run belongs to its settings. What determines its trajectory (method, model path and fingerprint,
LoRA, optimizer and method settings, schedule, seed, data file size and hash, batch layout) is its
*identity*, stored in every checkpoint, in ``lora_final.safetensors``' metadata and in
``results.json``. Running the same command again continues the run: from its newest valid
checkpoint, or, when training is done, it completes what is missing (evaluation, results) or says
that the run is complete. A different identity stops with one line naming each differing key.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Mapping

import numpy as np

from anlr_jax import rundir
from anlr_jax.analysis.results import RunResult, read_results, write_results
from anlr_jax.app.config import RENAMED_KEYS, RunConfig, save_config
from anlr_jax.app.identity import check_same_run, run_identity
from anlr_jax.app.evaluate import evaluate_base, evaluate_tasks, load_eval_sets, accuracy_summary
from anlr_jax.app.assemble import build_method, check_quantized_mesh, check_schedule
from anlr_jax.app.model import (
    load_base,
    load_lora_params,
    lora_file_identity,
    model_fingerprint,
    save_lora_params,
)
from anlr_jax.app.paths import expand_paths, format_run_dir, require_path, resolve_path
from anlr_jax.app.report import (
    BASE_ROW,
    Log,
    final_loss,
    is_writer,
    loss_curve,
    no_lock,
    plot_losses,
    say,
    table_text,
    write_json,
)
from anlr_jax.data import TEMPLATES, benchmarks, make_source
from anlr_jax.data.llava import IMAGE_TOKEN, LLAVA_TEMPLATES, image_token_id, make_llava_source
from anlr_jax.data.source import LengthBucketedSource
from anlr_jax.settings import ConfigError
from anlr_jax.evals import write_accuracy_table
from anlr_jax.methods import ADALORA_TOTAL_STEP
from anlr_jax.models.llava_config import LlavaConfig
from anlr_jax.models.llava_image import preprocess_image
from anlr_jax.train import Trainer
from anlr_jax.train.distributed import process0_value
from anlr_jax.train.lock import DirectoryLock
from anlr_jax.train.metrics import read_metrics


def _describe_data(source, path: str, config: RunConfig) -> str:
  examples = source.examples
  records = len(examples) + examples.dropped + source.records_skipped
  parts = [f"{records} records in {path}: {len(examples)} used"]
  if examples.truncated:
    parts.append(
        f"{examples.truncated} of them cut at data.max_length={config.data.max_length} tokens"
    )
  if examples.dropped:
    parts.append(
        f"{examples.dropped} dropped (no response token left within data.max_length="
        f"{config.data.max_length})"
    )
  if source.records_skipped:
    parts.append(f"{source.records_skipped} malformed skipped (data.on_error=skip)")
  return ", ".join(parts)


def _check_vocab(source, vocab_size: int, config: RunConfig) -> None:
  top = max(int(ids.max()) for ids in source.examples.input_ids if len(ids))
  if top >= vocab_size:
    tokenizer = resolve_path(config.model.tokenizer) or config.model.path
    raise ValueError(
        f"data.train: token id {top} is outside the model's vocabulary of {vocab_size}: the"
        f" tokenizer ({tokenizer}) does not belong to the model ({config.model.path})"
    )


def _check_settings(config: RunConfig) -> None:
  """When ``trainer.steps`` fixes the run's length, checks that every phase of the method starts
  within it (:func:`check_schedule`); reads no file."""
  if config.trainer.steps is not None:
    check_schedule(config, int(config.trainer.steps))


class _RunInputs:
  """What the methods of one ``anlr train`` read from their inputs, read once and shared: the eval
  sets (:func:`load_eval_sets`) and the training batches (:func:`training_source`) of methods whose
  settings for them are the same (compared methods differ in their method, not their data)."""

  def __init__(self):
    self._eval_sets: list[tuple[tuple, dict[str, list]]] = []
    self._sources: list[tuple[tuple, LengthBucketedSource]] = []

  @staticmethod
  def _get(cache: list, key: tuple, make):
    for stored, value in cache:
      if stored == key:
        return value
    value = make()
    cache.append((key, value))
    return value

  def eval_sets(self, config: RunConfig) -> dict[str, list]:
    """:func:`load_eval_sets` of ``config``, read at its first call."""
    key = (config.eval, config.model.path)  # a visual task checks the model it is scored on
    return self._get(self._eval_sets, key, lambda: load_eval_sets(config))

  def source(self, config: RunConfig, path: str, tokenizer, model_config) -> LengthBucketedSource:
    """:func:`training_source` of ``config``, read and tokenised at its first call."""
    key = (path, config.data, config.trainer.global_batch, config.seed, config.model)
    return self._get(
        self._sources,
        key,
        lambda: training_source(config, path, tokenizer, model_config=model_config),
    )


def _check_inputs(config: RunConfig, inputs: _RunInputs | None = None) -> str:
  """Checks that every input of a method's run exists (``model.path``, ``model.tokenizer`` when
  set, ``data.train``, every test file, read into ``inputs``): before anything is written or
  trained, so a comparison never stops at its second method. Returns the training file's path."""
  require_path(config.model.path, "model.path", kind="HF model directory")
  if config.model.tokenizer is not None:
    require_path(config.model.tokenizer, "model.tokenizer", kind="tokenizer directory")
  if benchmarks.is_benchmark_uri(config.data.train):
    if config.data.format not in (None, "completion"):
      raise ConfigError(
          f"data.format: {config.data.train} is a set of prompt/completion records: set"
          " data.format=completion or leave it out"
      )
    try:
      train_path = benchmarks.training_file(config.data.train)
    except ValueError as err:
      raise ConfigError(f"data.train: {err}") from None
  else:
    train_path = require_path(config.data.train, "data.train", kind="training file")
  (inputs or _RunInputs()).eval_sets(config)
  return train_path


def _finish(
    config: RunConfig,
    run_dir: str,
    model,
    tokenizer,
    identity: Mapping[str, Any],
    result: RunResult,
    log: Log,
    inputs: _RunInputs,
) -> RunResult:
  """Evaluates the tasks that ``result`` lacks, writes results.json and the tables."""
  missing = [t for t in config.eval.tasks if t not in result.accuracy]
  start = time.perf_counter()
  evals = evaluate_tasks(
      model,
      tokenizer,
      config,
      out_dir=run_dir,
      log=log,
      tasks=missing,
      sets=inputs.eval_sets(config),
  )
  accuracy = {**result.accuracy, **accuracy_summary(evals)[0]}
  result = dataclasses.replace(
      result,
      accuracy=accuracy,
      avg=float(np.mean(list(accuracy.values()))) if accuracy else None,
      eval_seconds=round(result.eval_seconds + time.perf_counter() - start, 2),
      identity=dict(identity),
  )
  if accuracy and is_writer():
    write_accuracy_table(
        {result.method: accuracy},
        os.path.join(run_dir, rundir.ACCURACY_TABLE),
        tasks=list(accuracy),
    )
  if is_writer():
    write_results(run_dir, result)
  return result


def _save_config(config: RunConfig, run_dir: str) -> None:
  """Writes the run's ``config.yaml``: only once its settings are known to be the directory's."""
  if is_writer():
    save_config(config, os.path.join(run_dir, rundir.CONFIG_FILE))


LossCurve = tuple[list[float], list[float]]
"""``(steps, losses)`` of a run's logged rows."""


def train_method(config: RunConfig, *, log: Log = say) -> tuple[RunResult, LossCurve]:
  """Trains ``config.method`` into ``config.run_dir`` (see the module docstring; path placeholders
  are expanded first); returns its result and its loss curve.

  Run again on the same ``run_dir``, it resumes from the newest valid checkpoint, or completes
  what is missing of a trained run, or returns the stored results of a complete one.
  """
  config = _method_config(config, config.method, config.run_dir, several=False)
  _check_settings(config)
  inputs = _RunInputs()
  return _train_method(config, _check_inputs(config, inputs), log, inputs)


def _train_method(
    config: RunConfig, train_path: str, log: Log, inputs: _RunInputs
) -> tuple[RunResult, LossCurve]:
  """:func:`train_method` of a method's config (:func:`_method_config`) whose inputs are checked
  (:func:`_check_inputs`, which returned ``train_path`` and read them into ``inputs``)."""
  method, run_dir = config.method, config.run_dir
  os.makedirs(run_dir, exist_ok=True)
  with DirectoryLock(run_dir, what="run directory") if is_writer() else no_lock():
    model, model_config, tokenizer = load_base(config)
    identity = run_identity(
        config,
        model_path=resolve_path(config.model.path),
        fingerprint=model_fingerprint(model_config, model),
        data_path=train_path,
    )
    lora_path = os.path.join(run_dir, rundir.LORA_FILE)
    stored = read_results(run_dir)
    if stored is not None:
      check_same_run(f"run directory {run_dir}", stored.identity, identity)
      if all(t in stored.accuracy for t in config.eval.tasks):
        log(f"[{method}] complete already: {os.path.join(run_dir, rundir.RESULTS_FILE)}")
        return stored, loss_curve(read_metrics(run_dir))
    if os.path.isfile(lora_path):
      check_same_run(lora_path, lora_file_identity(lora_path) or {}, identity)
      _save_config(config, run_dir)
      log(f"[{method}] trained already ({lora_path}): evaluating")
      build_method(config, model=model)
      load_lora_params(model, lora_path)
      rows = read_metrics(run_dir)
      curve = loss_curve(rows)
      result = stored or _trained_result(
          config, int(rows[-1]["step"]) if rows else None, curve, train_seconds=None
      )
    else:
      model, result, curve = _train(
          config, model, model_config.vocab_size, tokenizer, train_path, identity, log, inputs
      )
    model.eval()
    return _finish(config, run_dir, model, tokenizer, identity, result, log, inputs), curve


def training_source(
    config: RunConfig, path: str, tokenizer, *, model_config=None
) -> LengthBucketedSource:
  """The training batches of a run: ``path`` read, tokenised and batched as the ``data`` section,
  ``trainer.global_batch`` and ``seed`` of ``config`` say (``anlr train`` and the examples).

  A LLaVA model (``model_config`` a :class:`~anlr_jax.models.llava_config.LlavaConfig`) trains on LLaVA
  data (``data.format: llava``, the default for it): its images, from ``data.image_folder``, made
  into the vision tower's pixel values; other models on the text formats."""
  data = config.data
  llava = isinstance(model_config, LlavaConfig)
  fmt = data.format or ("llava" if llava else None)
  if llava and benchmarks.is_benchmark_uri(data.train):
    raise ConfigError(
        f"data.train: {data.train} holds text records; model.path {config.model.path} is a LLaVA"
        " model, which trains on LLaVA data (data.format=llava)"
    )
  if llava != (fmt == "llava"):
    model = config.model.path
    raise ConfigError(
        f"data.format={fmt}: model.path {model} is a LLaVA model, which trains on LLaVA data: set"
        " data.format=llava or leave it out"
        if llava
        else f"data.format=llava: model.path {model} is not a LLaVA model (config.json model_type"
        " llava); LLaVA data trains a LLaVA model only"
    )
  if not llava:
    if data.image_folder is not None:
      raise ConfigError("data.image_folder: only LLaVA data (data.format=llava) has images")
    if data.template not in TEMPLATES:
      raise ConfigError(
          f"data.template={data.template}: LLaVA-1.5's format, for LLaVA data only; text data"
          f" takes {' or '.join(TEMPLATES)}"
      )
    return make_source(
        path,
        tokenizer,
        format=fmt,
        max_length=data.max_length,
        global_batch=config.trainer.global_batch,
        seed=config.seed,
        on_error=data.on_error,
        pad_multiple=data.pad_multiple,
        template=data.template,
    )
  if data.template not in LLAVA_TEMPLATES:
    raise ConfigError(
        f"data.template={data.template}: LLaVA data takes {' or '.join(LLAVA_TEMPLATES)}"
        " (vicuna_v1: LLaVA-1.5's conversation format)"
    )
  if data.template == "vicuna_v1" and config.eval.text_tasks():
    raise ConfigError(
        "eval.tasks: the text tasks are prompted in data.template, which is vicuna_v1 (LLaVA"
        " data only): leave them out (visual tasks are fine) or train with data.template=chat"
    )
  folder = None
  if data.image_folder is not None:
    folder = require_path(data.image_folder, "data.image_folder", kind="image folder")
    if not os.path.isdir(folder):
      raise ConfigError(f"data.image_folder: {folder} is not a folder")
  try:
    token = image_token_id(tokenizer)
  except ValueError as err:
    raise ConfigError(f"model.tokenizer: {err}") from None
  if token != model_config.image_token_index:
    raise ConfigError(
        f"model.tokenizer: {IMAGE_TOKEN} is token {token}, the model's image_token_index is"
        f" {model_config.image_token_index}: the tokenizer does not belong to the model"
    )
  return make_llava_source(
      path,
      tokenizer,
      preprocess=functools.partial(preprocess_image, config=model_config),
      num_image_tokens=model_config.num_image_tokens,
      max_length=data.max_length,
      global_batch=config.trainer.global_batch,
      seed=config.seed,
      image_folder=folder,
      template=data.template,
      on_error=data.on_error,
      pad_multiple=data.pad_multiple,
  )


def _train(
    config: RunConfig,
    model,
    vocab_size: int,
    tokenizer,
    train_path: str,
    identity: Mapping[str, Any],
    log: Log,
    inputs: _RunInputs,
) -> tuple[Any, RunResult, LossCurve]:
  """Adapts the base ``model`` to ``config.method`` (:func:`build_method`), trains its adapters into
  ``config.run_dir`` (resuming from its newest checkpoint) and writes the adapter file and loss
  plot; returns the trained model, its result (not yet evaluated) and its loss curve."""
  method, run_dir, tc = config.method, config.run_dir, config.trainer
  source = inputs.source(config, train_path, tokenizer, getattr(model, "config", None))
  log(f"[{method}] data: {_describe_data(source, train_path, config)}")
  _check_vocab(source, vocab_size, config)
  total = tc.total_steps(len(source))
  built = build_method(config, model=model, total_steps=total, log=log)
  check_quantized_mesh(model, config)
  log(
      f"[{method}] {len(source)} batches/epoch of {tc.global_batch}; {total} updates at lr"
      f" {tc.learning_rate:g} -> {run_dir}"
  )
  model.train()
  start = time.perf_counter()
  trainer = Trainer(
      model,
      source,
      tc.trainer_config(),
      built.tx,
      checkpoint_dir=tc.ckpt_dir,
      log_dir=run_dir,
      identity=identity,
      renamed_keys=RENAMED_KEYS,
      schedule=built.schedule,
      **built.hooks,
  )
  _save_config(config, run_dir)  # the Trainer has checked the checkpoint's identity
  if trainer.step:
    log(f"[{method}] resumed at update {trainer.step} from {tc.ckpt_dir}")
  try:
    rows = trainer.run()
  finally:
    trainer.close()
  train_seconds = time.perf_counter() - start
  model = trainer.updated_model()
  model.eval()
  if is_writer():
    metadata = {ADALORA_TOTAL_STEP: str(total)} if built.spec.uses_adalora else None
    save_lora_params(
        model, os.path.join(run_dir, rundir.LORA_FILE), identity=identity, metadata=metadata
    )
  curve = loss_curve(rows)
  plot_losses({method: curve}, os.path.join(run_dir, rundir.LOSS_PLOT))
  result = _trained_result(config, total, curve, train_seconds=round(train_seconds, 2))
  final = result.final_loss
  log(
      f"[{method}] trained {total} updates in {train_seconds:.1f}s; final loss "
      + ("n/a" if final is None else f"{final:.4f}")
  )
  return model, result, curve


def _trained_result(
    config: RunConfig, steps: int | None, curve: LossCurve, *, train_seconds: float | None
) -> RunResult:
  """The result of ``config.method``'s trained run before evaluation (``train_seconds`` None:
  trained by an earlier process)."""
  return RunResult(
      method=config.method,
      learning_rate=config.trainer.learning_rate,
      seed=config.seed,
      steps=steps,
      final_loss=final_loss(curve),
      train_seconds=train_seconds,
  )


def train_run(config: RunConfig, *, log: Log = say, timestamp: str | None = None) -> dict:
  """``anlr train``: one method, or every method of ``compare`` in turn, then the comparison.

  Returns ``{"run_dir", "runs": [results per method], "base": {task: acc} or None, "table"}``.
  """
  methods = config.methods()
  if "{timestamp}" in config.run_dir:  # every process of a job takes process 0's
    timestamp = process0_value("timestamp", timestamp or time.strftime("%Y%m%d-%H%M%S"))
  run_dir = format_run_dir(
      config.run_dir, method="-vs-".join(methods), seed=config.seed, timestamp=timestamp
  )
  several = len(methods) > 1
  method_configs = [
      _method_config(
          config, method, rundir.method_dir(run_dir, method) if several else run_dir, several
      )
      for method in methods
  ]
  for method_config in method_configs:  # every method's settings before any input is read
    _check_settings(method_config)
  # (config, training file) of each method: every input checked once, up front (a start that
  # fails on a missing file creates no run directory); what they read is shared by the methods
  inputs = _RunInputs()
  planned = [
      (method_config, _check_inputs(method_config, inputs)) for method_config in method_configs
  ]
  os.makedirs(run_dir, exist_ok=True)
  with DirectoryLock(run_dir, what="run directory") if is_writer() else no_lock():
    return _train_run(config, planned, run_dir, log, inputs)


def _method_config(config: RunConfig, method: str, run_dir: str, several: bool) -> RunConfig:
  """The config of one method's run: ``method`` and ``run_dir`` set, paths expanded; a shared
  ``trainer.ckpt_dir`` without ``{method}`` or ``{run_dir}`` gets a sub-directory per method when
  several are compared."""
  config = dataclasses.replace(config, method=method, compare=[], run_dir=run_dir)
  ckpt = config.trainer.ckpt_dir
  if several and ckpt is not None and "{method}" not in ckpt and "{run_dir}" not in ckpt:
    ckpt = os.path.join(ckpt, "{method}")
    config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, ckpt_dir=ckpt))
  return expand_paths(config, method, run_dir)


def _train_run(
    config: RunConfig,
    planned: list[tuple[RunConfig, str]],
    run_dir: str,
    log: Log,
    inputs: _RunInputs,
) -> dict:
  methods = [method_config.method for method_config, _ in planned]
  if len(methods) == 1 and not config.eval.include_base:
    result, _ = _train_method(*planned[0], log, inputs)
    return {
        "run_dir": run_dir,
        "runs": [result.to_json()],
        "base": None,
        "table": table_text(None, [result]),
    }

  start = time.perf_counter()
  runs, curves = [], {}
  for method_config, train_path in planned:
    result, curves[method_config.method] = _train_method(method_config, train_path, log, inputs)
    runs.append(result)
  if len(methods) > 1:  # the comparison's config, once every method's settings are checked
    _save_config(dataclasses.replace(config, run_dir=run_dir), run_dir)
  base_dir = run_dir if len(methods) > 1 else os.path.join(run_dir, rundir.BASE_DIR)
  base_config = expand_paths(config, methods[0], run_dir)
  base = (
      evaluate_base(base_config, base_dir, log=log, sets=inputs.eval_sets(base_config))
      if config.eval.include_base and config.eval.tasks
      else None
  )
  plot_losses(curves, os.path.join(run_dir, rundir.LOSS_PLOT))
  table = {BASE_ROW: base} if base else {}
  table.update({r.method: r.accuracy for r in runs if r.accuracy})
  if table and is_writer():
    write_accuracy_table(
        table, os.path.join(run_dir, rundir.ACCURACY_TABLE), tasks=list(config.eval.tasks)
    )
  summary = {
      "run_dir": run_dir,
      "runs": [r.to_json() for r in runs],
      "base": base,
      "total_seconds": round(time.perf_counter() - start, 2),
  }
  write_json(os.path.join(run_dir, rundir.SUMMARY_FILE), summary)
  summary["table"] = table_text(base, runs)
  return summary


__all__ = ["train_method", "train_run", "training_source"]

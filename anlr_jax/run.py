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
``(d_in, r)``, ``<module path>/lora_b`` ``(r, d_out)``, ``<module path>/lora_magnitude`` for DoRA),
``results.json`` = ``{"method", "learning_rate", "seed", "accuracy": {task: fraction}, "avg", ...}``
(accuracies are fractions in ``[0, 1]``; ``avg`` is their unweighted mean, None without eval
tasks), ``accuracy.csv`` / ``accuracy.md`` and ``eval_<task>.jsonl`` (every generation). With
``compare`` each method gets a sub-directory ``<run_dir>/<method>`` and the top level holds the
comparison (``summary.json``, ``accuracy.*`` with one row per method, ``loss.png`` with every curve).
Every process trains and evaluates; only process 0 writes files (in a multi-process run give
``run_dir`` without ``{timestamp}``, so that every process agrees on it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from anlr_jax.config import RunConfig, format_run_dir, resolve_path, save_config
from anlr_jax.methods import get_method, method_optimizer

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
  """Wraps the targeted layers with the LoRA variant of ``method`` (seeded by ``config.seed``)."""
  from anlr_jax.nn import inject_lora

  return inject_lora(
      model,
      target_modules=tuple(config.lora.targets),
      rank=config.lora.rank,
      alpha=config.lora.alpha,
      dropout=config.lora.dropout,
      rngs=nnx.Rngs(params=config.seed, dropout=config.seed + 1),
      **get_method(method).lora_kwargs(),
  )


def save_lora_params(model: nnx.Module, path: str | os.PathLike) -> list[str]:
  """Writes every adapter param as ``<module path>/<name>`` (Flax layout, float32); returns keys."""
  from anlr_jax.nn import iter_lora_layers

  tensors = {}
  for module_path, layer in iter_lora_layers(model):
    for name, value in nnx.to_flat_state(nnx.state(layer, nnx.LoRAParam)):
      if len(name) == 1:  # the layer's own params, not those of nested modules
        tensors[f"{module_path}/{name[0]}"] = np.asarray(jax.device_get(value[...]), np.float32)
  if not tensors:
    raise ValueError("the model has no LoRA adapters to save")
  save_file(
      tensors, os.fspath(path), metadata={"layout": "flax: lora_a (d_in, r), lora_b (r, d_out)"}
  )
  return sorted(tensors)


def load_lora_params(model: nnx.Module, path: str | os.PathLike) -> nnx.Module:
  """Loads a :func:`save_lora_params` file into the matching adapters of ``model`` (in place)."""
  from anlr_jax.nn import iter_lora_layers

  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no LoRA params file at {path}")
  tensors = load_file(path)
  expected = set()
  for module_path, layer in iter_lora_layers(model):
    for name, variable in nnx.to_flat_state(nnx.state(layer, nnx.LoRAParam)):
      if len(name) != 1:
        continue
      key = f"{module_path}/{name[0]}"
      expected.add(key)
      if key not in tensors:
        raise KeyError(f"{path}: missing tensor {key!r} (the run's method/lora settings differ?)")
      if tensors[key].shape != variable[...].shape:
        raise ValueError(
            f"{path}: tensor {key!r} has shape {tensors[key].shape}, the model "
            f"expects {variable[...].shape}"
        )
      getattr(layer, name[0])[...] = jnp.asarray(tensors[key], variable[...].dtype)
  extra = sorted(set(tensors) - expected)
  if extra:
    raise KeyError(f"{path}: tensors {extra[:4]} match no adapter of the model")
  return model


# ------------------------------------------------------------------------------------- eval
def make_generate_fn(
    model, tokenizer, *, max_new_tokens: int, batch_size: int, width_multiple: int = 16
):
  """``prompts -> continuations`` by greedy decoding, with the training tokenisation of a prompt.

  A prompt is ``[bos] + tok(prompt)`` (as :mod:`anlr_jax.data.tokenize` builds it), left-padded to
  a multiple of ``width_multiple``; short batches are padded to ``batch_size`` rows, so decoding
  compiles once per prompt width.
  """
  from anlr_jax.models import generate

  bos = tokenizer.bos_token_id
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

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
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=int(pad),
    )
    return tokenizer.batch_decode(np.asarray(out)[: len(rows)], skip_special_tokens=True)

  return generate_fn


def evaluate_tasks(
    model, tokenizer, config: RunConfig, *, out_dir: str | None = None, log: Log = _print
) -> dict[str, Any]:
  """Scores ``model`` on every ``eval.tasks`` file; returns ``{task: EvalResult}``."""
  from anlr_jax.evals import evaluate, load_eval_examples

  model.eval()
  generate_fn = make_generate_fn(
      model, tokenizer, max_new_tokens=config.eval.max_new_tokens, batch_size=config.eval.batch_size
  )
  results = {}
  for task, file in config.eval.tasks.items():
    examples = load_eval_examples(_require_path(file, f"eval.tasks.{task}", kind="test file"))
    if config.eval.limit is not None:
      examples = examples[: config.eval.limit]
    start = time.perf_counter()
    result = evaluate(generate_fn, examples, task, batch_size=config.eval.batch_size)
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
def train_method(config: RunConfig, method: str, run_dir: str, *, log: Log = _print) -> dict:
  """Trains one method into ``run_dir`` (see the module docstring); returns its results dict."""
  from anlr_jax.data import make_source
  from anlr_jax.train import Trainer, linear_warmup_decay

  os.makedirs(run_dir, exist_ok=True)
  config = dataclasses.replace(config, method=method, compare=[], run_dir=run_dir)
  if _is_writer():
    save_config(config, os.path.join(run_dir, CONFIG_FILE))
  model, _, tokenizer = load_base(config)
  inject_method(model, config, method)
  train_path = _require_path(config.data.train, "data.train", kind="training file")
  tc = dataclasses.replace(
      config.trainer,
      run_dir=run_dir,
      seed=config.seed,
      optimizer="anlr" if get_method(method).uses_anlr else "adamw",
  )
  source = make_source(
      train_path,
      tokenizer,
      format=config.data.format,
      max_length=config.data.max_length,
      global_batch=tc.global_batch,
      seed=config.seed,
      on_error=config.data.on_error,
      pad_multiple=config.data.pad_multiple,
  )
  total = tc.total_steps(len(source))
  schedule = linear_warmup_decay(tc.learning_rate, total, min(tc.warmup_steps, total))
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
  )
  log(
      f"[{method}] {len(source.examples)} examples, {len(source)} batches/epoch of "
      f"{tc.global_batch}; {total} updates at lr {tc.learning_rate:g} -> {run_dir}"
  )
  model.train()
  start = time.perf_counter()
  trainer = Trainer(model, source, tc, tx, schedule=schedule)
  rows = trainer.run()
  train_seconds = time.perf_counter() - start
  model = trainer.updated_model()
  model.eval()
  if _is_writer():
    save_lora_params(model, os.path.join(run_dir, LORA_FILE))
  curve = _loss_curve(rows)
  plot_losses({method: curve}, os.path.join(run_dir, LOSS_PLOT))
  final = float(np.mean(curve[1][-max(1, len(curve[1]) // 10) :])) if curve[1] else None
  log(f"[{method}] trained {total} updates in {train_seconds:.1f}s; final loss {final:.4f}")

  start = time.perf_counter()
  evals = evaluate_tasks(model, tokenizer, config, out_dir=run_dir, log=log)
  accuracy, avg = accuracy_summary(evals)
  results = {
      "method": method,
      "learning_rate": tc.learning_rate,
      "seed": config.seed,
      "accuracy": accuracy,
      "avg": avg,
      "steps": total,
      "final_loss": final,
      "train_seconds": round(train_seconds, 2),
      "eval_seconds": round(time.perf_counter() - start, 2),
  }
  if evals and _is_writer():
    from anlr_jax.evals import write_accuracy_table

    write_accuracy_table(
        {method: accuracy}, os.path.join(run_dir, ACCURACY_TABLE), tasks=list(accuracy)
    )
  _write_json(os.path.join(run_dir, RESULTS_FILE), results)
  results["loss_curve"] = curve
  return results


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
  if _is_writer():
    save_config(dataclasses.replace(config, run_dir=run_dir), os.path.join(run_dir, CONFIG_FILE))
  if len(methods) == 1 and not config.eval.include_base:
    results = train_method(config, methods[0], run_dir, log=log)
    results.pop("loss_curve")
    return {
        "run_dir": run_dir,
        "runs": [results],
        "base": None,
        "table": _table_text(None, [results]),
    }

  start = time.perf_counter()
  base = (
      evaluate_base(config, run_dir, log=log)
      if config.eval.include_base and config.eval.tasks
      else None
  )
  runs, curves = [], {}
  for method in methods:
    sub = run_dir if len(methods) == 1 else os.path.join(run_dir, method.replace("+", "_"))
    results = train_method(config, method, sub, log=log)
    curves[method] = results.pop("loss_curve")
    runs.append(results)
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
            f"{r['train_seconds']:.0f}",
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
  from anlr_jax.nn import import_peft_adapter
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
    import_peft_adapter(model, adapter)
  else:
    raise FileNotFoundError(
        f"--adapter {adapter}: neither a run directory ({LORA_FILE} + "
        f"{CONFIG_FILE}) nor a PEFT adapter directory ({ADAPTER_CONFIG_FILE})"
    )
  model.eval()
  return model, model_config, tokenizer


def eval_run(
    config: RunConfig, adapter: str | None = None, *, out_dir: str | None = None, log: Log = _print
) -> dict:
  """``anlr eval``: scores the base model or base + ``adapter``; writes results to ``out_dir``."""
  if not config.eval.tasks:
    raise ValueError(
        "eval.tasks is empty: name at least one task, e.g. eval.tasks.boolq=<test file>"
    )
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
  model, model_config, tokenizer = load_adapted_model(config, run_dir)
  if fmt == "peft":
    export_peft_adapter(model, out, base_model_name_or_path=resolve_path(config.model.path))
  else:
    save_hf_model(model, model_config, out, merge_lora=True)
    tokenizer.save_pretrained(out)
  log(f"exported {run_dir} ({config.method}) as {fmt} -> {out}")
  return out


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
) -> str:
  """``anlr generate``: the continuation of ``prompt`` (wrapped in the Alpaca template unless raw)."""
  from anlr_jax.config import load_config
  from anlr_jax.data import alpaca_prompt
  from anlr_jax.models import generate

  config = load_config(None, [f"model.path={model_path}", f"model.dtype={dtype}"])
  model, _, tokenizer = load_adapted_model(config, adapter, model_path=model_path)
  model.eval()
  text = prompt if raw else alpaca_prompt(prompt)
  ids = ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + tokenizer(
      text, add_special_tokens=False
  ).input_ids
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  out = generate(
      model,
      np.asarray([ids], np.int32),
      np.ones((1, len(ids)), np.int32),
      max_new_tokens=max_new_tokens,
      temperature=temperature,
      rng=jax.random.key(seed) if temperature > 0 else None,
      eos_token_id=tokenizer.eos_token_id,
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

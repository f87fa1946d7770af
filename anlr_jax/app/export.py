"""``anlr export``: a run's adapter as a PEFT adapter directory or a merged Hugging Face model.

LoRA and its variants export as a PEFT LoRA adapter, AdaLoRA as a PEFT AdaLoRA adapter (only the
triplets it kept); LoRA-Dash has no PEFT format (PEFT cannot hold its amplified directions), so it
exports merged only. A merged model keeps the base's ``config.json`` and ``generation_config.json``.
Exported files are world-readable (0644).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from safetensors import safe_open

from anlr_jax import rundir
from anlr_jax.app.config import RunConfig, load_config
from anlr_jax.app.assemble import adalora_config
from anlr_jax.app.model import is_run_dir, load_adapted_model
from anlr_jax.app.paths import resolve_path
from anlr_jax.app.report import Log, say
from anlr_jax.methods import ADALORA_TOTAL_STEP, get_method
from anlr_jax.models import LlavaForConditionalGeneration, save_hf_model, save_llava_model
from anlr_jax.nn import export_adalora_adapter, export_peft_adapter, iter_adalora_layers
from anlr_jax.nn.inject import adapter_scope


def export_run(run_dir: str, fmt: str, out: str, *, log: Log = say) -> str:
  """``anlr export``: a run's adapter as a PEFT adapter directory or a merged HF model."""
  if fmt not in ("peft", "merged"):
    raise ValueError(f"--format {fmt!r} must be 'peft' or 'merged'")
  if not is_run_dir(run_dir):
    raise FileNotFoundError(
        f"--run {run_dir}: not a run directory (needs {rundir.LORA_FILE} and {rundir.CONFIG_FILE})"
    )
  config = load_config(os.path.join(run_dir, rundir.CONFIG_FILE))
  spec = get_method(config.method)
  if fmt == "peft" and spec.uses_loradash:
    raise ValueError(
        f"--format peft: method {config.method} (LoRA-Dash) has no PEFT adapter format (PEFT"
        " cannot hold its amplified directions); export it with --format merged"
    )
  if fmt == "peft" and spec.uses_adalora and config.model.projector_lr is not None:
    raise ValueError(
        f"--format peft: method {config.method} with model.projector_lr has no PEFT adapter"
        " format here (the AdaLoRA export holds no trained projector); export it with"
        " --format merged"
    )
  model, model_config, tokenizer = load_adapted_model(config, run_dir)
  if fmt == "peft" and spec.uses_adalora:
    export_adalora_run(model, config, os.path.join(run_dir, rundir.LORA_FILE), out)
  elif fmt == "peft":
    export_peft_adapter(
        model,
        out,
        base_model_name_or_path=resolve_path(config.model.path),
        # LLaVA's projector trained in full (model.projector_lr): PEFT's modules_to_save
        modules_to_save=[model.PROJECTOR] if config.model.projector_lr is not None else [],
    )
  else:
    save = save_llava_model if isinstance(model, LlavaForConditionalGeneration) else save_hf_model
    save(model, model_config, out, merge_lora=True)
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


def export_adalora_run(model, config: RunConfig, lora_path: str, out: str) -> None:
  """A PEFT AdaLoRA adapter of an ``adalora`` run: only the triplets with ``E != 0`` are written
  (``rank_pattern``; a pruned triplet has ``E = 0``, so the output is unchanged), and the
  allocator settings with the run's ``total_step`` (from the adapter file's metadata)."""
  with safe_open(lora_path, framework="numpy") as f:
    metadata = f.metadata() or {}
  if ADALORA_TOTAL_STEP not in metadata:
    raise ValueError(
        f"{lora_path}: no {ADALORA_TOTAL_STEP} in its metadata (written by an older anlr): the"
        " PEFT AdaLoRA config needs the run's total_step; use --format merged"
    )
  pattern = {
      path: [bool(v) for v in np.asarray(layer.lora_e[...]) != 0]
      for path, layer in iter_adalora_layers(model)
  }
  export_adalora_adapter(
      model,
      out,
      config=adalora_config(config, int(metadata[ADALORA_TOTAL_STEP])),
      base_model_name_or_path=resolve_path(config.model.path),
      # a model with an adapter scope (LLaVA) names its layers in full: short names would reach
      # the vision tower's projections of the same names
      target_modules=None if adapter_scope(model) else list(config.lora.targets),
      rank_pattern=pattern,
  )


__all__ = ["export_run"]

"""Assembling the model of a run: the base model, its adapter layers, adapter files.

``load_base`` reads the base model named by ``model.path`` (a Hugging Face directory or a GGUF file)
and its tokenizer; ``save_lora_params`` / ``load_lora_params`` write and read every adapter
variable as ``<module name>/<variable>`` in ``lora_final.safetensors`` (keys:
:func:`anlr_jax.naming.adapter_key`; Flax layout: ``lora_a (d_in, r)``, ``lora_b (r, d_out)``,
``lora_magnitude`` for DoRA, ``lora_e (r,)`` for AdaLoRA, ``dash_scale`` and the frozen directions
``dash_u``, ``dash_v``, ``dash_change_rate``, ``dash_index`` for LoRA-Dash); ``load_adapted_model``
rebuilds base + adapter from a run directory (the run's adapter layers by
:func:`anlr_jax.app.assemble.build_method`) or a PEFT adapter directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save as safetensors_bytes

from anlr_jax import naming, rundir
from anlr_jax.app.config import ConfigError, RunConfig, load_config
from anlr_jax.app.assemble import build_method
from anlr_jax.app.paths import require_path, resolve_path
from anlr_jax.methods import get_method
from anlr_jax.settings import DTYPES
from anlr_jax.fileio import atomic_write
from anlr_jax.models import load_hf_model, load_llava_model, load_tokenizer
from anlr_jax.models.llava_config import is_llava_config
from anlr_jax.nn import (
    DashDirections,
    import_adalora_adapter,
    import_peft_adapter,
    iter_adalora_layers,
    iter_lora_layers,
)
from anlr_jax.nn.trainable import FullParam
from anlr_jax.nn.peft_io import ADAPTER_CONFIG_FILE, adapter_peft_type


def quantize_on_load(config: RunConfig) -> str:
  """``model.quantize`` as applied while the base is read: ``none`` when the run's method takes
  its adapters' init from the float weight (PiSSA, MiLoRA: :func:`anlr_jax.app.assemble.build_method`
  quantises the residual after the init, as PEFT does)."""
  if config.model.quantize == "none" or get_method(config.method).init != "default":
    return "none"
  return config.model.quantize


def load_base(config: RunConfig, model_path: str | None = None):
  """``(model, model_config, tokenizer)`` of the base model named by ``model.path``, its linear
  layers quantised as ``model.quantize`` says (:func:`quantize_on_load`)."""
  path = require_path(model_path or config.model.path, "model.path", kind="HF model directory")
  quantize = {"quantize": quantize_on_load(config)}
  if is_llava_config(path):  # config.json model_type
    if config.model.quantize != "none":
      raise ConfigError(
          f"model.quantize={config.model.quantize}: LLaVA models have no quantised path"
          f" ({path}); use model.quantize=none"
      )
    load, quantize = load_llava_model, {}
  else:
    load = load_hf_model
  model, model_config = load(
      path,
      dtype=DTYPES[config.model.dtype],
      attention_impl=config.model.attention,
      matmul_dtype=config.model.matmul_dtype,
      **quantize,
  )
  tokenizer_path = resolve_path(config.model.tokenizer) or path
  tokenizer = load_tokenizer(tokenizer_path)
  return model, model_config, tokenizer


def _adapter_layers(model: nnx.Module) -> list[tuple[str, nnx.Module]]:
  """``(dotted path, layer)`` of every adapter layer (LoRA and its variants, LoRA-Dash, AdaLoRA)."""
  return sorted([*iter_lora_layers(model), *iter_adalora_layers(model)], key=lambda item: item[0])


def _full_params(model: nnx.Module) -> list[tuple[str, str, nnx.Variable]]:
  """``(module path, name, variable)`` of every base weight trained in full (LLaVA's projector,
  :class:`~anlr_jax.nn.trainable.FullParam`): saved with the adapters."""
  return [
      (naming.module_name(path[:-1]), str(path[-1]), variable)
      for path, variable in nnx.to_flat_state(nnx.state(model, FullParam))
  ]


def _adapter_variables(layer: nnx.Module) -> list[tuple[str, nnx.Variable]]:
  """The layer's own adapter variables: its ``nnx.LoRAParam`` s and LoRA-Dash's frozen
  ``DashDirections`` (directions chosen at launch, which cannot be recomputed later)."""
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
      tensors[naming.adapter_key(module_path, name)] = value.astype(dtype)
  for module_path, name, variable in _full_params(model):
    tensors[naming.adapter_key(module_path, name)] = np.asarray(
        jax.device_get(variable[...]), np.float32
    )
  if not tensors:
    raise ValueError("the model has no LoRA adapters to save")
  bad = [k for k, v in tensors.items() if not np.isfinite(v).all()]
  if bad:
    raise ValueError(f"refusing to write {os.fspath(path)}: adapter {bad[0]} holds NaN/Inf values")
  meta = {"layout": "flax: lora_a (d_in, r), lora_b (r, d_out)", **dict(metadata or {})}
  if identity is not None:
    meta["identity"] = json.dumps(dict(identity), sort_keys=True)
  data = safetensors_bytes(tensors, metadata=meta)
  with atomic_write(path, "wb") as f:
    f.write(data)
  return sorted(tensors)


def _read_safetensors(path: str):
  """``(tensors, metadata)`` of a safetensors file; one-line ValueError if it is cut or corrupt."""
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
      key = naming.adapter_key(module_path, name)
      expected.add(key)
      if key not in tensors:
        raise KeyError(f"{path}: missing tensor {key!r} (the run's method/lora settings differ?)")
      if tensors[key].shape != variable[...].shape:
        raise ValueError(
            f"{path}: tensor {key!r} has shape {tensors[key].shape}, the model "
            f"expects {variable[...].shape}"
        )
      getattr(layer, name)[...] = jnp.asarray(tensors[key], variable[...].dtype)
  for module_path, name, variable in _full_params(model):
    key = naming.adapter_key(module_path, name)
    expected.add(key)
    if key not in tensors:
      raise KeyError(f"{path}: missing tensor {key!r} (the run's model.projector_lr differs?)")
    if tensors[key].shape != variable[...].shape:
      raise ValueError(
          f"{path}: tensor {key!r} has shape {tensors[key].shape}, the model "
          f"expects {variable[...].shape}"
      )
    variable[...] = jnp.asarray(tensors[key], variable[...].dtype)
  extra = sorted(set(tensors) - expected)
  if extra:
    raise KeyError(f"{path}: tensors {extra[:4]} match no adapter of the model")
  return model


def model_fingerprint(model_config, model: nnx.Module) -> str:
  """A short hash of the model config and the shapes and dtypes of every weight."""
  shapes = sorted(
      (str(path), tuple(x.shape), str(x.dtype))
      for path, x in nnx.to_flat_state(nnx.state(model, nnx.Param))
  )
  text = json.dumps([dataclasses.asdict(model_config), shapes], sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def is_run_dir(path: str) -> bool:
  return os.path.isfile(os.path.join(path, rundir.LORA_FILE)) and os.path.isfile(
      os.path.join(path, rundir.CONFIG_FILE)
  )


def load_adapted_model(
    config: RunConfig,
    adapter: str | None,
    *,
    model_path: str | None = None,
    quantize: str | None = None,
):
  """Base model plus an adapter: a run directory (``lora_final.safetensors`` + ``config.yaml``,
  rebuilt with the run's method and LoRA settings) or a PEFT adapter directory. Returns
  ``(model, model_config, tokenizer)``.

  A run directory's base is quantised as ``quantize`` says when it is given (``none``: a float
  base under an adapter trained on a quantised one), else as ``config.model.quantize`` says, or as
  the run's was when that is ``none``."""
  if adapter is None:
    return load_base(config, model_path)
  if is_run_dir(adapter):
    run_config = load_config(os.path.join(adapter, rundir.CONFIG_FILE))
    if quantize is None:
      quantize = config.model.quantize if config.model.quantize != "none" else None
    run_config = dataclasses.replace(
        run_config,
        model=dataclasses.replace(
            run_config.model,
            path=model_path or run_config.model.path,
            quantize=quantize or run_config.model.quantize,
        ),
    )
    model, model_config, tokenizer = load_base(run_config)
    build_method(run_config, model=model)
    load_lora_params(model, os.path.join(adapter, rundir.LORA_FILE))
  elif os.path.isfile(os.path.join(adapter, ADAPTER_CONFIG_FILE)):
    if quantize is not None:
      config = dataclasses.replace(
          config, model=dataclasses.replace(config.model, quantize=quantize)
      )
    model, model_config, tokenizer = load_base(config, model_path)
    if adapter_peft_type(adapter) == "ADALORA":
      import_adalora_adapter(model, adapter)
    else:
      import_peft_adapter(model, adapter)
  else:
    raise FileNotFoundError(
        f"--adapter {adapter}: neither a run directory ({rundir.LORA_FILE} + "
        f"{rundir.CONFIG_FILE}) nor a PEFT adapter directory ({ADAPTER_CONFIG_FILE})"
    )
  model.eval()
  return model, model_config, tokenizer


__all__ = [
    "is_run_dir",
    "load_adapted_model",
    "load_base",
    "load_lora_params",
    "lora_file_identity",
    "model_fingerprint",
    "quantize_on_load",
    "save_lora_params",
]

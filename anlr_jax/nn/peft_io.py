r"""Export / import LoRA adapters in Hugging Face PEFT's on-disk format.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors``. For a
``LoRALinear`` at NNX path ``p`` (``'.'.join`` of the path; the project's models mirror Hugging
Face module names) the tensors are, with the Flax factors ``A`` ``(d_in, r)``, ``B`` ``(r, d_out)``:

    base_model.model.<p>.lora_A.weight           = A^T   (r, d_in)
    base_model.model.<p>.lora_B.weight           = B^T   (d_out, r)
    base_model.model.<p>.lora_magnitude_vector   = m     (d_out,)      DoRA only

which is exactly what ``peft.PeftModel.save_pretrained`` writes for a torch ``nn.Linear``
(``peft.utils.save_and_load.get_peft_model_state_dict``; DoRA's magnitude key has no ``.weight``).

PiSSA / MiLoRA. Their base kernel is the residual ``W_res = W0 - c A0 B0``, so the trained factors
alone are wrong against the original ``W0``. We export them the way PEFT converts a PiSSA adapter
to plain LoRA (``save_pretrained(..., path_initial_model_for_weight_conversion=...)``,
``LoraModel.subtract_mutated_init``): since
``W_res + c A B = W0 + c (A B - A0 B0) = W0 + c [A | A0] [B ; -B0]``, the file holds a rank-``2r``
adapter ``A' = [A | A0]``, ``B' = [B ; -B0]`` against ``W0``, with ``r' = 2r`` and
``lora_alpha' = 2 alpha`` (``sqrt(2) alpha`` for rsLoRA) so that ``c`` is unchanged, and
``init_lora_weights = true``. For DoRA + PiSSA the magnitude is unchanged, as
``||W0 + c A' B'|| = ||W_res + c A B||``. Importing such a file gives an ordinary rank-``2r`` LoRA
on the original weights.

Modules trained in full next to the adapters (LLaVA's projector, ``modules_to_save`` in PEFT) are
written as ``base_model.model.<p>.weight`` (``W = K^T``) and ``.bias`` for every ``nnx.Linear`` at
``p`` below them, with the last name of each such module in the config's ``modules_to_save``, as
PEFT writes them; importing loads them back into the base layers.

Tensors are written as the float32 arrays the layers hold; a re-export of an imported adapter is
byte-identical.
"""

from __future__ import annotations

import json
import math
import os
import typing as tp

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from anlr_jax.fileio import read_json
from anlr_jax.nn.inject import get_submodule, iter_lora_layers, path_str, set_submodule
from anlr_jax.nn.lora import LoRALinear

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
LORA_A_SUFFIX = ".lora_A.weight"
LORA_B_SUFFIX = ".lora_B.weight"
MAGNITUDE_SUFFIX = ".lora_magnitude_vector"


def _shared_setting(layers, name: str):
  values = {path: getattr(layer, name) for path, layer in layers}
  distinct = sorted(set(values.values()), key=repr)
  if len(distinct) > 1:
    examples = {v: next(p for p, x in values.items() if x == v) for v in distinct}
    raise ValueError(f"LoRA layers disagree on {name}: {examples}; PEFT export needs one value")
  return distinct[0]


def _export_factors(layer: LoRALinear) -> tuple[np.ndarray, np.ndarray]:
  """Flax ``(A, B)`` to write: the trained factors, or PEFT's rank-2r conversion for PiSSA/MiLoRA."""
  a, b = np.asarray(layer.lora_a[...]), np.asarray(layer.lora_b[...])
  if layer.init != "default":
    a = np.concatenate([a, np.asarray(layer.init_lora_a[...])], axis=1)
    b = np.concatenate([b, -np.asarray(layer.init_lora_b[...])], axis=0)
  return a, b


def _target_names(model: nnx.Module, lora_paths: list[str]) -> list[str]:
  """Short attribute names when they select exactly the adapted layers, else the full paths."""
  names = sorted({p.rsplit(".", 1)[-1] for p in lora_paths})
  selected = set()
  for path, module in nnx.iter_modules(model):
    if (
        path
        and isinstance(path[-1], str)
        and path[-1] in names
        and isinstance(module, (nnx.Linear, LoRALinear))
    ):
      if (
          len(path) >= 2
          and path[-1] == "base"
          and isinstance(get_submodule(model, path[:-1]), LoRALinear)
      ):
        continue
      selected.add(path_str(path))
  return names if selected == set(lora_paths) else sorted(lora_paths)


def export_peft_adapter(
    model: nnx.Module,
    out_dir: tp.Union[str, os.PathLike],
    *,
    base_model_name_or_path: str = "",
    task_type: tp.Optional[str] = "CAUSAL_LM",
    modules_to_save: tp.Sequence[tp.Sequence[str | int]] = (),
) -> None:
  r"""Write the ``LoRALinear`` adapters of ``model`` as a PEFT LoRA adapter directory.

  See the module docstring for the key layout and the PiSSA/MiLoRA conversion. Merged layers
  export the same tensors as unmerged ones (the factors are kept when merging).

  Args:
    model: an NNX module holding ``LoRALinear`` layers, all with the same rank, alpha, dropout,
      rsLoRA, DoRA and init settings.
    out_dir: directory to create or overwrite files in.
    base_model_name_or_path: recorded in ``adapter_config.json``.
    task_type: PEFT task type (``"CAUSAL_LM"``), or None for a bare ``PeftModel``.
    modules_to_save: module paths (e.g. ``('model', 'multi_modal_projector')``) whose linear
      layers were trained in full: saved whole, as PEFT's ``modules_to_save``.

  Raises:
    ValueError: the model has no ``LoRALinear``, or its layers disagree on a setting, or a
      module to save holds no ``nnx.Linear``.
  """
  layers = list(iter_lora_layers(model))
  if not layers:
    raise ValueError(f"{type(model).__name__} holds no LoRALinear layer to export")
  rank = _shared_setting(layers, "rank")
  alpha = _shared_setting(layers, "alpha")
  use_rslora = _shared_setting(layers, "use_rslora")
  use_dora = _shared_setting(layers, "use_dora")
  init = _shared_setting(layers, "init")
  dropout = _shared_setting([(p, l.dropout) for p, l in layers], "rate")
  if init != "default":  # rank-2r conversion keeps c = alpha / r (or alpha / sqrt(r)) fixed
    rank, alpha = 2 * rank, alpha * (math.sqrt(2.0) if use_rslora else 2.0)

  tensors = {}
  for path, layer in layers:
    a, b = _export_factors(layer)
    tensors[KEY_PREFIX + path + LORA_A_SUFFIX] = np.ascontiguousarray(a.T)
    tensors[KEY_PREFIX + path + LORA_B_SUFFIX] = np.ascontiguousarray(b.T)
    if use_dora:
      tensors[KEY_PREFIX + path + MAGNITUDE_SUFFIX] = np.ascontiguousarray(
          layer.lora_magnitude[...]
      )

  saved_names = []
  for module_path in modules_to_save:
    module_path = tuple(module_path)
    linears = [
        (path_str((*module_path, *p)), m)
        for p, m in nnx.iter_modules(get_submodule(model, module_path))
        if isinstance(m, nnx.Linear)
    ]
    if not linears:
      raise ValueError(f"modules_to_save: '{path_str(module_path)}' holds no nnx.Linear")
    for path, linear in linears:
      tensors[KEY_PREFIX + path + ".weight"] = np.ascontiguousarray(
          np.asarray(linear.kernel[...], np.float32).T
      )
      if linear.bias is not None:
        tensors[KEY_PREFIX + path + ".bias"] = np.asarray(linear.bias[...], np.float32)
    saved_names.append(str(module_path[-1]))

  write_adapter(
      out_dir,
      tensors,
      peft_type="LORA",
      task_type=task_type,
      base_model_name_or_path=base_model_name_or_path,
      alpha=alpha,
      dropout=dropout,
      target_modules=_target_names(model, [p for p, _ in layers]),
      use_rslora=use_rslora,
      use_dora=use_dora,
      r=rank,
      lora_bias=False,
      rank_pattern={},
      alpha_pattern={},
      modules_to_save=sorted(set(saved_names)) or None,
  )


def write_adapter(
    out_dir: str | os.PathLike,
    tensors: dict[str, np.ndarray],
    *,
    peft_type: str,
    task_type: str | None,
    base_model_name_or_path: str | None,
    alpha: float,
    dropout: float,
    target_modules: tp.Sequence[str],
    use_rslora: bool = False,
    use_dora: bool = False,
    **settings: tp.Any,
) -> None:
  """Writes ``adapter_config.json`` (the fields every PEFT adapter type shares, then ``settings``,
  the type's own) and ``adapter_model.safetensors`` to ``out_dir`` (created if needed)."""
  config = {
      "peft_type": peft_type,
      "task_type": task_type,
      "base_model_name_or_path": base_model_name_or_path or None,
      "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
      "lora_dropout": dropout,
      "target_modules": list(target_modules),
      "use_rslora": use_rslora,
      "use_dora": use_dora,
      "init_lora_weights": True,
      "fan_in_fan_out": False,
      "bias": "none",
      "modules_to_save": None,
      "layers_to_transform": None,
      "layers_pattern": None,
      "inference_mode": True,
      "revision": None,
      **settings,
  }
  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, ADAPTER_CONFIG_FILE), "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)
  save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})


def adapter_peft_type(adapter_dir: str | os.PathLike) -> str | None:
  """The ``peft_type`` of an adapter directory's config (``"LORA"`` when the field is absent), or
  None when the config is missing or unreadable (the importer then says what is wrong)."""
  try:
    with open(os.path.join(adapter_dir, ADAPTER_CONFIG_FILE), encoding="utf-8") as f:
      return json.load(f).get("peft_type", "LORA")
  except (OSError, ValueError, AttributeError):
    return None


def read_adapter(
    adapter_dir: str | os.PathLike, peft_type: str
) -> tuple[dict[str, tp.Any], dict[str, np.ndarray], str]:
  """An adapter directory's config, its tensors and the weights file's path (for messages).

  Raises:
    FileNotFoundError: a file is missing. ValueError: the config is not a JSON object, or its
    ``peft_type`` (``"LORA"`` when absent) is not ``peft_type``.
  """
  adapter_dir = os.fspath(adapter_dir)
  config_path = os.path.join(adapter_dir, ADAPTER_CONFIG_FILE)
  weights_path = os.path.join(adapter_dir, ADAPTER_WEIGHTS_FILE)
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"adapter config not found: {config_path}")
  config = read_json(config_path, dict, what="a JSON object (a PEFT adapter config)")
  if config.get("peft_type", "LORA") != peft_type:
    raise ValueError(f"{config_path}: peft_type {config['peft_type']!r} is not {peft_type!r}")
  if not os.path.isfile(weights_path):
    raise FileNotFoundError(f"adapter weights not found: {weights_path}")
  with safe_open(weights_path, framework="numpy") as f:
    tensors = {key: f.get_tensor(key) for key in f.keys()}
  return config, tensors, weights_path


def _check_lora_config(config: dict, config_path: str) -> None:
  """Refuses a LoRA config this importer cannot reproduce, naming the field."""
  for key in ("r", "lora_alpha"):
    if key not in config:
      raise KeyError(f"{config_path} has no '{key}'")
  unsupported = {
      "fan_in_fan_out": (False, None),
      "rank_pattern": ({}, None),
      "alpha_pattern": ({}, None),
      "bias": ("none", None),
      "lora_bias": (False, None),
      "init_lora_weights": (
          True,
          False,
          "gaussian",
          None,
      ),  # inits that leave the base weights as they are
  }
  for key, allowed in unsupported.items():
    if key in config and config[key] not in allowed:
      raise ValueError(
          f"{config_path}: {key}={config[key]!r} is not supported (expected one of {allowed}); "
          "PiSSA-style adapters must be converted to plain LoRA first"
      )


def import_peft_adapter(
    model: nnx.Module,
    adapter_dir: tp.Union[str, os.PathLike],
    *,
    rngs: tp.Optional[nnx.Rngs] = None,
) -> nnx.Module:
  r"""Load a PEFT LoRA adapter directory into ``model`` (in place), injecting where needed.

  Every module path ``p`` with a ``base_model.model.<p>.lora_A.weight`` key must be an
  ``nnx.Linear`` (it is wrapped in a ``LoRALinear`` with the config's ``r``, ``lora_alpha``,
  ``lora_dropout``, ``use_rslora``, ``use_dora``) or an unmerged default-init ``LoRALinear`` with
  the same settings (its factors are overwritten). Each ``LoRALinear`` already in the model must
  be covered by the file. Factors are transposed back to the Flax layout and cast to float32.

  Args:
    model: the NNX model, its module paths mirroring the torch module names.
    adapter_dir: directory with ``adapter_config.json`` and ``adapter_model.safetensors``.
    rngs: random streams for the new layers' dropout (default ``nnx.Rngs(0)``).

  Returns:
    ``model``.

  Raises:
    FileNotFoundError: a file is missing. KeyError: a tensor key is missing or names no module in
    ``model``. ValueError: a shape mismatch, an unsupported config field or an incompatible layer.
  """
  config, tensors, weights_path = read_adapter(adapter_dir, "LORA")
  _check_lora_config(config, os.path.join(adapter_dir, ADAPTER_CONFIG_FILE))
  rank, alpha = int(config["r"]), float(config["lora_alpha"])
  use_rslora, use_dora = bool(config.get("use_rslora", False)), bool(config.get("use_dora", False))
  dropout = float(config.get("lora_dropout", 0.0))
  rngs = nnx.Rngs(0) if rngs is None else rngs

  expected_keys = set()
  module_paths = sorted(
      k[len(KEY_PREFIX) : -len(LORA_A_SUFFIX)]
      for k in tensors
      if k.startswith(KEY_PREFIX) and k.endswith(LORA_A_SUFFIX)
  )
  if not module_paths:
    raise KeyError(f"{weights_path} has no '{KEY_PREFIX}<module>{LORA_A_SUFFIX}' key")

  def tensor(key: str, shape: tuple[int, ...]) -> np.ndarray:
    if key not in tensors:
      raise KeyError(f"{weights_path} has no key '{key}'")
    if tuple(tensors[key].shape) != shape:
      raise ValueError(
          f"{weights_path}: '{key}' has shape {tuple(tensors[key].shape)}, expected {shape}"
      )
    expected_keys.add(key)
    return tensors[key]

  for dotted in module_paths:
    path = tuple(int(p) if p.isdigit() else p for p in dotted.split("."))
    try:
      module = get_submodule(model, path)
    except KeyError as err:
      raise KeyError(
          f"{weights_path}: key '{KEY_PREFIX}{dotted}{LORA_A_SUFFIX}' names no module "
          f"of {type(model).__name__} ({err.args[0]})"
      ) from err
    if isinstance(module, LoRALinear):
      settings = dict(
          rank=module.rank,
          alpha=module.alpha,
          use_rslora=module.use_rslora,
          use_dora=module.use_dora,
          init=module.init,
          merged=module.merged,
      )
      wanted = dict(
          rank=rank,
          alpha=alpha,
          use_rslora=use_rslora,
          use_dora=use_dora,
          init="default",
          merged=False,
      )
      if settings != wanted:
        raise ValueError(
            f"LoRALinear at '{dotted}' has settings {settings}, the adapter in "
            f"{adapter_dir} needs {wanted}"
        )
      layer = module
    elif isinstance(module, nnx.Linear):
      layer = LoRALinear(
          module,
          rank=rank,
          alpha=alpha,
          dropout=dropout,
          use_rslora=use_rslora,
          use_dora=use_dora,
          rngs=rngs,
      )
    else:
      raise ValueError(
          f"'{dotted}' in {weights_path} is a {type(module).__name__}, not an nnx.Linear"
      )
    d_in, d_out = layer.in_features, layer.out_features
    a = tensor(KEY_PREFIX + dotted + LORA_A_SUFFIX, (rank, d_in))
    b = tensor(KEY_PREFIX + dotted + LORA_B_SUFFIX, (d_out, rank))
    layer.lora_a[...] = jnp.asarray(a.T, layer.lora_a.dtype)
    layer.lora_b[...] = jnp.asarray(b.T, layer.lora_b.dtype)
    if use_dora:
      m = tensor(KEY_PREFIX + dotted + MAGNITUDE_SUFFIX, (d_out,))
      layer.lora_magnitude[...] = jnp.asarray(m, layer.lora_magnitude.dtype)
    if layer is not module:
      set_submodule(model, path, layer)

  saved = config.get("modules_to_save") or []
  for key in sorted(set(tensors) - expected_keys):
    module_name, _, attr = key[len(KEY_PREFIX) :].rpartition(".")
    if not key.startswith(KEY_PREFIX) or attr not in ("weight", "bias"):
      continue
    parts = tuple(int(p) if p.isdigit() else p for p in module_name.split("."))
    if not any(name in parts for name in saved):
      continue
    try:
      linear = get_submodule(model, parts)
    except KeyError:
      continue
    if not isinstance(linear, nnx.Linear):
      continue
    variable = linear.kernel if attr == "weight" else linear.bias
    if variable is None:
      continue
    value = tensors[key].T if attr == "weight" else tensors[key]
    if tuple(value.shape) != tuple(variable.shape):
      raise ValueError(
          f"{weights_path}: '{key}' has shape {tuple(tensors[key].shape)}, the model's "
          f"{module_name} expects {tuple(variable.shape)[::-1] if attr == 'weight' else tuple(variable.shape)}"
      )
    variable[...] = jnp.asarray(value, variable.dtype)
    expected_keys.add(key)

  leftover = sorted(set(tensors) - expected_keys)
  if leftover:
    raise ValueError(f"{weights_path} holds keys this importer does not understand: {leftover[:5]}")
  loaded = set(module_paths)
  uncovered = [p for p, _ in iter_lora_layers(model) if p not in loaded]
  if uncovered:
    raise ValueError(
        f"LoRALinear layers {uncovered[:5]} of {type(model).__name__} have no tensors in "
        f"{weights_path}"
    )
  return model

r"""LLaVA checkpoints in the Hugging Face layout: the tensor table of
:class:`~anlr_jax.models.llava.LlavaForConditionalGeneration`, :func:`load_llava_model` and
:func:`save_llava_model`.

Checkpoints. Loading accepts the keys of the ``llava-hf`` checkpoints (``language_model.model.*``,
``language_model.lm_head.weight``, ``vision_tower.vision_model.*``, ``multi_modal_projector.*``),
of transformers 5's ``save_pretrained`` (the same without ``vision_model.``) and of transformers'
in-memory layout (``model.language_model.*``, ``model.vision_tower.*``, ``lm_head.*``), in one or
several safetensors files. Saving writes the ``llava-hf`` layout, which every transformers version
and the LLaVA serving stacks read. The ``text_config`` / ``vision_config`` of a ``config.json`` may
list only the fields that differ from transformers' ``LlamaConfig`` / ``CLIPVisionConfig``
defaults (as ``llava-hf/llava-1.5-7b-hf`` does); the missing ones take those defaults.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
from flax import nnx
from safetensors import safe_open

from anlr_jax.models.clip import ClipVisionConfig
from anlr_jax.models.hf_io import (
    IGNORED_KEY,
    ParamEntry,
    check_filled,
    check_shape,
    set_tensor,
    shard_weight_map,
    hf_param_table,
    write_param_table,
)
from anlr_jax.models.llava import LlavaForConditionalGeneration
from anlr_jax.models.llava_config import LlavaConfig


def _vision_entries(config: ClipVisionConfig) -> list[ParamEntry]:
  d, f = config.hidden_size, config.intermediate_size
  c, p = config.num_channels, config.patch_size
  root, key = ("model", "vision_tower"), "vision_tower.vision_model"
  emb = (*root, "embeddings")
  entries = [
      ParamEntry(f"{key}.embeddings.class_embedding", emb, "class_embedding", (d,), False),
      ParamEntry(
          f"{key}.embeddings.patch_embedding.weight",
          (*emb, "patch_embedding"),
          "weight",
          (d, c, p, p),
          False,
      ),
      ParamEntry(
          f"{key}.embeddings.position_embedding.weight",
          (*emb, "position_embedding"),
          "embedding",
          (config.num_patches + 1, d),
          False,
      ),
  ]

  def norm(name, path):
    return [
        ParamEntry(f"{key}.{name}.weight", path, "weight", (d,), False),
        ParamEntry(f"{key}.{name}.bias", path, "bias", (d,), False),
    ]

  entries += norm("pre_layrnorm", (*root, "pre_layrnorm"))
  linears = {
      "self_attn.q_proj": (d, d),
      "self_attn.k_proj": (d, d),
      "self_attn.v_proj": (d, d),
      "self_attn.out_proj": (d, d),
      "mlp.fc1": (f, d),
      "mlp.fc2": (d, f),
  }
  for i in range(config.num_hidden_layers):
    layer = (*root, "encoder", "layers", i)
    for name, shape in linears.items():
      path, hf = (*layer, *name.split(".")), f"{key}.encoder.layers.{i}.{name}"
      entries.append(ParamEntry(f"{hf}.weight", path, "kernel", shape, True))
      entries.append(ParamEntry(f"{hf}.bias", path, "bias", (shape[0],), False))
    for name in ("layer_norm1", "layer_norm2"):
      entries += norm(f"encoder.layers.{i}.{name}", (*layer, name))
  entries += norm("post_layernorm", (*root, "post_layernorm"))
  return entries


def llava_param_table(config: LlavaConfig) -> list[ParamEntry]:
  """Every tensor of a ``llava-hf`` checkpoint of ``config`` and where it lives in the model."""
  entries = _vision_entries(config.vision_config)
  text = config.text_config
  d_in = config.vision_config.hidden_size * len(config.feature_layers)
  for name, shape in (
      ("linear_1", (text.hidden_size, d_in)),
      ("linear_2", (text.hidden_size,) * 2),
  ):
    path = ("model", "multi_modal_projector", name)
    entries.append(ParamEntry(f"multi_modal_projector.{name}.weight", path, "kernel", shape, True))
    if config.multimodal_projector_bias:
      entries.append(
          ParamEntry(f"multi_modal_projector.{name}.bias", path, "bias", (shape[0],), False)
      )
  for entry in hf_param_table(text):
    if entry.hf_key.startswith("model."):
      path = ("model", "language_model", *entry.module_path[1:])
    else:  # lm_head
      path = entry.module_path
    entries.append(
        dataclasses.replace(entry, hf_key=f"language_model.{entry.hf_key}", module_path=path)
    )
  return entries


def canonical_key(key: str) -> str:
  """A LLaVA checkpoint key in any supported layout, as the ``llava-hf`` layout names it."""
  for old, new in (
      ("model.language_model.", "language_model.model."),
      ("lm_head.", "language_model.lm_head."),
      ("model.vision_tower.", "vision_tower."),
      ("model.multi_modal_projector.", "multi_modal_projector."),
  ):
    if key.startswith(old):
      key = new + key[len(old) :]
      break
  if key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
    key = "vision_tower.vision_model." + key[len("vision_tower.") :]
  return key


def load_llava_model(
    path: str | os.PathLike, *, dtype=jnp.float32, compute_dtype=None, **text_overrides
) -> tuple[LlavaForConditionalGeneration, LlavaConfig]:
  """Loads a local LLaVA checkpoint (``config.json`` + safetensors, one file or sharded).

  Args:
    path: the checkpoint directory.
    dtype: parameter dtype; compute_dtype: activation dtype (default ``dtype``).
    **text_overrides: other :class:`ModelConfig` fields of the language model (``remat=True``,
      ``attention_impl=...``).

  Returns:
    ``(model, config)``.

  Raises:
    FileNotFoundError: a file is missing. KeyError: a tensor is missing. ValueError: a tensor has
    the wrong shape, an unknown tensor is present, or the config is not a supported LLaVA.
  """
  path = os.fspath(path)
  config = LlavaConfig.from_pretrained(
      path, dtype=dtype, compute_dtype=compute_dtype, **text_overrides
  )
  by_key: dict[str, tuple[str, str]] = {}
  for key, file in shard_weight_map(path).items():
    if IGNORED_KEY.match(key):
      continue
    canonical = canonical_key(key)
    if canonical in by_key:
      raise ValueError(f"{path}: tensors {by_key[canonical][1]!r} and {key!r} are the same weight.")
    by_key[canonical] = (file, key)
  table = llava_param_table(config)
  expected = {e.hf_key for e in table}
  tied = config.text_config.tie_word_embeddings
  unexpected = sorted(
      by_key[k][1]
      for k in by_key
      if k not in expected and not (tied and k.endswith("lm_head.weight"))
  )
  if unexpected:
    raise ValueError(
        f"Checkpoint {path} holds tensors the LLaVA architecture of its config.json does not have:"
        f" {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}."
    )
  model = nnx.eval_shape(lambda: LlavaForConditionalGeneration(config, rngs=nnx.Rngs(0)))
  by_file: dict[str, list[tuple[ParamEntry, str]]] = {}
  for entry in table:
    if entry.hf_key not in by_key:
      raise KeyError(f"Tensor {entry.hf_key!r} (any LLaVA key layout) not found in {path}.")
    file, key = by_key[entry.hf_key]
    by_file.setdefault(file, []).append((entry, key))
  for file, entries in by_file.items():
    file_path = os.path.join(path, file)
    with safe_open(file_path, framework="numpy") as f:
      for entry, key in entries:
        check_shape(entry, tuple(f.get_slice(key).get_shape()), file_path)
        set_tensor(model, entry, f.get_tensor(key), dtype)
  check_filled(model)
  return model, config


def save_llava_model(
    model: LlavaForConditionalGeneration,
    config: LlavaConfig,
    out_dir: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    merge_lora: bool = True,
    dtype=None,
) -> list[str]:
  """Writes ``config.json`` and ``llava-hf``-layout safetensors (sharded above ``max_shard_size``).

  LoRA-wrapped projections are saved merged (``merge_lora=True``) or as their base weights; see
  :func:`anlr_jax.models.hf_io.save_hf_model` for the other arguments. Returns the file names.
  """
  return write_param_table(
      model, config, llava_param_table(config), out_dir, max_shard_size, merge_lora, dtype
  )


__all__ = ["canonical_key", "llava_param_table", "load_llava_model", "save_llava_model"]

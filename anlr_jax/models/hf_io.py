r"""Hugging Face checkpoint I/O for :class:`~anlr_jax.models.llama.LlamaForCausalLM`.

Key mapping (one table, :func:`hf_param_table`): a torch ``nn.Linear`` weight ``W`` of shape
``(out, in)`` is the NNX kernel ``K = W^T`` of shape ``(in, out)``; biases, RMSNorm weights and the
embedding matrix ``(V, d)`` are copied as they are:

    model.embed_tokens.weight                  <-> model.embed_tokens.embedding
    model.layers.<i>.<block>.<proj>.weight     <-> model.layers.<i>.<block>.<proj>.kernel  (transposed)
    model.layers.<i>.self_attn.<q,k,v>_proj.bias <-> ....bias                              (Qwen2)
    model.layers.<i>.<input,post_attention>_layernorm.weight <-> same path .weight
    model.norm.weight                          <-> model.norm.weight
    lm_head.weight                             <-> lm_head.kernel (transposed; absent when tied)

Loading builds the model abstractly (``nnx.eval_shape``) and fills it one tensor at a time with
``safetensors.safe_open``, so the host never holds two full copies of the weights. bfloat16
tensors come back from safetensors as ``ml_dtypes.bfloat16`` NumPy arrays.

A ``.gguf`` file (LLaMA / Qwen2, quantised or not) is read by :mod:`anlr_jax.models.gguf` into the
same ``config.json`` dict and tensors and loaded through :func:`model_from_hf_tensors`, which builds
a model from any ``(config dict, {hf_key: array})`` pair.

Saving writes ``config.json`` plus ``model.safetensors`` or ``model-0000i-of-0000n.safetensors``
with ``model.safetensors.index.json``, readable by ``transformers.AutoModelForCausalLM``.
Projections replaced by LoRA wrappers (objects with a ``base`` ``nnx.Linear`` and ``lora_a`` /
``lora_b``) are saved merged through their ``merged_kernel()`` (``merge_lora=True``) or as the bare
base weights (``merge_lora=False``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from anlr_jax.models.config import ModelConfig
from anlr_jax.models.gguf import load_gguf_tokenizer, read_gguf
from anlr_jax.models.hf_files import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    TOKENIZER_FILES,
    is_gguf,
    parse_size,
    write_safetensors_shards,
)
from anlr_jax.models.llama import LlamaForCausalLM
from anlr_jax.nn.quant import QuantEmbed, QuantLinear, RowBlocks, check_mode

# Buffers some older checkpoints store next to the weights; they are recomputed, never loaded.
IGNORED_KEY = re.compile(r".*rotary_emb\.inv_freq$")


@dataclasses.dataclass(frozen=True)
class ParamEntry:
  """One checkpoint tensor: HF key, the NNX module path and attribute holding it, its HF shape."""

  hf_key: str
  module_path: tuple[str | int, ...]
  attr: str  # 'kernel', 'bias', 'weight' (RMSNorm) or 'embedding'
  hf_shape: tuple[int, ...]
  transpose: bool  # torch (out, in) <-> NNX (in, out)


def hf_param_table(config: ModelConfig) -> list[ParamEntry]:
  """Every tensor of a Hugging Face checkpoint of ``config`` and where it lives in the NNX model."""
  d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
  q_dim = config.num_attention_heads * config.head_dim
  kv_dim = config.num_key_value_heads * config.head_dim
  entries = [
      ParamEntry("model.embed_tokens.weight", ("model", "embed_tokens"), "embedding", (v, d), False)
  ]
  linears = {
      "self_attn.q_proj": (q_dim, d),
      "self_attn.k_proj": (kv_dim, d),
      "self_attn.v_proj": (kv_dim, d),
      "self_attn.o_proj": (d, q_dim),
      "mlp.gate_proj": (f, d),
      "mlp.up_proj": (f, d),
      "mlp.down_proj": (d, f),
  }
  biased = set()
  if config.attention_bias:
    biased = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}
    if config.model_type == "llama":
      biased.add("self_attn.o_proj")
  for i in range(config.num_hidden_layers):
    prefix = f"model.layers.{i}"
    for name, shape in linears.items():
      path = ("model", "layers", i, *name.split("."))
      entries.append(ParamEntry(f"{prefix}.{name}.weight", path, "kernel", shape, True))
      if name in biased:
        entries.append(ParamEntry(f"{prefix}.{name}.bias", path, "bias", (shape[0],), False))
    for norm in ("input_layernorm", "post_attention_layernorm"):
      entries.append(
          ParamEntry(f"{prefix}.{norm}.weight", ("model", "layers", i, norm), "weight", (d,), False)
      )
  entries.append(ParamEntry("model.norm.weight", ("model", "norm"), "weight", (d,), False))
  if not config.tie_word_embeddings:
    entries.append(ParamEntry("lm_head.weight", ("lm_head",), "kernel", (v, d), True))
  return entries


def tensor_submodule(model: nnx.Module, path: Iterable[str | int]) -> Any:
  node = model
  for part in path:
    node = node[part] if isinstance(part, int) else getattr(node, part)
  return node


def is_lora_wrapper(module: Any) -> bool:
  return all(hasattr(module, a) for a in ("base", "lora_a", "lora_b"))


# --------------------------------------------------------------------------------------------------
# Loading


def _place(value: jax.Array, sharding) -> jax.Array:
  """Puts ``value`` where the abstract model wants it (sharded when built under a mesh)."""
  if sharding is None:
    return value
  if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(
      sharding.mesh, jax.sharding.AbstractMesh
  ):
    mesh = jax.sharding.get_mesh()
    if mesh is None or getattr(mesh, "empty", False):
      return value
    sharding = jax.sharding.NamedSharding(mesh, sharding.spec)
  return jax.device_put(value, sharding)


def shard_weight_map(path: str) -> dict[str, str]:
  """HF key -> safetensors file name, from the index when sharded or the single file."""
  index_path = os.path.join(path, INDEX_FILE)
  single_path = os.path.join(path, SINGLE_FILE)
  if os.path.isfile(index_path):
    try:
      with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
      raise ValueError(f"{index_path} is not a valid safetensors index ({e}).") from e
    for file in sorted(set(weight_map.values())):
      if not os.path.isfile(os.path.join(path, file)):
        raise FileNotFoundError(
            f"Shard {os.path.join(path, file)} listed in {index_path} is missing."
        )
    return dict(weight_map)
  if os.path.isfile(single_path):
    with safe_open(single_path, framework="numpy") as f:
      return {key: SINGLE_FILE for key in f.keys()}
  raise FileNotFoundError(f"No {SINGLE_FILE} or {INDEX_FILE} found in {path}.")


def _check_tensor_names(
    config: ModelConfig, names: Iterable[str], source: str, config_source: str
) -> None:
  """Raises ValueError when ``names`` holds tensors the architecture of ``config`` lacks."""
  expected = {e.hf_key for e in hf_param_table(config)}
  unexpected = sorted(
      k
      for k in names
      if k not in expected
      and not IGNORED_KEY.match(k)
      and not (config.tie_word_embeddings and k == "lm_head.weight")
  )
  if unexpected:
    raise ValueError(
        f"Checkpoint {source} holds tensors the {config.model_type} architecture of "
        f"{config_source} does not have: {unexpected[:8]}"
        f"{' ...' if len(unexpected) > 8 else ''}."
    )


def check_shape(entry: ParamEntry, found: tuple[int, ...], source: str) -> None:
  if found != entry.hf_shape:
    raise ValueError(
        f"{source}: tensor {entry.hf_key!r} has shape {found}, expected {entry.hf_shape}."
    )


def set_tensor(
    model: LlamaForCausalLM, entry: ParamEntry, array, dtype, quantize: str = "none"
) -> None:
  """Writes one torch-layout checkpoint tensor into the (abstract) model, placed and cast; with
  ``quantize`` (int8, nf4) a linear layer's weight is quantised from its float32 values and the
  layer becomes a :class:`~anlr_jax.nn.quant.QuantLinear`, the embedding table a
  :class:`~anlr_jax.nn.quant.QuantEmbed`."""
  if entry.transpose:
    array = array.T
  module = tensor_submodule(model, entry.module_path)
  if quantize != "none" and entry.attr == "kernel":
    # NumPy float32, quantised a chunk of columns at a time (no whole float copy on the device);
    # the packed arrays are placed like the abstract kernel
    value = array if isinstance(array, RowBlocks) else np.asarray(array, np.float32)
    name = ".".join(map(str, entry.module_path))
    layer = QuantLinear(module, quantize, value, name=name)
    setattr(tensor_submodule(model, entry.module_path[:-1]), entry.module_path[-1], layer)
    return
  if quantize != "none" and entry.attr == "embedding":
    table = array if isinstance(array, RowBlocks) else np.asarray(array, np.float32)
    table = QuantEmbed(module, quantize, table)
    setattr(tensor_submodule(model, entry.module_path[:-1]), entry.module_path[-1], table)
    return
  variable = getattr(module, entry.attr)
  value = jnp.asarray(array).astype(dtype)
  variable.set_value(_place(value, getattr(variable.get_value(), "sharding", None)))


def check_filled(model: LlamaForCausalLM) -> None:
  unfilled = [
      ".".join(map(str, p))
      for p, v in nnx.to_flat_state(nnx.state(model))
      if isinstance(v.get_value(), jax.ShapeDtypeStruct)
  ]
  if unfilled:  # the key table and the model disagree: a bug, not a user error
    raise RuntimeError(f"hf_param_table does not cover model variables {unfilled}.")


def model_from_hf_tensors(
    hf_config: Mapping[str, Any],
    tensors: Mapping[str, Any],
    *,
    dtype=jnp.float32,
    compute_dtype=None,
    source: str = "the given tensors",
    quantize: str = "none",
    **config_overrides,
) -> tuple[LlamaForCausalLM, ModelConfig]:
  """Builds a :class:`LlamaForCausalLM` from a ``config.json`` dict and Hugging Face tensors.

  Args:
    hf_config: the Hugging Face ``config.json`` dict (``model_type`` llama or qwen2).
    tensors: ``{hf_name: array}`` in torch layout (NumPy or anything ``jnp.asarray`` takes); a
      lazy mapping is read one tensor at a time.
    dtype, compute_dtype, quantize, **config_overrides: as in :func:`load_hf_model`.
    source: how error messages name where the tensors came from.

  Returns:
    ``(model, config)``.

  Raises:
    KeyError: a tensor the architecture needs is missing.
    ValueError: a tensor has the wrong shape, there are tensors the architecture does not have,
      or the model_type is unsupported.
  """
  config = ModelConfig.from_hf_config(
      hf_config,
      param_dtype=dtype,
      dtype=dtype if compute_dtype is None else compute_dtype,
      **config_overrides,
  )
  check_mode(quantize)
  _check_tensor_names(config, tensors.keys(), source, "its config")
  table = hf_param_table(config)
  for entry in table:
    if entry.hf_key not in tensors:
      raise KeyError(f"Tensor {entry.hf_key!r} not found in {source}.")
  model = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
  # a quantising load reads large tensors a block of rows at a time where the mapping can
  # (GGUFTensors.streamed): no whole float32 copy of the output matrix
  streamed = getattr(tensors, "streamed", None) if quantize != "none" else None
  for entry in table:
    array = streamed(entry.hf_key) if streamed else tensors[entry.hf_key]
    check_shape(entry, tuple(array.shape), source)
    set_tensor(model, entry, array, dtype, quantize)
    del array
  check_filled(model)
  return model, config


def load_hf_model(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    compute_dtype=None,
    quantize: str = "none",
    **config_overrides,
) -> tuple[LlamaForCausalLM, ModelConfig]:
  """Loads a local Hugging Face LLaMA / Qwen2 checkpoint into a :class:`LlamaForCausalLM`.

  Args:
    path: directory with ``config.json`` and ``model.safetensors`` or sharded safetensors files
      with ``model.safetensors.index.json``; or a ``.gguf`` file (LLaMA / Qwen2, see
      :func:`anlr_jax.models.gguf.read_gguf`), dequantised one tensor at a time.
    dtype: parameter dtype (checkpoint tensors are cast to it).
    compute_dtype: activation dtype; defaults to ``dtype``.
    quantize: ``'none'``, or ``'int8'`` / ``'nf4'``: every linear layer's weight (the output
      matrix too) and the embedding table are quantised as they are read
      (:mod:`anlr_jax.nn.quant`); a GGUF file's blocks are dequantised to float32 and quantised
      again, a large matrix a block of rows at a time (``GGUFTensors.streamed``).
    **config_overrides: other :class:`ModelConfig` fields, e.g. ``attention_impl='cudnn'``,
      ``remat=True``.

  Returns:
    ``(model, config)``.

  Raises:
    FileNotFoundError: ``config.json`` or the weight files are missing.
    KeyError: a tensor the architecture needs is not in the checkpoint.
    ValueError: a tensor has the wrong shape, the checkpoint holds tensors the architecture does
      not have, or the model_type is unsupported (for GGUF files see ``read_gguf``).
  """
  path = os.fspath(path)
  check_mode(quantize)
  if is_gguf(path):
    hf_config, tensors = read_gguf(path, lazy=True)
    return model_from_hf_tensors(
        hf_config,
        tensors,
        dtype=dtype,
        compute_dtype=compute_dtype,
        source=path,
        quantize=quantize,
        **config_overrides,
    )
  config_path = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"No {CONFIG_FILE} found at {config_path}.")
  config = ModelConfig.from_pretrained(
      path,
      param_dtype=dtype,
      dtype=dtype if compute_dtype is None else compute_dtype,
      **config_overrides,
  )
  weight_map = shard_weight_map(path)
  _check_tensor_names(config, weight_map, path, config_path)
  table = hf_param_table(config)

  model = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
  by_file: dict[str, list[ParamEntry]] = {}
  for entry in table:
    if entry.hf_key not in weight_map:
      files = sorted(set(weight_map.values())) or [SINGLE_FILE]
      raise KeyError(
          f"Tensor {entry.hf_key!r} not found in {os.path.join(path, files[0])}"
          f"{f' (or the other {len(files) - 1} shards)' if len(files) > 1 else ''}."
      )
    by_file.setdefault(weight_map[entry.hf_key], []).append(entry)

  for file, entries in by_file.items():
    file_path = os.path.join(path, file)
    with safe_open(file_path, framework="numpy") as f:
      keys = set(f.keys())
      for entry in entries:
        if entry.hf_key not in keys:
          raise KeyError(f"Tensor {entry.hf_key!r} not found in {file_path}.")
        check_shape(entry, tuple(f.get_slice(entry.hf_key).get_shape()), file_path)
        set_tensor(model, entry, f.get_tensor(entry.hf_key), dtype, quantize)
  check_filled(model)
  return model, config


# --------------------------------------------------------------------------------------------------
# Saving


def torch_layout_tensor(
    model: LlamaForCausalLM, entry: ParamEntry, merge_lora: bool, dtype
) -> np.ndarray:
  """The checkpoint tensor of ``entry`` as a contiguous NumPy array in torch layout."""
  module = tensor_submodule(model, entry.module_path)
  if is_lora_wrapper(module):
    if merge_lora and entry.attr == "kernel":
      if not hasattr(module, "merged_kernel"):
        raise AttributeError(
            f"LoRA wrapper at {'.'.join(map(str, entry.module_path))} has no "
            "merged_kernel() method; save with merge_lora=False."
        )
      value = module.merged_kernel()
    else:
      value = getattr(module.base, entry.attr)[...]
  else:
    value = getattr(module, entry.attr)[...]
  value = np.asarray(jax.device_get(value))
  if dtype is not None:
    value = value.astype(jnp.dtype(dtype))
  if value.shape != (entry.hf_shape[::-1] if entry.transpose else entry.hf_shape):
    raise ValueError(
        f"Model tensor for {entry.hf_key!r} has shape {value.shape}; its config "
        f"expects {entry.hf_shape} in HF layout."
    )
  return np.ascontiguousarray(value.T if entry.transpose else value)


def save_hf_model(
    model: LlamaForCausalLM,
    config: ModelConfig,
    out_dir: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    merge_lora: bool = True,
    dtype=None,
) -> list[str]:
  """Writes ``config.json`` and safetensors weights that transformers can load.

  Args:
    model: the model (LoRA-wrapped projections allowed, see the module docstring).
    config: its config.
    out_dir: output directory (created if needed).
    max_shard_size: largest shard in bytes (int or e.g. ``"200MB"``); more than one shard adds
      ``model.safetensors.index.json``.
    merge_lora: save LoRA-wrapped projections as ``base + merged delta`` via ``merged_kernel()``;
      False saves their frozen base weights.
    dtype: dtype of the saved tensors; defaults to each parameter's own dtype.

  Returns:
    The written safetensors file names.
  """
  return write_param_table(
      model, config, hf_param_table(config), out_dir, max_shard_size, merge_lora, dtype
  )


def write_param_table(
    model, config, table, out_dir, max_shard_size, merge_lora, dtype
) -> list[str]:
  """Writes ``config.json`` (``config.to_hf_config()``) and the tensors of the parameter ``table``
  (its ``hf_key`` / ``hf_shape`` layout) as safetensors shards: :func:`save_hf_model` and the
  other model families' savers. Returns the file names."""
  out_dir = os.fspath(out_dir)
  parse_size(max_shard_size)  # a bad size fails before anything is written
  os.makedirs(out_dir, exist_ok=True)
  entries = {entry.hf_key: entry for entry in table}
  sizes = {}
  for key, entry in entries.items():
    module = tensor_submodule(model, entry.module_path)
    variable = getattr(module.base if is_lora_wrapper(module) else module, entry.attr)
    itemsize = jnp.dtype(dtype if dtype is not None else variable.get_value().dtype).itemsize
    sizes[key] = math.prod(entry.hf_shape) * itemsize
  names = write_safetensors_shards(
      out_dir,
      sizes,
      lambda keys: {k: torch_layout_tensor(model, entries[k], merge_lora, dtype) for k in keys},
      max_shard_size,
  )
  hf_config = config.to_hf_config()
  if dtype is not None:
    hf_config["torch_dtype"] = hf_config["dtype"] = str(jnp.dtype(dtype))
  with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
    json.dump(hf_config, f, indent=2)
  return names


def load_tokenizer(path: str | os.PathLike):
  """``transformers.AutoTokenizer.from_pretrained(path)`` for a local directory or ``.gguf`` file.

  A ``.gguf`` file's tokenizer is built by transformers from its metadata
  (:func:`anlr_jax.models.gguf.load_gguf_tokenizer`).

  Raises:
    FileNotFoundError: ``path`` holds none of ``tokenizer.json``, ``tokenizer.model``,
      ``vocab.json`` or ``tokenizer_config.json`` (or the ``.gguf`` file does not exist).
  """
  path = os.fspath(path)
  if is_gguf(path):
    return load_gguf_tokenizer(path)
  if not os.path.isdir(path) or not any(
      os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES
  ):
    raise FileNotFoundError(f"No tokenizer files ({', '.join(TOKENIZER_FILES)}) found in {path}.")
  if _plain_fast_tokenizer(path):
    # The class AutoTokenizer would build, without importing transformers' auto classes (which
    # import torch: seconds at every start of the command line).
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
  import transformers

  return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def _plain_fast_tokenizer(path: str) -> bool:
  """Whether ``path`` holds a ``tokenizer.json`` whose ``tokenizer_config.json`` names the plain
  fast tokenizer class (no model-specific subclass)."""
  config = os.path.join(path, "tokenizer_config.json")
  if not os.path.isfile(os.path.join(path, "tokenizer.json")) or not os.path.isfile(config):
    return False
  try:
    with open(config, encoding="utf-8") as f:
      name = json.load(f).get("tokenizer_class")
  except (OSError, ValueError, AttributeError):
    return False
  return name in ("TokenizersBackend", "PreTrainedTokenizerFast")

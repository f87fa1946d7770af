r"""GGUF (llama.cpp) checkpoints of LLaMA and Qwen2 models, read into Hugging Face form.

A GGUF file holds the model's hyperparameters as metadata (``llama.block_count``, ...), the
tokenizer (``tokenizer.ggml.*``) and the tensors under llama.cpp's names, each stored in one GGML
type (float, or block-quantised such as Q4_K). :func:`read_gguf` turns it into what a Hugging Face
checkpoint holds, a ``config.json`` dict and float32 tensors in torch layout ``(out, in)``:

    token_embd.weight        -> model.embed_tokens.weight
    blk.<i>.attn_norm.weight -> model.layers.<i>.input_layernorm.weight
    blk.<i>.attn_<q,k,v>.<weight,bias> -> model.layers.<i>.self_attn.<q,k,v>_proj.<weight,bias>
    blk.<i>.attn_output.weight -> model.layers.<i>.self_attn.o_proj.weight
    blk.<i>.ffn_norm.weight  -> model.layers.<i>.post_attention_layernorm.weight
    blk.<i>.ffn_<gate,up,down>.weight -> model.layers.<i>.mlp.<gate,up,down>_proj.weight
    output_norm.weight       -> model.norm.weight
    output.weight            -> lm_head.weight   (absent: the embeddings are tied)

Quantised tensors are dequantised with ``gguf.quants.dequantize``. For LLaMA, llama.cpp's converter
reorders the rows of ``q_proj`` and ``k_proj`` (weights and biases) within each head for its RoPE
layout, which rotates adjacent pairs ``(x_{2j}, x_{2j+1})`` where Hugging Face rotates halves
``(x_j, x_{j + D/2})``: with ``n`` heads (``n_kv`` for ``k_proj``) and head width ``D``, the stored
row ``h D + 2 j + c`` is the Hugging Face row ``h D + c D/2 + j`` (``c`` in {0, 1}). :func:`read_gguf`
undoes it. Qwen2 uses llama.cpp's NeoX RoPE, which already rotates halves, and is stored unpermuted.

LLaMA-3.1-style RoPE scaling is stored as a ``rope_freqs.weight`` tensor of per-frequency divisors
rather than as metadata; it is turned back into a ``rope_scaling`` of type ``llama3`` (checked to
reproduce every divisor) or rejected.

:func:`convert_gguf` writes the result as a Hugging Face checkpoint directory, tokenizer included.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np

from anlr_jax.models.config import ModelConfig
from anlr_jax.nn.quant import RowBlocks
from anlr_jax.models.hf_files import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    INDEX_FILE,
    parse_size,
    write_safetensors_shards,
)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
SUPPORTED_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
"""GGML tensor types :func:`read_gguf` dequantises (``gguf.GGMLQuantizationType`` names)."""

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    **{
        f"attn_{p}.{kind}": f"self_attn.{p}_proj.{kind}"
        for p in ("q", "k", "v")
        for kind in ("weight", "bias")
    },
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
_ROPE_FREQS = "rope_freqs.weight"
_REQUIRED = object()


def _hf_name(gguf_name: str) -> str | None:
  """The Hugging Face name of a llama.cpp tensor name, or None when it has none."""
  if gguf_name in _GLOBAL_TENSORS:
    return _GLOBAL_TENSORS[gguf_name]
  match = _LAYER_TENSOR.fullmatch(gguf_name)
  if match and match.group(2) in _LAYER_TENSORS:
    return f"model.layers.{int(match.group(1))}.{_LAYER_TENSORS[match.group(2)]}"
  return None


def _unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
  r"""Undoes llama.cpp's per-head row order of ``q_proj`` / ``k_proj`` (see the module docstring)."""
  rows = weight.shape[0]
  return (
      weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
      .swapaxes(1, 2)
      .reshape(weight.shape)
  )


class _Reader(gguf.GGUFReader):
  """``gguf.GGUFReader`` over a plain ndarray view of its memory map.

  The reader slices its ``np.memmap`` once per metadata item and tensor; every slice of a memmap
  runs ``memmap.__array_finalize__``, which made parsing a 49k-token vocabulary take seconds. The
  plain view reads the same mapped bytes (and keeps the map open) without that cost.
  """

  @property
  def data(self) -> np.ndarray:
    return self.__dict__.get("_plain_data")

  @data.setter
  def data(self, value: np.ndarray) -> None:
    if isinstance(value, np.memmap):
      self.__dict__["memmap"] = value  # the map itself: GGUFTensors gives its read pages back
      value = value.view(np.ndarray)
    self.__dict__["_plain_data"] = value


def _open(path: str) -> gguf.GGUFReader:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"No GGUF file found at {path}.")
  try:
    reader = _Reader(path, "r")
  except Exception as e:  # the reader fails in many ways (struct, reshape, enum) on a bad file
    raise ValueError(
        f"{path} is not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}"
    ) from e
  end = os.path.getsize(path)
  for tensor in reader.tensors:
    if tensor.data_offset + tensor.n_bytes > end or tensor.data.nbytes != tensor.n_bytes:
      raise ValueError(
          f"{path} is truncated or corrupt: tensor {tensor.name!r} needs bytes "
          f"{tensor.data_offset}..{tensor.data_offset + tensor.n_bytes}, the file has {end}."
      )
  return reader


def _metadata(reader: gguf.GGUFReader, key: str, path: str, default: Any = _REQUIRED) -> Any:
  """A scalar or string metadata value (float32 values as their shortest decimal)."""
  field = reader.get_field(key)
  if field is None:
    if default is _REQUIRED:
      raise ValueError(f"{path}: GGUF metadata {key!r} is missing.")
    return default
  kind = field.types[0]
  if kind == gguf.GGUFValueType.STRING:
    return bytes(field.parts[field.data[0]]).decode("utf-8")
  if kind == gguf.GGUFValueType.ARRAY:
    if field.types[-1] == gguf.GGUFValueType.STRING:
      return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    return [field.parts[i].item() for i in field.data]
  value = field.parts[field.data[0]].item()
  if kind == gguf.GGUFValueType.FLOAT32:
    value = float(str(np.float32(value)))  # 1e-05, not 9.999999747378752e-06
  return value


def _same_in_every_layer(value: Any, key: str, path: str) -> int:
  """``head_count`` / ``head_count_kv`` may be per-layer arrays; only uniform ones are supported."""
  if isinstance(value, list):
    if len(set(value)) != 1:
      raise ValueError(f"{path}: {key} differs between layers ({value}); not supported.")
    value = value[0]
  return int(value)


def _llama3_rope_scaling(
    divisors: np.ndarray, rope_theta: float, head_dim: int, path: str
) -> dict[str, Any] | None:
  r"""The ``llama3`` ``rope_scaling`` whose per-frequency divisors are ``divisors``, or None (all 1).

  llama.cpp divides ``f_i = theta^{-2i/D}`` by ``r_i``: ``1`` for wavelengths ``w_i < C/h``, the
  factor ``s`` for ``w_i > C/l``, and ``1 / ((1 - m) / s + m)`` in between with
  ``m = (C / w_i - l) / (h - l)``. Only the two wavelength thresholds ``C/l``, ``C/h`` are fixed by
  the divisors, so ``l = 1`` is taken (Meta's value) and ``C, h`` are fitted from the in-between
  divisors (``m`` is linear in ``1/w_i``), falling back to Meta's ``C = 8192, h = 4``. The result
  must reproduce every divisor.
  """
  divisors = np.asarray(divisors, dtype=np.float64)
  if divisors.shape != (head_dim // 2,):
    raise ValueError(
        f"{path}: {_ROPE_FREQS} has shape {divisors.shape}, expected ({head_dim // 2},)."
    )
  if np.allclose(divisors, 1.0, rtol=0, atol=1e-6):
    return None
  factor = float(divisors.max())
  inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  wavelen = 2 * math.pi / inv_freq
  candidates = []
  middle = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
  if middle.sum() >= 2 and factor > 1:
    smooth = (1 / divisors[middle] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(1 / wavelen[middle], smooth, 1)
    if intercept < 0:
      high = 1 - 1 / intercept
      context = -slope / intercept
      if abs(context - round(context)) < 1e-3 * context:
        context = round(context)
      candidates.append((float(f"{high:.6g}"), context))
  candidates.append((4.0, 8192))
  plain = dict(
      vocab_size=1,
      hidden_size=head_dim,
      intermediate_size=1,
      num_hidden_layers=1,
      num_attention_heads=1,
      num_key_value_heads=1,
      rope_theta=rope_theta,
  )
  unscaled = ModelConfig(**plain).rope_inv_freq()
  for high, context in candidates:
    scaling = {
        "rope_type": "llama3",
        "factor": float(f"{factor:.6g}"),
        "low_freq_factor": 1.0,
        "high_freq_factor": high,
        "original_max_position_embeddings": context,
    }
    try:
      scaled = ModelConfig(**plain, rope_scaling=scaling).rope_inv_freq()
    except ValueError:
      continue
    if np.allclose(unscaled / scaled, divisors, rtol=1e-4, atol=0):
      return scaling
  raise ValueError(
      f"{path}: {_ROPE_FREQS} (per-frequency RoPE divisors {np.round(divisors, 4).tolist()}) "
      "does not match any llama3 rope_scaling; such RoPE scaling is not supported."
  )


DEQUANTIZE_CHUNK_BYTES = 64 << 20
"""Float32 bytes dequantised per call when a quantised tensor is read (a block of its rows): the
``gguf`` package's NumPy dequantisation holds several temporaries of its output's size, which for
a whole 151,936 x 1536 output matrix are gigabytes."""


def _dequantize_rows(data: np.ndarray, kind) -> np.ndarray:
  """The float32 values of a quantised tensor's ``(rows, bytes per row)`` data, a block of rows
  (:data:`DEQUANTIZE_CHUNK_BYTES` of output) at a time; equal to one call on the whole."""
  if data.ndim != 2:
    return gguf.quants.dequantize(data, kind).astype(np.float32, copy=False)
  first = gguf.quants.dequantize(data[:1], kind)
  out = np.empty((data.shape[0], first.shape[-1]), np.float32)
  step = max(1, DEQUANTIZE_CHUNK_BYTES // (4 * first.shape[-1]))
  for start in range(0, data.shape[0], step):
    out[start : start + step] = gguf.quants.dequantize(data[start : start + step], kind)
  return out


class GGUFTensors(Mapping):
  """The tensors of a GGUF file by Hugging Face name, dequantised (float32) when looked up.

  ``shape(name)`` gives a tensor's Hugging Face shape without reading it.
  """

  def __init__(self, path: str, reader: gguf.GGUFReader, tensors: dict, heads: dict[str, int]):
    self.path = path
    self._reader = reader
    self._tensors = tensors  # hf name -> gguf ReaderTensor
    self._heads = heads  # hf name -> heads whose rows llama.cpp permuted

  def __getitem__(self, name: str) -> np.ndarray:
    tensor = self._tensors[name]
    kind = gguf.GGMLQuantizationType(tensor.tensor_type)
    if kind == gguf.GGMLQuantizationType.F32:
      array = np.array(tensor.data, dtype=np.float32)  # a copy: not a view of the memory map
    else:
      array = _dequantize_rows(tensor.data, kind)
    self._drop_pages(tensor.data)
    array = array.reshape(self.shape(name))
    if name in self._heads:
      array = _unpermute_rows(array, self._heads[name])
    return array

  def streamed(self, name: str) -> np.ndarray | RowBlocks:
    """Tensor ``name`` as :meth:`__getitem__` gives it, except that a quantised matrix of more
    than :data:`DEQUANTIZE_CHUNK_BYTES` in float32 (and in Hugging Face row order as stored) comes
    as :class:`~anlr_jax.nn.quant.RowBlocks`, dequantised a block of rows at a time when read: a
    quantising loader (``model.quantize``) never holds its float32 values whole."""
    tensor = self._tensors[name]
    kind = gguf.GGMLQuantizationType(tensor.tensor_type)
    shape = self.shape(name)
    small = len(shape) != 2 or 4 * math.prod(shape) <= DEQUANTIZE_CHUNK_BYTES
    if small or kind == gguf.GGMLQuantizationType.F32 or name in self._heads:
      return self[name]
    data = tensor.data.reshape(shape[0], -1)

    def read(start: int, stop: int) -> np.ndarray:
      rows = _dequantize_rows(data[start:stop], kind)
      self._drop_pages(data[start:stop])
      return rows

    return RowBlocks(shape, read)

  def _drop_pages(self, data: np.ndarray) -> None:
    """Lets the kernel take back the pages of the memory-mapped file that ``data`` (a view of it,
    already read) lies on: they stay in the page cache, but no longer count in this process's
    resident memory, which otherwise grows by the whole file while a model loads."""
    whole = getattr(self._reader, "memmap", None)
    mapping = getattr(whole, "_mmap", None)
    if mapping is None or getattr(whole, "mode", None) != "r" or not hasattr(mapping, "madvise"):
      return
    start = data.__array_interface__["data"][0] - whole.__array_interface__["data"][0]
    if not data.flags.c_contiguous or start < 0 or start + data.nbytes > whole.nbytes:
      return
    first = start // mmap.PAGESIZE * mmap.PAGESIZE
    try:
      mapping.madvise(mmap.MADV_DONTNEED, first, start + data.nbytes - first)
    except (OSError, ValueError):  # advice only: reading works the same without it
      pass

  def __iter__(self) -> Iterator[str]:
    return iter(self._tensors)

  def __len__(self) -> int:
    return len(self._tensors)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(self._tensors[name].shape.tolist()))


def read_gguf(
    path: str | os.PathLike, *, lazy: bool = False
) -> tuple[dict[str, Any], Mapping[str, np.ndarray]]:
  r"""Reads a LLaMA or Qwen2 GGUF file as a Hugging Face config and tensors.

  Args:
    path: the ``.gguf`` file.
    lazy: return the tensors as a :class:`GGUFTensors` mapping that dequantises each one when it is
      looked up (one tensor in host memory at a time) instead of a dict of all of them.

  Returns:
    ``(hf_config, tensors)``: the ``config.json`` dict transformers reads (``model_type`` ``llama``
    or ``qwen2``, sizes, RoPE, ``tie_word_embeddings`` when there is no ``output.weight``,
    ``bos/eos/pad_token_id`` when the file gives them) and ``{hf_name: float32 array}`` in torch
    layout, q/k rows back in Hugging Face order.

  Raises:
    FileNotFoundError: ``path`` is not a file.
    ValueError: the file is truncated or not GGUF, its architecture is not llama / qwen2, metadata
      is missing or unsupported (e.g. RoPE scaling other than llama3), a tensor has no Hugging
      Face counterpart, or a tensor's GGML type is not in :data:`SUPPORTED_TENSOR_TYPES`.
  """
  path = os.fspath(path)
  reader = _open(path)
  arch = _metadata(reader, "general.architecture", path)
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(
        f"GGUF architecture {arch!r} is not supported; supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)} (file {path})."
    )
  if _metadata(reader, f"{arch}.expert_count", path, 0):
    raise ValueError(f"{path}: mixture-of-experts {arch} GGUF files are not supported.")

  by_name = {t.name: t for t in reader.tensors}
  tensors, unknown = {}, []
  for name, tensor in by_name.items():
    hf_name = _hf_name(name)
    if hf_name is not None:
      tensors[hf_name] = tensor
    elif name != _ROPE_FREQS:
      unknown.append(name)
  if unknown:
    raise ValueError(
        f"{path}: tensors {unknown[:8]}{' ...' if len(unknown) > 8 else ''} have no counterpart "
        f"in a Hugging Face {arch} model."
    )
  for tensor in tensors.values():
    kind = gguf.GGMLQuantizationType(tensor.tensor_type).name
    if kind not in SUPPORTED_TENSOR_TYPES:
      raise ValueError(
          f"{path}: tensor {tensor.name!r} has GGML type {kind}, which is not supported; "
          f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}."
      )
  if "token_embd.weight" not in by_name:
    raise ValueError(f"{path}: tensor 'token_embd.weight' is missing.")

  def meta(key, default=_REQUIRED):
    return _metadata(reader, f"{arch}.{key}", path, default)

  hidden = int(meta("embedding_length"))
  heads = _same_in_every_layer(meta("attention.head_count"), "attention.head_count", path)
  kv_heads = _same_in_every_layer(
      meta("attention.head_count_kv", heads), "attention.head_count_kv", path
  )
  head_dim = meta("attention.key_length", None)
  if head_dim is not None and meta("attention.value_length", head_dim) != head_dim:
    raise ValueError(f"{path}: attention.key_length differs from value_length; not supported.")
  rope_dim = meta("rope.dimension_count", None)
  head_dim = int(head_dim or rope_dim or hidden // max(heads, 1))
  if rope_dim is not None and rope_dim != head_dim:
    raise ValueError(
        f"{path}: RoPE on {rope_dim} of {head_dim} head dimensions (partial rotary) is not "
        "supported."
    )
  scaling_type = meta("rope.scaling.type", "none")
  if scaling_type not in ("none", ""):
    raise ValueError(f"{path}: RoPE scaling type {scaling_type!r} is not supported.")
  rope_theta = float(meta("rope.freq_base", 10000.0))
  rope_scaling = None
  if _ROPE_FREQS in by_name:
    rope_scaling = _llama3_rope_scaling(
        gguf.quants.dequantize(by_name[_ROPE_FREQS].data, by_name[_ROPE_FREQS].tensor_type),
        rope_theta,
        head_dim,
        path,
    )
  try:
    config = ModelConfig(
        vocab_size=int(by_name["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in by_name,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in by_name,
        model_type=arch,
    )
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from e
  hf_config = config.to_hf_config()
  for key, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
    token_id = _metadata(reader, f"tokenizer.ggml.{gguf_key}_token_id", path, None)
    if token_id is not None:
      hf_config[f"{key}_token_id"] = int(token_id)

  permuted = {}
  if arch == "llama":  # Qwen2 (NeoX RoPE in llama.cpp) is stored as it is
    for hf_name in tensors:
      if ".self_attn.q_proj." in hf_name:
        permuted[hf_name] = heads
      elif ".self_attn.k_proj." in hf_name:
        permuted[hf_name] = kv_heads
  for hf_name, n_head in permuted.items():
    rows = int(tensors[hf_name].shape[-1])
    if rows % (2 * n_head):
      raise ValueError(
          f"{path}: tensor {tensors[hf_name].name!r} has {rows} rows, not a multiple of "
          f"2 x {n_head} heads."
      )
  lazy_tensors = GGUFTensors(path, reader, tensors, permuted)
  if lazy:
    return hf_config, lazy_tensors
  return hf_config, {name: lazy_tensors[name] for name in lazy_tensors}


def _has_tokenizer(path: str) -> bool:
  return _open(path).get_field("tokenizer.ggml.tokens") is not None


def load_gguf_tokenizer(path: str | os.PathLike):
  """The tokenizer a GGUF file describes, built by transformers from its ``tokenizer.ggml.*``.

  Raises:
    FileNotFoundError: ``path`` is not a file.
    ValueError: the file is not readable GGUF or holds no tokenizer.
  """
  import transformers

  path = os.fspath(path)
  if not _has_tokenizer(path):
    raise ValueError(f"{path} holds no tokenizer (no 'tokenizer.ggml.tokens' metadata).")
  directory, name = os.path.split(os.path.abspath(path))
  return transformers.AutoTokenizer.from_pretrained(
      directory, gguf_file=name, local_files_only=True
  )


def convert_gguf(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype="float32",
    max_shard_size: int | str = "5GB",
    tokenizer: bool = True,
) -> list[str]:
  r"""Writes a LLaMA / Qwen2 GGUF file as a Hugging Face checkpoint directory.

  Writes ``config.json``, ``model.safetensors`` (or shards with ``model.safetensors.index.json``),
  ``generation_config.json`` when the file gives a bos or eos token id (``eos_token_id`` lists
  the end-of-turn token too when the file has a distinct one), and, when the file holds a
  tokenizer and ``tokenizer`` is True, the tokenizer files (chat template included) built by
  ``transformers.AutoTokenizer.from_pretrained(..., gguf_file=...)``.

  Args:
    path: the ``.gguf`` file.
    out_dir: output directory (created if needed).
    dtype: dtype of the saved weights; ``float32`` keeps the dequantised values exactly.
    max_shard_size: largest safetensors file, in bytes or e.g. ``"2GB"``.
    tokenizer: also write the tokenizer.

  Returns:
    The names of the files written to ``out_dir``.
  """
  path, out_dir = os.fspath(path), os.fspath(out_dir)
  parse_size(max_shard_size)  # a bad size fails before the file is read
  try:
    dtype = jnp.dtype(dtype)
  except TypeError as e:
    raise ValueError(f"dtype={dtype!r} is not a dtype.") from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"dtype must be a floating dtype, got {dtype}.")
  hf_config, tensors = read_gguf(path, lazy=True)
  os.makedirs(out_dir, exist_ok=True)
  sizes = {name: math.prod(tensors.shape(name)) * dtype.itemsize for name in tensors}
  written = write_safetensors_shards(
      out_dir,
      sizes,
      lambda names: {n: np.ascontiguousarray(tensors[n].astype(dtype)) for n in names},
      max_shard_size,
  )
  if len(written) > 1:
    written.append(INDEX_FILE)

  hf_config["torch_dtype"] = hf_config["dtype"] = str(dtype)
  with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
    json.dump(hf_config, f, indent=2)
  written.append(CONFIG_FILE)

  reader = tensors._reader
  generation = {
      k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf_config
  }
  eot = _metadata(reader, "tokenizer.ggml.eot_token_id", path, None)
  if eot is not None and "eos_token_id" in generation and eot != generation["eos_token_id"]:
    generation["eos_token_id"] = [generation["eos_token_id"], int(eot)]
  if "bos_token_id" in generation or "eos_token_id" in generation:
    with open(os.path.join(out_dir, GENERATION_CONFIG_FILE), "w") as f:
      json.dump(generation, f, indent=2)
    written.append(GENERATION_CONFIG_FILE)

  if tokenizer and reader.get_field("tokenizer.ggml.tokens") is not None:
    before = set(os.listdir(out_dir))
    load_gguf_tokenizer(path).save_pretrained(out_dir)
    written += sorted(set(os.listdir(out_dir)) - before)
  return written

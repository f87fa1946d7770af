"""The files of a Hugging Face checkpoint directory: their names, shard sizes and the shard writer.

Shared by :mod:`anlr_jax.models.hf_io` (save a model) and :mod:`anlr_jax.models.gguf` (convert a
GGUF file); neither imports the other for these. :func:`read_hf_config` is the one reader of a
checkpoint's ``config.json`` (LLaMA / Qwen2 and LLaVA configs alike).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from safetensors.numpy import save_file

from anlr_jax import fileio

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")

_SIZE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def read_hf_config(path: str | os.PathLike) -> dict:
  """The ``config.json`` of the checkpoint directory ``path`` (or ``path`` itself when it is a
  file): a JSON object.

  Raises:
    FileNotFoundError: no such file. ValueError: not JSON (names the file and line) or not an
      object.
  """
  path = os.fspath(path)
  file = path if os.path.isfile(path) else os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(file):
    raise FileNotFoundError(f"No {CONFIG_FILE} found at {file}.")
  return fileio.read_json(file, dict, what="a JSON object (the model's settings)")


def is_gguf(path: str) -> bool:
  """Whether ``path`` names a GGUF file (by its extension)."""
  return path.lower().endswith(".gguf")


def parse_size(size: int | str) -> int:
  """Bytes from an int or a string such as ``"5GB"`` / ``"200MiB"``.

  Raises:
    ValueError: not a size, or not positive (the message names ``max_shard_size``).
  """
  if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
    value = int(size)
  else:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(size))
    unit = match.group(2).upper() if match else ""
    if not match or (unit or "B") not in _SIZE_UNITS:
      raise ValueError(f"max_shard_size={size!r} is not a size such as 5000000 or '5GB'.")
    value = int(float(match.group(1)) * _SIZE_UNITS[unit or "B"])
  if value <= 0:
    raise ValueError(f"max_shard_size must be positive, got {size!r}.")
  return value


def write_safetensors_shards(
    out_dir: str,
    sizes: Mapping[str, int],
    tensors_of: Callable[[Sequence[str]], Mapping[str, np.ndarray]],
    max_shard_size: int | str,
) -> list[str]:
  """Writes tensors in checkpoint order as ``model.safetensors`` or numbered shards plus an index.

  Tensors are grouped in the order of ``sizes`` so that no shard exceeds ``max_shard_size`` bytes
  (a single tensor larger than that gets a shard of its own); each shard's arrays are made only when
  it is written (``tensors_of(names)``) and dropped after, so at most one shard is in memory.

  Args:
    out_dir: an existing directory.
    sizes: tensor name -> its size in bytes as saved, in the order to write them.
    tensors_of: names -> ``{name: contiguous array}`` for those names.
    max_shard_size: the largest shard, in bytes or e.g. ``"5GB"``.

  Returns:
    The safetensors file names written (with more than one, :data:`INDEX_FILE` is written too).
  """
  limit = parse_size(max_shard_size)
  shards: list[list[str]] = [[]]
  shard_bytes = 0
  for name, size in sizes.items():
    if shards[-1] and shard_bytes + size > limit:
      shards.append([])
      shard_bytes = 0
    shards[-1].append(name)
    shard_bytes += size
  n = len(shards)
  files = (
      [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
  )
  for file, names in zip(files, shards):
    arrays = dict(tensors_of(names))
    save_file(arrays, os.path.join(out_dir, file), metadata={"format": "pt"})
    del arrays
  if n == 1:
    return files
  weight_map = {name: file for file, names in zip(files, shards) for name in names}
  index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
  with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
    json.dump(index, f, indent=2)
  return files

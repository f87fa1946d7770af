"""Per-module AnLR diagnostics on disk: one ``<run_dir>/diagnostics/step_<t>.npz`` per snapshot.

:func:`diagnostics_from_tree` splits :func:`anlr_jax.diagnostics`' tree into per-module and
run-level arrays, :func:`write_diagnostics` writes a snapshot atomically, :func:`read_diagnostics`
reads one back (:class:`DiagnosticsSnapshot`), :func:`diagnostics_steps` lists them and
:func:`remove_diagnostics_after` drops those of a run resumed at an earlier step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from anlr_jax.fileio import atomic_write
from anlr_jax.optim.diagnostics import DIAG_MODULES
from anlr_jax.rundir import DIAGNOSTICS_DIR

__all__ = [
    "DIAG_MAGNITUDES",
    "DIAG_MODULES",
    "PER_RANK_FIELDS",
    "DiagnosticsSnapshot",
    "diagnostics_from_tree",
    "diagnostics_path",
    "diagnostics_steps",
    "read_diagnostics",
    "remove_diagnostics_after",
    "write_diagnostics",
]

DIAG_MAGNITUDES = "magnitudes"
"""Key of the per-rank contribution magnitudes ``{module: (..., r)}`` the trainer adds to that tree;
stored as the module field of the same name."""
PER_RANK_FIELDS = ("nu_bar", "snr", "multipliers", DIAG_MAGNITUDES)
"""The per-rank ``(..., r)`` fields of a module in a snapshot (``magnitudes`` is optional)."""

_DIAG_PREFIX, _DIAG_SUFFIX = "step_", ".npz"
_DIAG_INDEX = "__index__"  # JSON: {"format", "step", "modules": {module: {field: key}}, "summary"}
_DIAG_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class DiagnosticsSnapshot:
  """One diagnostics file read back.

  Attributes:
    step: the update step it was taken after.
    modules: ``{module name: {field: array}}`` (``nu_bar``, ``snr``, ``multipliers`` of shape
      ``(..., r)``, optionally ``magnitudes``, and scalar summaries such as ``velocity_cv``).
    summary: run-level arrays, ``{name: array}`` (e.g. ``mean/velocity_cv``, ``count``).
  """

  step: int
  modules: dict[str, dict[str, np.ndarray]]
  summary: dict[str, np.ndarray]


def diagnostics_path(run_dir: str, step: int) -> str:
  """``<run_dir>/diagnostics/step_<step:08d>.npz``."""
  return os.path.join(run_dir, DIAGNOSTICS_DIR, f"{_DIAG_PREFIX}{step:08d}{_DIAG_SUFFIX}")


def diagnostics_steps(run_dir: str) -> list[int]:
  """The steps of the diagnostics snapshots in ``run_dir``, ascending (empty without any)."""
  folder = os.path.join(run_dir, DIAGNOSTICS_DIR)
  if not os.path.isdir(folder):
    return []
  steps = []
  for name in os.listdir(folder):
    if name.startswith(_DIAG_PREFIX) and name.endswith(_DIAG_SUFFIX):
      digits = name[len(_DIAG_PREFIX) : -len(_DIAG_SUFFIX)]
      if digits.isdigit():
        steps.append(int(digits))
  return sorted(steps)


def _flatten_summary(tree: Any, keys: tuple[str, ...], out: dict[str, np.ndarray]) -> None:
  if isinstance(tree, Mapping):
    for key, value in tree.items():
      _flatten_summary(value, keys + (str(key),), out)
  elif tree is not None:
    out["/".join(keys)] = np.asarray(tree)


def diagnostics_from_tree(
    tree: Mapping[str, Any],
) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
  """Splits a host diagnostics tree into ``(modules, summary)`` for :func:`write_diagnostics`.

  ``tree`` is :func:`anlr_jax.diagnostics`' output (``{"modules": {module: {field: array}},
  "mean": {...}, "count": ...}``), optionally with ``"magnitudes": {module: array}`` (stored as the
  module field ``magnitudes``). Every other entry is run-level: nested keys are joined with ``/``
  (``mean/velocity_cv``).
  """
  modules: dict[str, dict[str, np.ndarray]] = {}
  for name, fields in (tree.get(DIAG_MODULES) or {}).items():
    modules[name] = {field: np.asarray(value) for field, value in fields.items()}
  for name, value in (tree.get(DIAG_MAGNITUDES) or {}).items():
    modules.setdefault(name, {})[DIAG_MAGNITUDES] = np.asarray(value)
  summary: dict[str, np.ndarray] = {}
  for key, value in tree.items():
    if key not in (DIAG_MODULES, DIAG_MAGNITUDES):
      _flatten_summary(value, (str(key),), summary)
  return modules, summary


def write_diagnostics(
    run_dir: str,
    step: int,
    modules: Mapping[str, Mapping[str, Any]],
    summary: Mapping[str, Any] | None = None,
) -> str:
  """Writes one diagnostics snapshot, ``<run_dir>/diagnostics/step_<step>.npz``, atomically.

  Args:
    run_dir: the run directory.
    step: the update step of the snapshot.
    modules: ``{module name: {field: array}}``; names and fields are any strings.
    summary: run-level ``{name: array}``.

  Returns:
    The file's path. Its arrays are stored under opaque keys (``<field>.<module index>``) listed in
    a JSON index together with their module and field, so :func:`read_diagnostics` never parses a
    key.
  """
  arrays: dict[str, np.ndarray] = {}
  index: dict[str, Any] = {"format": _DIAG_FORMAT, "step": int(step), "modules": {}, "summary": {}}
  for i, (name, fields) in enumerate(modules.items()):
    index["modules"][name] = {}
    for field, value in fields.items():
      key = f"{field}.{i}"
      arrays[key] = np.asarray(value)
      index["modules"][name][field] = key
  for j, (name, value) in enumerate((summary or {}).items()):
    key = f"summary.{j}"
    arrays[key] = np.asarray(value)
    index["summary"][name] = key
  arrays[_DIAG_INDEX] = np.asarray(json.dumps(index))
  path = diagnostics_path(run_dir, step)
  with atomic_write(path, "wb") as f:
    np.savez(f, **arrays)
  return path


def read_diagnostics(path: str) -> DiagnosticsSnapshot:
  """Reads a :func:`write_diagnostics` file.

  Raises:
    FileNotFoundError: no such file.
    ValueError: not a diagnostics file of this format (the message names the file).
  """
  try:
    data = np.load(path, allow_pickle=False)
  except FileNotFoundError:
    raise
  except (OSError, EOFError, ValueError, zipfile.BadZipFile) as err:
    raise ValueError(f"{path}: not a readable .npz file ({err})") from None
  if not isinstance(data, np.lib.npyio.NpzFile):
    raise ValueError(f"{path}: a single array, not a diagnostics .npz file")
  with data:
    if _DIAG_INDEX not in data.files:
      raise ValueError(
          f"{path}: no {_DIAG_INDEX} entry: not a diagnostics file, or one written by an older"
          " anlr_jax (train again with trainer.diag_every=N to write them in this format)"
      )
    index = json.loads(str(data[_DIAG_INDEX]))
    if index.get("format") != _DIAG_FORMAT:
      raise ValueError(
          f"{path}: diagnostics format {index.get('format')!r}, this reader knows {_DIAG_FORMAT}"
      )
    modules = {
        name: {field: data[key] for field, key in fields.items()}
        for name, fields in index["modules"].items()
    }
    summary = {name: data[key] for name, key in index["summary"].items()}
  return DiagnosticsSnapshot(step=int(index["step"]), modules=modules, summary=summary)


def remove_diagnostics_after(run_dir: str, step: int) -> list[int]:
  """Deletes the snapshots taken after ``step`` (a run resumed at ``step``); returns their steps."""
  removed = [s for s in diagnostics_steps(run_dir) if s > step]
  for s in removed:
    os.remove(diagnostics_path(run_dir, s))
  return removed

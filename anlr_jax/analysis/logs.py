r"""Reads what ``anlr train`` leaves in a run directory, for :mod:`anlr_jax.analysis`.

File names, module names and the file formats are those of :mod:`anlr_jax.rundir`:

* ``diagnostics/step_<t>.npz`` (every ``trainer.diag_every`` steps, read with
  :func:`anlr_jax.train.diagnostics_io.read_diagnostics`): per module, ``nu_bar``, ``snr``,
  ``multipliers`` and optionally ``magnitudes`` (from :func:`anlr_jax.analysis.rank_magnitudes`), each ``(..., r)``.
  Leading batch axes (stacked layers) are split into separate modules named ``<module>[i]``.
* ``lora_final.safetensors``: ``<module>/lora_a (..., d_in, r)`` and ``<module>/lora_b (..., r, d_out)``
  (:func:`anlr_jax.naming.adapter_key`).
* ``results.json`` / ``config.yaml``: the run's label (its ``method``).

Module names are :func:`anlr_jax.naming.module_name` everywhere, so a module of the diagnostics and
the same module of ``lora_final`` have equal names.

Every missing input is recorded in :attr:`RunLogs.missing` as a message naming the file and how to get
it; the analysis draws what the remaining inputs allow.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

import numpy as np

from anlr_jax import naming, rundir
from anlr_jax.train import diagnostics_io
from anlr_jax.analysis.results import RunResult, read_results

__all__ = [
    'RunLogs',
    'load_run',
    'load_diagnostics',
    'load_lora',
    'split_batch_axes',
]

_FIELDS = ('nu_bar', 'snr', 'multipliers')
_SERIES = _FIELDS + (diagnostics_io.DIAG_MAGNITUDES,)
_LORA_A, _LORA_B = 'lora_a', 'lora_b'


@dataclasses.dataclass
class RunLogs:
  """Everything the analysis reads from one run directory (arrays are NumPy, float64).

  Attributes:
    run_dir: the directory.
    label: the run's ``method`` (from ``results.json``/``config.yaml``), else the directory name.
    steps: ``(T,)`` update steps of the diagnostic snapshots, ascending (empty without diagnostics).
    nu_bar, snr, multipliers: ``{module: (T, r)}`` per-rank trajectories.
    magnitudes: ``{module: (T, r)}`` per-rank contribution magnitudes, if the trainer logged them.
    lora: ``{module: (A (d_in, r), B (r, d_out))}`` from ``lora_final.safetensors``.
    results: ``results.json``, if any.
    missing: messages naming the missing inputs and how to produce them.
  """

  run_dir: str
  label: str
  steps: np.ndarray
  nu_bar: dict[str, np.ndarray]
  snr: dict[str, np.ndarray]
  multipliers: dict[str, np.ndarray]
  magnitudes: dict[str, np.ndarray]
  lora: dict[str, tuple[np.ndarray, np.ndarray]]
  results: RunResult | None
  missing: list[str]

  @property
  def has_diagnostics(self) -> bool:
    return bool(self.nu_bar) and len(self.steps) > 0


def split_batch_axes(name: str, array: np.ndarray, trailing: int) -> dict[str, np.ndarray]:
  """Splits leading batch axes of ``array`` (all but the last ``trailing``) into modules
  ``name[i]`` / ``name[i,j]``; no leading axes -> ``{name: array}``."""
  lead = array.shape[: array.ndim - trailing]
  if not lead:
    return {name: array}
  return {f"{name}[{','.join(map(str, idx))}]": array[idx] for idx in np.ndindex(*lead)}


def load_diagnostics(run_dir: str):
  """``(steps (T,), {field: {module: (T, r)}})`` from ``run_dir/diagnostics/step_*.npz``.

  Raises:
    FileNotFoundError: no snapshot (message says how to log them).
    ValueError: snapshots that disagree on modules or shapes, or a file with no per-module arrays
      (the message names the file).
  """
  folder = os.path.join(run_dir, rundir.DIAGNOSTICS_DIR)
  steps = diagnostics_io.diagnostics_steps(run_dir)
  if not steps:
    raise FileNotFoundError(
        f'{folder}/step_*.npz not found: per-rank diagnostics are written only when training with the '
        f'AnLR optimizer and a diagnostic interval, e.g. `anlr train ... trainer.diag_every=50` '
        f'(plain `lora` trains with optax.adamw, which keeps no per-rank state: log a LoRA baseline '
        f"with AnLR's signal='uniform', s_k = 1, whose updates are plain LoRA's)."
    )
  series: dict[str, dict[str, list]] = {f: {} for f in _SERIES}
  for index, step in enumerate(steps):
    path = diagnostics_io.diagnostics_path(run_dir, step)
    modules = diagnostics_io.read_diagnostics(path).modules
    snapshot: dict[str, dict[str, np.ndarray]] = {f: {} for f in series}
    for name, fields in modules.items():
      for field in _SERIES:
        if field in fields:
          value = np.asarray(fields[field], np.float64)
          snapshot[field].update(split_batch_axes(name, value, 1))
    if not snapshot['nu_bar']:
      raise ValueError(f'{path}: no per-module nu_bar arrays (is it an AnLR diagnostics file?)')
    for field, per_module in snapshot.items():
      if index and set(per_module) != set(series[field]):
        raise ValueError(f'{path}: modules of {field!r} differ from the earlier snapshots')
      for name, value in per_module.items():
        series[field].setdefault(name, []).append(value)
  out = {}
  for field, per_module in series.items():
    out[field] = {}
    for name, values in per_module.items():
      if len({v.shape for v in values}) != 1:
        raise ValueError(f'{folder}: {field} of module {name!r} changes shape between snapshots')
      out[field][name] = np.stack(values)
  return np.array(steps), out


def load_lora(path: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """``{module: (A (d_in, r), B (r, d_out))}`` from a ``lora_final.safetensors`` file.

  Raises:
    FileNotFoundError: no such file.
    ValueError: an ``A`` without its ``B`` (or the reverse), or ranks that disagree (names the key).
  """
  if not os.path.exists(path):
    raise FileNotFoundError(
        f'{path} not found: `anlr train` writes it at the end of training (re-run or finish the run).'
    )
  from safetensors.numpy import load_file

  tensors = load_file(path)
  factors: dict[str, dict[str, np.ndarray]] = {}
  for key, value in tensors.items():
    module, leaf = naming.split_adapter_key(key)
    if leaf in (_LORA_A, _LORA_B):
      factors.setdefault(module, {})[leaf] = np.asarray(value, np.float64)
  if not factors:
    raise ValueError(
        f'{path}: no `{naming.adapter_key("<module>", _LORA_A)}` / '
        f'`{naming.adapter_key("<module>", _LORA_B)}` tensors'
    )
  out = {}
  for module, pair in factors.items():
    for need in (_LORA_A, _LORA_B):
      if need not in pair:
        have = naming.adapter_key(module, next(iter(pair)))
        raise ValueError(f'{path}: key {have} has no sibling {naming.adapter_key(module, need)}')
    a, b = pair[_LORA_A], pair[_LORA_B]
    if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2] or a.shape[:-2] != b.shape[:-2]:
      raise ValueError(
          f'{path}: {naming.adapter_key(module, _LORA_A)} {a.shape} and'
          f' {naming.adapter_key(module, _LORA_B)} {b.shape} are not (..., d_in, r) and'
          ' (..., r, d_out)'
      )
    a_split, b_split = split_batch_axes(module, a, 2), split_batch_axes(module, b, 2)
    out.update({name: (a_split[name], b_split[name]) for name in a_split})
  return out


def _label(run_dir: str, results: RunResult | None) -> str:
  if results is not None and results.method:
    return str(results.method)
  config = os.path.join(run_dir, rundir.CONFIG_FILE)
  if os.path.exists(config):
    import yaml

    with open(config) as f:
      data = yaml.safe_load(f) or {}
    if isinstance(data, Mapping) and data.get('method'):
      return str(data['method'])
  return os.path.basename(os.path.normpath(run_dir))


def load_run(run_dir: str) -> RunLogs:
  """Reads a run directory; missing inputs become :attr:`RunLogs.missing` messages.

  Raises:
    FileNotFoundError: ``run_dir`` is not a directory.
    ValueError: a malformed file (the message names it).
  """
  if not os.path.isdir(run_dir):
    raise FileNotFoundError(f'run directory {run_dir} does not exist')
  missing = []
  results = read_results(run_dir)
  try:
    steps, series = load_diagnostics(run_dir)
  except FileNotFoundError as e:
    missing.append(str(e))
    steps, series = np.zeros((0,), np.int64), {f: {} for f in _SERIES}
  if len(steps) and not series[diagnostics_io.DIAG_MAGNITUDES]:
    missing.append(
        f"{os.path.join(run_dir, rundir.DIAGNOSTICS_DIR)}: no 'magnitudes' arrays (per-rank "
        '|A_k||B_k| from anlr_jax.analysis.rank_magnitudes at diagnostic steps); Fig. 2b uses the '
        'accumulated velocity (path length) instead.'
    )
  try:
    lora = load_lora(os.path.join(run_dir, rundir.LORA_FILE))
  except FileNotFoundError as e:
    missing.append(str(e))
    lora = {}
  return RunLogs(
      run_dir=run_dir,
      label=_label(run_dir, results),
      steps=steps,
      nu_bar=series['nu_bar'],
      snr=series['snr'],
      multipliers=series['multipliers'],
      magnitudes=series[diagnostics_io.DIAG_MAGNITUDES],
      lora=lora,
      results=results,
      missing=missing,
  )

r"""Reads what ``anlr train`` leaves in a run directory, for :mod:`anlr_jax.analysis`.

* ``diagnostics/step_<t>.npz`` (every ``trainer.diag_every`` steps): the flattened
  :func:`anlr_jax.diagnostics` tree, keys ``['modules']['<module>']['nu_bar' | 'snr' | 'multipliers']``
  of shape ``(..., r)``; optionally ``['magnitudes']['<module>']`` from
  :func:`anlr_jax.analysis.rank_magnitudes`. Leading batch axes (stacked layers) are split into separate
  modules named ``<module>[i]``.
* ``lora_final.safetensors``: ``<module>/lora_a (..., d_in, r)`` and ``<module>/lora_b (..., r, d_out)``;
  ``<module>`` may be dotted (``model.layers.0.q_proj``): :func:`match_modules` pairs it with the
  ``/``-joined diagnostics name.
* ``results.json`` / ``config.yaml``: the run's label (its ``method``).

Every missing input is recorded in :attr:`RunLogs.missing` as a message naming the file and how to get
it; the analysis draws what the remaining inputs allow.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Mapping

import numpy as np

__all__ = [
    'RunLogs',
    'load_run',
    'load_diagnostics',
    'load_lora',
    'split_batch_axes',
    'match_modules',
]

_DIAG_KEY = re.compile(
    r"^\['(?P<group>modules|magnitudes)'\]\['(?P<module>.+?)'\](?:\['(?P<field>\w+)'\])?$"
)
_STEP_FILE = re.compile(r'^step_(\d+)\.npz$')
_FIELDS = ('nu_bar', 'snr', 'multipliers')


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
    results: ``results.json`` contents, if any.
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
  results: dict | None
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
  folder = os.path.join(run_dir, 'diagnostics')
  files = sorted(
      (int(m.group(1)), f)
      for f in (os.listdir(folder) if os.path.isdir(folder) else [])
      if (m := _STEP_FILE.match(f))
  )
  if not files:
    raise FileNotFoundError(
        f'{folder}/step_*.npz not found: per-rank diagnostics are written only when training with the '
        f'AnLR optimizer and a diagnostic interval, e.g. `anlr train ... trainer.diag_every=50` '
        f'(plain `lora` trains with optax.adamw, which keeps no per-rank state: log a LoRA baseline '
        f"with AnLR's signal='uniform', s_k = 1, whose updates are plain LoRA's)."
    )
  series: dict[str, dict[str, list]] = {f: {} for f in _FIELDS + ('magnitudes',)}
  for index, (step, fname) in enumerate(files):
    path = os.path.join(folder, fname)
    snapshot: dict[str, dict[str, np.ndarray]] = {f: {} for f in series}
    with np.load(path) as arrays:
      for key in arrays.files:
        m = _DIAG_KEY.match(key)
        if m is None:
          continue
        field = 'magnitudes' if m.group('group') == 'magnitudes' else m.group('field')
        if field not in series:
          continue
        snapshot[field].update(
            split_batch_axes(m.group('module'), np.asarray(arrays[key], np.float64), 1)
        )
    if not snapshot['nu_bar']:
      raise ValueError(
          f"{path}: no ['modules'][<module>]['nu_bar'] arrays (is it an AnLR diagnostics file?)"
      )
    for field, modules in snapshot.items():
      if index and set(modules) != set(series[field]):
        raise ValueError(f'{path}: modules of {field!r} differ from the earlier snapshots')
      for name, value in modules.items():
        series[field].setdefault(name, []).append(value)
  out = {}
  for field, modules in series.items():
    out[field] = {}
    for name, values in modules.items():
      if len({v.shape for v in values}) != 1:
        raise ValueError(f'{folder}: {field} of module {name!r} changes shape between snapshots')
      out[field][name] = np.stack(values)
  return np.array([s for s, _ in files]), out


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
    module, _, leaf = key.rpartition('/')
    if leaf in ('lora_a', 'lora_b'):
      factors.setdefault(module, {})[leaf] = np.asarray(value, np.float64)
  if not factors:
    raise ValueError(f'{path}: no `<module>/lora_a` / `<module>/lora_b` tensors')
  out = {}
  for module, pair in factors.items():
    for need in ('lora_a', 'lora_b'):
      if need not in pair:
        have = next(iter(pair))
        raise ValueError(f'{path}: key {module}/{have} has no sibling {module}/{need}')
    a, b = pair['lora_a'], pair['lora_b']
    if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2] or a.shape[:-2] != b.shape[:-2]:
      raise ValueError(
          f'{path}: {module}/lora_a {a.shape} and {module}/lora_b {b.shape} are not '
          f'(..., d_in, r) and (..., r, d_out)'
      )
    a_split, b_split = split_batch_axes(module, a, 2), split_batch_axes(module, b, 2)
    out.update({name: (a_split[name], b_split[name]) for name in a_split})
  return out


def _normalise(name: str) -> str:
  return re.sub(r'[./]+', '/', name).strip('/')


def match_modules(names_a, names_b) -> dict[str, str]:
  """Pairs module names of two sources (e.g. diagnostics and ``lora_final``): exact after normalising
  ``.``/``/`` separators, else a unique suffix match. Returns ``{name_a: name_b}`` for the pairs found.
  """
  norm_b = {_normalise(n): n for n in names_b}
  out = {}
  for name in names_a:
    key = _normalise(name)
    if key in norm_b:
      out[name] = norm_b[key]
      continue
    hits = [n for k, n in norm_b.items() if k.endswith('/' + key) or key.endswith('/' + k)]
    if len(hits) == 1:
      out[name] = hits[0]
  return out


def _label(run_dir: str, results: Mapping | None) -> str:
  if results and results.get('method'):
    return str(results['method'])
  config = os.path.join(run_dir, 'config.yaml')
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
  results = None
  results_path = os.path.join(run_dir, 'results.json')
  if os.path.exists(results_path):
    with open(results_path) as f:
      try:
        results = json.load(f)
      except json.JSONDecodeError as e:
        raise ValueError(f'{results_path}: not valid JSON ({e})') from e
  try:
    steps, series = load_diagnostics(run_dir)
  except FileNotFoundError as e:
    missing.append(str(e))
    steps, series = np.zeros((0,), np.int64), {f: {} for f in _FIELDS + ('magnitudes',)}
  if len(steps) and not series['magnitudes']:
    missing.append(
        f"{os.path.join(run_dir, 'diagnostics')}: no ['magnitudes'] arrays (per-rank |A_k||B_k| from "
        f'anlr_jax.analysis.rank_magnitudes at diagnostic steps); Fig. 2b uses the accumulated '
        f'velocity (path length) instead.'
    )
  try:
    lora = load_lora(os.path.join(run_dir, 'lora_final.safetensors'))
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
      magnitudes=series['magnitudes'],
      lora=lora,
      results=results,
      missing=missing,
  )

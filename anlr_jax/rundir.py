r"""The run-directory contract: file names, module names, ``results.json`` and diagnostics I/O.

Everything that ``anlr train`` writes and ``anlr analyze`` / ``anlr sweep`` / ``anlr eval`` read is
named here, once. The module imports nothing from ``anlr_jax`` (only the standard library and NumPy),
so every layer (``anlr_jax.optim``, ``anlr_jax.nn``, ``anlr_jax.train``, ``anlr_jax.analysis``, the
CLI) can import it.

**Module names.** One rule, :func:`module_name`: the names of a module's path joined with ``.``,
as PyTorch / PEFT name modules (``model.layers.0.self_attn.q_proj``; the root module is ``""``).
The optimizer's per-module state (:func:`anlr_jax.find_lora_modules`), the LoRA injection
(:func:`anlr_jax.nn.iter_lora_layers`), the adapter file (:func:`adapter_key`), the diagnostics and
the analysis all use it, so the same module has the same name everywhere and names are compared
with ``==``.

**A run directory** (``<run_dir>``)::

  config.yaml                 CONFIG_FILE        the resolved run config
  metrics.jsonl               METRICS_FILE       one JSON row per logged step
  metrics.csv                 METRICS_CSV        the same rows as CSV
  tensorboard/                TENSORBOARD_DIR    TensorBoard event files
  diagnostics/step_<t>.npz    DIAGNOSTICS_DIR    per-module AnLR arrays at step t (write_diagnostics)
  checkpoints/                CHECKPOINTS_DIR    Orbax checkpoints (default trainer.ckpt_dir)
  lora_final.safetensors      LORA_FILE          the trained adapter, keys adapter_key(module, var)
  results.json                RESULTS_FILE       method, settings, accuracies (write_results)
  summary.json                SUMMARY_FILE       comparison of several methods (``compare``)
  loss.png                    LOSS_PLOT          training loss curve(s)
  accuracy.{csv,md}           ACCURACY_TABLE     accuracy per task (and method)
  eval_<task>.jsonl           eval_records_path  every generation of one eval task
  <method>/                   method_dir         one method's run directory (``compare``)
  analysis/                   ANALYSIS_DIR       ``anlr analyze`` output (default)
  .anlr.lock                  LOCK_FILE          the single-writer lock

**A sweep directory** (``anlr sweep --out``): ``<method>/lr<lr>/seed<seed>/`` run directories
(:func:`sweep_cell_dir`, each with a ``train.log``), ``results.csv``, ``summary.{csv,md}`` and
``accuracy_vs_lr.png``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

__all__ = [
    # module names
    "module_name",
    "key_name",
    "ADAPTER_KEY_SEP",
    "adapter_key",
    "split_adapter_key",
    # run directory
    "CONFIG_FILE",
    "METRICS_FILE",
    "METRICS_CSV",
    "TENSORBOARD_DIR",
    "DIAGNOSTICS_DIR",
    "CHECKPOINTS_DIR",
    "LORA_FILE",
    "RESULTS_FILE",
    "SUMMARY_FILE",
    "LOSS_PLOT",
    "ACCURACY_TABLE",
    "EVAL_RECORDS",
    "ANALYSIS_DIR",
    "LOCK_FILE",
    "method_dir_name",
    "method_dir",
    "eval_records_path",
    # analysis directory
    "ANALYSIS_SUMMARY",
    "MISSING_FILE",
    "FIG1_VELOCITY_BARS",
    "FIG2A_VELOCITY_TRAJECTORY",
    "FIG2A_ORDERING_STABILITY",
    "FIG2B_QUARTILE_MAGNITUDE",
    "FIG2C_VELOCITY_VS_CONCENTRATION",
    "FIG3A_LOG_MULTIPLIERS",
    "FIG3B_CUMULATIVE_ENERGY",
    "FIG3C_ENERGY_SHIFT",
    "ANALYSIS_FIGURES",
    # sweep directory
    "TRAIN_LOG",
    "SWEEP_RESULTS_CSV",
    "SWEEP_SUMMARY",
    "SWEEP_PLOT",
    "sweep_cell_dir",
    # results
    "write_json_atomic",
    "EvalResult",
    "RunResult",
    "write_results",
    "read_results",
    # diagnostics
    "DIAG_MODULES",
    "DIAG_MAGNITUDES",
    "PER_RANK_FIELDS",
    "DiagnosticsSnapshot",
    "diagnostics_path",
    "diagnostics_steps",
    "diagnostics_from_tree",
    "write_diagnostics",
    "read_diagnostics",
    "remove_diagnostics_after",
]

# --------------------------------------------------------------------------------- module names

ADAPTER_KEY_SEP = "/"
"""Separates the module name from the variable name in an adapter file key (``<module>/lora_a``);
variable names hold no ``/``, so the last one splits the key."""


def key_name(entry: Any) -> Any:
  """The name of one path entry: a ``str`` / ``int`` as is, or the key of a JAX key-path entry
  (``DictKey.key``, ``GetAttrKey.name``, ``SequenceKey.idx``, ``FlattenedIndexKey.key``)."""
  if isinstance(entry, (str, int)):
    return entry
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return getattr(entry, attr)
  return str(entry)


def module_name(path: Iterable[Any]) -> str:
  """The one module-naming rule: the names of ``path``'s entries joined with ``.``.

  ``path`` is an NNX path (``('model', 'layers', 0, 'q_proj')``, from ``nnx.iter_modules``) or a JAX
  key path (``jax.tree_util.tree_flatten_with_path``); both give ``'model.layers.0.q_proj'``, the
  PyTorch / PEFT name of the module. The empty path (the root module) is ``''``.
  """
  return ".".join(str(key_name(e)) for e in path)


def adapter_key(module: str, variable: str) -> str:
  """The key of one adapter variable in ``lora_final.safetensors``: ``'<module>/<variable>'``."""
  return f"{module}{ADAPTER_KEY_SEP}{variable}"


def split_adapter_key(key: str) -> tuple[str, str]:
  """Inverse of :func:`adapter_key`: ``'a.b/lora_a' -> ('a.b', 'lora_a')``."""
  module, _, variable = key.rpartition(ADAPTER_KEY_SEP)
  return module, variable


# ------------------------------------------------------------------------------ run directory

CONFIG_FILE = "config.yaml"
"""The run's resolved config (every default filled in); ``anlr eval --adapter`` reads it back."""
METRICS_FILE = "metrics.jsonl"
"""One JSON object per logged step (``step``, ``loss``, ``lr``, ``grad_norm``, ... ``anlr/*``)."""
METRICS_CSV = "metrics.csv"
"""The rows of :data:`METRICS_FILE` as CSV (a new column rewrites the file)."""
TENSORBOARD_DIR = "tensorboard"
"""Folder of TensorBoard event files with the same scalars."""
DIAGNOSTICS_DIR = "diagnostics"
"""Folder of per-module AnLR diagnostics, one ``step_<t>.npz`` per snapshot (:func:`write_diagnostics`).
"""
CHECKPOINTS_DIR = "checkpoints"
"""Folder of the run's Orbax checkpoints (the default ``trainer.ckpt_dir``)."""
LORA_FILE = "lora_final.safetensors"
"""The trained adapter variables, keys :func:`adapter_key` (Flax layout: ``lora_a (d_in, r)``,
``lora_b (r, d_out)``), the run identity in the metadata."""
RESULTS_FILE = "results.json"
"""One run's outcome, a :class:`RunResult` (``method``, ``learning_rate``, ``seed``, ``accuracy``
``{task: fraction}``, ``avg``, ``identity`` ...; :func:`write_results`); a sweep cell is finished
when it exists."""
SUMMARY_FILE = "summary.json"
"""The comparison of several methods trained by one ``anlr train`` (``compare``)."""
LOSS_PLOT = "loss.png"
"""Training loss curve(s), one per method."""
ACCURACY_TABLE = "accuracy"
"""Stem of the accuracy tables ``accuracy.csv`` and ``accuracy.md`` (task x method)."""
EVAL_RECORDS = "eval_{task}.jsonl"
"""Every generation of one eval task (prompt, output, extracted answer, gold); see
:func:`eval_records_path`."""
ANALYSIS_DIR = "analysis"
"""Default output folder of ``anlr analyze`` (inside the last run directory given)."""
LOCK_FILE = ".anlr.lock"
"""The advisory lock that keeps a second writer out of a run directory (holds the owner's pid)."""


def method_dir_name(method: str) -> str:
  """``method`` as a path component (``+`` becomes ``_``); also what ``{method}`` expands to in
  path settings."""
  return method.replace("+", "_")


def method_dir(run_dir: str, method: str) -> str:
  """The run directory of ``method`` inside a comparison run: ``<run_dir>/<method_dir_name>``."""
  return os.path.join(run_dir, method_dir_name(method))


def eval_records_path(run_dir: str, task: str) -> str:
  """``<run_dir>/eval_<task>.jsonl``."""
  return os.path.join(run_dir, EVAL_RECORDS.format(task=task))


# ---------------------------------------------------------------- analysis and sweep directories

ANALYSIS_SUMMARY = "summary"
"""Stem of ``anlr analyze``'s summary table, ``summary.csv`` and ``summary.md``."""
MISSING_FILE = "missing.txt"
"""What ``anlr analyze`` could not draw, and why (written only when something is missing)."""
FIG1_VELOCITY_BARS = "fig1_velocity_bars"
"""Fig. 1 (``.png`` + ``.csv``): velocity / module mean per rank, final snapshot."""
FIG2A_VELOCITY_TRAJECTORY = "fig2a_velocity_trajectory"
"""Fig. 2a (``.png`` + ``.csv``): per-rank velocity over steps, one module."""
FIG2A_ORDERING_STABILITY = "fig2a_ordering_stability"
"""Fig. 2a's numbers (``.csv`` only): Spearman rho, early window vs end, per module."""
FIG2B_QUARTILE_MAGNITUDE = "fig2b_quartile_magnitude"
"""Fig. 2b (``.png`` + ``.csv``): magnitude by velocity quartile over steps."""
FIG2C_VELOCITY_VS_CONCENTRATION = "fig2c_velocity_vs_concentration"
"""Fig. 2c (``.png`` + ``.csv``): module velocity vs spectral concentration of ``AB``."""
FIG3A_LOG_MULTIPLIERS = "fig3a_log_multipliers"
"""Fig. 3a (``.png`` + ``.csv``): heatmap of ``log s_k``, one module."""
FIG3B_CUMULATIVE_ENERGY = "fig3b_cumulative_energy"
"""Fig. 3b (``.png`` + ``.csv``): mean cumulative singular energy of ``AB``."""
FIG3C_ENERGY_SHIFT = "fig3c_energy_shift"
"""Fig. 3c (``.png`` + ``.csv``): per-index energy share, run B - run A."""
ANALYSIS_FIGURES = (
    FIG1_VELOCITY_BARS,
    FIG2A_VELOCITY_TRAJECTORY,
    FIG2B_QUARTILE_MAGNITUDE,
    FIG2C_VELOCITY_VS_CONCENTRATION,
    FIG3A_LOG_MULTIPLIERS,
    FIG3B_CUMULATIVE_ENERGY,
    FIG3C_ENERGY_SHIFT,
)
"""Stems of every figure (``<stem>.png`` with its numbers in ``<stem>.csv``)."""

TRAIN_LOG = "train.log"
"""A sweep cell's ``anlr train`` command line and its stdout/stderr."""
SWEEP_RESULTS_CSV = "results.csv"
"""One row per finished sweep cell: method, learning_rate, seed, avg, ``acc/<task>``."""
SWEEP_SUMMARY = "summary"
"""Stem of the sweep's table, ``summary.csv`` (mean, std per method and LR) and ``summary.md``."""
SWEEP_PLOT = "accuracy_vs_lr.png"
"""The sweep's accuracy vs learning rate plot."""


def sweep_cell_dir(out: str, method: str, learning_rate: float, seed: int) -> str:
  """The run directory of one sweep cell: ``<out>/<method>/lr<learning_rate:g>/seed<seed>``."""
  return os.path.join(out, method, f"lr{learning_rate:g}", f"seed{seed}")


# ------------------------------------------------------------------------------------- results


@contextlib.contextmanager
def _atomic_file(path: str, mode: str = "w", **kwargs):
  """A file object on a temporary name in ``path``'s folder, renamed to ``path`` when the block
  ends without an exception (removed otherwise): ``path`` is either the old file or the new one,
  never a partial one."""
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
  try:
    with os.fdopen(fd, mode, **kwargs) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


def write_json_atomic(path: str, payload: Any) -> str:
  """Writes ``payload`` as indented JSON to ``path`` atomically (temporary file + ``os.replace``);
  returns ``path``. A payload that cannot be serialised raises and leaves ``path`` as it was."""
  text = json.dumps(payload, indent=2) + "\n"  # serialise first: a TypeError writes nothing
  with _atomic_file(path, "w", encoding="utf-8") as f:
    f.write(text)
  return path


@dataclasses.dataclass
class RunResult:
  """One trained run's outcome, ``results.json`` of ``anlr train`` (one JSON key per field).

  Attributes:
    method: the method's name.
    learning_rate: the peak learning rate.
    seed: the run's seed.
    steps: updates trained (None: unknown).
    final_loss: mean training loss of the last tenth of the logged rows (None: no rows).
    train_seconds: training time (None: trained by an earlier process).
    accuracy: ``{task: fraction correct}``.
    avg: the mean of ``accuracy`` (None: no task).
    eval_seconds: evaluation time, summed over the processes that evaluated.
    identity: the run's identity (what determines its trajectory).
  """

  method: str | None = None
  learning_rate: float | None = None
  seed: int | None = None
  steps: int | None = None
  final_loss: float | None = None
  train_seconds: float | None = None
  accuracy: dict[str, float] = dataclasses.field(default_factory=dict)
  avg: float | None = None
  eval_seconds: float = 0.0
  identity: dict[str, Any] = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict[str, Any]:
    """The JSON object of ``results.json``."""
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, payload: Mapping[str, Any]) -> "RunResult":
    """Reads a ``results.json`` object; keys it lacks take their defaults, others are ignored."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in payload.items() if k in names})


@dataclasses.dataclass
class EvalResult:
  """``anlr eval``'s outcome, ``results.json`` of its output directory.

  Attributes:
    adapter: the adapter scored (a run directory or an adapter file; None: the base model).
    accuracy: ``{task: fraction correct}``.
    avg: the mean of ``accuracy`` (None: no task).
  """

  adapter: str | None
  accuracy: dict[str, float]
  avg: float | None

  def to_json(self) -> dict[str, Any]:
    """The JSON object of ``results.json``."""
    return dataclasses.asdict(self)


def write_results(run_dir: str, result: RunResult | EvalResult) -> str:
  """Writes ``<run_dir>/results.json`` atomically; returns its path."""
  return write_json_atomic(os.path.join(run_dir, RESULTS_FILE), result.to_json())


def read_results(run_dir: str) -> RunResult | None:
  """The :class:`RunResult` in ``<run_dir>/results.json``, or None when there is none.

  Raises:
    ValueError: the file is not a JSON object (the message names the file).
  """
  path = os.path.join(run_dir, RESULTS_FILE)
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    try:
      results = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not valid JSON ({e})") from e
  if not isinstance(results, dict):
    raise ValueError(f"{path}: expected a JSON object, got {type(results).__name__}")
  return RunResult.from_json(results)


# --------------------------------------------------------------------------------- diagnostics

DIAG_MODULES = "modules"
"""Key of the per-module entries of :func:`anlr_jax.diagnostics`: ``{module: {field: array}}``."""
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
  with _atomic_file(path, "wb") as f:
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

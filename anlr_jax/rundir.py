r"""The run-directory contract: the names of the files ``anlr train`` writes.

Everything that ``anlr train`` writes and ``anlr analyze`` / ``anlr sweep`` / ``anlr eval`` read is
named here, once. The module imports nothing from ``anlr_jax``, so every layer can import it. What
the files hold is written and read elsewhere: ``results.json`` by :mod:`anlr_jax.results`, the
diagnostics by :mod:`anlr_jax.diagnostics_io`, the adapter file's keys follow
:func:`anlr_jax.naming.adapter_key`.

**A run directory** (``<run_dir>``)::

  config.yaml                 CONFIG_FILE        the resolved run config
  metrics.jsonl               METRICS_FILE       one JSON row per logged step
  metrics.csv                 METRICS_CSV        the same rows as CSV
  tensorboard/                TENSORBOARD_DIR    TensorBoard event files
  diagnostics/step_<t>.npz    DIAGNOSTICS_DIR    per-module AnLR arrays at step t (diagnostics_io)
  checkpoints/                CHECKPOINTS_DIR    Orbax checkpoints (default trainer.ckpt_dir)
  lora_final.safetensors      LORA_FILE          the trained adapter, keys adapter_key(module, var)
  results.json                RESULTS_FILE       method, settings, accuracies (results)
  summary.json                SUMMARY_FILE       comparison of several methods (``compare``)
  loss.png                    LOSS_PLOT          training loss curve(s)
  accuracy.{csv,md}           ACCURACY_TABLE     accuracy per task (and method)
  eval_<task>.jsonl           eval_records_path  every generation of one eval task
  eval_<task>_score.json                         a visual task's score (metrics, per question)
  base/                       BASE_DIR           the base model's eval records (one method with
                                                 ``eval.include_base``; with ``compare``: here)
  <method>/                   method_dir         one method's run directory (``compare``)
  analysis/                   ANALYSIS_DIR       ``anlr analyze`` output (default)
  .anlr.lock                  LOCK_FILE          the single-writer lock

**A sweep directory** (``anlr sweep --out``): ``<method>/lr<lr>/seed<seed>/`` run directories
(:func:`sweep_cell_dir`, each with a ``train.log``), ``results.csv``, ``summary.{csv,md}`` and
``accuracy_vs_lr.png``.
"""

from __future__ import annotations

import os

__all__ = [
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
    "BASE_DIR",
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
]

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
"""Folder of per-module AnLR diagnostics, one ``step_<t>.npz`` per snapshot
(:func:`anlr_jax.diagnostics_io.write_diagnostics`).
"""
CHECKPOINTS_DIR = "checkpoints"
"""Folder of the run's Orbax checkpoints (the default ``trainer.ckpt_dir``)."""
LORA_FILE = "lora_final.safetensors"
"""The trained adapter variables, keys :func:`anlr_jax.naming.adapter_key` (Flax layout:
``lora_a (d_in, r)``, ``lora_b (r, d_out)``), the run identity in the metadata."""
RESULTS_FILE = "results.json"
"""One run's outcome, a :class:`anlr_jax.results.RunResult` (``method``, ``learning_rate``,
``seed``, ``accuracy`` ``{task: fraction}``, ``avg``, ``identity`` ...); a sweep cell is finished
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
BASE_DIR = "base"
"""The base model's eval records in a one-method run directory (``eval.include_base``)."""
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

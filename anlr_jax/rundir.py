r"""The run-directory contract: the names of the files ``anlr train`` writes.

Everything that ``anlr train`` writes and ``anlr analyze`` / ``anlr sweep`` / ``anlr eval`` read is
named here, once. The module imports nothing from ``anlr_jax``, so every layer can import it. What
the files hold is written and read elsewhere: ``results.json`` by :mod:`anlr_jax.analysis.results`, the
diagnostics by :mod:`anlr_jax.train.diagnostics_io`, the adapter file's keys follow
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

The files of an analysis directory (``anlr analyze``) and of a sweep directory (``anlr sweep``) are
named in :mod:`anlr_jax.analysis.file_names`, beside the code that writes them.
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
(:func:`anlr_jax.train.diagnostics_io.write_diagnostics`).
"""
CHECKPOINTS_DIR = "checkpoints"
"""Folder of the run's Orbax checkpoints (the default ``trainer.ckpt_dir``)."""
LORA_FILE = "lora_final.safetensors"
"""The trained adapter variables, keys :func:`anlr_jax.naming.adapter_key` (Flax layout:
``lora_a (d_in, r)``, ``lora_b (r, d_out)``), the run identity in the metadata."""
RESULTS_FILE = "results.json"
"""One run's outcome, a :class:`anlr_jax.analysis.results.RunResult` (``method``, ``learning_rate``,
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

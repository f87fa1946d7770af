r"""The names of the files ``anlr analyze`` and ``anlr sweep`` write (the run directory's are
:mod:`anlr_jax.rundir`'s).

**An analysis directory** (``anlr analyze --out``, default ``<run_dir>/analysis``): ``summary.{csv,md}``
(:data:`ANALYSIS_SUMMARY`), one ``<stem>.png`` with its numbers in ``<stem>.csv`` per figure
(:data:`ANALYSIS_FIGURES`), and ``missing.txt`` (:data:`MISSING_FILE`) when something could not be
drawn.

**A sweep directory** (``anlr sweep --out``): ``<method>/lr<lr>/seed<seed>/`` run directories
(:func:`sweep_cell_dir`, each with a ``train.log``), ``results.csv``, ``summary.{csv,md}`` and
``accuracy_vs_lr.png``.
"""

from __future__ import annotations

import os

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


__all__ = [
    "ANALYSIS_FIGURES",
    "ANALYSIS_SUMMARY",
    "FIG1_VELOCITY_BARS",
    "FIG2A_ORDERING_STABILITY",
    "FIG2A_VELOCITY_TRAJECTORY",
    "FIG2B_QUARTILE_MAGNITUDE",
    "FIG2C_VELOCITY_VS_CONCENTRATION",
    "FIG3A_LOG_MULTIPLIERS",
    "FIG3B_CUMULATIVE_ENERGY",
    "FIG3C_ENERGY_SHIFT",
    "MISSING_FILE",
    "SWEEP_PLOT",
    "SWEEP_RESULTS_CSV",
    "SWEEP_SUMMARY",
    "TRAIN_LOG",
    "sweep_cell_dir",
]

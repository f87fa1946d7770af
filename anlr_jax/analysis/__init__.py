"""Analysis of rank-one training dynamics (paper Sec. 3, Sec. 6, App. C) and LR sweeps.

:func:`analyze` reads a run directory's diagnostics and ``lora_final`` and draws the paper's figures
(``anlr analyze``); :func:`run_sweep` runs a methods x learning rates x seeds grid (``anlr sweep``).
The measurements themselves are pure NumPy functions in :mod:`anlr_jax.analysis.measures`.
"""

from anlr_jax.analysis.analyze import AnalysisReport, analyze
from anlr_jax.analysis.logs import RunLogs, load_diagnostics, load_lora, load_run
from anlr_jax.analysis.measures import (
    CONCENTRATED_BELOW,
    effective_rank_np,
    energy_shares,
    energy_shift,
    is_concentrated,
    max_min_ratio,
    normalised_velocity,
    ordering_stability,
    quartile_means,
    rank_magnitudes,
    spearman,
    spectral_concentration,
    top_k_energy,
    velocity_cv,
    velocity_quartiles,
)
from anlr_jax.analysis.sweep import SweepCell, aggregate, grid, run_sweep, write_sweep_report

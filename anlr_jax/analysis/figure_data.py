r"""The numbers behind each figure and the summary table, computed from a :class:`RunLogs` (no plotting).

Choices the paper leaves open, fixed here:

* velocity is the logged EMA :math:`\bar\nu_k`; per-module "final" values are those of the last
  diagnostic snapshot. The EMA has no bias correction, but its bias factor :math:`1 - \rho^t` is common
  to the ``r`` components of a module, so ratios, CV, normalised velocities and rank orderings are
  unaffected;
* Fig. 2a ordering stability: :func:`~anlr_jax.analysis.measures.ordering_stability` with the first 10%
  of snapshots as the early window;
* Fig. 2b: components are grouped by within-module quartile of their time-mean velocity; each
  module's magnitudes are divided by that module's mean final magnitude (so modules weigh equally),
  then averaged per quartile at every snapshot. Without logged magnitudes, the accumulated velocity
  :math:`\int \bar\nu_k\,dt` (trapezoid over snapshots; an upper bound on how far the component moved)
  stands in, and the figure says so;
* Fig. 2c: module mean final velocity vs spectral concentration :math:`1 - \mathrm{erank}/r` of the
  final :math:`AB`; the cumulative energy curves average the slowest and fastest quarter of modules;
* the representative module of Fig. 2a / 3a is the one whose final max/min velocity ratio is the median.
"""

from __future__ import annotations

import os

import numpy as np

from anlr_jax import naming, rundir
from anlr_jax.analysis import measures
from anlr_jax.analysis.logs import RunLogs

__all__ = [
    'representative_module',
    'velocity_bars',
    'ordering_stability_by_module',
    'quartile_magnitude',
    'module_spectra',
    'velocity_vs_concentration',
    'cumulative_energy_by_velocity_group',
    'log_multipliers',
    'cumulative_energy_mean',
    'summary_row',
    'SUMMARY_COLUMNS',
]


def _final(series: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {name: traj[-1] for name, traj in series.items()}


def representative_module(run: RunLogs) -> str:
  """The module whose final max/min velocity ratio is the median over modules."""
  if not run.nu_bar:
    raise ValueError(f'{run.run_dir}: no per-rank velocities (diagnostics) to pick a module from')
  names = sorted(run.nu_bar)
  ratios = np.array([measures.max_min_ratio(run.nu_bar[n][-1]) for n in names])
  ratios = np.where(np.isfinite(ratios), ratios, np.finfo(np.float64).max)
  return names[int(np.argsort(ratios, kind='stable')[(len(names) - 1) // 2])]


def velocity_bars(run: RunLogs) -> list[dict]:
  """Fig. 1 rows: ``module, rank, velocity, normalised`` (final snapshot; ``normalised`` = velocity /
  module mean, whose mean line is 1)."""
  rows = []
  for name in sorted(run.nu_bar):
    nu = run.nu_bar[name][-1]
    for k, (v, n) in enumerate(zip(nu, measures.normalised_velocity(nu))):
      rows.append(dict(module=name, rank=k, velocity=float(v), normalised=float(n)))
  return rows


def ordering_stability_by_module(run: RunLogs, *, early_fraction: float = 0.1) -> dict[str, float]:
  """Fig. 2a: Spearman :math:`\\rho` (early window vs final) per module (needs >= 2 snapshots)."""
  if len(run.steps) < 2:
    return {}
  return {
      name: float(measures.ordering_stability(run.nu_bar[name], early_fraction=early_fraction))
      for name in sorted(run.nu_bar)
  }


def quartile_magnitude(run: RunLogs) -> tuple[np.ndarray, np.ndarray, str]:
  """Fig. 2b: ``(steps (T,), means (T, 4), source)``, the mean normalised magnitude of each velocity
  quartile over training; ``source`` is ``'magnitude'`` or ``'accumulated velocity'``."""
  if run.magnitudes:
    source, series = 'magnitude', run.magnitudes
  else:
    source = 'accumulated velocity'
    dt = np.diff(run.steps, prepend=0).astype(np.float64)
    series = {}
    for name, nu in run.nu_bar.items():
      prev = np.concatenate([np.zeros_like(nu[:1]), nu[:-1]], axis=0)
      series[name] = np.cumsum(0.5 * (nu + prev) * dt[:, None], axis=0)
  names = sorted(n for n in series if n in run.nu_bar and series[n].shape == run.nu_bar[n].shape)
  per_module = []
  for name in names:
    quart = measures.velocity_quartiles(run.nu_bar[name].mean(axis=0))
    values = series[name]
    scale = values[-1].mean()
    values = values / scale if scale > 0 else values
    per_module.append(measures.quartile_means(values, quart))
  if not per_module:
    return run.steps, np.full((len(run.steps), 4), np.nan), source
  stacked = np.stack(per_module)  # (M, T, 4)
  with np.errstate(invalid='ignore'):
    means = np.nanmean(stacked, axis=0) if np.isfinite(stacked).any() else stacked[0]
  return run.steps, means, source


def module_spectra(run: RunLogs) -> dict[str, np.ndarray]:
  """Singular values of the final :math:`AB` per module, ``{module: (r,)}`` descending (from
  :func:`anlr_jax.singular_values`, which never forms the ``d_in x d_out`` product)."""
  from anlr_jax.optim.diagnostics import singular_values

  return {
      name: np.asarray(singular_values(a, b), np.float64)
      for name, (a, b) in sorted(run.lora.items())
  }


def velocity_vs_concentration(run: RunLogs, spectra: dict[str, np.ndarray]) -> list[dict]:
  """Fig. 2c rows: ``module, mean_velocity, effective_rank, rank, concentration, top1_energy,
  concentrated`` for every module present in both the diagnostics and ``lora_final`` (the same
  :func:`anlr_jax.naming.module_name` in both)."""
  rows = []
  for name in sorted(set(run.nu_bar) & set(spectra)):
    sv = spectra[name]
    rows.append(
        dict(
            module=name,
            mean_velocity=float(run.nu_bar[name][-1].mean()),
            effective_rank=float(measures.effective_rank_np(sv)),
            rank=int(sv.shape[-1]),
            concentration=float(measures.spectral_concentration(sv)),
            top1_energy=float(measures.top_k_energy(sv, 1)),
            concentrated=bool(measures.is_concentrated(sv)),
        )
    )
  return rows


def cumulative_energy_by_velocity_group(
    rows: list[dict], spectra: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
  """Mean cumulative energy curve of the slowest and the fastest quarter of modules (by mean final
  velocity), ``{'slowest 25%': (r,), 'fastest 25%': (r,)}``; modules of the most common rank only.
  """
  if not rows:
    return {}
  ranks = [r['rank'] for r in rows]
  common = max(set(ranks), key=ranks.count)
  kept = sorted((r for r in rows if r['rank'] == common), key=lambda r: r['mean_velocity'])
  n = max(1, len(kept) // 4)
  curve = lambda group: np.mean(
      [np.cumsum(measures.energy_shares(spectra[r['module']])) for r in group], axis=0
  )
  return {'slowest 25%': curve(kept[:n]), 'fastest 25%': curve(kept[-n:])}


def log_multipliers(run: RunLogs, module: str) -> tuple[np.ndarray, np.ndarray]:
  """Fig. 3a: ``(steps (T,), log s (T, r))`` for ``module``."""
  if module not in run.multipliers:
    raise KeyError(
        f'module {module!r} has no multipliers in '
        f'{os.path.join(run.run_dir, rundir.DIAGNOSTICS_DIR)} '
        f'(known: {sorted(run.multipliers)[:5]}...)'
    )
  return run.steps, np.log(np.maximum(run.multipliers[module], np.finfo(np.float64).tiny))


def cumulative_energy_mean(spectra: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
  """Fig. 3b/3c: ``(mean energy shares (r,), mean cumulative energy (r,))`` over the modules of the
  most common rank."""
  if not spectra:
    raise ValueError(f'no LoRA spectra ({rundir.LORA_FILE}) to average')
  ranks = [sv.shape[-1] for sv in spectra.values()]
  common = max(set(ranks), key=ranks.count)
  shares = np.stack(
      [measures.energy_shares(sv) for sv in spectra.values() if sv.shape[-1] == common]
  )
  return shares.mean(axis=0), np.cumsum(shares, axis=-1).mean(axis=0)


SUMMARY_COLUMNS = (
    ('modules', 'modules'),
    ('ratio_p50', 'max/min velocity ratio, median'),
    ('ratio_p90', 'max/min velocity ratio, 90th pct'),
    ('ratio_p99', 'max/min velocity ratio, 99th pct'),
    ('velocity_cv', 'CV of per-rank velocity (mean over modules)'),
    ('ordering_rho', 'ordering stability, median Spearman rho'),
    ('effective_rank', 'effective rank of AB (mean over modules)'),
    ('rank', 'nominal rank r (mean over modules)'),
    (
        'concentrated_share',
        f'share of concentrated modules (erank < {measures.CONCENTRATED_BELOW:g} r)',
    ),
)


def summary_row(
    run: RunLogs, spectra: dict[str, np.ndarray], stability: dict[str, float]
) -> dict[str, float]:
  """The summary table's numbers for one run (``nan`` where an input is missing)."""
  nan = float('nan')
  row = dict.fromkeys((k for k, _ in SUMMARY_COLUMNS), nan)
  if run.nu_bar:
    ratios = [measures.max_min_ratio(nu) for nu in _final(run.nu_bar).values()]
    cvs = [measures.velocity_cv(nu) for nu in _final(run.nu_bar).values()]
    pct = measures.percentile_summary(ratios)
    row.update(
        modules=float(len(ratios)),
        ratio_p50=pct['p50'],
        ratio_p90=pct['p90'],
        ratio_p99=pct['p99'],
        velocity_cv=float(np.mean(cvs)),
    )
  rhos = np.array([v for v in stability.values() if np.isfinite(v)])
  if rhos.size:
    row['ordering_rho'] = float(np.median(rhos))
  if spectra:
    sv = list(spectra.values())
    row['effective_rank'] = float(np.mean([measures.effective_rank_np(s) for s in sv]))
    row['rank'] = float(np.mean([s.shape[-1] for s in sv]))
    row['concentrated_share'] = float(np.mean([measures.is_concentrated(s) for s in sv]))
    if not run.nu_bar:
      row['modules'] = float(len(sv))
  return row

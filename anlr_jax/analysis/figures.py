r"""Matplotlib (Agg) drawings of the paper's analysis figures; each takes the numbers computed in
:mod:`anlr_jax.analysis.figure_data` for one or more runs (drawn side by side) and writes a PNG.

Fig. 1 per-rank velocity / module mean, Fig. 2a velocity over steps + ordering stability, Fig. 2b
magnitude by velocity quartile, Fig. 2c module velocity vs spectral concentration, Fig. 3a
:math:`\log s_k` heatmap, Fig. 3b cumulative singular energy, Fig. 3c per-index energy shift, Fig. 5
accuracy vs learning rate (sweeps); and MT-Bench scores per category with their bootstrap intervals.
"""

from __future__ import annotations

from typing import Sequence

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402

__all__ = [
    'velocity_bars_figure',
    'velocity_trajectory_figure',
    'quartile_magnitude_figure',
    'concentration_figure',
    'multiplier_heatmap_figure',
    'cumulative_energy_figure',
    'energy_shift_figure',
    'accuracy_vs_lr_figure',
    'mtbench_scores_figure',
]


def _save(fig, path: str) -> str:
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _columns(n: int, rows: int = 1, width: float = 4.6, height: float = 3.4):
  fig, axes = plt.subplots(rows, n, figsize=(width * n, height * rows), squeeze=False)
  return fig, axes


def velocity_bars_figure(runs: Sequence[tuple[str, list[dict], list[str]]], path: str) -> str:
  """Fig. 1: for each run ``(label, rows, modules)``, bars of velocity / module mean for the listed
  modules (a few), with the dashed mean line at 1."""
  n_mod = max(len(m) for _, _, m in runs)
  fig, axes = _columns(len(runs), rows=n_mod, height=2.4)
  for col, (label, rows, modules) in enumerate(runs):
    for row in range(n_mod):
      ax = axes[row, col]
      if row >= len(modules):
        ax.axis('off')
        continue
      values = [r['normalised'] for r in rows if r['module'] == modules[row]]
      ax.bar(np.arange(len(values)), values, color='tab:blue')
      ax.axhline(1.0, color='k', ls='--', lw=1, label='module mean')
      ax.set_title(f'{label}: {modules[row]}', fontsize=8)
      ax.set_ylabel('velocity / mean')
      if row == len(modules) - 1:
        ax.set_xlabel('rank-one component k')
  axes[0, 0].legend(fontsize=7)
  return _save(fig, path)


def velocity_trajectory_figure(
    runs: Sequence[tuple[str, str, np.ndarray, np.ndarray, list[float]]], path: str
) -> str:
  """Fig. 2a: top row, per-rank velocity over steps for one module (coloured by rank index); bottom
  row, histogram of the per-module Spearman rho (early window vs end). Each run is
  ``(label, module, steps, velocity (T, r), rhos)``."""
  fig, axes = _columns(len(runs), rows=2)
  for col, (label, module, steps, nu, rhos) in enumerate(runs):
    ax = axes[0, col]
    colors = plt.cm.viridis(np.linspace(0, 1, nu.shape[-1]))
    for k in range(nu.shape[-1]):
      ax.plot(steps, nu[:, k], color=colors[k], lw=1)
    ax.set(title=f'{label}: {module}', xlabel='step', ylabel='velocity (EMA)')
    ax.title.set_fontsize(8)
    sm = plt.cm.ScalarMappable(cmap='viridis', norm=plt.Normalize(0, nu.shape[-1] - 1))
    fig.colorbar(sm, ax=ax, label='rank index k')
    ax = axes[1, col]
    finite = [r for r in rhos if np.isfinite(r)]
    if finite:
      ax.hist(finite, bins=np.linspace(-1, 1, 21), color='tab:green')
      ax.axvline(
          float(np.median(finite)),
          color='k',
          ls='--',
          lw=1,
          label=f'median {np.median(finite):.2f}',
      )
      ax.legend(fontsize=7)
    ax.set(xlabel='Spearman rho, early window vs end', ylabel='modules', xlim=(-1.05, 1.05))
  return _save(fig, path)


def quartile_magnitude_figure(
    runs: Sequence[tuple[str, np.ndarray, np.ndarray, str]], path: str
) -> str:
  """Fig. 2b: mean normalised magnitude of each velocity quartile over steps; each run is
  ``(label, steps, means (T, 4), source)``."""
  fig, axes = _columns(len(runs))
  names = ('Q1 (slowest)', 'Q2', 'Q3', 'Q4 (fastest)')
  colors = plt.cm.coolwarm(np.linspace(0, 1, 4))
  for col, (label, steps, means, source) in enumerate(runs):
    ax = axes[0, col]
    for q in range(4):
      if np.isfinite(means[:, q]).any():
        ax.plot(steps, means[:, q], color=colors[q], label=names[q], marker='.')
    ax.set(title=label, xlabel='step', ylabel=f'{source} / module mean at end')
    ax.legend(fontsize=7)
  return _save(fig, path)


def concentration_figure(
    runs: Sequence[tuple[str, list[dict], dict[str, np.ndarray]]], path: str
) -> str:
  """Fig. 2c: top, module mean velocity vs spectral concentration ``1 - erank/r``; bottom, mean
  cumulative energy of the slowest vs fastest quarter of modules. Each run is
  ``(label, rows, curves)``."""
  fig, axes = _columns(len(runs), rows=2)
  for col, (label, rows, curves) in enumerate(runs):
    ax = axes[0, col]
    x = np.array([r['mean_velocity'] for r in rows])
    y = np.array([r['concentration'] for r in rows])
    ax.scatter(x, y, s=12, c=['tab:red' if r['concentrated'] else 'tab:blue' for r in rows])
    if x.size and np.all(x > 0):
      ax.set_xscale('log')
    ax.set(title=label, xlabel='module mean velocity (end)', ylabel='concentration 1 - erank/r')
    ax = axes[1, col]
    for name, curve in curves.items():
      ax.plot(np.arange(1, len(curve) + 1), curve, marker='.', label=name)
    ax.set(xlabel='singular index j', ylabel='cumulative energy', ylim=(0, 1.02))
    if curves:
      ax.legend(fontsize=7)
  return _save(fig, path)


def multiplier_heatmap_figure(
    runs: Sequence[tuple[str, str, np.ndarray, np.ndarray]], path: str
) -> str:
  """Fig. 3a: heatmap of :math:`\\log s_k` (rank x step); each run is
  ``(label, module, steps, log_s (T, r))``."""
  fig, axes = _columns(len(runs))
  bound = max(float(np.max(np.abs(ls))) for _, _, _, ls in runs) or 1.0
  for col, (label, module, steps, log_s) in enumerate(runs):
    ax = axes[0, col]
    steps = np.asarray(steps, np.float64)
    half = np.diff(steps) / 2 if len(steps) > 1 else np.array([0.5])
    edges = np.concatenate([[steps[0] - half[0]], steps[:-1] + half, [steps[-1] + half[-1]]])
    image = ax.pcolormesh(
        edges, np.arange(log_s.shape[-1] + 1) - 0.5, log_s.T, cmap='RdBu_r', vmin=-bound, vmax=bound
    )
    ax.set(title=f'{label}: {module}', xlabel='step', ylabel='rank-one component k')
    ax.title.set_fontsize(8)
    fig.colorbar(image, ax=ax, label='log s_k')
  return _save(fig, path)


def cumulative_energy_figure(curves: Sequence[tuple[str, np.ndarray]], path: str) -> str:
  """Fig. 3b: mean cumulative singular energy of :math:`AB` per run, with the flat-spectrum line."""
  fig, axes = _columns(1)
  ax = axes[0, 0]
  for label, curve in curves:
    ax.plot(np.arange(1, len(curve) + 1), curve, marker='.', label=label)
  r = max(len(c) for _, c in curves)
  ax.plot(np.arange(1, r + 1), np.arange(1, r + 1) / r, 'k:', lw=1, label='flat spectrum')
  ax.set(xlabel='singular index j', ylabel='cumulative energy E_j', ylim=(0, 1.02))
  ax.legend(fontsize=7)
  return _save(fig, path)


def energy_shift_figure(shift: np.ndarray, label_a: str, label_b: str, path: str) -> str:
  """Fig. 3c: per-index energy share of B minus that of A (mean over modules)."""
  fig, axes = _columns(1)
  ax = axes[0, 0]
  ax.bar(np.arange(1, len(shift) + 1), shift, color=np.where(shift >= 0, 'tab:green', 'tab:red'))
  ax.axhline(0.0, color='k', lw=0.8)
  ax.set(xlabel='singular index i', ylabel=f'energy share: {label_b} - {label_a}')
  return _save(fig, path)


def accuracy_vs_lr_figure(
    table: Sequence[dict], path: str, *, metric: str = 'avg', base: float | None = None
) -> str:
  """Fig. 5: mean accuracy (± std over seeds) vs learning rate, one line per method; ``table`` rows
  have ``method, learning_rate, mean, std``; ``base``: the base model's accuracy, a dashed line."""
  fig, axes = _columns(1, width=5.5, height=3.8)
  ax = axes[0, 0]
  if base is not None:
    ax.axhline(base, color='0.4', linestyle='--', linewidth=1, label='base model')
  for method in dict.fromkeys(r['method'] for r in table):
    rows = sorted((r for r in table if r['method'] == method), key=lambda r: r['learning_rate'])
    ax.errorbar(
        [r['learning_rate'] for r in rows],
        [r['mean'] for r in rows],
        yerr=[r['std'] for r in rows],
        marker='o',
        capsize=3,
        label=method,
    )
  ax.set_xscale('log')
  # ticks at the swept learning rates only (log-axis minor labels overlap on a short range)
  lrs = sorted({r['learning_rate'] for r in table})
  ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(lrs))
  ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
  ax.xaxis.set_major_formatter(matplotlib.ticker.FixedFormatter([f'{lr:g}' for lr in lrs]))
  ax.set(xlabel='learning rate', ylabel=f'accuracy ({metric})')
  ax.legend(fontsize=8)
  return _save(fig, path)


def mtbench_bars(
    summary: dict, field: str = 'score', categories: Sequence[str] | None = None
) -> tuple[list[str], np.ndarray, np.ndarray]:
  """``(labels, means, errors)`` of one model's single-grading summary (``field``: ``score``, the
  protocol's rating, or ``prob_rating``, the probability rating): overall first, then each of
  ``categories`` (None: the summary's own); ``errors`` is ``(2, n)``, the distances down and up to
  the 95 % bootstrap interval (0 where there is none); a mean that does not exist is NaN."""
  part = summary if field == 'score' else summary[field]
  categories = list(part['categories'] if categories is None else categories)
  labels = ['overall', *categories]
  means = [part['overall'], *(part['categories'].get(c) for c in categories)]
  cis = [part['ci95']['overall'], *(part['ci95']['categories'].get(c) for c in categories)]
  means = np.array([np.nan if m is None else m for m in means], np.float64)
  errors = np.zeros((2, len(labels)))
  for i, (mean, ci) in enumerate(zip(means, cis)):
    if ci is not None:
      errors[:, i] = (mean - ci[0], ci[1] - mean)
  return labels, means, errors


def mtbench_scores_figure(summaries: Sequence[tuple[str, dict]], path: str) -> str:
  """MT-Bench single grading, one bar per model ``(label, summary)`` for the overall score and each
  category, with 95 % bootstrap intervals over questions; a second panel for the probability
  rating where the summaries have one (a local judge)."""
  fields = ['score'] + (['prob_rating'] if all(s.get('prob_rating') for _, s in summaries) else [])
  categories = sorted({c for _, s in summaries for c in s['categories']}, key=str)
  fig, axes = _columns(1, rows=len(fields), width=9.0, height=3.2)
  width = 0.8 / len(summaries)
  titles = {
      'score': "protocol rating ([[N]] in the judge's reply)",
      'prob_rating': "probability rating (expected value after 'Rating: [[')",
  }
  for ax, field in zip(axes[:, 0], fields):
    for i, (label, summary) in enumerate(summaries):
      names, means, errors = mtbench_bars(summary, field, categories)
      x = np.arange(len(names)) + (i - (len(summaries) - 1) / 2) * width
      ax.bar(x, means, width, yerr=errors, capsize=2, label=label)
    ax.set_xticks(np.arange(len(names)), names, fontsize=8)
    ax.set(ylim=(0, 10), ylabel='score (1-10)')
    ax.set_title(titles[field], fontsize=9)
  axes[0, 0].legend(fontsize=8, ncol=len(summaries))
  return _save(fig, path)

r"""``anlr analyze``: from one or two run directories, the paper's analysis figures (PNG) with the
numbers behind each (CSV), and a summary table (CSV + Markdown). Two runs (A = LoRA, B = AnLR) are drawn
side by side and add Fig. 3c (per-index energy shift from A to B).

Files written to ``out`` (each only when its inputs exist; ``missing.txt`` lists what was not drawn and
why):

==============================================  ============================================  =========
file                                            content                                       needs
==============================================  ============================================  =========
``fig1_velocity_bars.{png,csv}``                velocity / module mean per rank (final)       diag
``fig2a_velocity_trajectory.{png,csv}``         per-rank velocity over steps, one module      diag
``fig2a_ordering_stability.csv``                Spearman rho early window vs end, per module  diag (T>=2)
``fig2b_quartile_magnitude.{png,csv}``          magnitude by velocity quartile over steps     diag
``fig2c_velocity_vs_concentration.{png,csv}``   module velocity vs 1 - erank/r                diag + lora
``fig3a_log_multipliers.{png,csv}``             log s_k heatmap, one module                   diag
``fig3b_cumulative_energy.{png,csv}``           mean cumulative singular energy of AB         lora
``fig3c_energy_shift.{png,csv}``                per-index energy share, B - A                 2 x lora
``summary.{csv,md}``                            ratios, CV, rho, effective rank, % conc.      any
==============================================  ============================================  =========

"diag" is ``diagnostics/step_*.npz`` (``trainer.diag_every=N``), "lora" is ``lora_final.safetensors``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Callable, Sequence

import numpy as np

from anlr_jax import rundir
from anlr_jax.analysis import file_names
from anlr_jax.analysis import figure_data, measures
from anlr_jax.analysis.logs import RunLogs, load_run
from anlr_jax.analysis.tables import write_csv, write_markdown


def _figures():
  """:mod:`anlr_jax.analysis.figures`, imported (with matplotlib) when a figure is drawn: the
  command line imports this module at every start."""
  from anlr_jax.analysis import figures

  return figures


__all__ = ['AnalysisReport', 'analyze', 'bar_modules']

_DIAG_FILES = f'{rundir.DIAGNOSTICS_DIR}/step_*.npz'


@dataclasses.dataclass
class AnalysisReport:
  """What :func:`analyze` wrote (``files``) and could not draw (``missing``)."""

  files: list[str]
  missing: list[str]
  summary: list[dict]


def bar_modules(run: RunLogs, count: int = 4) -> list[str]:
  """Up to ``count`` modules spread evenly over the range of final max/min velocity ratios."""
  names = sorted(run.nu_bar)
  ratios = np.array([measures.max_min_ratio(run.nu_bar[n][-1]) for n in names])
  order = np.argsort(np.where(np.isfinite(ratios), ratios, np.finfo(np.float64).max), kind='stable')
  picks = np.unique(np.linspace(0, len(names) - 1, min(count, len(names))).round().astype(int))
  return [names[order[i]] for i in picks]


def _module_for(run: RunLogs, wanted: str | None) -> str:
  if wanted is not None and wanted in run.nu_bar:
    return wanted
  if wanted is not None and run.nu_bar:
    raise KeyError(
        f'--module {wanted!r} is not a module of '
        f'{os.path.join(run.run_dir, rundir.DIAGNOSTICS_DIR)}; '
        f'some modules: {sorted(run.nu_bar)[:5]}'
    )
  return figure_data.representative_module(run)


@dataclasses.dataclass
class _Output:
  """The output directory, what has been written to it and what could not be drawn, in order."""

  out: str
  files: list[str]
  missing: list[str]

  def path(self, stem: str, ext: str) -> str:
    return os.path.join(self.out, f'{stem}.{ext}')

  def csv(self, stem: str, rows: list[dict]) -> None:
    self.files.append(write_csv(self.path(stem, 'csv'), rows))

  def png(self, written: str) -> None:
    self.files.append(written)


def _velocity_bars(o: _Output, diag_runs: list[RunLogs]) -> None:
  """Fig. 1: each rank's final velocity over its module's mean, a few modules per run."""
  bars = {run.run_dir: figure_data.velocity_bars(run) for run in diag_runs}
  stem = file_names.FIG1_VELOCITY_BARS
  o.csv(stem, [dict(run=r.label, **row) for r in diag_runs for row in bars[r.run_dir]])
  o.png(
      _figures().velocity_bars_figure(
          [(r.label, bars[r.run_dir], bar_modules(r)) for r in diag_runs], o.path(stem, 'png')
      )
  )


def _velocity_trajectory(
    o: _Output, diag_runs: list[RunLogs], chosen: dict[str, str], stability: dict[str, dict]
) -> None:
  """Fig. 2a: per-rank velocity over steps in one module, and the ordering's stability."""
  stem = file_names.FIG2A_VELOCITY_TRAJECTORY
  o.csv(
      stem,
      [
          dict(run=r.label, module=chosen[r.run_dir], step=int(s), rank=k, velocity=float(v))
          for r in diag_runs
          for s, nu in zip(r.steps, r.nu_bar[chosen[r.run_dir]])
          for k, v in enumerate(nu)
      ],
  )
  if any(stability.values()):
    o.csv(
        file_names.FIG2A_ORDERING_STABILITY,
        [
            dict(run=r.label, module=m, spearman=rho)
            for r in diag_runs
            for m, rho in stability[r.run_dir].items()
        ],
    )
  else:
    o.missing.append(
        'fig2a_ordering_stability: needs at least 2 diagnostic snapshots per run '
        '(lower trainer.diag_every).'
    )
  o.png(
      _figures().velocity_trajectory_figure(
          [
              (
                  r.label,
                  chosen[r.run_dir],
                  r.steps,
                  r.nu_bar[chosen[r.run_dir]],
                  list(stability[r.run_dir].values()),
              )
              for r in diag_runs
          ],
          o.path(stem, 'png'),
      )
  )


def _quartile_magnitude(o: _Output, diag_runs: list[RunLogs]) -> None:
  """Fig. 2b: the contribution magnitude of each velocity quartile over steps."""
  quart = {r.run_dir: figure_data.quartile_magnitude(r) for r in diag_runs}
  stem = file_names.FIG2B_QUARTILE_MAGNITUDE
  o.csv(
      stem,
      [
          dict(
              run=r.label,
              step=int(s),
              source=quart[r.run_dir][2],
              **{f'q{q + 1}': float(m[q]) for q in range(4)},
          )
          for r in diag_runs
          for s, m in zip(quart[r.run_dir][0], quart[r.run_dir][1])
      ],
  )
  o.png(
      _figures().quartile_magnitude_figure(
          [(r.label, *quart[r.run_dir]) for r in diag_runs], o.path(stem, 'png')
      )
  )


def _log_multipliers(o: _Output, diag_runs: list[RunLogs], chosen: dict[str, str]) -> None:
  """Fig. 3a: log s_k of one module over steps, for the runs that log multipliers."""
  heat_runs = [r for r in diag_runs if chosen[r.run_dir] in r.multipliers]
  if not heat_runs:
    return
  heat = {r.run_dir: figure_data.log_multipliers(r, chosen[r.run_dir]) for r in heat_runs}
  stem = file_names.FIG3A_LOG_MULTIPLIERS
  o.csv(
      stem,
      [
          dict(run=r.label, module=chosen[r.run_dir], step=int(s), rank=k, log_s=float(v))
          for r in heat_runs
          for s, ls in zip(*heat[r.run_dir])
          for k, v in enumerate(ls)
      ],
  )
  o.png(
      _figures().multiplier_heatmap_figure(
          [(r.label, chosen[r.run_dir], *heat[r.run_dir]) for r in heat_runs],
          o.path(stem, 'png'),
      )
  )


def _velocity_vs_concentration(
    o: _Output, diag_runs: list[RunLogs], spectra: dict[str, dict]
) -> None:
  """Fig. 2c: a module's velocity anisotropy against its adapter's energy concentration."""
  both = [r for r in diag_runs if spectra[r.run_dir]]
  conc = {r.run_dir: figure_data.velocity_vs_concentration(r, spectra[r.run_dir]) for r in both}
  both = [r for r in both if conc[r.run_dir]]
  if not both:
    o.missing.append(
        f'fig2c not drawn: needs {_DIAG_FILES} and {rundir.LORA_FILE} with '
        'matching module names in the same run.'
    )
    return
  stem = file_names.FIG2C_VELOCITY_VS_CONCENTRATION
  o.csv(stem, [dict(run=r.label, **row) for r in both for row in conc[r.run_dir]])
  o.png(
      _figures().concentration_figure(
          [
              (
                  r.label,
                  conc[r.run_dir],
                  figure_data.cumulative_energy_by_velocity_group(
                      conc[r.run_dir], spectra[r.run_dir]
                  ),
              )
              for r in both
          ],
          o.path(stem, 'png'),
      )
  )


def _cumulative_energy(
    o: _Output, runs: list[RunLogs], spectra: dict[str, dict]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Fig. 3b: mean cumulative singular energy of the adapters; returns each run's (share, cum.)."""
  energy = {
      r.run_dir: figure_data.cumulative_energy_mean(spectra[r.run_dir])
      for r in runs
      if spectra[r.run_dir]
  }
  spec_runs = [r for r in runs if r.run_dir in energy]
  if not spec_runs:
    o.missing.append(f'fig3b not drawn: no run has {rundir.LORA_FILE}.')
    return energy
  stem = file_names.FIG3B_CUMULATIVE_ENERGY
  o.csv(
      stem,
      [
          dict(run=r.label, index=i + 1, energy_share=float(p), cumulative_energy=float(c))
          for r in spec_runs
          for i, (p, c) in enumerate(zip(*energy[r.run_dir]))
      ],
  )
  o.png(
      _figures().cumulative_energy_figure(
          [(r.label, energy[r.run_dir][1]) for r in spec_runs], o.path(stem, 'png')
      )
  )
  return energy


def _energy_shift(o: _Output, runs: list[RunLogs], energy: dict[str, tuple]) -> None:
  """Fig. 3c: the per-index energy share of run B minus run A."""
  spec_runs = [r for r in runs if r.run_dir in energy]
  if len(spec_runs) != 2:
    o.missing.append(
        f'fig3c not drawn: needs {rundir.LORA_FILE} in both runs.'
        if len(runs) == 2
        else 'fig3c not drawn: needs two runs (anlr analyze RUN_LORA RUN_ANLR).'
    )
    return
  a, b = spec_runs
  pa, pb = energy[a.run_dir][0], energy[b.run_dir][0]
  if len(pa) != len(pb):
    o.missing.append(f'fig3c not drawn: the runs have different ranks ({len(pa)} vs {len(pb)}).')
    return
  shift = measures.energy_shift(pa, pb)
  stem = file_names.FIG3C_ENERGY_SHIFT
  o.csv(
      stem,
      [
          dict(index=i + 1, share_a=float(x), share_b=float(y), shift=float(s))
          for i, (x, y, s) in enumerate(zip(pa, pb, shift))
      ],
  )
  o.png(_figures().energy_shift_figure(shift, a.label, b.label, o.path(stem, 'png')))


def _summary(o: _Output, runs: list[RunLogs], spectra: dict, stability: dict) -> list[dict]:
  """The summary table, runs side by side, as CSV and Markdown."""
  summary = [
      figure_data.summary_row(r, spectra[r.run_dir], stability.get(r.run_dir, {})) for r in runs
  ]
  o.csv(
      file_names.ANALYSIS_SUMMARY,
      [
          dict(metric=key, description=desc, **{r.label: s[key] for r, s in zip(runs, summary)})
          for key, desc in figure_data.SUMMARY_COLUMNS
      ],
  )
  o.files.append(
      write_markdown(
          o.path(file_names.ANALYSIS_SUMMARY, 'md'),
          ['metric'] + [r.label for r in runs],
          [[desc] + [s[key] for s in summary] for key, desc in figure_data.SUMMARY_COLUMNS],
          title='Rank-one dynamics summary',
      )
  )
  return summary


def analyze(
    run_dirs: Sequence[str],
    out: str,
    *,
    module: str | None = None,
    early_fraction: float = 0.1,
    log: Callable[[str], None] | None = None,
) -> AnalysisReport:
  """Draws every figure the runs' logs allow; see the module docstring for the files.

  Args:
    run_dirs: one run directory, or two (A = LoRA, B = AnLR) to compare.
    out: output directory (created).
    module: the module of Fig. 2a / 3a (default: the median-anisotropy module of the first run).
    early_fraction: early window of the ordering-stability Spearman rho (fraction of snapshots).
    log: where messages go (default: stderr).

  Raises:
    ValueError: not one or two run directories. FileNotFoundError: a run directory that does not exist.
  """
  log = log or (lambda message: print(message, file=sys.stderr))
  if len(run_dirs) not in (1, 2):
    raise ValueError(f'anlr analyze takes one or two run directories, got {len(run_dirs)}')
  runs = [load_run(d) for d in run_dirs]
  if len(runs) == 2 and runs[0].label == runs[1].label:
    runs[0].label, runs[1].label = f'A: {runs[0].label}', f'B: {runs[1].label}'
  os.makedirs(out, exist_ok=True)
  o = _Output(out, files=[], missing=[m for run in runs for m in run.missing])
  diag_runs = [run for run in runs if run.has_diagnostics]
  spectra = {run.run_dir: figure_data.module_spectra(run) for run in runs}

  stability = {}
  if diag_runs:
    first = _module_for(diag_runs[0], module)
    chosen = {r.run_dir: first if first in r.nu_bar else _module_for(r, None) for r in diag_runs}
    stability = {
        r.run_dir: figure_data.ordering_stability_by_module(r, early_fraction=early_fraction)
        for r in diag_runs
    }
    _velocity_bars(o, diag_runs)
    _velocity_trajectory(o, diag_runs, chosen, stability)
    _quartile_magnitude(o, diag_runs)
    _log_multipliers(o, diag_runs, chosen)
  else:
    o.missing.append(
        f'fig1, fig2a, fig2b, fig3a not drawn: no run has {_DIAG_FILES} '
        '(train with trainer.diag_every=N).'
    )
  _velocity_vs_concentration(o, diag_runs, spectra)
  energy = _cumulative_energy(o, runs, spectra)
  _energy_shift(o, runs, energy)
  summary = _summary(o, runs, spectra, stability)

  if o.missing:
    missing_file = os.path.join(out, file_names.MISSING_FILE)
    with open(missing_file, 'w') as f:
      f.write('\n'.join(o.missing) + '\n')
    o.files.append(missing_file)
    for message in o.missing:
      log(f'anlr analyze: {message}')
  return AnalysisReport(files=o.files, missing=o.missing, summary=summary)

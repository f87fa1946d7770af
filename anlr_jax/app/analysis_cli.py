"""Entry points of ``anlr analyze`` and ``anlr sweep`` (dispatched from the ``anlr`` command).

``anlr analyze RUN_DIR [RUN_DIR_B] [--out DIR] [--module NAME] [--early-fraction F]`` (``--out``
defaults to the ``analysis/`` folder of the last run directory given: ``RUN_DIR_B/analysis`` when
comparing two)
``anlr sweep --config CFG --methods lora,anlr --lrs 1e-4,2e-4 [--seeds 0,1] [--out DIR] [key=value ...]``
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

from anlr_jax import rundir
from anlr_jax.analysis import file_names
from anlr_jax.analysis.analyze import analyze
from anlr_jax.analysis.sweep import (
    BaseRunner,
    Runner,
    base_runner,
    grid,
    run_sweep,
    subprocess_runner,
    write_sweep_report,
)
from anlr_jax.app.config import ConfigError, load_config
from anlr_jax.methods import METHOD_NAMES
from anlr_jax.app.paths import find_config

__all__ = ['analyze_main', 'sweep_main']


def _analyze_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog='anlr analyze',
      description="Draw the paper's rank-one analysis figures (PNG + CSV) and summary table from a run "
      'directory, or compare two (RUN_DIR = LoRA, RUN_DIR_B = AnLR).',
  )
  p.add_argument('run_dirs', nargs='+', metavar='RUN_DIR', help='one or two run directories')
  p.add_argument(
      '--out',
      default=None,
      help=f'output directory (default: {rundir.ANALYSIS_DIR}/ in the last run directory given: '
      f'RUN_DIR/{rundir.ANALYSIS_DIR}, or RUN_DIR_B/{rundir.ANALYSIS_DIR} when comparing two)',
  )
  p.add_argument(
      '--module', default=None, help='module of Fig. 2a / 3a (default: median anisotropy)'
  )
  p.add_argument(
      '--early-fraction',
      type=float,
      default=0.1,
      help='early window of the ordering-stability Spearman rho, fraction of snapshots',
  )
  return p


def analyze_main(argv: Sequence[str] | None = None) -> int:
  """``anlr analyze``; returns the exit status (0, or 2 for bad arguments / unreadable runs)."""
  parser = _analyze_parser()
  args = parser.parse_args(argv)
  if len(args.run_dirs) > 2:
    parser.error(f'at most two RUN_DIRs (got {len(args.run_dirs)}: {args.run_dirs})')
  if not 0.0 < args.early_fraction < 1.0:
    parser.error(f'--early-fraction={args.early_fraction} must be in (0, 1)')
  out = args.out or os.path.join(args.run_dirs[-1], rundir.ANALYSIS_DIR)
  try:
    report = analyze(args.run_dirs, out, module=args.module, early_fraction=args.early_fraction)
  except (FileNotFoundError, ValueError, KeyError) as e:
    print(f'anlr analyze: error: {e}', file=sys.stderr)
    return 2
  print(f'anlr analyze: wrote {len(report.files)} files to {out}')
  return 0


def _csv(kind, name: str):
  def parse(text: str):
    try:
      values = [kind(v) for v in text.split(',') if v.strip()]
    except ValueError:
      raise argparse.ArgumentTypeError(
          f'{name}: cannot parse {text!r} as comma-separated {kind.__name__}s'
      )
    if not values:
      raise argparse.ArgumentTypeError(f'{name}: empty list')
    return values

  return parse


def _sweep_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog='anlr sweep',
      description='Run `anlr train` over methods x learning rates x seeds (resumable: cells with a '
      f'{rundir.RESULTS_FILE} are skipped), then write {file_names.SWEEP_RESULTS_CSV}, '
      f'{file_names.SWEEP_SUMMARY}.{{csv,md}} and {file_names.SWEEP_PLOT}.',
  )
  p.add_argument('--config', required=True, help='training config passed to every cell')
  p.add_argument(
      '--methods', required=True, type=_csv(str, '--methods'), help='e.g. lora,rslora,loraplus,anlr'
  )
  p.add_argument('--lrs', required=True, type=_csv(float, '--lrs'), help='e.g. 5e-5,1e-4,2e-4,3e-4')
  p.add_argument('--seeds', default=[0], type=_csv(int, '--seeds'), help='e.g. 0,1 (default 0)')
  p.add_argument('--out', default='runs/sweep', help='sweep directory (default runs/sweep)')
  p.add_argument('--report-only', action='store_true', help='only (re)write the tables and plot')
  p.add_argument('overrides', nargs='*', metavar='key=value', help='extra overrides for every cell')
  return p


def sweep_main(
    argv: Sequence[str] | None = None,
    *,
    runner: Runner | None = None,
    base: BaseRunner | None = None,
) -> int:
  """``anlr sweep``; ``runner`` and ``base`` replace the default subprocess runners of the cells and
  of the base model (tests). Returns the exit status (0; 1 when a cell failed, after writing the
  report of the finished cells; 2 bad arguments).
  """
  parser = _sweep_parser()
  args = parser.parse_args(argv)
  for item in args.overrides:
    key, sep, _ = item.partition('=')
    if not sep or not key:
      parser.error(f'override {item!r} is not key=value')
    if key in ('run_dir', 'method', 'seed', 'trainer.learning_rate', 'compare'):
      parser.error(f'override {item!r}: {key} is set per cell by the sweep')
  try:
    args.config = find_config(args.config)
  except FileNotFoundError as err:
    parser.error(f'--config {err}')
  unknown = [m for m in args.methods if m not in METHOD_NAMES]
  if unknown:
    parser.error(f'--methods: unknown {unknown}; allowed: {", ".join(METHOD_NAMES)}')
  try:
    cells = grid(args.methods, args.lrs, args.seeds)
  except ValueError as e:
    parser.error(str(e))
  try:
    config = load_config(args.config, args.overrides)
  except (ConfigError, ValueError, OSError) as err:
    parser.error(str(err))
  runner = runner or subprocess_runner(args.config, args.overrides)
  if config.eval.include_base and config.eval.tasks:  # scored once, in <out>/base
    base = base or base_runner(args.config, args.overrides)
  else:
    base = None
  logging.basicConfig(level=logging.INFO, format='%(message)s')
  status = 0
  if not args.report_only:
    try:
      run_sweep(cells, args.out, runner, log=lambda m: print(m, file=sys.stderr), base=base)
    except (RuntimeError, OSError) as e:
      print(
          f'anlr sweep: error: {e}\nanlr sweep: re-run the same command to resume.', file=sys.stderr
      )
      status = 1
  paths = write_sweep_report(cells, args.out, normalization=config.eval.normalization)
  print(
      f"anlr sweep: table {paths['markdown']}"
      + (f", plot {paths['plot']}" if 'plot' in paths else '')
  )
  return status

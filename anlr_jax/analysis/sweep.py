r"""``anlr sweep``: a methods x learning rates x seeds grid of ``anlr train`` runs, resumable, with the
paper's LR-robustness table (Tab. 7) and plot (Fig. 5).

Each cell ``(method, lr, seed)`` runs in ``<out>/<method>/lr<lr>/seed<seed>``; a cell whose
``results.json`` exists is finished and never run again, so re-running an interrupted sweep completes
only the rest. Per method and LR the table gives the mean and the sample standard deviation
(``ddof=1``; 0 for a single seed) of ``results.json["avg"]`` over the finished seeds:
:math:`\bar a = \frac1n\sum_i a_i`, :math:`s = \sqrt{\frac{1}{n-1}\sum_i (a_i - \bar a)^2}`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from typing import Callable, Sequence

import numpy as np

from anlr_jax import rundir
from anlr_jax.results import read_results
from anlr_jax.analysis.tables import write_csv, write_markdown

__all__ = [
    'SweepCell',
    'Runner',
    'grid',
    'cell_dir',
    'subprocess_runner',
    'run_sweep',
    'collect_results',
    'aggregate',
    'write_sweep_report',
]

logger = logging.getLogger('anlr_jax.sweep')


@dataclasses.dataclass(frozen=True)
class SweepCell:
  """One run of the grid."""

  method: str
  learning_rate: float
  seed: int

  def describe(self) -> str:
    return f'method={self.method} lr={self.learning_rate:g} seed={self.seed}'

  def overrides(self) -> list[str]:
    """The run-config overrides that make a run this cell (each field's key in :data:`CELL_KEYS`)."""
    values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    # repr keeps every digit of a float; names and seeds go as they are
    return [
        f'{CELL_KEYS[k]}={v!r}' if isinstance(v, float) else f'{CELL_KEYS[k]}={v}'
        for k, v in values.items()
    ]


CELL_KEYS = {'method': 'method', 'learning_rate': 'trainer.learning_rate', 'seed': 'seed'}
"""Each :class:`SweepCell` field's run-config key; the fields are also the first result columns."""


Runner = Callable[[SweepCell, str], None]
"""Runs one cell so that it leaves ``<run_dir>/results.json``; raises on failure."""


def grid(
    methods: Sequence[str], learning_rates: Sequence[float], seeds: Sequence[int]
) -> list[SweepCell]:
  """All cells, method-major then LR then seed. Raises ``ValueError`` on an empty or repeated axis."""
  for name, values in (('methods', methods), ('learning rates', learning_rates), ('seeds', seeds)):
    if not values:
      raise ValueError(f'sweep: no {name} given')
    if len(set(values)) != len(values):
      raise ValueError(f'sweep: repeated {name}: {list(values)}')
  for lr in learning_rates:
    if not lr > 0:
      raise ValueError(f'sweep: learning rate {lr} must be > 0')
  return [SweepCell(m, float(lr), int(s)) for m in methods for lr in learning_rates for s in seeds]


def cell_dir(out: str, cell: SweepCell) -> str:
  """``<out>/<method>/lr<lr:g>/seed<seed>`` (:func:`anlr_jax.rundir.sweep_cell_dir`)."""
  return rundir.sweep_cell_dir(out, cell.method, cell.learning_rate, cell.seed)


def subprocess_runner(
    config: str, overrides: Sequence[str] = (), *, python: str = sys.executable
) -> Runner:
  """The default runner: ``python -m anlr_jax train --config CONFIG run_dir=<cell dir>
  method=<m> trainer.learning_rate=<lr> seed=<s> compare=[] *overrides`` (the cell's keys are
  :data:`CELL_KEYS`), output to
  ``<cell dir>/train.log``. ``compare=[]`` because a config's ``compare`` list would replace ``method``.
  """

  def run(cell: SweepCell, run_dir: str) -> None:
    os.makedirs(run_dir, exist_ok=True)
    command = [
        python,
        '-m',
        'anlr_jax',  # the `anlr` command (anlr_jax/__main__.py), wherever its CLI module lives
        'train',
        '--config',
        config,
        f'run_dir={run_dir}',
        *cell.overrides(),
        'compare=[]',
        # each cell checkpoints into its own directory, unless the overrides say otherwise
        *(
            []
            if any(o.startswith('trainer.ckpt_dir=') for o in overrides)
            else [f'trainer.ckpt_dir={{run_dir}}/{rundir.CHECKPOINTS_DIR}']
        ),
        *overrides,
    ]
    log_path = os.path.join(run_dir, rundir.TRAIN_LOG)
    with open(log_path, 'a') as log_file:
      log_file.write('$ ' + ' '.join(command) + '\n')
      log_file.flush()
      code = subprocess.call(command, stdout=log_file, stderr=subprocess.STDOUT)
    if code:
      raise RuntimeError(f'sweep cell {cell.describe()} failed (exit {code}); see {log_path}')

  return run


def _results_path(out: str, cell: SweepCell) -> str:
  return os.path.join(cell_dir(out, cell), rundir.RESULTS_FILE)


def run_sweep(
    cells: Sequence[SweepCell],
    out: str,
    runner: Runner,
    *,
    log: Callable[[str], None] | None = None,
    progress: bool | None = None,
) -> list[SweepCell]:
  """Runs every unfinished cell in order; returns the cells it ran.

  A cell is finished when ``<cell dir>/results.json`` exists (it is then skipped, the runner not
  called). A runner that raises stops the sweep (the exception propagates); finished cells stay, so
  calling again resumes after them.

  Raises:
    RuntimeError: the runner returned without writing ``results.json`` (names the file).
  """
  log = log or logger.info
  todo = [c for c in cells if not os.path.exists(_results_path(out, c))]
  done = len(cells) - len(todo)
  log(f'sweep: {len(cells)} cells, {done} finished, {len(todo)} to run -> {out}')
  bar = None
  use_bar = sys.stderr.isatty() if progress is None else progress
  if use_bar and todo:
    from tqdm.auto import tqdm

    bar = tqdm(total=len(cells), initial=done, desc='sweep', dynamic_ncols=True)
  ran = []
  try:
    for i, cell in enumerate(todo):
      run_dir = cell_dir(out, cell)
      log(f'sweep [{done + i + 1}/{len(cells)}] {cell.describe()} -> {run_dir}')
      runner(cell, run_dir)
      if not os.path.exists(_results_path(out, cell)):
        raise RuntimeError(
            f'sweep cell {cell.describe()} finished without writing ' f'{_results_path(out, cell)}'
        )
      ran.append(cell)
      if bar is not None:
        bar.update(1)
  finally:
    if bar is not None:
      bar.close()
  return ran


def collect_results(cells: Sequence[SweepCell], out: str) -> list[dict]:
  """One row per finished cell: ``method, learning_rate, seed, avg`` and ``acc/<task>`` columns.

  Raises:
    ValueError: a ``results.json`` without a numeric ``avg`` (names the file).
  """
  rows = []
  for cell in cells:
    path = _results_path(out, cell)
    result = read_results(cell_dir(out, cell))
    if result is None:
      continue
    if isinstance(result.avg, bool) or not isinstance(result.avg, (int, float)):
      raise ValueError(f'{path}: needs a numeric "avg" (got {result.avg!r})')
    row = dict(dataclasses.asdict(cell), avg=float(result.avg))
    row.update({f'acc/{task}': float(v) for task, v in (result.accuracy or {}).items()})
    rows.append(row)
  return rows


def aggregate(rows: Sequence[dict], metric: str = 'avg') -> list[dict]:
  """Mean and sample std (``ddof=1``; 0 for one seed) of ``metric`` per (method, learning rate), in
  first-seen order: rows ``method, learning_rate, n, mean, std``."""
  groups: dict[tuple[str, float], list[float]] = {}
  for row in rows:
    if metric in row:
      groups.setdefault((row['method'], row['learning_rate']), []).append(float(row[metric]))
  out = []
  for (method, lr), values in groups.items():
    v = np.asarray(values)
    out.append(
        dict(
            method=method,
            learning_rate=lr,
            n=len(v),
            mean=float(v.mean()),
            std=float(v.std(ddof=1)) if len(v) > 1 else 0.0,
        )
    )
  return out


def write_sweep_report(cells: Sequence[SweepCell], out: str) -> dict[str, str]:
  """Writes ``results.csv`` (one row per finished cell), ``summary.csv``, ``summary.md`` (methods x
  LRs, ``mean ± std (n)``) and ``accuracy_vs_lr.png`` into ``out``; returns their paths by name."""
  from anlr_jax.analysis.figures import accuracy_vs_lr_figure

  rows = collect_results(cells, out)
  table = aggregate(rows)
  paths = dict(
      results=write_csv(os.path.join(out, rundir.SWEEP_RESULTS_CSV), rows),
      summary=write_csv(
          os.path.join(out, f'{rundir.SWEEP_SUMMARY}.csv'),
          table,
          ['method', 'learning_rate', 'n', 'mean', 'std'],
      ),
  )
  lrs = sorted({c.learning_rate for c in cells})
  methods = list(dict.fromkeys(c.method for c in cells))
  cell_text = {
      (r['method'], r['learning_rate']): f"{r['mean']:.4g} ± {r['std']:.2g} ({r['n']})"
      for r in table
  }
  paths['markdown'] = write_markdown(
      os.path.join(out, f'{rundir.SWEEP_SUMMARY}.md'),
      ['method'] + [f'{lr:g}' for lr in lrs],
      [[m] + [cell_text.get((m, lr), '-') for lr in lrs] for m in methods],
      title='Accuracy (avg) vs learning rate: mean ± std (seeds)',
  )
  if table:
    paths['plot'] = accuracy_vs_lr_figure(table, os.path.join(out, rundir.SWEEP_PLOT))
  return paths

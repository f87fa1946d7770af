r"""``anlr sweep``: a methods x learning rates x seeds grid of ``anlr train`` runs, resumable, with the
paper's LR-robustness table (Tab. 7) and plot (Fig. 5).

Each cell ``(method, lr, seed)`` runs in ``<out>/<method>/lr<lr>/seed<seed>``; a cell whose
``results.json`` exists is finished and never run again, so re-running an interrupted sweep completes
only the rest. The base model, when the config scores it (``eval.include_base``), is scored once in
``<out>/base`` rather than in every cell. Per method and LR the table gives the mean and the sample
standard deviation (``ddof=1``; 0 for a single seed) of ``results.json["avg"]`` over the finished
seeds: :math:`\bar a = \frac1n\sum_i a_i`, :math:`s = \sqrt{\frac{1}{n-1}\sum_i (a_i - \bar a)^2}`.

Paired tests (``paired.{csv,md}``): at each learning rate, for each pair of methods ``(a, b)``, the
questions both answered (the same task, question and seed, from each run's ``eval_<task>.jsonl``)
are pooled over tasks and seeds; with ``n_a`` the questions only ``a`` got right and ``n_b`` those
only ``b`` did, the exact McNemar test gives the two-sided
:math:`p = \min(1, 2 \sum_{k \le \min(n_a, n_b)} \binom{n_a + n_b}{k} 2^{-(n_a + n_b)})`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
from typing import Callable, Sequence

import numpy as np

from anlr_jax import fileio, rundir
from anlr_jax.analysis import file_names
from anlr_jax.analysis.results import read_results
from anlr_jax.analysis.tables import write_csv, write_markdown

__all__ = [
    'SweepCell',
    'Runner',
    'grid',
    'run_order',
    'cell_dir',
    'subprocess_runner',
    'run_sweep',
    'collect_results',
    'aggregate',
    'write_sweep_report',
    'base_runner',
    'base_result',
    'mcnemar_exact',
    'paired_tests',
    'per_task_table',
    'question_outcomes',
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
  """``<out>/<method>/lr<lr:g>/seed<seed>`` (:func:`anlr_jax.file_names.sweep_cell_dir`)."""
  return file_names.sweep_cell_dir(out, cell.method, cell.learning_rate, cell.seed)


def subprocess_runner(
    config: str, overrides: Sequence[str] = (), *, python: str = sys.executable
) -> Runner:
  """The default runner: ``python -m anlr_jax train --config CONFIG run_dir=<cell dir>
  method=<m> trainer.learning_rate=<lr> seed=<s> compare=[] eval.include_base=false *overrides``
  (the cell's keys are :data:`CELL_KEYS`), output to ``<cell dir>/train.log``. ``compare=[]``
  because a config's ``compare`` list would replace ``method``; the base model is scored once by
  :func:`base_runner`, not in every cell.
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
        'eval.include_base=false',  # the sweep scores the base model once (base_runner)
        # each cell checkpoints into its own directory, unless the overrides say otherwise
        *(
            []
            if any(o.startswith('trainer.ckpt_dir=') for o in overrides)
            else [f'trainer.ckpt_dir={{run_dir}}/{rundir.CHECKPOINTS_DIR}']
        ),
        *overrides,
    ]
    log_path = os.path.join(run_dir, file_names.TRAIN_LOG)
    with open(log_path, 'a') as log_file:
      log_file.write('$ ' + ' '.join(command) + '\n')
      log_file.flush()
      code = subprocess.call(command, stdout=log_file, stderr=subprocess.STDOUT)
    if code:
      raise RuntimeError(f'sweep cell {cell.describe()} failed (exit {code}); see {log_path}')

  return run


SWEEP_PER_TASK = 'per_task'
SWEEP_PAIRED = 'paired'
BASE_DIR = 'base'
"""``<out>/base``: the base model's scores (``anlr eval`` without an adapter), once per sweep."""

BaseRunner = Callable[[str], None]
"""Scores the base model so that it leaves ``<run_dir>/results.json``; raises on failure."""


def base_runner(
    config: str, overrides: Sequence[str] = (), *, python: str = sys.executable
) -> BaseRunner:
  """``python -m anlr_jax eval --config CONFIG --out <out>/base *overrides``, output to
  ``<out>/base/eval.log``: the base model on the config's ``eval.tasks``."""

  def run(run_dir: str) -> None:
    os.makedirs(run_dir, exist_ok=True)
    command = [python, '-m', 'anlr_jax', 'eval', '--config', config, '--out', run_dir, *overrides]
    log_path = os.path.join(run_dir, 'eval.log')
    with open(log_path, 'a') as log_file:
      log_file.write('$ ' + ' '.join(command) + '\n')
      log_file.flush()
      code = subprocess.call(command, stdout=log_file, stderr=subprocess.STDOUT)
    if code:
      raise RuntimeError(f'sweep: scoring the base model failed (exit {code}); see {log_path}')

  return run


def _results_path(out: str, cell: SweepCell) -> str:
  return os.path.join(cell_dir(out, cell), rundir.RESULTS_FILE)


def run_order(cells: Sequence[SweepCell]) -> list[SweepCell]:
  """``cells`` in the order a sweep runs them: seed-major, then learning rate (in the given order),
  then method. A sweep stopped part-way has then run every method at each (seed, learning rate) it
  finished, so what it has is compared in pairs; the reports keep :func:`grid`'s order."""
  seeds = list(dict.fromkeys(c.seed for c in cells))
  lrs = list(dict.fromkeys(c.learning_rate for c in cells))
  return sorted(cells, key=lambda c: (seeds.index(c.seed), lrs.index(c.learning_rate)))


def run_sweep(
    cells: Sequence[SweepCell],
    out: str,
    runner: Runner,
    *,
    log: Callable[[str], None] | None = None,
    progress: bool | None = None,
    base: BaseRunner | None = None,
) -> list[SweepCell]:
  """Runs ``base`` (when given and ``<out>/base/results.json`` is missing), then every unfinished
  cell in :func:`run_order`; returns the cells it ran.

  A cell is finished when ``<cell dir>/results.json`` exists (it is then skipped, the runner not
  called). A runner that raises stops the sweep (the exception propagates); finished cells stay, so
  calling again resumes after them.

  Raises:
    RuntimeError: the runner returned without writing ``results.json`` (names the file).
  """
  log = log or logger.info
  base_dir = os.path.join(out, BASE_DIR)
  if base is not None and not os.path.exists(os.path.join(base_dir, rundir.RESULTS_FILE)):
    log(f'sweep: scoring the base model -> {base_dir}')
    base(base_dir)
    if not os.path.exists(os.path.join(base_dir, rundir.RESULTS_FILE)):
      raise RuntimeError(
          f'sweep: the base model was scored without writing '
          f'{os.path.join(base_dir, rundir.RESULTS_FILE)}'
      )
  todo = [c for c in run_order(cells) if not os.path.exists(_results_path(out, c))]
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


def base_result(out: str) -> dict | None:
  """The base model's ``{'accuracy': {task: acc}, 'avg': a}`` of ``<out>/base``, or None."""
  result = read_results(os.path.join(out, BASE_DIR))
  if result is None or result.avg is None:
    return None
  return {'accuracy': dict(result.accuracy), 'avg': float(result.avg)}


def question_outcomes(run_dir: str, task: str, normalization: str) -> dict[str, bool]:
  """``{question id: answered right}`` of one task of a run, from ``<run_dir>/eval_<task>.jsonl``:
  a generated answer's ``correct``, a program's ``passed``, or for a log-likelihood record whether
  its prediction under ``normalization`` is the gold choice. Empty when the file is missing.

  Raises:
    ValueError: a record none of these apply to (names the file and line).
  """
  path = rundir.eval_records_path(run_dir, task)
  if not os.path.isfile(path):
    return {}
  outcomes = {}
  for line_no, record in fileio.read_jsonl_lines(path):
    key = str(record.get('id', record.get('task_id', record.get('index'))))
    if 'correct' in record:
      outcomes[key] = bool(record['correct'])
    elif 'passed' in record:
      outcomes[key] = bool(record['passed'])
    elif normalization in record.get('predictions', {}) and 'gold' in record:
      outcomes[key] = record['predictions'][normalization] == record['gold']
    else:
      raise ValueError(
          f'{path}:{line_no}: a record without correct, passed or predictions[{normalization!r}]'
      )
  return outcomes


def mcnemar_exact(only_a: int, only_b: int) -> float:
  """Two-sided exact McNemar p-value of ``only_a`` vs ``only_b`` discordant pairs (1 when none)."""
  n = only_a + only_b
  if n == 0:
    return 1.0
  from scipy.stats import binomtest

  return float(binomtest(min(only_a, only_b), n, 0.5).pvalue)


def paired_tests(cells: Sequence[SweepCell], out: str, normalization: str) -> list[dict]:
  """Per learning rate and pair of methods (in ``cells``' method order), the questions both runs
  of the same seed answered, pooled over tasks and seeds: rows ``learning_rate, method_a,
  method_b, seeds, questions, right_a, right_b, only_a, only_b, p`` (:func:`mcnemar_exact`)."""
  finished = {
      (c.method, c.learning_rate, c.seed): cell_dir(out, c)
      for c in cells
      if os.path.exists(_results_path(out, c))
  }
  methods = list(dict.fromkeys(c.method for c in cells))
  rows = []
  for lr in sorted({c.learning_rate for c in cells}):
    for i, a in enumerate(methods):
      for b in methods[i + 1 :]:
        seeds = sorted(s for (m, l, s) in finished if m == a and l == lr and (b, lr, s) in finished)
        pairs = []
        for seed in seeds:
          dir_a, dir_b = finished[(a, lr, seed)], finished[(b, lr, seed)]
          tasks = read_results(dir_a).accuracy
          for task in tasks:
            right_a = question_outcomes(dir_a, task, normalization)
            right_b = question_outcomes(dir_b, task, normalization)
            pairs += [(right_a[q], right_b[q]) for q in right_a if q in right_b]
        if not pairs:
          continue
        only_a = sum(x and not y for x, y in pairs)
        only_b = sum(y and not x for x, y in pairs)
        rows.append(
            dict(
                learning_rate=lr,
                method_a=a,
                method_b=b,
                seeds=len(seeds),
                questions=len(pairs),
                right_a=sum(x for x, _ in pairs),
                right_b=sum(y for _, y in pairs),
                only_a=only_a,
                only_b=only_b,
                p=mcnemar_exact(only_a, only_b),
            )
        )
  return rows


def per_task_table(rows: Sequence[dict]) -> list[dict]:
  """Mean over seeds of every ``acc/<task>`` column and of ``avg`` per (method, learning rate):
  rows ``method, learning_rate, n, <task>..., avg``."""
  tasks = list(dict.fromkeys(k[4:] for row in rows for k in row if k.startswith('acc/')))
  table = []
  for agg in aggregate(rows):
    same = [
        r
        for r in rows
        if (r['method'], r['learning_rate']) == (agg['method'], agg['learning_rate'])
    ]
    entry = dict(method=agg['method'], learning_rate=agg['learning_rate'], n=agg['n'])
    for task in tasks:
      values = [r[f'acc/{task}'] for r in same if f'acc/{task}' in r]
      entry[task] = float(np.mean(values)) if values else None
    entry['avg'] = agg['mean']
    table.append(entry)
  return table


def write_sweep_report(
    cells: Sequence[SweepCell], out: str, *, normalization: str = 'char'
) -> dict[str, str]:
  """Writes ``results.csv`` (one row per finished cell), ``summary.csv``, ``summary.md`` (methods x
  LRs, ``mean ± std (n)``), ``per_task.{csv,md}`` (every task's mean over seeds), ``paired.{csv,md}``
  (:func:`paired_tests`, log-likelihood predictions under ``normalization``) and
  ``accuracy_vs_lr.png`` (with the base model as a line when ``<out>/base`` holds its scores) into
  ``out``; returns their paths by name."""
  from anlr_jax.analysis import figures

  rows = collect_results(cells, out)
  table = aggregate(rows)
  base = base_result(out)
  paths = dict(
      results=write_csv(os.path.join(out, file_names.SWEEP_RESULTS_CSV), rows),
      summary=write_csv(
          os.path.join(out, f'{file_names.SWEEP_SUMMARY}.csv'),
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
  base_rows = [['base'] + [f"{base['avg']:.4g}"] * len(lrs)] if base else []
  paths['markdown'] = write_markdown(
      os.path.join(out, f'{file_names.SWEEP_SUMMARY}.md'),
      ['method'] + [f'{lr:g}' for lr in lrs],
      [[m] + [cell_text.get((m, lr), '-') for lr in lrs] for m in methods] + base_rows,
      title='Accuracy (avg) vs learning rate: mean ± std (seeds)',
  )
  per_task = per_task_table(rows)
  if base:
    per_task.append(
        dict(method='base', learning_rate=None, n=1, **base['accuracy'], avg=base['avg'])
    )
  if per_task:
    fields = list(dict.fromkeys(k for row in per_task for k in row))
    paths['per_task'] = write_csv(os.path.join(out, f'{SWEEP_PER_TASK}.csv'), per_task, fields)
    write_markdown(
        os.path.join(out, f'{SWEEP_PER_TASK}.md'),
        ['method', 'lr', 'seeds', *fields[3:]],
        [
            [r['method'], '-' if r['learning_rate'] is None else f"{r['learning_rate']:g}", r['n']]
            + ['-' if r.get(k) is None else f'{100 * r[k]:.1f}' for k in fields[3:]]
            for r in per_task
        ],
        title='Accuracy (%) per task: mean over seeds',
    )
  paired = paired_tests(cells, out, normalization)
  if paired:
    paths['paired'] = write_csv(os.path.join(out, f'{SWEEP_PAIRED}.csv'), paired)
    write_markdown(
        os.path.join(out, f'{SWEEP_PAIRED}.md'),
        ['lr', 'a', 'b', 'seeds', 'questions', 'a right', 'b right', 'only a', 'only b', 'p'],
        [
            [f"{r['learning_rate']:g}", r['method_a'], r['method_b'], r['seeds'], r['questions']]
            + [r['right_a'], r['right_b'], r['only_a'], r['only_b'], f"{r['p']:.3g}"]
            for r in paired
        ],
        title='Paired per-question tests (exact McNemar, pooled over tasks and seeds)',
    )
  if table:
    paths['plot'] = figures.accuracy_vs_lr_figure(
        table, os.path.join(out, file_names.SWEEP_PLOT), base=None if base is None else base['avg']
    )
  return paths

"""`anlr sweep`: skips finished cells, resumes after an interruption, aggregates mean ± std like NumPy,
writes the table and plot; the default subprocess runner's command line."""

import csv
import json
import os
import stat
import sys

import chex
import numpy as np
import pytest

from anlr_jax.analysis import aggregate
from anlr_jax.app.analysis_cli import sweep_main
from anlr_jax.analysis.sweep import SweepCell, cell_dir, grid, run_order, subprocess_runner

METHODS = ('lora', 'anlr')
LRS = (5e-5, 1e-4, 2e-4)
SEEDS = (0, 1, 2)


def _accuracy(method, lr, seed):
  """A planted accuracy: anlr above lora, a peak at 1e-4, seed noise."""
  return 0.6 + 0.1 * (method == 'anlr') - 0.05 * abs(np.log10(lr) + 4) + 0.01 * seed


def _write_results(run_dir, cell):
  os.makedirs(run_dir, exist_ok=True)
  acc = _accuracy(cell.method, cell.learning_rate, cell.seed)
  with open(os.path.join(run_dir, 'results.json'), 'w') as f:
    json.dump(
        {
            'method': cell.method,
            'learning_rate': cell.learning_rate,
            'seed': cell.seed,
            'accuracy': {'boolq': acc, 'piqa': acc},
            'avg': acc,
        },
        f,
    )


class FakeRunner:
  """Writes results.json at once; raises at call number ``fail_at`` (1-based) to simulate a crash."""

  def __init__(self, fail_at=None):
    self.calls = []
    self.fail_at = fail_at

  def __call__(self, cell, run_dir):
    self.calls.append(cell)
    if self.fail_at is not None and len(self.calls) == self.fail_at:
      raise RuntimeError(f'simulated crash in {cell.describe()}')
    _write_results(run_dir, cell)


def _argv(tmp_path, *extra):
  config = tmp_path / 'cfg.yaml'
  config.write_text('method: lora\n')
  return [
      '--config',
      str(config),
      '--methods',
      ','.join(METHODS),
      '--lrs',
      ','.join(map(str, LRS)),
      '--seeds',
      ','.join(map(str, SEEDS)),
      '--out',
      str(tmp_path / 'sweep'),
      *extra,
  ]


def _all_cells():
  return grid(METHODS, LRS, SEEDS)


def test_finished_cells_are_not_run_again(tmp_path):
  out = str(tmp_path / 'sweep')
  finished = _all_cells()[::4]
  for cell in finished:
    _write_results(cell_dir(out, cell), cell)
  runner = FakeRunner()
  assert sweep_main(_argv(tmp_path), runner=runner) == 0
  assert set(runner.calls) == set(_all_cells()) - set(finished)
  assert len(runner.calls) == len(_all_cells()) - len(finished)
  again = FakeRunner()
  assert sweep_main(_argv(tmp_path), runner=again) == 0
  assert again.calls == []


def test_a_sweep_runs_every_method_of_a_seed_and_rate_before_the_next():
  """Stopped after any cell, a sweep has every method at each (seed, LR) it finished but the last:
  its results compare the methods in pairs. The reports keep the grid's method-major order."""
  order = run_order(_all_cells())
  assert len(order) == len(_all_cells()) and set(order) == set(_all_cells())
  n = len(METHODS)
  for i in range(0, len(order), n):
    block = order[i : i + n]
    assert [c.method for c in block] == list(METHODS)
    assert len({(c.seed, c.learning_rate) for c in block}) == 1
  assert [(c.seed, c.learning_rate) for c in order[::n]] == [(s, lr) for s in SEEDS for lr in LRS]


def test_interrupted_sweep_resumes_where_it_stopped(tmp_path, capsys):
  crashing = FakeRunner(fail_at=5)
  assert sweep_main(_argv(tmp_path), runner=crashing) == 1
  assert 'simulated crash' in capsys.readouterr().err
  cells = run_order(_all_cells())
  out = str(tmp_path / 'sweep')
  assert crashing.calls == cells[:5]
  assert [os.path.exists(os.path.join(cell_dir(out, c), 'results.json')) for c in cells[:5]] == [
      True
  ] * 4 + [False]
  # the table of the finished cells is there already
  with open(tmp_path / 'sweep' / 'results.csv') as f:
    assert len(list(csv.DictReader(f))) == 4
  rest = FakeRunner()
  assert sweep_main(_argv(tmp_path), runner=rest) == 0
  assert rest.calls == cells[4:]


def test_aggregates_mean_and_std_and_writes_table_and_plot(tmp_path):
  assert sweep_main(_argv(tmp_path, 'trainer.steps=3'), runner=FakeRunner()) == 0
  out = tmp_path / 'sweep'
  with open(out / 'summary.csv') as f:
    table = list(csv.DictReader(f))
  assert len(table) == len(METHODS) * len(LRS)
  for row in table:
    values = np.array([_accuracy(row['method'], float(row['learning_rate']), s) for s in SEEDS])
    assert int(row['n']) == len(SEEDS)
    chex.assert_trees_all_close(float(row['mean']), values.mean(), rtol=1e-12)
    chex.assert_trees_all_close(float(row['std']), values.std(ddof=1), rtol=1e-12)
  with open(out / 'results.csv') as f:
    rows = list(csv.DictReader(f))
  assert len(rows) == len(_all_cells()) and 'acc/boolq' in rows[0]
  markdown = (out / 'summary.md').read_text()
  assert '| anlr |' in markdown and '±' in markdown and '0.0001' in markdown
  png = (out / 'accuracy_vs_lr.png').read_bytes()
  assert png[:4] == b'\x89PNG' and len(png) > 1000


def test_aggregate_single_seed_and_order():
  rows = [
      dict(method='a', learning_rate=1e-4, seed=0, avg=0.5),
      dict(method='b', learning_rate=1e-4, seed=0, avg=0.7),
      dict(method='a', learning_rate=1e-4, seed=1, avg=0.6),
  ]
  table = aggregate(rows)
  assert [(r['method'], r['n']) for r in table] == [('a', 2), ('b', 1)]
  chex.assert_trees_all_close(table[0]['std'], float(np.std([0.5, 0.6], ddof=1)))
  assert table[1]['std'] == 0.0


def test_subprocess_runner_passes_the_cell_and_overrides(tmp_path):
  """The default runner's command line, with a stand-in `python` that records its arguments and
  writes results.json where run_dir= says."""
  fake_python = tmp_path / 'fake_python'
  fake_python.write_text(
      f'#!{sys.executable}\n'
      'import json, os, sys\n'
      'args = sys.argv[1:]\n'
      'kv = dict(a.split("=", 1) for a in args if "=" in a)\n'
      'os.makedirs(kv["run_dir"], exist_ok=True)\n'
      'json.dump({"argv": args, "avg": 0.5}, open(os.path.join(kv["run_dir"], "results.json"), "w"))\n'
  )
  fake_python.chmod(fake_python.stat().st_mode | stat.S_IEXEC)
  cell = SweepCell('anlr', 2e-4, 1)
  run_dir = str(tmp_path / 'cell')
  subprocess_runner('cfg.yaml', ['trainer.steps=5'], python=str(fake_python))(cell, run_dir)
  argv = json.load(open(os.path.join(run_dir, 'results.json')))['argv']
  assert argv == [
      '-m',
      'anlr_jax',
      'train',
      '--config',
      'cfg.yaml',
      f'run_dir={run_dir}',
      'method=anlr',
      'trainer.learning_rate=0.0002',
      'seed=1',
      'compare=[]',
      'eval.include_base=false',
      'trainer.ckpt_dir={run_dir}/checkpoints',
      'trainer.steps=5',
  ]
  failing = tmp_path / 'failing_python'
  failing.write_text('#!/bin/sh\necho boom\nexit 3\n')
  failing.chmod(failing.stat().st_mode | stat.S_IEXEC)
  with pytest.raises(
      RuntimeError, match=r'method=anlr lr=0.0002 seed=1 failed \(exit 3\).*train.log'
  ):
    subprocess_runner('cfg.yaml', python=str(failing))(cell, str(tmp_path / 'bad'))
  assert 'boom' in (tmp_path / 'bad' / 'train.log').read_text()


def test_bad_arguments_name_the_argument(tmp_path, capsys):
  with pytest.raises(SystemExit):
    sweep_main(
        _argv(tmp_path)[:4] + ['--lrs', '1e-4,abc', '--out', str(tmp_path / 's')],
        runner=FakeRunner(),
    )
  assert '--lrs' in capsys.readouterr().err
  with pytest.raises(SystemExit):
    sweep_main(_argv(tmp_path, 'seed=3'), runner=FakeRunner())
  assert 'seed' in capsys.readouterr().err
  with pytest.raises(SystemExit):
    sweep_main(_argv(tmp_path, 'compare=[lora]'), runner=FakeRunner())
  assert 'compare' in capsys.readouterr().err
  with pytest.raises(SystemExit):
    sweep_main(
        ['--config', str(tmp_path / 'missing.yaml'), '--methods', 'lora', '--lrs', '1e-4'],
        runner=FakeRunner(),
    )
  assert 'missing.yaml' in capsys.readouterr().err
  with pytest.raises(ValueError, match='repeated'):
    grid(['lora', 'lora'], [1e-4], [0])


def test_runner_that_writes_nothing_is_an_error(tmp_path, capsys):
  assert sweep_main(_argv(tmp_path), runner=lambda cell, run_dir: None) == 1
  assert 'results.json' in capsys.readouterr().err


def test_accuracy_vs_lr_plot_labels_exactly_the_swept_learning_rates(tmp_path, monkeypatch):
  from anlr_jax.analysis import figures

  saved = []
  monkeypatch.setattr(figures, '_save', lambda fig, path: saved.append(fig) or path)
  table = [
      {'method': m, 'learning_rate': lr, 'mean': 0.5, 'std': 0.1}
      for m in METHODS
      for lr in (5e-4, 1e-3, 2e-3, 4e-3, 8e-3)
  ]
  figures.accuracy_vs_lr_figure(table, str(tmp_path / 'plot.png'))
  (ax,) = saved[0].axes
  saved[0].canvas.draw()
  assert [t.get_text() for t in ax.get_xticklabels()] == [
      '0.0005',
      '0.001',
      '0.002',
      '0.004',
      '0.008',
  ]
  assert not ax.xaxis.get_minor_ticks()  # no log-axis minor labels to overlap them


# ------------------------------------------------------------- the base model, per-task, paired
def _records(run_dir, task, outcomes):
  """eval_<task>.jsonl of log-likelihood records: question i right under 'char' iff outcomes[i]
  ('raw' always wrong, to check the normalisation is the one asked for)."""
  with open(os.path.join(run_dir, f'eval_{task}.jsonl'), 'w') as f:
    for i, right in enumerate(outcomes):
      predictions = {'raw': 1, 'char': 0 if right else 1, 'token': 0}
      f.write(json.dumps({'index': i, 'id': str(10 + i), 'gold': 0, 'predictions': predictions}))
      f.write('\n')


class RecordsRunner(FakeRunner):
  """Writes results.json and per-question records: lora right on questions 0-5, anlr on 2-9 (of
  12) on both tasks, so per pair of runs lora alone is right on 2 and anlr alone on 4."""

  def __call__(self, cell, run_dir):
    super().__call__(cell, run_dir)
    right = range(0, 6) if cell.method == 'lora' else range(2, 10)
    for task in ('boolq', 'piqa'):
      _records(run_dir, task, [i in right for i in range(12)])


def test_mcnemar_is_the_exact_binomial_test():
  from math import comb

  from anlr_jax.analysis.sweep import mcnemar_exact

  for a, b in [(3, 9), (9, 3), (22, 34), (0, 5), (7, 7)]:
    n, k = a + b, min(a, b)
    expected = min(1.0, 2 * sum(comb(n, i) for i in range(k + 1)) / 2**n)
    assert mcnemar_exact(a, b) == pytest.approx(expected, rel=1e-12)
  assert mcnemar_exact(0, 0) == 1.0


def test_report_has_the_base_model_per_task_means_and_paired_tests(tmp_path, monkeypatch):
  from math import comb

  from anlr_jax.analysis import figures

  config = tmp_path / 'cfg.yaml'
  config.write_text(
      'method: lora\neval:\n  include_base: true\n  normalization: char\n'
      f'  tasks:\n    boolq: {tmp_path}/t.json\n'
  )
  based = []

  def base(run_dir):
    based.append(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, 'results.json'), 'w') as f:
      json.dump({'adapter': None, 'accuracy': {'boolq': 0.5, 'piqa': 0.4}, 'avg': 0.45}, f)

  drawn = {}
  real = figures.accuracy_vs_lr_figure
  monkeypatch.setattr(
      figures,
      'accuracy_vs_lr_figure',
      lambda table, path, **kw: drawn.update(kw) or real(table, path, **kw),
  )
  out = tmp_path / 'sweep'
  argv = ['--config', str(config), '--methods', 'lora,anlr', '--lrs', '1e-4,2e-4']
  argv += ['--seeds', '0,1', '--out', str(out)]
  assert sweep_main(argv, runner=RecordsRunner(), base=base) == 0
  assert based == [str(out / 'base')] and drawn == {'base': 0.45}
  assert sweep_main(argv, runner=RecordsRunner(), base=base) == 0
  assert len(based) == 1  # scored once: a re-run finds it

  summary = (out / 'summary.md').read_text()
  assert '| base | 0.45 | 0.45 |' in summary
  per_task = list(csv.DictReader(open(out / 'per_task.csv')))
  lora = next(r for r in per_task if r['method'] == 'lora' and float(r['learning_rate']) == 1e-4)
  acc = np.mean([_accuracy('lora', 1e-4, s) for s in (0, 1)])
  assert float(lora['boolq']) == pytest.approx(acc) and float(lora['avg']) == pytest.approx(acc)
  assert per_task[-1]['method'] == 'base' and float(per_task[-1]['piqa']) == 0.4
  paired = list(csv.DictReader(open(out / 'paired.csv')))
  assert [(float(r['learning_rate']), r['method_a'], r['method_b']) for r in paired] == [
      (1e-4, 'lora', 'anlr'),
      (2e-4, 'lora', 'anlr'),
  ]
  row = paired[0]
  # 2 seeds x 2 tasks x 12 questions; per run pair lora alone right on 0-1, anlr alone on 6-9
  assert (int(row['seeds']), int(row['questions'])) == (2, 48)
  assert (int(row['right_a']), int(row['right_b'])) == (24, 32)
  assert (int(row['only_a']), int(row['only_b'])) == (8, 16)
  expected = 2 * sum(comb(24, i) for i in range(9)) / 2**24
  assert float(row['p']) == pytest.approx(expected, rel=1e-9)
  assert '| 0.0001 | lora | anlr | 2 | 48 | 24 | 32 | 8 | 16 |' in (out / 'paired.md').read_text()


def test_paired_outcomes_use_the_configured_normalization(tmp_path):
  from anlr_jax.analysis.sweep import question_outcomes

  _records(str(tmp_path), 'boolq', [True, False, True])
  assert question_outcomes(str(tmp_path), 'boolq', 'char') == {'10': True, '11': False, '12': True}
  assert question_outcomes(str(tmp_path), 'boolq', 'raw') == {'10': False, '11': False, '12': False}
  with open(tmp_path / 'eval_gsm8k.jsonl', 'w') as f:
    f.write(json.dumps({'index': 0, 'correct': True}) + '\n{"index": 1}\n')
  with pytest.raises(ValueError, match=r'eval_gsm8k.jsonl:2: a record without correct'):
    question_outcomes(str(tmp_path), 'gsm8k', 'char')
  assert question_outcomes(str(tmp_path), 'missing', 'char') == {}


def test_base_runner_runs_anlr_eval_once_into_the_base_directory(tmp_path):
  from anlr_jax.analysis.sweep import base_runner

  fake_python = tmp_path / 'fake_python'
  fake_python.write_text(
      f'#!{sys.executable}\n'
      'import json, os, sys\n'
      'args = sys.argv[1:]\n'
      'out = args[args.index("--out") + 1]\n'
      'json.dump({"argv": args, "avg": 0.5}, open(os.path.join(out, "results.json"), "w"))\n'
  )
  fake_python.chmod(fake_python.stat().st_mode | stat.S_IEXEC)
  out = str(tmp_path / 'base')
  base_runner('cfg.yaml', ['eval.limit=5'], python=str(fake_python))(out)
  argv = json.load(open(os.path.join(out, 'results.json')))['argv']
  assert argv == ['-m', 'anlr_jax', 'eval', '--config', 'cfg.yaml', '--out', out, 'eval.limit=5']

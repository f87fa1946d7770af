"""The run-directory contract (anlr_jax.rundir, naming, results, diagnostics_io, fileio): one module
name for the optimizer, the injection, the adapter file, the diagnostics and the analysis;
results.json and diagnostics round trips; atomic writes that never leave a partial file."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file

import anlr_jax
from anlr_jax import naming, rundir
from anlr_jax.train import diagnostics_io
from anlr_jax.analysis import file_names
from anlr_jax.analysis.results import RunResult, read_results, write_results
from anlr_jax.analysis import load_run, measures
from anlr_jax.nn.inject import inject_lora, iter_lora_layers
from anlr_jax.train.metrics import MetricsWriter

from anlr_jax.app.model import save_lora_params  # the adapter writer of `anlr train`


class Attention(nnx.Module):

  def __init__(self, rngs):
    self.q_proj = nnx.Linear(6, 6, rngs=rngs)
    self.v_proj = nnx.Linear(6, 4, use_bias=False, rngs=rngs)
    self.o_proj = nnx.Linear(4, 6, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.o_proj(self.v_proj(x)) + self.q_proj(x)


class Block(nnx.Module):

  def __init__(self, rngs):
    self.self_attn = Attention(rngs)
    self.up_proj = nnx.Linear(6, 6, use_bias=False, rngs=rngs)

  def __call__(self, x):
    return x + self.up_proj(jax.nn.tanh(self.self_attn(x)))


class Inner(nnx.Module):

  def __init__(self, rngs):
    self.layers = nnx.List([Block(rngs) for _ in range(2)])

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return x


class Toy(nnx.Module):
  """``model.layers.<i>.self_attn.{q,v}_proj`` and ``model.layers.<i>.up_proj``, as in HF LLaMA."""

  def __init__(self, rngs):
    self.model = Inner(rngs)

  def __call__(self, x):
    return self.model(x)


def _toy():
  model = Toy(nnx.Rngs(0))
  return inject_lora(
      model,
      target_modules=('q_proj', 'v_proj', 'up_proj'),
      rank=3,
      alpha=6.0,
      rngs=nnx.Rngs(1),
  )


EXPECTED = sorted(
    f'model.layers.{i}.{m}'
    for i in range(2)
    for m in ('self_attn.q_proj', 'self_attn.v_proj', 'up_proj')
)


# --------------------------------------------------------------------------------- module names


def test_module_name_is_the_dot_joined_path_for_nnx_and_jax_paths():
  assert naming.module_name(('model', 'layers', 0, 'q_proj')) == 'model.layers.0.q_proj'
  assert naming.module_name(()) == ''
  tree = {'model': {'layers': [{'q_proj': {'lora_a': 1}}]}}
  [(path, _)] = jax.tree_util.tree_flatten_with_path(tree)[0]
  assert naming.module_name(path[:-1]) == 'model.layers.0.q_proj'

  attr_path = (jax.tree_util.GetAttrKey('model'), jax.tree_util.SequenceKey(3))
  assert naming.module_name(attr_path) == 'model.3'
  key = naming.adapter_key('model.layers.0.q_proj', 'lora_a')
  assert key == 'model.layers.0.q_proj/lora_a'
  assert naming.split_adapter_key(key) == ('model.layers.0.q_proj', 'lora_a')


def test_names_agree_across_optimizer_injection_adapter_diagnostics_and_analysis(tmp_path):
  model = _toy()
  injected = [name for name, _ in iter_lora_layers(model)]
  assert injected == EXPECTED

  # The optimizer, on the LoRA params as the trainer holds them (a pure dict) and as nnx.State.
  lora = nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))
  assert sorted(m.name for m in anlr_jax.find_lora_modules(lora)) == EXPECTED
  assert sorted(m.name for m in anlr_jax.find_lora_modules(nnx.state(model, nnx.LoRAParam))) == (
      EXPECTED
  )
  tx = anlr_jax.anlr(1e-2, warmup_steps=0)
  state = tx.init(lora)
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.1), lora)
  updates, state = tx.update(grads, state, lora)
  lora = optax.apply_updates(lora, updates)
  diag = anlr_jax.diagnostics(state)
  assert sorted(diag[diagnostics_io.DIAG_MODULES]) == EXPECTED
  assert sorted(measures.rank_magnitudes(lora)) == EXPECTED

  # The exported adapter file, written the way `anlr train` writes it.
  run_dir = str(tmp_path)
  nnx.update(model, lora)
  keys = save_lora_params(model, os.path.join(run_dir, rundir.LORA_FILE))
  exported = sorted({naming.split_adapter_key(k)[0] for k in keys})
  assert exported == EXPECTED
  assert set(load_file(os.path.join(run_dir, rundir.LORA_FILE))) == set(keys)

  # The diagnostics file and the analysis reader: the same names, compared with ==.
  writer = MetricsWriter(run_dir, total_steps=1, progress=False, is_writer=True)
  writer.write_diagnostics(
      1, {**diag, diagnostics_io.DIAG_MAGNITUDES: measures.rank_magnitudes(lora)}
  )
  writer.close()
  snapshot = diagnostics_io.read_diagnostics(diagnostics_io.diagnostics_path(run_dir, 1))
  assert sorted(snapshot.modules) == EXPECTED
  run = load_run(run_dir)
  assert sorted(run.nu_bar) == sorted(run.lora) == sorted(run.magnitudes) == EXPECTED


# --------------------------------------------------------------------------------- results.json


def test_results_round_trip(tmp_path):
  run_dir = str(tmp_path / 'run')
  assert read_results(run_dir) is None
  results = RunResult(
      method='anlr',
      learning_rate=2e-4,
      seed=1,
      steps=10,
      final_loss=1.5,
      train_seconds=3.0,
      accuracy={'boolq': 0.5, 'piqa': 0.75},
      avg=0.625,
      eval_seconds=1.0,
      identity={'model': 'x', 'rank': 16},
  )
  path = write_results(run_dir, results)
  assert path == os.path.join(run_dir, rundir.RESULTS_FILE)
  assert read_results(run_dir) == results
  with open(path) as f:  # one JSON key per field, in the field order
    assert list(json.load(f)) == [f.name for f in dataclasses.fields(RunResult)]
  results.avg = None
  write_results(run_dir, results)
  assert read_results(run_dir) == results
  assert os.listdir(run_dir) == [rundir.RESULTS_FILE]
  with open(path, 'w') as f:
    f.write('{"method": "an')
  with pytest.raises(ValueError, match='results.json:1: invalid JSON'):
    read_results(run_dir)
  with open(path, 'w') as f:
    json.dump([1, 2], f)
  with pytest.raises(ValueError, match='expected a JSON object'):
    read_results(run_dir)


def test_a_results_file_with_fewer_or_other_keys_reads(tmp_path):
  path = tmp_path / rundir.RESULTS_FILE
  path.write_text(json.dumps({'method': 'lora', 'avg': 0.5, 'accuracy': {'t': 0.5}, 'note': 'x'}))
  result = read_results(str(tmp_path))
  assert result == RunResult(method='lora', avg=0.5, accuracy={'t': 0.5})


def test_atomic_write_leaves_no_partial_file(tmp_path, monkeypatch):
  run_dir = str(tmp_path)
  old = RunResult(method='lora', avg=0.5)
  write_results(run_dir, old)
  # A payload that cannot be serialised: nothing written, the old file intact.
  with pytest.raises(TypeError):
    write_results(run_dir, RunResult(method='anlr', avg=object()))
  assert read_results(run_dir) == old
  assert os.listdir(run_dir) == [rundir.RESULTS_FILE]

  # A crash after the temporary file is written but before the rename (here: the rename fails).
  real_replace = os.replace

  def crash(src, dst):
    raise OSError('simulated crash')

  monkeypatch.setattr(os, 'replace', crash)
  with pytest.raises(OSError, match='simulated crash'):
    write_results(run_dir, RunResult(method='anlr', avg=0.9))
  with pytest.raises(OSError, match='simulated crash'):
    diagnostics_io.write_diagnostics(run_dir, 3, {'m': {'nu_bar': np.ones(2)}})
  monkeypatch.setattr(os, 'replace', real_replace)
  assert read_results(run_dir) == old
  assert sorted(os.listdir(run_dir)) == sorted([rundir.RESULTS_FILE, rundir.DIAGNOSTICS_DIR])
  assert os.listdir(os.path.join(run_dir, rundir.DIAGNOSTICS_DIR)) == []
  assert diagnostics_io.diagnostics_steps(run_dir) == []

  # A crash while the file is being written: the serialiser fails half way through.
  def half_savez(file, **arrays):
    file.write(b'PK\x03\x04 partial')
    raise RuntimeError('disk full')

  monkeypatch.setattr(np, 'savez', half_savez)
  with pytest.raises(RuntimeError, match='disk full'):
    diagnostics_io.write_diagnostics(run_dir, 3, {'m': {'nu_bar': np.ones(2)}})
  assert os.listdir(os.path.join(run_dir, rundir.DIAGNOSTICS_DIR)) == []


def test_every_file_writer_writes_whole_files_or_none(tmp_path, monkeypatch):
  """The adapter file, the truncated metrics and results.json go through fileio.atomic_write: a
  crash before the rename leaves the old file and no temporary one."""
  adapter = tmp_path / rundir.LORA_FILE
  save_lora_params(_toy(), adapter)
  before = adapter.read_bytes()
  metrics = ''.join(json.dumps({'step': step, 'loss': 1.0 / step}) + '\n' for step in (1, 2, 3))
  (tmp_path / rundir.METRICS_FILE).write_text(metrics)
  listing = sorted(os.listdir(tmp_path))

  def crash(src, dst):
    raise OSError('simulated crash')

  monkeypatch.setattr(os, 'replace', crash)
  with pytest.raises(OSError, match='simulated crash'):
    save_lora_params(_toy(), adapter)
  with pytest.raises(OSError, match='simulated crash'):
    MetricsWriter(str(tmp_path), total_steps=3, start_step=1, is_writer=True, progress=False)
  assert sorted(os.listdir(tmp_path)) == listing
  assert adapter.read_bytes() == before and (tmp_path / rundir.METRICS_FILE).read_text() == metrics


# --------------------------------------------------------------------------------- diagnostics


def test_diagnostics_round_trip(tmp_path):
  run_dir = str(tmp_path)
  rng = np.random.default_rng(0)
  modules = {  # names are opaque: dots, brackets, slashes, quotes and the root module ''
      'model.layers.0.self_attn.q_proj': {
          'nu_bar': rng.random(4).astype(np.float32),
          'snr': rng.random(4).astype(np.float32),
          'multipliers': rng.random((2, 4)),
          'velocity_cv': np.float32(0.25),
      },
      "odd['name']/with.dots[0]": {
          'nu_bar': rng.random(3),
          diagnostics_io.DIAG_MAGNITUDES: rng.random(3),
      },
      '': {'nu_bar': np.arange(2, dtype=np.int32)},
  }
  summary = {'mean/velocity_cv': np.float32(0.3), 'count': np.int32(7)}
  for step in (30, 10, 20):
    path = diagnostics_io.write_diagnostics(run_dir, step, modules, summary)
    assert path == diagnostics_io.diagnostics_path(run_dir, step)
  assert diagnostics_io.diagnostics_steps(run_dir) == [10, 20, 30]
  snap = diagnostics_io.read_diagnostics(diagnostics_io.diagnostics_path(run_dir, 20))
  assert snap.step == 20
  assert list(snap.modules) == list(modules)
  for name, fields in modules.items():
    assert list(snap.modules[name]) == list(fields)
    for field, value in fields.items():
      got = snap.modules[name][field]
      assert got.dtype == np.asarray(value).dtype and got.shape == np.shape(value)
      np.testing.assert_array_equal(got, value)
  assert set(snap.summary) == set(summary)
  np.testing.assert_array_equal(snap.summary['count'], 7)
  assert diagnostics_io.remove_diagnostics_after(run_dir, 15) == [20, 30]
  assert diagnostics_io.diagnostics_steps(run_dir) == [10]


def test_diagnostics_from_the_optimizer_tree():
  params = {'layers': {'q': {'lora_a': jnp.ones((2, 5, 3)), 'lora_b': jnp.ones((2, 3, 4))}}}
  tx = anlr_jax.anlr(1e-2, warmup_steps=0)
  state = tx.init(params)
  tree = jax.device_get(
      {
          **anlr_jax.diagnostics(state),
          diagnostics_io.DIAG_MAGNITUDES: measures.rank_magnitudes(params),
      }
  )
  modules, summary = diagnostics_io.diagnostics_from_tree(tree)
  assert list(modules) == ['layers.q']
  assert {'nu_bar', 'snr', 'multipliers', diagnostics_io.DIAG_MAGNITUDES} <= set(
      modules['layers.q']
  )
  assert modules['layers.q']['nu_bar'].shape == (2, 3)
  assert {'count', 'mean/velocity_cv'} <= set(summary)


def test_reader_rejects_files_that_are_not_diagnostics(tmp_path):
  folder = tmp_path / rundir.DIAGNOSTICS_DIR
  folder.mkdir()
  foreign = folder / 'step_00000001.npz'
  np.savez(foreign, **{"['modules']['m']['nu_bar']": np.ones(2)})  # the keystr format of before
  with pytest.raises(ValueError, match='step_00000001.npz: no __index__'):
    diagnostics_io.read_diagnostics(str(foreign))
  garbage = folder / 'step_00000002.npz'
  garbage.write_bytes(b'not a zip file')
  with pytest.raises(ValueError, match='step_00000002.npz: not a readable'):
    diagnostics_io.read_diagnostics(str(garbage))
  with pytest.raises(FileNotFoundError):
    diagnostics_io.read_diagnostics(str(folder / 'step_00000003.npz'))
  (folder / 'notes.txt').write_text('x')
  (folder / 'step_x.npz').write_text('x')
  assert diagnostics_io.diagnostics_steps(str(tmp_path)) == [1, 2]


# --------------------------------------------------------------------------------- names on disk


def test_file_names_are_distinct_and_paths_follow_them(tmp_path):
  names = [
      rundir.CONFIG_FILE,
      rundir.METRICS_FILE,
      rundir.METRICS_CSV,
      rundir.TENSORBOARD_DIR,
      rundir.DIAGNOSTICS_DIR,
      rundir.CHECKPOINTS_DIR,
      rundir.LORA_FILE,
      rundir.RESULTS_FILE,
      rundir.SUMMARY_FILE,
      rundir.LOSS_PLOT,
      rundir.ACCURACY_TABLE,
      rundir.ANALYSIS_DIR,
      rundir.LOCK_FILE,
  ]
  assert len(set(names)) == len(names) and all('/' not in n for n in names)
  assert rundir.eval_records_path('r', 'gsm8k') == os.path.join('r', 'eval_gsm8k.jsonl')
  assert rundir.method_dir('r', 'lora+') == os.path.join('r', 'lora_')
  assert rundir.method_dir_name('a+b') == 'a_b'
  assert file_names.sweep_cell_dir('out', 'anlr', 2e-4, 1) == os.path.join(
      'out', 'anlr', 'lr0.0002', 'seed1'
  )
  assert len(set(file_names.ANALYSIS_FIGURES)) == 7


def test_the_eval_records_tables_and_config_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
  """An eval task's records, the accuracy tables and the saved run config go through
  fileio.atomic_write too: a crash before the rename leaves no file, whole or partial."""
  from anlr_jax.app.config import RunConfig, save_config
  from anlr_jax.evals import write_accuracy_table
  from anlr_jax.evals.generative import EvalResult

  def crash(src, dst):
    raise OSError('simulated crash')

  monkeypatch.setattr(os, 'replace', crash)
  with pytest.raises(OSError, match='simulated crash'):
    EvalResult('boolq', ()).save_records(tmp_path / 'eval_boolq.jsonl')
  with pytest.raises(OSError, match='simulated crash'):
    write_accuracy_table({'lora': {'boolq': 0.5}}, tmp_path / 'accuracy')
  with pytest.raises(OSError, match='simulated crash'):
    save_config(RunConfig(), tmp_path / 'config.yaml')
  assert os.listdir(tmp_path) == []

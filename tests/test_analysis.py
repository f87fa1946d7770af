"""`anlr analyze`: the pure measurements against NumPy / SciPy references on planted data, the run
directory reader on the trainer's own diagnostics format, and the command end to end."""

import csv
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.stats
from safetensors.numpy import save_file

import anlr_jax
from anlr_jax import naming, rundir
from anlr_jax.analysis.results import RunResult, write_results
from anlr_jax.analysis import figure_data, load_lora, load_run, measures
from anlr_jax.app.analysis_cli import analyze_main
from anlr_jax.train.metrics import MetricsWriter


def _orthonormal(rng, n, k):
  q, _ = np.linalg.qr(rng.standard_normal((n, k)))
  return q


def _factors_with_spectrum(rng, sigma, d_in=10, d_out=9):
  """A (d_in, r), B (r, d_out) with A @ B = U diag(sigma) V^T (singular values exactly sigma)."""
  r = len(sigma)
  return _orthonormal(rng, d_in, r) * np.asarray(sigma), _orthonormal(rng, d_out, r).T


def _entropy_rank(sigma):
  p = np.asarray(sigma, np.float64) ** 2
  p = p[p > 0] / p.sum()
  return float(np.exp(-(p * np.log(p)).sum()))


# ---------------------------------------------------------------- pure measurements


@pytest.mark.parametrize(
    'sigma, erank',
    [
        ([1.0] * 6, 6.0),
        ([2.0, 2.0, 2.0, 2.0, 0.0, 0.0], 4.0),
        ([2.0, 2.0, 0.0, 0.0, 0.0, 0.0], 2.0),
        ([5.0, 0, 0, 0, 0, 0], 1.0),
        ([3.0, 2.0, 1.0, 0.5, 0.1, 0.01], None),
    ],
)
def test_known_spectrum_gives_known_effective_rank_and_concentration(sigma, erank):
  rng = np.random.default_rng(0)
  a, b = _factors_with_spectrum(rng, sigma)
  sv = np.asarray(anlr_jax.singular_values(a, b), np.float64)
  chex.assert_trees_all_close(np.sort(sv)[::-1], np.sort(sigma)[::-1], atol=1e-5)
  expected = _entropy_rank(sigma) if erank is None else erank
  chex.assert_trees_all_close(measures.effective_rank_np(sv), expected, rtol=1e-4)
  chex.assert_trees_all_close(
      measures.effective_rank_np(sv), float(anlr_jax.effective_rank(a, b)), rtol=1e-4
  )
  r = len(sigma)
  chex.assert_trees_all_close(measures.spectral_concentration(sv), 1 - expected / r, atol=1e-4)
  assert bool(measures.is_concentrated(sv)) == (expected < r / 2)
  p = np.sort(np.asarray(sigma) ** 2)[::-1] / np.sum(np.asarray(sigma) ** 2)
  chex.assert_trees_all_close(measures.top_k_energy(sv, 2), p[:2].sum(), atol=1e-5)
  chex.assert_trees_all_close(
      np.cumsum(measures.energy_shares(sv)), np.asarray(anlr_jax.cumulative_energy(a, b)), atol=1e-5
  )


def test_ratio_cv_and_normalisation_match_numpy():
  nu = np.random.default_rng(1).uniform(0.1, 3.0, size=(5, 7, 8))
  chex.assert_trees_all_close(measures.max_min_ratio(nu), nu.max(-1) / nu.min(-1))
  chex.assert_trees_all_close(measures.velocity_cv(nu), nu.std(-1) / nu.mean(-1))
  chex.assert_trees_all_close(measures.normalised_velocity(nu), nu / nu.mean(-1, keepdims=True))
  chex.assert_trees_all_close(measures.normalised_velocity(nu).mean(-1), np.ones((5, 7)))
  # degenerate modules: no NaN
  zero = np.zeros((2, 4))
  assert np.all(measures.max_min_ratio(zero) == 1) and np.all(measures.velocity_cv(zero) == 0)
  assert np.all(measures.max_min_ratio(np.array([0.0, 1.0])) == np.inf)


def test_spearman_matches_scipy_with_ties():
  rng = np.random.default_rng(2)
  for _ in range(5):
    x = rng.integers(0, 4, size=9).astype(float)  # many ties
    y = rng.standard_normal(9)
    chex.assert_trees_all_close(
        measures.spearman(x, y), scipy.stats.spearmanr(x, y).statistic, atol=1e-12
    )
  batch_x, batch_y = rng.standard_normal((3, 6)), rng.standard_normal((3, 6))
  chex.assert_trees_all_close(
      measures.spearman(batch_x, batch_y),
      np.array([scipy.stats.spearmanr(a, b).statistic for a, b in zip(batch_x, batch_y)]),
  )
  assert np.isnan(measures.spearman(np.ones(4), np.arange(4.0)))
  with pytest.raises(ValueError, match='at least 2'):
    measures.spearman(np.ones(1), np.ones(1))


def test_planted_ordering_is_found_persistent_and_reversed():
  rng = np.random.default_rng(3)
  steps, r = 20, 8
  perm = rng.permutation(r) + 1.0
  t = np.arange(steps)[:, None]
  persistent = perm * (1 + 0.05 * t) + 0.01 * rng.standard_normal((steps, r))
  chex.assert_trees_all_close(measures.ordering_stability(persistent), 1.0)
  # the ordering set early flips: the slowest early component ends fastest
  weight = np.clip(t / (steps - 1), 0, 1)
  reversed_ = (1 - weight) * perm + weight * (r + 1 - perm)
  chex.assert_trees_all_close(measures.ordering_stability(reversed_), -1.0)
  # per module: (T, M, r)
  stacked = np.stack([persistent, reversed_], axis=1)
  chex.assert_trees_all_close(measures.ordering_stability(stacked), np.array([1.0, -1.0]))
  with pytest.raises(ValueError, match='early_fraction'):
    measures.ordering_stability(persistent, early_fraction=1.5)


def test_velocity_quartiles_and_quartile_means():
  nu = np.array([0.5, 8.0, 1.0, 7.0, 3.0, 2.0, 6.0, 4.0])  # ascending order: 0,2,5,4,7,6,3,1
  q = measures.velocity_quartiles(nu)
  np.testing.assert_array_equal(q, [0, 3, 0, 3, 1, 1, 2, 2])
  values = np.arange(16.0).reshape(2, 8)
  expected = np.array([[values[t, q == g].mean() for g in range(4)] for t in range(2)])
  chex.assert_trees_all_close(measures.quartile_means(values, q), expected)
  # r = 6: quartile sizes 2, 1, 2, 1 from floor(4 pi / r)
  np.testing.assert_array_equal(
      np.bincount(measures.velocity_quartiles(np.arange(6.0)), minlength=4), [2, 1, 2, 1]
  )
  with pytest.raises(ValueError, match='quartiles shape'):
    measures.quartile_means(np.ones((2, 5)), q)


def test_rank_magnitudes_match_materialised_outer_products():
  rng = np.random.default_rng(4)
  params = {
      'layers': {
          'q': {'lora_a': rng.standard_normal((3, 5, 4)), 'lora_b': rng.standard_normal((3, 4, 6))},
          'v': {
              'lora_a': rng.standard_normal((5, 2)),
              'lora_b': rng.standard_normal((2, 7)),
              'bias': np.zeros(7),
          },
      }
  }
  mags = jax.jit(measures.rank_magnitudes)(params)
  assert set(mags) == {'layers.q', 'layers.v'}
  for name, (lead, a, b) in {
      'layers.q': ((3,), params['layers']['q']['lora_a'], params['layers']['q']['lora_b']),
      'layers.v': ((), params['layers']['v']['lora_a'], params['layers']['v']['lora_b']),
  }.items():
    expected = np.zeros(lead + (a.shape[-1],))
    for idx in np.ndindex(*lead):
      for k in range(a.shape[-1]):
        expected[idx + (k,)] = np.linalg.norm(np.outer(a[idx][:, k], b[idx][k, :]))
    chex.assert_trees_all_close(np.asarray(mags[name]), expected, rtol=1e-5)
  chex.assert_trees_all_close(
      measures.rank_magnitudes_np(params['layers']['q']['lora_a'], params['layers']['q']['lora_b']),
      np.asarray(mags['layers.q']),
      rtol=1e-5,
  )


def test_energy_shift_and_percentiles():
  a = np.array([[0.7, 0.2, 0.1], [0.5, 0.3, 0.2]])
  b = np.array([[0.4, 0.3, 0.3], [0.4, 0.4, 0.2]])
  chex.assert_trees_all_close(measures.energy_shift(a, b), b.mean(0) - a.mean(0))
  chex.assert_trees_all_close(measures.energy_shift(a, b).sum(), 0.0, atol=1e-12)
  v = np.array([1.0, 2.0, 3.0, np.inf, 10.0])
  pct = measures.percentile_summary(v)
  chex.assert_trees_all_close(pct['p90'], np.percentile([1.0, 2.0, 3.0, 10.0], 90))


# ---------------------------------------------------------------- synthetic run directories

MODULES = (  # anlr_jax.naming.module_name: the optimizer's, the diagnostics' and the adapter's
    'layers.0.attn.q_proj',
    'layers.0.attn.v_proj',
    'layers.1.attn.q_proj',
    'layers.1.attn.v_proj',
)
R = 8
STEPS = (10, 20, 30, 40, 50, 60)
SPECTRA = {  # nominal rank 8: two concentrated (erank < 4) and two spread modules
    'layers.0.attn.q_proj': [4.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01],
    'layers.0.attn.v_proj': [1.0] * 8,
    'layers.1.attn.q_proj': [3.0, 3.0, 0.1, 0.1, 0.0, 0.0, 0.0, 0.0],
    'layers.1.attn.v_proj': [2.0, 1.8, 1.6, 1.4, 1.2, 1.0, 0.8, 0.6],
}


def _planted_velocity(seed):
  """{module: (T, r)}: a persistent random ordering per module, scaled by 1 + t/10."""
  rng = np.random.default_rng(seed)
  out = {}
  for i, name in enumerate(MODULES):
    perm = rng.permutation(R) + 1.0
    out[name] = np.stack([(i + 1) * perm * (1 + 0.1 * j) for j in range(len(STEPS))])
  return out


def _write_run(run_dir, *, method='lora', diag=True, lora=True, magnitudes=True, seed=0):
  """A run dir in the trainer's format: MetricsWriter.write_diagnostics of a diagnostics-shaped tree,
  lora_final.safetensors and results.json."""
  os.makedirs(run_dir, exist_ok=True)
  nu = _planted_velocity(seed)
  if diag:
    writer = MetricsWriter(str(run_dir), total_steps=STEPS[-1], progress=False, is_writer=True)
    for j, step in enumerate(STEPS):
      tree = {
          'modules': {
              name: {
                  'nu_bar': nu[name][j].astype(np.float32),
                  'snr': np.ones(R, np.float32),
                  'multipliers': np.exp(np.linspace(-0.5, 0.5, R) * (j % 2 * 2 - 1)).astype(
                      np.float32
                  ),
                  'velocity_cv': np.float32(0.3),
              }
              for name in MODULES
          },
          'mean': {'velocity_cv': np.float32(0.3)},
          'count': np.int32(step),
      }
      if magnitudes:
        tree['magnitudes'] = {
            name: (np.cumsum(nu[name][: j + 1], axis=0)[-1]).astype(np.float32) for name in MODULES
        }
      writer.write_diagnostics(step, tree)
    writer.close()
  if lora:
    rng = np.random.default_rng(seed + 100)
    tensors = {}
    for name, sigma in SPECTRA.items():
      a, b = _factors_with_spectrum(rng, sigma)
      tensors[naming.adapter_key(name, 'lora_a')] = np.ascontiguousarray(a, np.float32)
      tensors[naming.adapter_key(name, 'lora_b')] = np.ascontiguousarray(b, np.float32)
    save_file(tensors, os.path.join(run_dir, rundir.LORA_FILE))
  write_results(
      str(run_dir),
      RunResult(method=method, learning_rate=1e-4, seed=seed, accuracy={'t': 0.5}, avg=0.5),
  )
  return nu


def _read_csv(path):
  with open(path, newline='') as f:
    return list(csv.DictReader(f))


FIGURES = (
    'fig1_velocity_bars',
    'fig2a_velocity_trajectory',
    'fig2b_quartile_magnitude',
    'fig2c_velocity_vs_concentration',
    'fig3a_log_multipliers',
    'fig3b_cumulative_energy',
    'fig3c_energy_shift',
)


def test_analyze_two_runs_writes_every_figure_with_the_planted_numbers(tmp_path, capsys):
  nu = _write_run(tmp_path / 'lora', method='lora', seed=0)
  _write_run(tmp_path / 'anlr', method='anlr', seed=1)
  out = tmp_path / 'out'
  assert analyze_main([str(tmp_path / 'lora'), str(tmp_path / 'anlr'), '--out', str(out)]) == 0
  for name in FIGURES:
    png = out / f'{name}.png'
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b'\x89PNG', name
    assert (out / f'{name}.csv').exists(), name
  assert (out / 'fig2a_ordering_stability.csv').exists() and (out / 'summary.md').exists()
  assert not (out / 'missing.txt').exists()

  summary = {row['metric']: row for row in _read_csv(out / 'summary.csv')}
  final = np.stack([nu[m][-1] for m in MODULES])
  chex.assert_trees_all_close(
      float(summary['ratio_p50']['lora']), np.median(final.max(1) / final.min(1))
  )
  chex.assert_trees_all_close(
      float(summary['velocity_cv']['lora']), np.mean(final.std(1) / final.mean(1))
  )
  eranks = [_entropy_rank(s) for s in SPECTRA.values()]
  chex.assert_trees_all_close(float(summary['effective_rank']['lora']), np.mean(eranks), rtol=1e-4)
  chex.assert_trees_all_close(
      float(summary['concentrated_share']['anlr']), np.mean(np.array(eranks) < R / 2)
  )
  chex.assert_trees_all_close(float(summary['ordering_rho']['lora']), 1.0)

  rho = _read_csv(out / 'fig2a_ordering_stability.csv')
  assert len(rho) == 2 * len(MODULES) and all(
      float(r['spearman']) == pytest.approx(1.0) for r in rho
  )
  bars = [r for r in _read_csv(out / 'fig1_velocity_bars.csv') if r['run'] == 'lora']
  first = [float(r['normalised']) for r in bars if r['module'] == MODULES[0]]
  chex.assert_trees_all_close(
      np.array(first), nu[MODULES[0]][-1] / nu[MODULES[0]][-1].mean(), rtol=1e-6
  )
  conc = {
      r['module']: r
      for r in _read_csv(out / 'fig2c_velocity_vs_concentration.csv')
      if r['run'] == 'lora'
  }
  for name, sigma in SPECTRA.items():
    chex.assert_trees_all_close(
        float(conc[name]['concentration']), 1 - _entropy_rank(sigma) / R, atol=1e-4
    )
  # Fig. 2b: magnitudes grow fastest for the fastest quartile (planted persistent ordering)
  quart = [r for r in _read_csv(out / 'fig2b_quartile_magnitude.csv') if r['run'] == 'lora']
  assert quart[-1]['source'] == 'magnitude'
  assert (
      float(quart[-1]['q1'])
      < float(quart[-1]['q2'])
      < float(quart[-1]['q3'])
      < float(quart[-1]['q4'])
  )
  shift = _read_csv(out / 'fig3c_energy_shift.csv')
  chex.assert_trees_all_close(sum(float(r['shift']) for r in shift), 0.0, atol=1e-5)
  assert 'wrote' in capsys.readouterr().out


def test_default_output_is_the_analysis_folder_of_the_last_run_dir(tmp_path, capsys):
  from anlr_jax.app.analysis_cli import _analyze_parser

  assert 'RUN_DIR_B/analysis' in ' '.join(_analyze_parser().format_help().split())
  _write_run(tmp_path / 'a', method='lora', seed=0)
  _write_run(tmp_path / 'b', method='anlr', seed=1)
  assert analyze_main([str(tmp_path / 'a'), str(tmp_path / 'b')]) == 0
  assert (tmp_path / 'b' / rundir.ANALYSIS_DIR / 'summary.md').exists()
  assert not (tmp_path / 'a' / rundir.ANALYSIS_DIR).exists()
  assert str(tmp_path / 'b' / rundir.ANALYSIS_DIR) in capsys.readouterr().out
  assert analyze_main([str(tmp_path / 'a')]) == 0
  assert (tmp_path / 'a' / rundir.ANALYSIS_DIR / 'summary.md').exists()


def test_missing_diagnostics_names_the_file_and_the_setting(tmp_path, capsys):
  _write_run(tmp_path / 'run', diag=False)
  out = tmp_path / 'out'
  assert analyze_main([str(tmp_path / 'run'), '--out', str(out)]) == 0
  err = capsys.readouterr().err
  assert 'diagnostics/step_*.npz not found' in err and 'trainer.diag_every' in err
  assert (out / 'fig3b_cumulative_energy.png').exists() and (out / 'summary.csv').exists()
  assert not (out / 'fig1_velocity_bars.png').exists()
  assert 'trainer.diag_every' in (out / 'missing.txt').read_text()


def test_missing_lora_final_and_magnitudes_still_draw_the_rest(tmp_path, capsys):
  _write_run(tmp_path / 'run', lora=False, magnitudes=False)
  out = tmp_path / 'out'
  assert analyze_main([str(tmp_path / 'run'), '--out', str(out)]) == 0
  err = capsys.readouterr().err
  assert 'lora_final.safetensors not found' in err and "no 'magnitudes' arrays" in err
  for name in (
      'fig1_velocity_bars',
      'fig2a_velocity_trajectory',
      'fig2b_quartile_magnitude',
      'fig3a_log_multipliers',
  ):
    assert (out / f'{name}.png').exists(), name
  assert not (out / 'fig3b_cumulative_energy.png').exists()
  assert _read_csv(out / 'fig2b_quartile_magnitude.csv')[0]['source'] == 'accumulated velocity'


def test_bad_inputs_name_the_problem(tmp_path, capsys):
  assert analyze_main([str(tmp_path / 'nope')]) == 2
  assert 'nope' in capsys.readouterr().err
  os.makedirs(tmp_path / 'bad')
  save_file(
      {'m/lora_a': np.ones((4, 2), np.float32)}, str(tmp_path / 'bad' / 'lora_final.safetensors')
  )
  with pytest.raises(ValueError, match='m/lora_a has no sibling m/lora_b'):
    load_lora(str(tmp_path / 'bad' / 'lora_final.safetensors'))
  _write_run(tmp_path / 'run')
  assert analyze_main([str(tmp_path / 'run'), '--module', 'not.a.module']) == 2
  assert 'not.a.module' in capsys.readouterr().err
  with pytest.raises(SystemExit):
    analyze_main([str(tmp_path / 'run')] * 3)


def test_reads_real_anlr_diagnostics_with_stacked_modules(tmp_path):
  """The reader on what the trainer writes: anlr_jax.diagnostics of a real AnLR state (stacked layers,
  leading axis 2) plus rank_magnitudes, through MetricsWriter.write_diagnostics."""
  rng = np.random.default_rng(5)
  params = {
      'layers': {
          'q': {
              'lora_a': jnp.asarray(rng.standard_normal((2, 6, 4)) * 0.3, jnp.float32),
              'lora_b': jnp.asarray(rng.standard_normal((2, 4, 5)) * 0.3, jnp.float32),
          }
      }
  }
  x = jnp.asarray(rng.standard_normal((16, 6)), jnp.float32)
  y = jnp.asarray(rng.standard_normal((16, 5)), jnp.float32)
  loss = lambda p: jnp.mean(
      (jnp.einsum('ni,lir,lro->no', x, p['layers']['q']['lora_a'], p['layers']['q']['lora_b']) - y)
      ** 2
  )
  tx = anlr_jax.anlr(1e-2, warmup_steps=1)
  state = tx.init(params)
  writer = MetricsWriter(str(tmp_path), total_steps=4, progress=False, is_writer=True)
  for step in range(1, 5):
    updates, state = tx.update(jax.grad(loss)(params), state, params)
    params = optax.apply_updates(params, updates)
    writer.write_diagnostics(
        step, {**anlr_jax.diagnostics(state), 'magnitudes': measures.rank_magnitudes(params)}
    )
  writer.close()
  run = load_run(str(tmp_path))
  assert sorted(run.nu_bar) == ['layers.q[0]', 'layers.q[1]']
  np.testing.assert_array_equal(run.steps, [1, 2, 3, 4])
  final = anlr_jax.diagnostics(state)['modules']['layers.q']
  chex.assert_trees_all_close(
      run.nu_bar['layers.q[1]'][-1], np.asarray(final['nu_bar'][1]), rtol=1e-6
  )
  chex.assert_trees_all_close(
      run.multipliers['layers.q[0]'][-1], np.asarray(final['multipliers'][0])
  )
  chex.assert_trees_all_close(
      run.magnitudes['layers.q[0]'][-1],
      measures.rank_magnitudes_np(
          params['layers']['q']['lora_a'][0], params['layers']['q']['lora_b'][0]
      ),
      rtol=1e-5,
  )
  assert figure_data.representative_module(run) in run.nu_bar

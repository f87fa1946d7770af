"""Orbax checkpoints: bit-exact resume (toy LM with LoRA dropout RNG + AnLR state on a 2x2x2 mesh),
keep-last-K, full-model option, and a process SIGKILLed while saving."""

import os
import signal
import subprocess
import sys

import chex
import jax
import numpy as np
import optax
import pytest

import anlr_jax
from anlr_jax.train.checkpoint import TrainCheckpointer, flatten_for_checkpoint
from tests.helpers.toy_lm import make_toy_model, make_toy_trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


MESH_2X2X2 = dict(mesh_data=2, mesh_fsdp=2, mesh_tensor=2)


@pytest.fixture(autouse=True, scope='module')
def _compile_each_program_once():
  """The trainers here compile the same few programs again and again (and the in-process runs
  those of ``tests.helpers.ckpt_run``'s process): JAX's persistent compilation cache (the
  session's, as ``anlr train`` turns it on) compiles each once."""
  from anlr_jax.app.cli import use_compile_cache

  use_compile_cache(os.environ.get('ANLR_COMPILE_CACHE') or None)


def _trainer(ckpt_dir, steps=4, **overrides):
  tx = optax.chain(optax.clip_by_global_norm(1.0), anlr_jax.anlr(1e-2, warmup_steps=1))
  config = {**MESH_2X2X2, 'steps': steps, 'save_every': 0, 'keep': 2, **overrides}
  return make_toy_trainer(tx, model=make_toy_model(dropout=0.1), checkpoint_dir=ckpt_dir, **config)


def _host(tree):
  """Flat host copy (PRNG keys as their uint32 data) for exact comparisons."""
  return {k: np.asarray(jax.device_get(v)) for k, v in flatten_for_checkpoint(tree).items()}


def test_resume_is_bit_exact(tmp_path):
  straight = _trainer(tmp_path / 'straight')
  straight_losses = [float(straight.train_step()['loss']) for _ in range(4)]

  first = _trainer(tmp_path / 'resumed')
  losses = [float(first.train_step()['loss']) for _ in range(2)]
  first.save()
  first.checkpointer.wait()
  del first
  second = _trainer(tmp_path / 'resumed')  # fresh model/optimizer objects; restores step 2
  assert second.step == 2
  losses += [float(second.train_step()['loss']) for _ in range(2)]

  assert losses == straight_losses  # identical floats, not just close
  chex.assert_trees_all_equal(_host(second.state), _host(straight.state))  # params, AnLR, RNG
  # the restored state lives on the mesh with the step's shardings (so no recompilation)
  assert jax.tree.map(lambda x: x.sharding, second.state) == second.state_shardings
  assert second.step_traces == 1


def test_resuming_in_the_other_lora_layout_names_the_setting(tmp_path):
  first = _trainer(tmp_path / 'ckpt', lora_layout='per-layer')
  first.train_step()
  first.save()
  first.checkpointer.wait()
  with pytest.raises(ValueError, match=r"'per-layer' layout but trainer.lora_layout='stacked'"):
    _trainer(tmp_path / 'ckpt', lora_layout='stacked')
  assert _trainer(tmp_path / 'ckpt', lora_layout='per-layer').step == 1


def _toy_trainer(ckpt_dir, steps, **overrides):
  config = {**MESH_2X2X2, 'steps': steps, 'keep': 2, **overrides}
  return make_toy_trainer(
      optax.adamw(1e-2), model=make_toy_model(dropout=0.1), checkpoint_dir=ckpt_dir, **config
  )


def test_keep_last_k_and_full_model(tmp_path):
  trainer = _toy_trainer(tmp_path, steps=3, save_every=1, save_full_model=True, log_every=3)
  trainer.run()
  assert trainer.checkpointer.manager.all_steps() == [2, 3]
  restored = _toy_trainer(tmp_path, steps=3, save_full_model=True)
  assert restored.step == 3
  chex.assert_trees_all_equal(_host(restored.frozen), _host(trainer.frozen))
  chex.assert_trees_all_equal(_host(restored.state.lora), _host(trainer.state.lora))


def test_restore_without_checkpoint_names_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match=str(tmp_path)):
    TrainCheckpointer(tmp_path).restore(None, {'x': np.zeros(2)})


def _run_helper(args, timeout=240, in_process=False):
  if in_process:  # same code path and device count as the subprocesses (8 fake CPU devices)
    from tests.helpers import ckpt_run

    return ckpt_run.main(args)
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS='cpu')
  return subprocess.run(
      [sys.executable, '-m', 'tests.helpers.ckpt_run', *args],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
  )


def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path, capsys):
  ckpt = tmp_path / 'ckpt'
  # trains with a save every 2 steps and SIGKILLs itself right after the save of step 4 starts
  proc = _run_helper(['--ckpt', str(ckpt), '--steps', '6', '--save-every', '2', '--kill-at', '4'])
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
  assert 'save of step 4 started' in proc.stdout
  assert any(p.name.startswith('4.') and 'tmp' in p.name for p in ckpt.iterdir())  # cut mid-save
  manager = TrainCheckpointer(ckpt)
  assert manager.latest_step() == 2  # the interrupted step-4 save is not taken as complete
  manager.close()

  # resume to the end (here: the killed process left only its files, which a fresh trainer reads
  # as a new process would); it must match a straight run bit for bit
  _run_helper(
      [
          '--ckpt',
          str(ckpt),
          '--steps',
          '6',
          '--save-every',
          '2',
          '--out',
          str(tmp_path / 'resumed.npz'),
      ],
      in_process=True,
  )
  assert 'resumed at step 2' in capsys.readouterr().out
  straight = _run_helper(
      [
          '--ckpt',
          str(tmp_path / 'straight'),
          '--steps',
          '6',
          '--out',
          str(tmp_path / 'straight.npz'),
      ],
      in_process=True,
  )
  a, b = np.load(tmp_path / 'resumed.npz'), np.load(tmp_path / 'straight.npz')
  assert sorted(k for k in a if k.startswith('loss.')) == ['loss.3', 'loss.4', 'loss.5', 'loss.6']
  assert set(a) <= set(b)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)

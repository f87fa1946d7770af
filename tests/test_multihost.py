"""2 processes x 4 CPU devices (jax.distributed on localhost, gloo collectives) give the same
losses as 1 process x 8 devices, each process feeding only its own rows of every batch."""

import functools
import os
import socket
import subprocess
import sys

import numpy as np
import optax
import pytest

from anlr_jax.train.distributed import initialize_distributed
from anlr_jax.train.trainer import Trainer, TrainerConfig
from tests.helpers.toy_lm import ToyBatches, make_toy_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4  # the fresh job trains STEPS - 1 updates, the resumed one the last


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _launch(out, steps, extra=()):
  """Runs the 2-process job to the end; returns each process's stdout."""
  port = _free_port()
  procs = []
  for pid in range(2):
    env = dict(
        os.environ,
        PYTHONPATH=REPO,
        JAX_PLATFORMS='cpu',
        JAX_COORDINATOR_ADDRESS=f'127.0.0.1:{port}',
        JAX_NUM_PROCESSES='2',
        JAX_PROCESS_ID=str(pid),
    )
    procs.append(
        subprocess.Popen(
            [
                sys.executable,
                '-m',
                'tests.helpers.multihost_run',
                '--devices',
                '4',
                '--steps',
                str(steps),
                '--out',
                str(out),
                *extra,
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    )
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=240))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  for proc, (stdout, stderr) in zip(procs, outputs):
    assert proc.returncode == 0, stderr[-3000:]
  assert 'process 1/2' in outputs[1][0]
  return [stdout for stdout, _ in outputs]


@functools.cache  # the same reference for both tests: trained and compiled once
def _single_process_losses():
  cfg = TrainerConfig(
      steps=STEPS,
      global_batch=8,
      micro_batches=2,
      compute_dtype='float32',
      progress=False,
      mesh_data=2,
      mesh_fsdp=2,
      mesh_tensor=2,
  )
  trainer = Trainer(make_toy_model(), ToyBatches(), cfg, optax.adamw(1e-2))
  return tuple(float(trainer.train_step()['loss']) for _ in range(STEPS))


@pytest.fixture(scope='module')
def fresh_job(tmp_path_factory):
  """The 2-process job trained from scratch for STEPS - 1 updates, saving a checkpoint of its end:
  the job both tests below look at (the second resumes it)."""
  root = tmp_path_factory.mktemp('multihost')
  _launch(root / 'first.npy', STEPS - 1, ['--ckpt', str(root / 'ckpt')])
  return root


@pytest.mark.slow
def test_two_processes_match_one_process(fresh_job):
  single = _single_process_losses()
  np.testing.assert_allclose(
      np.load(fresh_job / 'first.npy'), single[: STEPS - 1], rtol=1e-5, atol=1e-5
  )
  assert len(set(np.round(single, 4))) == STEPS  # the losses move: the test compares real steps


@pytest.mark.slow
def test_two_processes_checkpoint_and_resume(fresh_job):
  """Process 0 seals the checkpoint (checksums); both verify and check it on restore."""
  ckpt = fresh_job / 'ckpt'
  assert (ckpt / str(STEPS - 1) / 'anlr_checksums.json').is_file()
  stdouts = _launch(fresh_job / 'rest.npy', STEPS, ['--ckpt', str(ckpt)])
  assert all(f'resumed at step {STEPS - 1}' in out for out in stdouts)
  losses = list(np.load(fresh_job / 'first.npy')) + list(np.load(fresh_job / 'rest.npy'))
  np.testing.assert_allclose(losses, _single_process_losses(), rtol=1e-5, atol=1e-5)


def test_initialize_distributed_validates_settings(monkeypatch):
  for var in ('JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID'):
    monkeypatch.delenv(var, raising=False)
  assert initialize_distributed() is False  # single process: nothing to do
  with pytest.raises(ValueError, match='JAX_PROCESS_ID'):
    initialize_distributed(coordinator_address='127.0.0.1:1', num_processes=2)
  with pytest.raises(ValueError, match='process_id=2'):
    initialize_distributed('127.0.0.1:1', 2, 2)


UNCAUGHT_IN_A_LIBRARY_THREAD = r"""
import ctypes, sys
import jax, jax.numpy as jnp
from anlr_jax.train.distributed import PeerWatchdog, initialize_distributed

initialize_distributed(f"127.0.0.1:{sys.argv[1]}", 1, 0)
PeerWatchdog(10.0, what="anlr train").start()
# what gloo's own thread does when a peer dies mid-collective: a C++ exception nobody catches, in a
# thread Python never saw, while the main thread computes
runtime, libc = ctypes.CDLL("libstdc++.so.6"), ctypes.CDLL(None)
throw = ctypes.cast(runtime._ZSt19__throw_logic_errorPKc, ctypes.c_void_p)  # std::__throw_logic_error
libc.pthread_create.argtypes = [ctypes.c_void_p] * 4
message = ctypes.c_char_p(b"[enforce fail at pair.cc] op.preamble.length <= op.nbytes")
libc.pthread_create(ctypes.byref(ctypes.c_ulong()), None, throw, message)
x = jnp.ones((64, 64))
for _ in range(100000):
  x = jnp.tanh(x @ x).block_until_ready()
print("the process outlived the exception")
"""


def test_an_uncaught_error_in_a_collectives_thread_stops_the_process_with_one_line():
  """The gloo abort (``terminate called after throwing ... EnforceNotMet``, status -6) seen when a
  peer was SIGKILLed mid-collective, made on purpose: a C++ exception thrown and not caught in a
  native thread of a process whose PeerWatchdog runs. It exits 4 with one line naming the
  exception, like the other ends of a job that lost a peer."""
  done = subprocess.run(
      [sys.executable, '-c', UNCAUGHT_IN_A_LIBRARY_THREAD, str(_free_port())],
      capture_output=True,
      text=True,
      timeout=120,
      cwd=REPO,
      env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS='cpu'),
  )
  assert done.returncode == 4, (done.returncode, done.stderr[-3000:])
  lines = [l for l in done.stderr.splitlines() if l.strip()]
  assert len(lines) == 1, done.stderr[-3000:]
  assert lines[0].startswith('anlr train: error: process 0 of 1: the collectives library stopped')
  assert 'std::logic_error' in lines[0] and 'run the same command on every host' in lines[0]
  assert 'outlived' not in done.stdout

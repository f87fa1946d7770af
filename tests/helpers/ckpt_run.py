"""Subprocess entry point for the checkpoint tests: trains the toy LM on 8 fake CPU devices with
checkpoints; can SIGKILL itself right after a save starts, or the moment orbax has committed it
(renamed its directory into place: no instant later); writes final LoRA params and losses."""

import argparse
import os
import signal

import jax

jax.config.update('jax_num_cpu_devices', 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

from anlr_jax.train.checkpoint import flatten_for_checkpoint  # noqa: E402
from anlr_jax.train.trainer import Trainer, TrainerConfig  # noqa: E402
from tests.helpers.toy_lm import ToyBatches, make_toy_model  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument('--ckpt', required=True)
  parser.add_argument('--steps', type=int, required=True)
  parser.add_argument('--save-every', type=int, default=0)
  parser.add_argument('--kill-at', type=int, default=-1)
  parser.add_argument('--kill-after-commit', type=int, default=-1)
  parser.add_argument('--out')
  args = parser.parse_args(argv)
  cfg = TrainerConfig(
      steps=args.steps,
      global_batch=8,
      compute_dtype='float32',
      progress=False,
      mesh_data=2,
      mesh_fsdp=2,
      mesh_tensor=2,
      save_every=args.save_every,
      keep=3,
      save_full_model=True,
  )
  trainer = Trainer(
      make_toy_model(d=64, f=256, dropout=0.1),
      ToyBatches(),
      cfg,
      optax.adamw(1e-2),
      checkpoint_dir=args.ckpt,
  )
  print(f'resumed at step {trainer.step}', flush=True)
  save = trainer.checkpointer.save

  def save_then_maybe_die(step, *a, **kw):
    started = save(step, *a, **kw)
    if started and step == args.kill_at:
      print(f'save of step {step} started', flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    return started

  trainer.checkpointer.save = save_then_maybe_die
  if args.kill_after_commit >= 0:
    committed = trainer.checkpointer.step_dir(args.kill_after_commit)
    rename = os.rename

    def rename_then_maybe_die(src, dst, *a, **kw):  # orbax commits by this rename
      rename(src, dst, *a, **kw)
      if os.fspath(dst) == committed:
        print(f'checkpoint {args.kill_after_commit} committed', flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    os.rename = rename_then_maybe_die
  rows = trainer.run()
  trainer.checkpointer.close()
  if args.out:
    out = {
        f'lora.{k}': np.asarray(v)
        for k, v in flatten_for_checkpoint(jax.device_get(trainer.state)).items()
    }
    out.update({f"loss.{int(r['step'])}": np.float32(r['loss']) for r in rows})
    np.savez(args.out, **out)


if __name__ == '__main__':
  if os.environ.get('ANLR_COMPILE_CACHE'):  # the test session's: the tests' in-process runs of
    # the same programs read what this process compiled
    jax.config.update('jax_compilation_cache_dir', os.environ['ANLR_COMPILE_CACHE'])
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
    jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)
  main()

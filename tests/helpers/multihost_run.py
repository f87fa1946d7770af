"""Subprocess entry point for the multi-host test: one of P processes with D CPU devices each,
joined with jax.distributed (gloo); trains the toy LM on the global (2, 2, 2) mesh, each process
feeding only its own batch rows; process 0 writes the losses."""

import argparse
import os
import sys

import jax


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--devices', type=int, required=True)
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--out', required=True)
  parser.add_argument('--ckpt', help='checkpoint dir: train with Trainer.run (resuming, saving)')
  args = parser.parse_args()
  jax.config.update('jax_num_cpu_devices', args.devices)  # before any JAX call
  if os.environ.get('ANLR_COMPILE_CACHE'):  # the test session's: a job run again compiles less
    jax.config.update('jax_compilation_cache_dir', os.environ['ANLR_COMPILE_CACHE'])
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
    jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)

  import numpy as np
  import optax

  from anlr_jax.train.distributed import initialize_distributed
  from anlr_jax.train.trainer import Trainer, TrainerConfig
  from tests.helpers.toy_lm import ToyBatches, make_toy_model

  initialize_distributed()  # JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID
  assert jax.device_count() == 8 and jax.local_device_count() == args.devices
  cfg = TrainerConfig(
      steps=args.steps,
      global_batch=8,
      micro_batches=2,
      compute_dtype='float32',
      progress=False,
      mesh_data=2,
      mesh_fsdp=2,
      mesh_tensor=2,
  )
  if args.ckpt:
    cfg.resume_allow = ['trainer.steps']
  trainer = Trainer(
      make_toy_model(), ToyBatches(), cfg, optax.adamw(1e-2), checkpoint_dir=args.ckpt or None
  )
  if args.ckpt:
    print(f'resumed at step {trainer.step}', flush=True)
    losses = [row['loss'] for row in trainer.run()]
    trainer.close()
  else:
    losses = [float(trainer.train_step()['loss']) for _ in range(args.steps)]
  if jax.process_index() == 0:
    np.save(args.out, np.asarray(losses, np.float64))
  print(f'process {jax.process_index()}/{jax.process_count()} losses {losses}', flush=True)
  jax.distributed.shutdown()
  sys.exit(0)


if __name__ == '__main__':
  main()

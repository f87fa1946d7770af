"""What sealing a checkpoint inside orbax's commit costs the training loop, next to sealing it after
the commit in a thread of its own (the earlier design, which left a window in which a killed
process left its newest checkpoint unsealed).

A loop of ``--steps`` updates of a float32 state of ``--mib`` MiB (params and Adam's two moments:
each update is a jitted elementwise Adam-like step plus ``--work`` chained matmuls, to stand for the
forward and backward pass) saves a :class:`anlr_jax.train.checkpoint.TrainCheckpointer` checkpoint
every ``--save-every`` updates, and waits for the last one at the end, as the trainer does. Three
variants run ``--rounds`` times each, interleaved: no checkpoints, checkpoints sealed after the
commit (a thread that waits for orbax's rename, then hashes), and checkpoints sealed inside the
commit (the shipped :class:`TrainCheckpointer`). The save cost of the loop is a variant's loop time
minus the no-checkpoint loop time of the same round, per save; the script prints the medians and
the ratio sealed-in-commit / sealed-after.

    python benchmarks/checkpoint_seal.py --mib 64 --steps 40 --save-every 5 --rounds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import threading
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import machine_line, write_json


def _post_commit_checkpointer(directory: str):
  """A :class:`TrainCheckpointer` sealed as before: orbax commits with its plain rename, and a thread
  started with each save waits for the committed directory, then writes the checksums; the end of
  the loop joins those threads."""
  import orbax.checkpoint as ocp

  from anlr_jax.train import checkpoint as ck

  class PostCommit(ck.TrainCheckpointer):

    def __init__(self, directory):
      super().__init__(directory, keep=2)
      options = dataclasses.replace(self.manager._options, temporary_path_class=None)
      self.manager.close()
      self.manager = ocp.CheckpointManager(self.directory, options=options)
      self.threads = []

    def _seal_when_committed(self, step, finished):
      folder = self.step_dir(step)
      while not os.path.isdir(folder) and not finished.is_set():
        finished.wait(0.05)
      if os.path.isdir(folder):
        start = time.perf_counter()
        ck.seal_directory(folder)
        self.seal_seconds[step] = time.perf_counter() - start

    def save(self, step, state, meta, frozen=None, *, force=False):
      started = super().save(step, state, meta, frozen, force=force)
      if started:
        finished = threading.Event()
        thread = threading.Thread(target=self._seal_when_committed, args=(step, finished))
        thread.start()
        self.threads.append((thread, finished))
      return started

    def wait(self):
      super().wait()
      for thread, finished in self.threads:
        finished.set()
        thread.join()
      self.threads = []

  return PostCommit(directory)


def loop_seconds(variant: str, mib: int, steps: int, save_every: int, work: int, root: str):
  """Wall time of one loop of ``steps`` updates with the ``variant``'s checkpoints."""
  import jax
  import jax.numpy as jnp

  from anlr_jax.train.checkpoint import TrainCheckpointer

  n = mib * 2**20 // 4 // 3
  key = jax.random.key(0)
  state = {
      "params": jax.random.normal(key, (n,)),
      "mu": jnp.zeros((n,)),
      "nu": jnp.zeros((n,)),
  }
  side = jax.random.normal(key, (256, 256)) / 16

  @jax.jit
  def update(state, side):
    for _ in range(work):
      side = jnp.tanh(side @ side)
    g = state["params"] * 1e-3 + side[0, 0]
    mu = 0.9 * state["mu"] + 0.1 * g
    nu = 0.999 * state["nu"] + 0.001 * g * g
    return {"params": state["params"] - 1e-3 * mu / (jnp.sqrt(nu) + 1e-8), "mu": mu, "nu": nu}, side

  state, side = update(state, side)  # compiled outside the timing
  jax.block_until_ready(state)
  directory = tempfile.mkdtemp(dir=root)
  checkpointer = None
  if variant == "sealed after the commit":
    checkpointer = _post_commit_checkpointer(directory)
  elif variant == "sealed in the commit":
    checkpointer = TrainCheckpointer(directory, keep=2)
  start = time.perf_counter()
  for step in range(1, steps + 1):
    state, side = update(state, side)
    if checkpointer is not None and step % save_every == 0:
      checkpointer.save(step, state, {"step": step}, force=True)
  jax.block_until_ready(state)
  if checkpointer is not None:
    checkpointer.wait()
  seconds = time.perf_counter() - start
  if checkpointer is not None:
    checkpointer.close()
  return seconds


VARIANTS = ("no checkpoints", "sealed after the commit", "sealed in the commit")


def main(argv=None):
  ap = argparse.ArgumentParser(
      description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  ap.add_argument("--mib", type=int, default=64, help="train state size (MiB)")
  ap.add_argument("--steps", type=int, default=40, help="updates per loop")
  ap.add_argument("--save-every", type=int, default=5, help="a checkpoint every N updates")
  ap.add_argument("--work", type=int, default=8, help="256 x 256 matmuls per update")
  ap.add_argument("--rounds", type=int, default=5, help="loops of each variant, interleaved")
  ap.add_argument("--out", help="write the results as JSON here")
  args = ap.parse_args(argv)
  if min(args.mib, args.steps, args.save_every, args.rounds) < 1:
    raise ValueError("--mib, --steps, --save-every and --rounds must be >= 1")
  saves = args.steps // args.save_every
  times = {v: [] for v in VARIANTS}
  with tempfile.TemporaryDirectory() as root:
    loop_seconds("sealed in the commit", args.mib, args.save_every, args.save_every, 1, root)
    for r in range(args.rounds):
      order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
      for variant in order:
        times[variant].append(
            loop_seconds(variant, args.mib, args.steps, args.save_every, args.work, root)
        )
  base = times["no checkpoints"]
  cost = {
      v: statistics.median((t - b) / saves for t, b in zip(times[v], base)) for v in VARIANTS[1:]
  }
  ratio = cost["sealed in the commit"] / cost["sealed after the commit"]
  print(machine_line())
  print(
      f"{args.mib} MiB state, {args.steps} updates, a save every {args.save_every} ({saves} saves)"
  )
  for v in VARIANTS:
    print(f"  {v:<24} loop s (rounds): " + ", ".join(f"{t:.3f}" for t in times[v]))
  for v in VARIANTS[1:]:
    print(f"  {v:<24} save cost per save, median: {cost[v] * 1e3:.1f} ms")
  print(f"  ratio, sealed in the commit / sealed after it: {ratio:.3f}")
  if args.out:
    write_json(args.out, {"args": vars(args), "times": times, "cost_s": cost, "ratio": ratio})


if __name__ == "__main__":
  main()

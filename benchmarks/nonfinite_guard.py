"""Cost of the trainer's non-finite guard (skip the update when the loss or gradient is not finite).

One jitted train step of the CPU reference config (``benchmarks/common.py``: LLaMA hidden 512,
8 layers, LoRA r = 16 on q, k, v, up, down, batch 4 x 256, float32, stacked layout) with
``anlr_jax.anlr``, built twice: ``make_train_step(..., skip_nonfinite=True)`` (the trainer's) and
``skip_nonfinite=False``. The two are timed interleaved, in a random order each round, in one
process; the script prints the median step time of each and the ratio guarded / unguarded.

    python benchmarks/nonfinite_guard.py --rounds 31
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import jax
import jax.numpy as jnp

import anlr_jax
from benchmarks.common import (
    add_config_flags,
    build_jax_lora_model,
    config_from_args,
    jax_batch,
    machine_line,
)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_config_flags(ap)
  ap.add_argument("--rounds", type=int, default=31)
  ap.add_argument("--out", help="write the results as JSON here")
  args = ap.parse_args(argv)
  cfg = config_from_args(args)

  from anlr_jax.train.step import init_train_state, make_train_step, stack_layers

  graphdef, lora, frozen, extra = build_jax_lora_model(cfg)
  stacked = cfg.lora_layout == "stacked"
  if stacked:
    lora = stack_layers(lora)
  batch = jax_batch(cfg)
  tx = anlr_jax.anlr(1e-4, warmup_steps=2)
  steps, states = {}, {}
  for guarded in (True, False):
    name = "guarded" if guarded else "unguarded"
    step = make_train_step(graphdef, tx, stacked_layers=stacked, skip_nonfinite=guarded)
    steps[name] = jax.jit(step, donate_argnums=(0,))
    states[name] = init_train_state(*jax.tree.map(jnp.copy, (lora, extra)), tx)
    for _ in range(3):  # compile and warm up
      states[name], metrics = steps[name](states[name], frozen, batch)
    jax.block_until_ready(metrics)

  times = {name: [] for name in steps}
  rng = random.Random(0)
  for _ in range(args.rounds):
    order = list(steps)
    rng.shuffle(order)
    for name in order:
      start = time.perf_counter()
      states[name], metrics = steps[name](states[name], frozen, batch)
      jax.block_until_ready(metrics)
      times[name].append(time.perf_counter() - start)
      time.sleep(0.1)
  med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
  paired = statistics.median(g / u for g, u in zip(times["guarded"], times["unguarded"]))
  result = {
      "machine": machine_line(),
      "config": json.loads(cfg.to_json()),
      "rounds": args.rounds,
      "median_ms": med,
      "ratio_guarded_over_unguarded": med["guarded"] / med["unguarded"],
      "paired_ratio": paired,
  }
  print(
      f"step median: guarded {med['guarded']:.1f} ms, unguarded {med['unguarded']:.1f} ms;"
      f" ratio {result['ratio_guarded_over_unguarded']:.4f} (paired {paired:.4f}),"
      f" {args.rounds} rounds"
  )
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)
  return result


if __name__ == "__main__":
  main()

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
import os
import sys

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import anlr_jax
from benchmarks.common import (
    JaxStep,
    add_config_flags,
    build_jax_lora_model,
    config_from_args,
    interleave,
    jax_batch,
    machine_line,
    timed,
    write_json,
)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_config_flags(ap)
  ap.add_argument("--rounds", type=int, default=31)
  ap.add_argument("--out", help="write the results as JSON here")
  args = ap.parse_args(argv)
  cfg = config_from_args(args)

  parts, batch = build_jax_lora_model(cfg), jax_batch(cfg)
  tx = anlr_jax.anlr(1e-4, warmup_steps=2)
  steps = {
      name: JaxStep(cfg, tx, parts, batch, copy_state=True, skip_nonfinite=name == "guarded")
      for name in ("guarded", "unguarded")
  }
  timings = interleave(
      {name: timed(step) for name, step in steps.items()}, args.rounds, warmup=3, pause=0.1
  )
  med = {name: 1e3 * timings.median(name) for name in steps}
  paired = timings.paired("guarded", "unguarded")
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
    write_json(args.out, result)
  return result


if __name__ == "__main__":
  main()

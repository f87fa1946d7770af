r"""What this machine's XLA does per second: the rates the serving and judging targets run into.

Two measurements, each in one jitted program, timed after its compile (median of ``--repeats``):

- *square products*: ``N x N`` times ``N x N`` in float32, bfloat16 and int8 (int32 sums), in
  GFLOP/s (2 N^3 operations): the most arithmetic a second this machine's XLA does;
- *products of a few rows*: ``R`` rows through a chain of ``--layers`` MLP blocks of SmolLM2-135M's
  shapes (``576 x 1536`` then ``1536 x 576``, float32, 318 MB of weights at 30 layers), for
  ``R`` = 1, 2, 4, 8, 16: the time per chain, its ratio to one row, GFLOP/s and the weights' bytes
  read per second. One row reads every weight for two flops (bound by memory); more rows do more
  arithmetic on the same reads. A decoding step of ``R`` requests is such a chain plus attention.

  python benchmarks/cpu_rates.py [--size 2048] [--layers 30] [--repeats 9] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HIDDEN, FFN = 576, 1536  # SmolLM2-135M
ROWS = (1, 2, 4, 8, 16)


def timed(fn, *args, repeats: int) -> float:
  """The median wall time (s) of ``fn(*args)`` after one call that compiles it."""
  fn(*args).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn(*args).block_until_ready()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def square_rates(size: int, repeats: int) -> dict[str, float]:
  """GFLOP/s of an ``size x size`` product per element type."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  values = np.random.default_rng(0).integers(-100, 100, (size, size))
  rates = {}
  for name, dtype, out in (
      ("float32", jnp.float32, jnp.float32),
      ("bfloat16", jnp.bfloat16, jnp.float32),
      ("int8", jnp.int8, jnp.int32),
  ):
    a = jnp.asarray(values, dtype)
    product = jax.jit(lambda a, b, out=out: jax.lax.dot(a, b, preferred_element_type=out))
    rates[name] = 2 * size**3 / timed(product, a, a, repeats=repeats) / 1e9
  return rates


def row_rates(layers: int, repeats: int) -> list[dict[str, float]]:
  """Per row count: the chain's time, its ratio to one row, GFLOP/s and GB/s of weights."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  rng = np.random.default_rng(0)
  up = [jnp.asarray(rng.standard_normal((HIDDEN, FFN), np.float32) * 0.02) for _ in range(layers)]
  down = [jnp.asarray(rng.standard_normal((FFN, HIDDEN), np.float32) * 0.02) for _ in range(layers)]

  @jax.jit
  def chain(x, up, down):
    for a, b in zip(up, down):
      x = x + jnp.tanh(x @ a) @ b * 0.01
    return x

  weights = 2 * layers * HIDDEN * FFN
  out = []
  for rows in ROWS:
    x = jnp.asarray(rng.standard_normal((rows, HIDDEN), np.float32))
    seconds = timed(chain, x, up, down, repeats=repeats)
    out.append(
        {
            "rows": rows,
            "ms": seconds * 1e3,
            "gflops": 2 * rows * weights / seconds / 1e9,
            "weights_gb_per_s": 4 * weights / seconds / 1e9,
        }
    )
  for r in out:
    r["vs_one_row"] = r["ms"] / out[0]["ms"]
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", type=int, default=2048, help="the square products' N")
  parser.add_argument("--layers", type=int, default=30, help="MLP blocks in the row chain")
  parser.add_argument("--repeats", type=int, default=9)
  parser.add_argument("--json", help="write the figures here")
  args = parser.parse_args(argv)
  import jax

  squares = square_rates(args.size, args.repeats)
  print(f"square {args.size} x {args.size} products ({jax.devices()[0].device_kind}):")
  for name, rate in squares.items():
    print(f"  {name:>9}: {rate:7.1f} GFLOP/s")
  rows = row_rates(args.layers, args.repeats)
  print(f"rows through {args.layers} MLP blocks of {HIDDEN} x {FFN} (float32):")
  print("  rows      ms  x one row  GFLOP/s  weights GB/s")
  for r in rows:
    print(
        f"  {r['rows']:4d} {r['ms']:7.2f} {r['vs_one_row']:10.2f} {r['gflops']:8.1f}"
        f" {r['weights_gb_per_s']:13.1f}"
    )
  if args.json:
    record = {
        "args": vars(args),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "square_gflops": squares,
        "rows": rows,
    }
    with open(args.json, "w") as f:
      json.dump(record, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())

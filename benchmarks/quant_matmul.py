r"""One projection of a quantised base at decode sizes: float32 against nf4 and int8, side by side.

For each kernel shape ``d_in x d_out`` (default: the projections of Qwen2.5-1.5B, the local
judge: q / o ``1536 x 1536``, k / v ``1536 x 256``, gate / up ``1536 x 8960``, down
``8960 x 1536``, the output matrix ``1536 x 151936``) and each row count ``M`` (``--rows``: 1 is
one-token decoding of one sequence, 8 of a batch of 8), one jitted ``y = x @ W`` per variant:

    f32       the float32 kernel
    nf4_old   the whole kernel dequantised into one float32 buffer, then one product (the
              quantised layer's path for many rows)
    nf4_new   the quantised layer's forward (:class:`anlr_jax.nn.quant.QuantLinear`): for at most
              ``DECODE_ROWS`` rows and a kernel over two chunks, the product a chunk of output
              columns at a time
    int8_old, int8_new  the same for int8

The variants run in a shuffled order each round (``--rounds``); the table gives the median
milliseconds and the paired ratios (medians over rounds of the per-round quotients). Every
variant's output is checked against the whole-kernel path (largest difference relative to the
largest output), and the compiled program is searched for a ``(d_in, d_out)`` float32 buffer.

    python benchmarks/quant_matmul.py
    python benchmarks/quant_matmul.py --shapes 1536x8960 --rows 1 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

SHAPES = "1536x1536,1536x256,1536x8960,8960x1536,1536x151936"


def _variants(quant, jnp):
  def old(mode):
    spec = quant._MatmulSpec(mode, jnp.dtype("float32"), False, None)
    return lambda x, a: quant._dot(x, quant._dequantize_after(a, x, mode), spec, 0)

  def new(mode):
    spec = quant._MatmulSpec(mode, jnp.dtype("float32"), False, None)
    return lambda x, a: quant._quant_matmul(x, a, spec)

  return old, new


def run_shape(d_in: int, d_out: int, rows: list[int], rounds: int) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from anlr_jax.nn import quant

  old, new = _variants(quant, jnp)
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((d_in, d_out), np.float32) * 0.02)
  packed = {m: quant.quantize_concrete(w, m) for m in ("nf4", "int8")}
  fns = {"f32": (jax.jit(lambda x, w: x @ w), w)}
  for m in ("nf4", "int8"):
    fns[f"{m}_old"] = (jax.jit(old(m)), packed[m])
    fns[f"{m}_new"] = (jax.jit(new(m)), packed[m])
  out = []
  for m_rows in rows:
    x = jnp.asarray(rng.standard_normal((m_rows, d_in), np.float32))
    ys = {k: np.asarray(f(x, a)) for k, (f, a) in fns.items()}
    whole = f"f32[{d_in},{d_out}]"
    buffer = {k: whole in f.lower(x, a).compile().as_text() for k, (f, a) in fns.items()}
    err = {
        m: float(np.max(np.abs(ys[f"{m}_new"] - ys[f"{m}_old"])) / np.max(np.abs(ys[f"{m}_old"])))
        for m in ("nf4", "int8")
    }
    times = {k: [] for k in fns}
    for r in range(rounds):
      order = list(fns)
      np.random.default_rng(r).shuffle(order)
      for k in order:
        f, a = fns[k]
        t = time.perf_counter()
        f(x, a).block_until_ready()
        times[k].append(time.perf_counter() - t)
    out.append(
        {
            "shape": [d_in, d_out],
            "rows": m_rows,
            "median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
            "paired": {k: common.paired_ratio(times[k], times["f32"]) for k in fns if k != "f32"}
            | {
                f"{m}_new/{m}_old": common.paired_ratio(times[f"{m}_new"], times[f"{m}_old"])
                for m in ("nf4", "int8")
            },
            "whole_float_buffer": buffer,
            "max_rel_diff_new_vs_old": err,
        }
    )
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--shapes", default=SHAPES)
  ap.add_argument("--rows", default="1,8")
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--out", help="write the figures as JSON here")
  args = ap.parse_args(argv)
  print(f"{common.machine_line()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
  print(f"load average at start: {os.getloadavg()}")
  rows = [int(r) for r in args.rows.split(",")]
  print(
      "| shape | M | f32 ms | nf4 old ms | nf4 new ms | new/old | nf4 new/f32 | int8 old ms"
      " | int8 new ms | new/old | int8 new/f32 | whole float buffer (old, new) |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  results = []
  for shape in args.shapes.split(","):
    d_in, d_out = map(int, shape.split("x"))
    for r in run_shape(d_in, d_out, rows, args.rounds):
      results.append(r)
      ms, p, b = r["median_ms"], r["paired"], r["whole_float_buffer"]
      print(
          f"| {d_in} x {d_out} | {r['rows']} | {ms['f32']:.2f} | {ms['nf4_old']:.2f} |"
          f" {ms['nf4_new']:.2f} | {p['nf4_new/nf4_old']:.2f} | {p['nf4_new']:.2f} |"
          f" {ms['int8_old']:.2f} | {ms['int8_new']:.2f} | {p['int8_new/int8_old']:.2f} |"
          f" {p['int8_new']:.2f} | nf4 {b['nf4_old']}, {b['nf4_new']}; int8 {b['int8_old']},"
          f" {b['int8_new']} |",
          flush=True,
      )
  print(f"load average at end: {os.getloadavg()}")
  if args.out:
    common.write_json(args.out, {"load_average_end": os.getloadavg(), "results": results})
  return 0


if __name__ == "__main__":
  sys.exit(main())

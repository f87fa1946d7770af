"""Optimizer-only overhead of ``anlr_jax.anlr`` over ``optax.adamw`` on a LLaMA-2-7B-shaped LoRA tree.

One jitted step = ``tx.update`` + ``optax.apply_updates`` with parameters and state donated. The two
optimizers are timed interleaved (adamw, anlr, adamw, anlr, ...) and the medians compared; the
optimizer-state bytes of each are counted from the state pytrees.

    python benchmarks/optimizer_overhead.py --layers 8 --rank 32 --runs 21
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import sys

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import optax

from anlr_jax.methods import method_optimizer
from benchmarks.common import interleave, timed, tree_bytes, tree_size, write_json

# LLaMA-2-7B: hidden 4096, FFN 11008; the paper's LoRA targets.
TARGETS = {
    "q_proj": (4096, 4096),
    "k_proj": (4096, 4096),
    "v_proj": (4096, 4096),
    "up_proj": (4096, 11008),
    "down_proj": (11008, 4096),
}


def lora_tree(layers: int, rank: int, stacked: bool, dtype):
  key = jax.random.key(0)
  tree = {}
  for i, (name, (d_in, d_out)) in enumerate(TARGETS.items()):
    lead = (layers,) if stacked else ()
    ka, kb = jax.random.split(jax.random.fold_in(key, i))
    make = lambda k, shape: (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
    if stacked:
      tree[name] = {
          "lora_a": make(ka, lead + (d_in, rank)),
          "lora_b": make(kb, lead + (rank, d_out)),
      }
    else:
      for layer in range(layers):
        k1, k2 = jax.random.split(jax.random.fold_in(ka, layer))
        tree.setdefault(f"layer_{layer}", {})[name] = {
            "lora_a": make(k1, (d_in, rank)),
            "lora_b": make(k2, (rank, d_out)),
        }
  return tree


def make_step(tx):
  def step(grads, state, params):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(1, 2))


def main(argv=None):
  ap = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--rank", type=int, default=32)
  ap.add_argument(
      "--runs", type=int, default=21, help="interleaved timed runs per optimizer (>= 15)"
  )
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument(
      "--window",
      type=int,
      default=1,
      help="steps per timing sample, dispatched back to back (1: wait after every step)",
  )
  ap.add_argument(
      "--stacked", action="store_true", help="stack layers on a leading axis (nnx.scan layout)"
  )
  ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  ap.add_argument(
      "--unbatched",
      action="store_true",
      help="also time anlr(batch_modules=False): statistics module by module",
  )
  ap.add_argument("--json", help="also write the results to this JSON file")
  args = ap.parse_args(argv)
  dtype = jnp.dtype(args.dtype)

  params = lora_tree(args.layers, args.rank, args.stacked, dtype)
  grads = jax.tree.map(lambda x: (0.01 * jnp.ones_like(x)).astype(x.dtype), params)
  # through the one method assembly: "adamw" is method lora (optax.adamw), "anlr" AnLR-LoRA with
  # warmup_steps=0: the timed steps are all anisotropic (the full AnLR computation)
  tx_of = functools.partial(
      method_optimizer,
      learning_rate=1e-4,
      weight_decay=1e-4,
      clip_norm=None,
      anlr_kwargs={"warmup_steps": 0},
  )
  optimizers = {"adamw": tx_of("lora"), "anlr": tx_of("anlr")}
  if args.unbatched:
    optimizers["anlr-unbatched"] = tx_of("anlr", batch_modules=False)
  runs = {}
  for name, tx in optimizers.items():
    p = jax.tree.map(jnp.copy, params)
    runs[name] = dict(step=make_step(tx), state=tx.init(p), params=p)
  state_bytes = {name: tree_bytes(r["state"]) for name, r in runs.items()}

  def window(name):
    r = runs[name]
    for _ in range(args.window):  # dispatched back to back; one wait at the end
      r["params"], r["state"] = r["step"](grads, r["state"], r["params"])
    jax.block_until_ready((r["params"], r["state"]))

  # In a fixed order: adamw, anlr, adamw, anlr, ...; one sample = the time of a window / its steps.
  timings = interleave(
      {name: timed(functools.partial(window, name)) for name in runs},
      args.runs,
      warmup=args.warmup,
      shuffle=False,
  )
  med = {name: timings.median(name) / args.window for name in runs}
  param_count = tree_size(params)
  result = dict(
      machine=f"{platform.processor() or platform.machine()}, {jax.device_count()} x {jax.devices()[0].device_kind}",
      backend=jax.default_backend(),
      layers=args.layers,
      rank=args.rank,
      stacked=args.stacked,
      dtype=args.dtype,
      lora_params=param_count,
      runs=args.runs,
      window=args.window,
      adamw_ms=1e3 * med["adamw"],
      anlr_ms=1e3 * med["anlr"],
      time_ratio=med["anlr"] / med["adamw"],
      adamw_state_bytes=state_bytes["adamw"],
      anlr_state_bytes=state_bytes["anlr"],
      extra_state_pct=100.0 * (state_bytes["anlr"] - state_bytes["adamw"]) / state_bytes["adamw"],
  )
  if args.unbatched:
    result["anlr_unbatched_ms"] = 1e3 * med["anlr-unbatched"]
    result["unbatched_time_ratio"] = med["anlr-unbatched"] / med["adamw"]
  print(
      f"LoRA tree: {args.layers} layers x (q,k,v,up,down), r={args.rank}, {param_count/1e6:.1f}M params, "
      f"{args.dtype}, {'stacked' if args.stacked else 'per-layer'}; backend {result['backend']}"
  )
  print(
      f"median of {args.runs} interleaved runs: adamw {result['adamw_ms']:.2f} ms, "
      f"anlr {result['anlr_ms']:.2f} ms, ratio {result['time_ratio']:.3f}"
      + (
          f"; anlr(batch_modules=False) {result['anlr_unbatched_ms']:.2f} ms, ratio "
          f"{result['unbatched_time_ratio']:.3f}"
          if args.unbatched
          else ""
      )
  )
  print(
      f"optimizer state: adamw {state_bytes['adamw']/2**20:.2f} MiB, anlr {state_bytes['anlr']/2**20:.2f} MiB, "
      f"extra {result['extra_state_pct']:.4f}%"
  )
  if args.json:
    write_json(args.json, result)
  return result


if __name__ == "__main__":
  main()

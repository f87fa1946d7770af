r"""Cost of the paper's baselines next to LoRA: step time and XLA memory of lora, adalora, lorapro,
loradash and anlr, side by side in one process.

One step = the trainer's jitted train step (``anlr_jax.train.make_train_step``: forward, backward,
``clip_by_global_norm(1)``, the method's optimizer, train state donated) on the CPU reference config
of ``benchmarks/common.py`` (LLaMA hidden 512, 8 layers, LoRA r = 16 on q, k, v, up, down, batch
4 x 256, float32, stacked layout). Each method is built as ``anlr train`` builds it
(``anlr_jax.run.inject_method``, ``anlr_jax.methods.method_optimizer``,
``anlr_jax.method_hooks.method_hooks``):

    lora      LoRALinear + optax.adamw
    adalora   AdaLoRALinear + rank_allocator(adamw) in its budget-decrease phase (a global sort and
              masking every step, deltaT = 1) + the orthogonal regulariser in the loss
    lorapro   LoRALinear + lorapro(mode="full"): the paper's Algorithm 1, Adam moments of the
              d_in x d_out equivalent gradient and two eigendecompositions + a Sylvester solve per
              module and step (its stated drawback)
    loradash  LoRADashLinear launched (s = 8 directions) + adamw: the dash term in every forward
    anlr      LoRALinear + anlr_jax.anlr(warmup_steps=0): every timed step anisotropic

The steps are timed interleaved (one step of each per round, in a shuffled order), and the script
prints each method's median step time, its ratio over LoRA's (and the median of the per-round
ratios), and XLA's ``memory_analysis()`` of the compiled step (arguments + outputs - aliased +
temporaries) with its ratio over LoRA's. LoRA-Dash's one-off launch (an SVD of every adapted
kernel) is timed apart.

    python benchmarks/method_cost.py --rounds 11
    python benchmarks/method_cost.py --methods lora,lorapro --rank 32 --out cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (
    BenchConfig,
    add_config_flags,
    config_from_args,
    jax_batch,
    machine_line,
    model_config,
    xla_memory,
)

METHODS = ("lora", "adalora", "lorapro", "loradash", "anlr")
LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.01  # as benchmarks/train_step.py
ADALORA_TOTAL_STEP = 10_000  # long enough that every timed step is in the budget-decrease phase


def run_config(cfg: BenchConfig):
  """The ``anlr train`` config of the benchmark's LoRA shape (the methods' other keys: defaults,
  e.g. ``adalora.target_r = round(r / 1.5)``; ``anlr.warmup_steps=0``, LoRA-Dash launched)."""
  from anlr_jax.config import load_config

  return load_config(
      None,
      [
          f"lora.rank={cfg.rank}",
          f"lora.alpha={cfg.alpha}",
          "lora.dropout=0",
          f"lora.targets=[{','.join(cfg.targets)}]",
          f"loradash.num_directions={min(8, cfg.hidden)}",
          "loradash.launch_step=0",
          "anlr.warmup_steps=0",
      ],
  )


def build_method_step(cfg: BenchConfig, method: str):
  """``(step, info)``: a no-argument closure running one jitted train step of ``method`` on the
  benchmark model (random weights, seed 0; adapters seed 1), and its compile time and memory."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from anlr_jax.method_hooks import adalora_config, method_hooks
  from anlr_jax.methods import get_method, method_optimizer
  from anlr_jax.models.llama import LlamaForCausalLM
  from anlr_jax.nn import launch_dash, lora_scale
  from anlr_jax.run import inject_method
  from anlr_jax.train.step import init_train_state, make_train_step, split_model, stack_layers

  spec = get_method(method)
  config = run_config(cfg)
  model = LlamaForCausalLM(model_config(cfg), rngs=nnx.Rngs(0))
  inject_method(model, config, method)
  info = {}
  if spec.uses_loradash:  # launched at once, so every timed forward has the dash term
    t0 = time.perf_counter()
    launch_dash(model)
    info["dash_launch_s"] = time.perf_counter() - t0
  graphdef, lora, frozen, extra = split_model(model)
  tx = method_optimizer(
      method,
      LEARNING_RATE,
      weight_decay=WEIGHT_DECAY,
      clip_norm=1.0,
      anlr_kwargs=config.anlr.as_kwargs(),
      adalora_config=adalora_config(config, ADALORA_TOTAL_STEP) if spec.uses_adalora else None,
      lora_scale=lora_scale(cfg.rank, cfg.alpha, spec.use_rslora),
      lorapro_mode=config.lorapro.mode,
  )
  hooks = method_hooks(config, method)
  stacked = cfg.lora_layout == "stacked"
  if stacked:
    lora = stack_layers(lora)
  dtype = jnp.dtype(cfg.dtype)
  train_step = make_train_step(
      graphdef,
      tx,
      compute_dtype=None if dtype == jnp.float32 else dtype,
      remat=cfg.remat,
      stacked_layers=stacked,
      loss_regularizer=hooks.get("loss_regularizer"),
  )
  batch = jax_batch(cfg)
  state = init_train_state(lora, extra, tx)
  t0 = time.perf_counter()
  compiled = jax.jit(train_step, donate_argnums=(0,)).lower(state, frozen, batch).compile()
  info["compile_s"] = time.perf_counter() - t0
  info["xla"] = xla_memory(compiled)
  info["lora_params"] = int(sum(x.size for x in jax.tree.leaves(lora)))
  info["opt_state_bytes"] = int(
      sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.opt_state))
  )
  holder = [state]

  def step():
    new_state, metrics = compiled(holder[0], frozen, batch)
    jax.block_until_ready((new_state, metrics))
    holder[0] = new_state
    return metrics

  return step, info


def main(argv=None):
  ap = argparse.ArgumentParser(
      description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  add_config_flags(ap)
  ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated; lora first")
  ap.add_argument("--rounds", type=int, default=11, help="timed rounds (one step of each method)")
  ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each method first")
  ap.add_argument("--pause", type=float, default=0.05, help="seconds between two timed steps")
  ap.add_argument("--out", help="write the results as JSON here")
  args = ap.parse_args(argv)
  cfg = config_from_args(args)
  methods = [m for m in args.methods.split(",") if m]
  unknown = [m for m in methods if m not in METHODS]
  if unknown or not methods or methods[0] != "lora" or len(set(methods)) != len(methods):
    raise ValueError(
        f"--methods {args.methods!r}: distinct names from {', '.join(METHODS)}, lora first (the"
        " ratios are over LoRA)"
    )
  if args.rounds < 1:
    raise ValueError(f"--rounds {args.rounds} must be >= 1")

  import jax

  steps, infos = {}, {}
  for method in methods:
    steps[method], infos[method] = build_method_step(cfg, method)
    for _ in range(max(1, args.warmup)):
      metrics = steps[method]()
    loss = float(metrics["loss"])
    if not loss == loss:  # NaN
      raise RuntimeError(f"{method}: the warm-up step's loss is NaN")
    print(f"{method}: compiled in {infos[method]['compile_s']:.1f} s", file=sys.stderr)

  times = {m: [] for m in methods}
  rng = random.Random(0)
  for _ in range(args.rounds):
    order = list(methods)
    rng.shuffle(order)
    for method in order:
      t0 = time.perf_counter()
      steps[method]()
      times[method].append(time.perf_counter() - t0)
      time.sleep(args.pause)

  base_ms = 1e3 * statistics.median(times["lora"])
  base_peak = infos["lora"]["xla"]["peak_bytes"]
  rows = {}
  for m in methods:
    median_ms = 1e3 * statistics.median(times[m])
    rows[m] = dict(
        median_ms=median_ms,
        times_ms=[1e3 * t for t in times[m]],
        time_ratio_over_lora=median_ms / base_ms,
        paired_time_ratio=statistics.median(a / b for a, b in zip(times[m], times["lora"])),
        xla_peak_mib=infos[m]["xla"]["peak_bytes"] / 2**20,
        xla_ratio_over_lora=infos[m]["xla"]["peak_bytes"] / base_peak,
        **infos[m],
    )
  result = dict(
      machine=machine_line(),
      backend=jax.default_backend(),
      jax=jax.__version__,
      date=time.strftime("%Y-%m-%d"),
      config=json.loads(cfg.to_json()),
      rounds=args.rounds,
      methods=rows,
  )
  c = result["config"]
  print(
      f"{result['machine']}, {result['backend']}; LLaMA hidden {c['hidden']}, {c['layers']}"
      f" layers, r = {c['rank']} on {','.join(c['targets'])}, batch {c['batch']} x {c['seq']},"
      f" {c['dtype']}, {c['lora_layout']}; {args.rounds} interleaved rounds"
  )
  header = f"{'method':<10}{'step ms':>10}{'/ lora':>9}{'paired':>9}{'XLA MiB':>10}{'/ lora':>9}"
  print(header)
  for m, r in rows.items():
    print(
        f"{m:<10}{r['median_ms']:>10.1f}{r['time_ratio_over_lora']:>9.3f}"
        f"{r['paired_time_ratio']:>9.3f}{r['xla_peak_mib']:>10.1f}{r['xla_ratio_over_lora']:>9.3f}"
    )
  for m in methods[1:]:
    r = rows[m]
    print(
        f"ratio step time {m} / lora: {r['time_ratio_over_lora']:.4f} (paired"
        f" {r['paired_time_ratio']:.4f}); XLA memory {m} / lora: {r['xla_ratio_over_lora']:.4f}"
    )
  if "loradash" in rows:
    launch_s = rows["loradash"]["dash_launch_s"]
    print(f"loradash one-off launch (SVD of every adapted kernel): {launch_s:.2f} s")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)
  return result


if __name__ == "__main__":
  main()

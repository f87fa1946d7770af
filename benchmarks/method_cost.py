r"""Cost of the paper's baselines next to LoRA: step time and XLA memory of lora, adalora, lorapro,
loradash and anlr, side by side in one process.

One step = the trainer's jitted train step (``anlr_jax.train.make_train_step``: forward, backward,
``clip_by_global_norm(1)``, the method's optimizer, train state donated) on the CPU reference config
of ``benchmarks/common.py`` (LLaMA hidden 512, 8 layers, LoRA r = 16 on q, k, v, up, down, batch
4 x 256, float32, stacked layout). Each method is built as ``anlr train`` builds it
(``anlr_jax.app.assemble.build_method``: adapter layers, optimizer, trainer hooks; a constant
learning rate):

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
import dataclasses
import json
import os
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (
    LEARNING_RATE,
    WEIGHT_DECAY,
    BenchConfig,
    JaxStep,
    add_config_flags,
    config_from_args,
    interleave,
    jax_batch,
    machine_line,
    model_config,
    timed,
    write_json,
)

METHODS = ("lora", "adalora", "lorapro", "loradash", "anlr")
ADALORA_TOTAL_STEP = 10_000  # long enough that every timed step is in the budget-decrease phase


def run_config(cfg: BenchConfig):
  """The ``anlr train`` config of the benchmark's LoRA shape (the methods' other keys: defaults,
  e.g. ``adalora.target_r = round(r / 1.5)``; ``anlr.warmup_steps=0``, LoRA-Dash launched)."""
  from anlr_jax.app.config import load_config

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
          f"trainer.weight_decay={WEIGHT_DECAY}",
          "trainer.clip_norm=1.0",
          "trainer.diag_every=0",
      ],
  )


def build_method_step(cfg: BenchConfig, method: str):
  """``(step, info)``: the compiled train step of ``method`` on the benchmark model (random weights,
  seed 0; adapters seed 1; calling it runs one step) and its compile time and memory."""
  from flax import nnx

  from anlr_jax.app.assemble import build_method
  from anlr_jax.models import LlamaForCausalLM
  from anlr_jax.nn import launch_dash
  from anlr_jax.train import split_model

  config = dataclasses.replace(run_config(cfg), method=method)
  model = LlamaForCausalLM(model_config(cfg), rngs=nnx.Rngs(0))
  built = build_method(
      config, total_steps=ADALORA_TOTAL_STEP, model=model, learning_rate=LEARNING_RATE
  )
  info = {}
  if built.spec.uses_loradash:  # launched at once, so every timed forward has the dash term
    info["dash_launch_s"] = timed(lambda: launch_dash(model))()
  regularizer = built.hooks.get("loss_regularizer")
  step = JaxStep(cfg, built.tx, split_model(model), jax_batch(cfg), loss_regularizer=regularizer)
  info.update(
      compile_s=step.compile_s,
      xla=step.xla,
      lora_params=step.lora_params,
      opt_state_bytes=step.opt_state_bytes,
  )
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
    step, infos[method] = build_method_step(cfg, method)
    for _ in range(max(1, args.warmup)):
      loss = float(step()["loss"])
    if not loss == loss:  # NaN
      raise RuntimeError(f"{method}: the warm-up step's loss is NaN")
    print(f"{method}: compiled in {infos[method]['compile_s']:.1f} s", file=sys.stderr)
    steps[method] = timed(step)
  timings = interleave(steps, args.rounds, pause=args.pause)

  base_ms = 1e3 * timings.median("lora")
  base_peak = infos["lora"]["xla"]["peak_bytes"]
  rows = {}
  for m in methods:
    median_ms = 1e3 * timings.median(m)
    rows[m] = dict(
        median_ms=median_ms,
        times_ms=[1e3 * t for t in timings.times[m]],
        time_ratio_over_lora=median_ms / base_ms,
        paired_time_ratio=timings.paired(m, "lora"),
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
    write_json(args.out, result)
  return result


if __name__ == "__main__":
  main()

r"""Full LoRA train step, side by side: this project (AdamW, AnLR) vs PyTorch + PEFT (eager, compiled).

One step = forward, backward and optimizer update of the LoRA factors on one ``B x T`` batch:

    (a) jax-adamw    anlr_jax.train.make_train_step + optax.adamw, jitted, train state donated
    (b) jax-anlr     the same step with anlr_jax.anlr(warmup_steps=0): every timed step anisotropic
    (c) torch-eager  transformers.LlamaForCausalLM + peft.get_peft_model + torch.optim.AdamW
    (d) torch-compile  (c) with torch.compile on the PEFT model (skipped with a reason if it fails)

Every framework runs in its own subprocess (peak RSS via ``resource.getrusage`` is its own); the
parent times them interleaved (one step each per round, or ``--block`` back-to-back steps, each
round in a shuffled order) and reports medians, tokens/s and ratios. JAX's compiled step also reports XLA's ``memory_analysis()``
(arguments + outputs - aliased + temporaries).

    python benchmarks/train_step.py                         # reference config (hidden 512, 8 layers)
    python benchmarks/train_step.py --runs 21 --json out.json
    python benchmarks/train_step.py --frameworks jax-adamw,jax-anlr --rank 64
    python benchmarks/train_step.py --block 4     # 4 back-to-back steps per turn, first left out
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (
    BenchConfig,
    JaxStep,
    Worker,
    add_config_flags,
    build_torch_step,
    config_from_args,
    interleave,
    jax_optimizer,
    machine_line,
    paired_ratio,
    serve,
    stderr_tail,
    thread_env,
    write_json,
)

FRAMEWORKS = ("jax-adamw", "jax-anlr", "torch-eager", "torch-compile")


def build_jax_step(cfg: BenchConfig, optimizer: str):
  """``(step, info)``: a no-argument closure running one jitted train step, and memory facts."""
  import flax
  import jax
  import optax

  step = JaxStep(cfg, jax_optimizer(optimizer))
  info = dict(
      compile_s=step.compile_s,
      xla=step.xla,
      backend=jax.default_backend(),
      versions=dict(jax=jax.__version__, flax=flax.__version__, optax=optax.__version__),
      lora_params=step.lora_params,
  )
  return step, info


def worker_main(name: str, cfg: BenchConfig, warmup: int):
  if name not in FRAMEWORKS:
    raise ValueError(f"--worker {name!r} must be one of {sorted(FRAMEWORKS)}")
  if name.startswith("jax-"):
    step, info = build_jax_step(cfg, name[len("jax-") :])
  else:  # transformers' LLaMA + PEFT LoRA + torch.optim.AdamW on the CPU, cfg.threads threads
    import torch

    torch.set_num_threads(cfg.threads)
    step, info = build_torch_step(cfg, name == "torch-compile")
    info = dict(threads=torch.get_num_threads(), **info)
  serve(step, info, warmup)


def start_workers(names, cfg: BenchConfig, warmup: int, script: str = __file__):
  """Starts one worker per name, one after another (compiles never overlap); failures reported."""
  workers, failed = {}, {}
  for name in names:
    with tempfile.TemporaryFile("w+") as err:
      argv = [sys.executable, os.path.abspath(script), "--worker", name]
      argv += ["--config-json", cfg.to_json(), "--warmup", str(warmup)]
      try:
        workers[name] = Worker(name, argv, env=thread_env(cfg.threads), stderr=err)
      except RuntimeError as e:
        failed[name] = f"{e}: {stderr_tail(err)}"
  return workers, failed


def run_interleaved(
    workers: dict, runs: int, settle: int = 0, pause_s: float = 0.1, seed: int = 0, block: int = 1
) -> None:
  """``settle`` untimed and then ``runs`` timed rounds of one step per worker, each round in a fresh
  random order (seeded), 0.1 s apart (:func:`benchmarks.common.interleave`).

  Step times are measured inside the workers, so neither the pause nor the pipes enter them. The
  workers warm up one after the other, and the first rounds after that run slow for every framework
  (1.5-3x in the first round on the 2-core CPU); the ``settle`` rounds absorb that and are kept
  apart in each worker's ``settle_ms``. With ``block > 1`` a turn is ``block`` back-to-back steps
  and each turn's first step is kept apart in ``block_first_ms``.
  """
  steps = {name: w.step for name, w in workers.items()}
  timings = interleave(steps, runs, settle=settle, pause=pause_s, seed=seed, block=block)
  for name, w in workers.items():
    w.times_ms, w.settle_ms = timings.times[name], timings.settle[name]
    w.block_first_ms = timings.block_first.get(name, [])


def run_workers(names, cfg: BenchConfig, warmup: int, runs: int, settle: int = 0, block: int = 1):
  """``(workers, failed)``: the workers started, timed (:func:`run_interleaved`) and finished (their
  peak RSS read), every process ended whatever happens."""
  workers, failed = start_workers(names, cfg, warmup)
  try:
    run_interleaved(workers, runs, settle, block=block)
    for w in workers.values():
      w.finish()
  finally:
    for w in workers.values():
      w.kill()
  return workers, failed


def summarise(
    cfg: BenchConfig, workers: dict, failed: dict, runs: int, settle: int = 0, block: int = 1
) -> dict:
  res = dict(
      config=json.loads(cfg.to_json()),
      machine=machine_line(),
      date=time.strftime("%Y-%m-%d %H:%M %Z"),
      runs=runs,
      settle=settle,
      block=block,
      failed=failed,
      frameworks={},
  )
  for name, w in workers.items():
    med = statistics.median(w.times_ms)
    res["frameworks"][name] = dict(
        w.info,
        median_ms=med,
        tokens_per_s=cfg.tokens / (med / 1e3),
        min_ms=min(w.times_ms),
        times_ms=w.times_ms,
        settle_ms=w.settle_ms,
        **({"block_first_ms": w.block_first_ms} if block > 1 else {}),
    )
  return res


def ratio_lines(res: dict) -> list[str]:
  fw = res["frameworks"]
  lines = []

  def have(*names):
    return all(n in fw for n in names)

  for jax_name in ("jax-adamw", "jax-anlr"):
    for torch_name in ("torch-eager", "torch-compile"):
      if have(jax_name, torch_name):
        r = fw[jax_name]["tokens_per_s"] / fw[torch_name]["tokens_per_s"]
        lines.append(f"ratio tokens/s {jax_name} / {torch_name}: {r:.3f}")
  if have("jax-adamw", "jax-anlr"):
    a, b = fw["jax-adamw"], fw["jax-anlr"]
    lines.append(f"ratio step time jax-anlr / jax-adamw: {b['median_ms'] / a['median_ms']:.3f}")
    paired = paired_ratio(b["times_ms"], a["times_ms"])
    lines.append(f"ratio step time jax-anlr / jax-adamw, median of paired runs: {paired:.3f}")
    lines.append(
        f"ratio step peak RSS jax-anlr / jax-adamw: "
        f"{b['steady_peak_rss_mib'] / a['steady_peak_rss_mib']:.4f}"
    )
    lines.append(
        f"ratio process peak RSS jax-anlr / jax-adamw: {b['peak_rss_mib'] / a['peak_rss_mib']:.4f}"
    )
    lines.append(
        f"ratio XLA peak bytes jax-anlr / jax-adamw: "
        f"{b['xla']['peak_bytes'] / a['xla']['peak_bytes']:.4f}"
    )
  if have("torch-eager", "torch-compile"):
    r = fw["torch-compile"]["tokens_per_s"] / fw["torch-eager"]["tokens_per_s"]
    lines.append(f"ratio tokens/s torch-compile / torch-eager: {r:.3f}")
  for jax_name in ("jax-adamw", "jax-anlr"):
    if have(jax_name, "torch-eager"):
      r = fw[jax_name]["steady_peak_rss_mib"] / fw["torch-eager"]["steady_peak_rss_mib"]
      lines.append(f"ratio step peak RSS {jax_name} / torch-eager: {r:.3f}")
  return lines


def print_report(res: dict) -> None:
  c = res["config"]
  print(f"machine: {res['machine']}; {res['date']}; threads {c['threads']}")
  print(
      f"config: LLaMA hidden {c['hidden']}, {c['layers']} layers, {c['heads']} heads, FFN {c['ffn']}, "
      f"vocab {c['vocab']}, batch {c['batch']} x {c['seq']} tokens, LoRA r={c['rank']} on "
      f"{','.join(c['targets'])}, {c['dtype']}"
      + (f", JAX GEMMs in {c['matmul_dtype']}" if c.get("matmul_dtype") else "")
      + (
          f", PyTorch autocast {c.get('torch_autocast', 'same')}"
          if c.get("matmul_dtype") or c["dtype"] != "float32"
          else ""
      )
      + f", JAX LoRA layout {c.get('lora_layout', 'per-layer')}; "
      f"median of {res['runs']} interleaved runs after {res.get('settle', 0)} untimed ones"
      + (
          f", each run {res['block']} back-to-back steps of which the first is left out"
          if res.get("block", 1) > 1
          else ""
      )
  )
  print(
      "memory: 'step RSS' = peak RSS (VmHWM) over the timed steps, reset after warmup; 'process RSS'"
      " = ru_maxrss incl. import/compile; 'XLA' = memory_analysis args+outputs-aliased+temps (MiB)"
  )
  print(
      f"{'framework':<14} {'median ms':>10} {'min ms':>9} {'tokens/s':>9} {'step RSS':>9} "
      f"{'process RSS':>12} {'XLA':>7} {'1st step s':>10}"
  )
  for name, f in res["frameworks"].items():
    xla = f"{f['xla']['peak_bytes'] / 2**20:7.1f}" if "xla" in f else f"{'-':>7}"
    print(
        f"{name:<14} {f['median_ms']:10.1f} {f['min_ms']:9.1f} {f['tokens_per_s']:9.0f} "
        f"{f['steady_peak_rss_mib']:9.1f} {f['peak_rss_mib']:12.1f} {xla} {f['first_step_s']:10.1f}"
    )
  for name, why in res["failed"].items():
    print(f"{name}: did not run ({why})")
  for line in ratio_lines(res):
    print(line)


def main(argv=None):
  ap = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  add_config_flags(ap)
  ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
  ap.add_argument("--runs", type=int, default=15, help="interleaved timed steps per framework")
  ap.add_argument("--warmup", type=int, default=3, help="untimed steps per worker (incl. compile)")
  ap.add_argument(
      "--settle",
      type=int,
      default=5,
      help="untimed interleaved rounds after the warmup, before the timed ones",
  )
  ap.add_argument(
      "--block",
      type=int,
      default=1,
      help="steps each framework runs back to back per turn; the first of each turn is left out"
      " of the timed steps (as a training run sees them); 1: one step per turn",
  )
  ap.add_argument("--json", help="also write the results to this JSON file")
  ap.add_argument("--worker", help=argparse.SUPPRESS)
  ap.add_argument("--config-json", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    return worker_main(args.worker, BenchConfig.from_json(args.config_json), args.warmup)
  cfg = config_from_args(args)
  names = [n for n in args.frameworks.split(",") if n]
  unknown = [n for n in names if n not in FRAMEWORKS]
  if unknown:
    raise ValueError(f"--frameworks has unknown names {unknown}; choose from {FRAMEWORKS}")
  if args.runs < 1:
    raise ValueError(f"--runs={args.runs} must be >= 1")
  if args.settle < 0:
    raise ValueError(f"--settle={args.settle} must be >= 0")
  if args.block < 1:
    raise ValueError(f"--block={args.block} must be >= 1")
  workers, failed = run_workers(names, cfg, args.warmup, args.runs, args.settle, args.block)
  res = summarise(cfg, workers, failed, args.runs, args.settle, args.block)
  print_report(res)
  if args.json:
    write_json(args.json, res)
  return res


if __name__ == "__main__":
  main()

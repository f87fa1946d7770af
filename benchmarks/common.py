r"""Shared pieces of the train-step benchmarks: one model/batch/LoRA config, built in JAX and PyTorch.

A step is the full LoRA update on a batch of ``B x T`` token ids:

.. math::  \theta \leftarrow \theta + \mathrm{opt}(\nabla_\theta \tfrac{1}{B(T-1)}\textstyle\sum_{b,t}
           \mathrm{CE}(f_{W_0,\theta}(x_b)_t, x_{b,t+1}))

over the LoRA factors ``theta`` only, with the base weights ``W_0`` frozen. Both frameworks get the
same architecture (LLaMA: RMSNorm, RoPE, SwiGLU, untied head), the same shapes, the same LoRA
targets / rank / alpha (no dropout, PEFT's default init) and float32 (or a chosen dtype).

Each framework runs in its own *worker* subprocess (so ``resource.getrusage`` peak RSS belongs to
one framework only). A worker builds its step, compiles/warms it up, then answers ``step`` lines on
stdin with the step's wall time (ms) on stdout, one line each; ``done`` makes it report its peak
RSS and exit. The parent drives the workers in turn (a, b, c, d, a, b, ...), so slow drifts of the
shared machine's load hit every framework alike; only one worker computes at any moment.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import resource
import subprocess
import sys
import time

TARGETS = ("q_proj", "k_proj", "v_proj", "up_proj", "down_proj")


LORA_LAYOUTS = ("stacked", "per-layer")


@dataclasses.dataclass
class BenchConfig:
  """Model, batch and LoRA shapes shared by every framework in one benchmark run."""

  hidden: int = 512
  layers: int = 8
  heads: int = 8
  ffn: int = 1376
  vocab: int = 8000
  batch: int = 4
  seq: int = 256
  rank: int = 16
  alpha: float = 32.0
  targets: tuple = TARGETS
  dtype: str = "float32"
  remat: str = "none"  # JAX only: 'none' | 'full' | 'dots'
  threads: int = 0  # 0: every core (os.cpu_count())
  # JAX only: LoRA params in the train state stacked per projection over the layers (the trainer's
  # default, anlr_jax.train.stack_layers: one optimizer module per projection) or per layer
  lora_layout: str = "stacked"
  # a real model instead of random weights: a local Hugging Face directory or a LLaMA/Qwen2 .gguf
  # file; its config then sets hidden, layers, heads, ffn and vocab
  model: str = ""

  def __post_init__(self):
    if self.model:
      hf = pretrained_config(self.model)
      self.hidden, self.layers = hf["hidden_size"], hf["num_hidden_layers"]
      self.heads, self.ffn = hf["num_attention_heads"], hf["intermediate_size"]
      self.vocab = hf["vocab_size"]
    for name in ("hidden", "layers", "heads", "ffn", "vocab", "batch", "seq", "rank"):
      if int(getattr(self, name)) < 1:
        raise ValueError(f"BenchConfig.{name}={getattr(self, name)} must be >= 1")
    if self.hidden % self.heads:
      raise ValueError(f"BenchConfig.heads={self.heads} must divide hidden={self.hidden}")
    if self.lora_layout not in LORA_LAYOUTS:
      raise ValueError(
          f"BenchConfig.lora_layout={self.lora_layout!r} must be one of {LORA_LAYOUTS}"
      )
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"BenchConfig.dtype={self.dtype!r} must be 'float32' or 'bfloat16'")
    bad = [
        t
        for t in self.targets
        if t not in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    ]
    if bad:
      raise ValueError(f"BenchConfig.targets has unknown module names {bad}")
    self.targets = tuple(self.targets)
    if self.threads <= 0:
      self.threads = os.cpu_count() or 1

  @property
  def tokens(self) -> int:
    return self.batch * self.seq

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self))

  @classmethod
  def from_json(cls, text: str) -> "BenchConfig":
    return cls(**json.loads(text))


def pretrained_config(path: str) -> dict:
  """The Hugging Face config dict of a local model directory or ``.gguf`` file."""
  if not os.path.exists(path):
    raise ValueError(f"--model {path}: no such file or directory")
  if path.endswith(".gguf"):
    from anlr_jax.models.gguf import read_gguf

    return read_gguf(path, lazy=True)[0]
  with open(os.path.join(path, "config.json")) as f:
    return json.load(f)


def add_config_flags(ap, defaults: BenchConfig | None = None):
  """Adds one ``--flag`` per :class:`BenchConfig` field to an ``argparse`` parser."""
  d = defaults or BenchConfig()
  for f in dataclasses.fields(BenchConfig):
    value = getattr(d, f.name)
    if f.name == "targets":
      ap.add_argument("--targets", default=",".join(value), help="comma-separated LoRA targets")
    elif f.name == "lora_layout":
      ap.add_argument("--lora_layout", choices=LORA_LAYOUTS, default=value, help="JAX LoRA layout")
    else:
      ap.add_argument(f"--{f.name}", type=type(value), default=value)


def config_from_args(args) -> BenchConfig:
  kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchConfig)}
  kw["targets"] = tuple(t for t in kw["targets"].split(",") if t)
  return BenchConfig(**kw)


def peak_rss_mib() -> float:
  """Peak resident set size of this process (Linux ``ru_maxrss`` is in KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def status_mib(field: str) -> float:
  """A ``/proc/self/status`` memory field (``VmHWM``, ``VmRSS``) in MiB."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) / 1024.0
  raise KeyError(f"/proc/self/status has no field {field!r}")


def reset_peak_rss() -> bool:
  """Resets the kernel's peak-RSS mark ``VmHWM`` (``/proc/self/clear_refs``, Linux >= 4.0)."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def release_free_heap() -> bool:
  """glibc ``malloc_trim(0)``: hands freed heap pages (compiler scratch, warmup garbage) back to the OS."""
  try:
    import ctypes

    return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
  except (OSError, AttributeError):
    return False


def xla_memory(compiled) -> dict:
  """``compiled.memory_analysis()`` in bytes: arguments, outputs, aliased, temporaries, and
  ``peak_bytes`` = arguments + outputs - aliased + temporaries (what the step's buffers take)."""
  mem = compiled.memory_analysis()
  out = {
      k: int(getattr(mem, k))
      for k in (
          "argument_size_in_bytes",
          "output_size_in_bytes",
          "alias_size_in_bytes",
          "temp_size_in_bytes",
      )
  }
  out["peak_bytes"] = (
      out["argument_size_in_bytes"]
      + out["output_size_in_bytes"]
      - out["alias_size_in_bytes"]
      + out["temp_size_in_bytes"]
  )
  return out


def current_rss_mib() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# --------------------------------------------------------------------------------------------------
# The benchmark model, as both frameworks build it


def model_config(cfg: BenchConfig, *, attention: str = "einsum", max_positions: int = 2048):
  """The benchmark LLaMA as an ``anlr_jax`` ``ModelConfig``; the PyTorch side is built from its
  ``to_hf_config()``, so both frameworks run the same architecture."""
  import jax.numpy as jnp

  from anlr_jax.models.config import ModelConfig

  dtype = jnp.dtype(cfg.dtype)
  return ModelConfig(
      vocab_size=cfg.vocab,
      hidden_size=cfg.hidden,
      intermediate_size=cfg.ffn,
      num_hidden_layers=cfg.layers,
      num_attention_heads=cfg.heads,
      num_key_value_heads=cfg.heads,
      max_position_embeddings=max(max_positions, cfg.seq),
      dtype=dtype,
      param_dtype=dtype,
      attention_impl=attention,
  )


def build_jax_lora_model(cfg: BenchConfig, *, attention: str = "einsum", max_positions: int = 2048):
  """``(graphdef, lora, frozen, extra)``: the benchmark LLaMA (random weights, seed 0) with LoRA
  (seed 1, no dropout) on ``cfg.targets``, split as :func:`anlr_jax.train.step.split_model` does."""
  from flax import nnx

  from anlr_jax.models.llama import LlamaForCausalLM
  from anlr_jax.nn import inject_lora
  from anlr_jax.train.step import split_model

  if cfg.model:
    import jax.numpy as jnp

    from anlr_jax.models import load_hf_model

    model, _ = load_hf_model(cfg.model, dtype=jnp.dtype(cfg.dtype), attention_impl=attention)
  else:
    config = model_config(cfg, attention=attention, max_positions=max_positions)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
  inject_lora(
      model,
      target_modules=cfg.targets,
      rank=cfg.rank,
      alpha=cfg.alpha,
      dropout=0.0,
      rngs=nnx.Rngs(1),
  )
  return split_model(model)


def jax_batch(cfg: BenchConfig) -> dict:
  """A ``B x T`` batch of random token ids (seed 0), every token real and scored."""
  import jax.numpy as jnp
  import numpy as np

  ids = np.random.default_rng(0).integers(0, cfg.vocab, (cfg.batch, cfg.seq), dtype=np.int32)
  ones = np.ones_like(ids)
  return {
      "input_ids": jnp.asarray(ids),
      "attention_mask": jnp.asarray(ones),
      "loss_mask": jnp.asarray(ones),
  }


def build_peft_model(cfg: BenchConfig, *, device=None, max_positions: int = 2048):
  """The same model in PyTorch: ``transformers.LlamaForCausalLM`` (random weights, torch seed 0)
  built in ``cfg.dtype`` on ``device``, wrapped by ``peft.get_peft_model`` (LoRA on
  ``cfg.targets``, no dropout, PEFT's default init)."""
  import peft
  import torch
  import transformers

  torch.manual_seed(0)
  if cfg.model:
    folder, name = os.path.split(os.path.abspath(cfg.model))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder if name.endswith(".gguf") else cfg.model,
        gguf_file=name if name.endswith(".gguf") else None,
        torch_dtype=getattr(torch, cfg.dtype),
        local_files_only=True,
        use_cache=False,
    ).to(device or "cpu")
    return peft.get_peft_model(model, _peft_lora_config(cfg))
  hf_config = transformers.LlamaConfig(
      **model_config(cfg, max_positions=max_positions).to_hf_config(), use_cache=False
  )
  default = torch.get_default_dtype()
  torch.set_default_dtype(getattr(torch, cfg.dtype))
  try:
    with torch.device(device or "cpu"):
      model = transformers.LlamaForCausalLM(hf_config)
  finally:
    torch.set_default_dtype(default)
  return peft.get_peft_model(model, _peft_lora_config(cfg))


def _peft_lora_config(cfg: BenchConfig):
  import peft

  return peft.LoraConfig(
      r=cfg.rank,
      lora_alpha=cfg.alpha,
      lora_dropout=0.0,
      target_modules=list(cfg.targets),
      bias="none",
  )


# --------------------------------------------------------------------------------------------------
# Worker side


def serve(step, info: dict, warmup: int):
  """Worker loop: warm ``step`` up, report ``info`` + RSS, then time one ``step()`` per stdin line."""
  t0 = time.perf_counter()
  step()
  info["first_step_s"] = time.perf_counter() - t0
  for _ in range(max(0, warmup - 1)):
    step()
  # Freed compiler/warmup memory that the allocator still holds is returned to the OS, so that RSS
  # measures what the step keeps and touches; from here VmHWM is the peak of the timed steps only.
  gc.collect()
  info["heap_trimmed"] = release_free_heap()
  info["rss_after_warmup_mib"] = current_rss_mib()
  info["peak_reset"] = reset_peak_rss()
  out = sys.__stdout__
  out.write("READY " + json.dumps(info) + "\n")
  out.flush()
  for line in sys.stdin:
    cmd = line.strip()
    if cmd == "step":
      t0 = time.perf_counter()
      step()
      out.write(f"{1e3 * (time.perf_counter() - t0)!r}\n")
      out.flush()
    elif cmd == "done":
      out.write(
          "DONE "
          + json.dumps({"peak_rss_mib": peak_rss_mib(), "steady_peak_rss_mib": status_mib("VmHWM")})
          + "\n"
      )
      out.flush()
      return
    else:
      raise ValueError(f"worker got unknown command {cmd!r}")


# --------------------------------------------------------------------------------------------------
# Parent side


class Worker:
  """A framework's step in its own subprocess, driven one step at a time."""

  def __init__(self, name: str, argv: list[str], env: dict | None = None, stderr=None):
    self.name = name
    self.proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
        bufsize=1,
    )
    self.info = self._expect("READY")
    self.times_ms: list[float] = []
    self.settle_ms: list[float] = []  # untimed rounds (train_step.run_interleaved's ``settle``)

  def _expect(self, tag: str) -> dict:
    for line in self.proc.stdout:
      if line.startswith(tag + " "):
        return json.loads(line[len(tag) + 1 :])
    code = self.proc.wait()
    raise RuntimeError(f"worker {self.name!r} exited (code {code}) before printing {tag}")

  def step(self) -> float:
    self.proc.stdin.write("step\n")
    self.proc.stdin.flush()
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"worker {self.name!r} died during a step (code {self.proc.wait()})")
    self.times_ms.append(float(line))
    return self.times_ms[-1]

  def finish(self) -> dict:
    self.proc.stdin.write("done\n")
    self.proc.stdin.flush()
    self.info.update(self._expect("DONE"))
    self.proc.wait()
    return self.info

  def kill(self):
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()


def thread_env(threads: int) -> dict:
  """Environment pinning the OpenMP / MKL pools of a worker to ``threads`` threads."""
  env = dict(os.environ)
  for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    env[key] = str(threads)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  return env


def machine_line() -> str:
  """``lscpu`` model name and core count of this machine."""
  model = "unknown CPU"
  try:
    text = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    for line in text.splitlines():
      if line.startswith("Model name:"):
        model = line.split(":", 1)[1].strip()
  except OSError:
    pass
  return f"{model}, {os.cpu_count()} cores"

r"""Shared pieces of the benchmarks: one model/batch/LoRA config built in JAX and PyTorch, the
train step of each, and one interleaved timing loop.

A step is the full LoRA update on a batch of ``B x T`` token ids:

.. math::  \theta \leftarrow \theta + \mathrm{opt}(\nabla_\theta \tfrac{1}{B(T-1)}\textstyle\sum_{b,t}
           \mathrm{CE}(f_{W_0,\theta}(x_b)_t, x_{b,t+1}))

over the LoRA factors ``theta`` only, with the base weights ``W_0`` frozen. Both frameworks get the
same architecture (LLaMA: RMSNorm, RoPE, SwiGLU, untied head), the same shapes, the same LoRA
targets / rank / alpha (no dropout, PEFT's default init) and float32 (or a chosen dtype).

Timing (:func:`interleave`): the variants a benchmark compares (frameworks, optimizers, methods)
take turns, one step each per round, so slow drifts of the shared machine's load hit all alike and
only one computes at any moment; the scripts report medians, their ratios and paired ratios (the
median over rounds of the per-round quotient, :func:`paired_ratio`).

Where peak RSS must belong to one framework, each runs in its own *worker* subprocess: it builds its
step, compiles/warms it up, then answers ``step`` lines on stdin with the step's wall time (ms) on
stdout, one line each; ``done`` makes it report its peak RSS and exit (:func:`serve`,
:class:`Worker`). A worker that runs to its end prints one ``RESULT`` line (:func:`run_worker`).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

JOINED_JUDGE = os.path.join(
    "~", ".cache", "anlr_jax", "joined", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
)
"""Where ``anlr judge-model`` joins the offline judge (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF)."""
TARGETS = ("q_proj", "k_proj", "v_proj", "up_proj", "down_proj")
LORA_LAYOUTS = ("stacked", "per-layer")
LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.01  # torch.optim.AdamW's default; used by every framework


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
  # JAX only: tokens per chunk of the next-token loss (0: the model's whole (B, T, V) logits)
  loss_chunk: int = 0
  threads: int = 0  # 0: every core (os.cpu_count())
  # JAX only: LoRA params in the train state stacked per projection over the layers (the trainer's
  # default, anlr_jax.train.stack_layers: one optimizer module per projection) or per layer
  lora_layout: str = "stacked"
  # a real model instead of random weights: a local Hugging Face directory or a LLaMA/Qwen2 .gguf
  # file; its config then sets hidden, layers, heads, ffn and vocab
  model: str = ""
  # '' or 'bfloat16': GEMM operands in this dtype, float32 sums, activations in `dtype` (JAX:
  # ModelConfig.matmul_dtype; PyTorch: the same weights under torch.autocast to this dtype)
  matmul_dtype: str = ""
  # PyTorch's autocast: 'same' (to matmul_dtype, or dtype when that is not float32, as JAX computes)
  # or 'off' (PyTorch in dtype, e.g. float32 PEFT against JAX with bfloat16 GEMMs)
  torch_autocast: str = "same"

  def __post_init__(self):
    if self.model:
      hf = pretrained_config(self.model)
      self.hidden, self.layers = hf["hidden_size"], hf["num_hidden_layers"]
      self.heads, self.ffn = hf["num_attention_heads"], hf["intermediate_size"]
      self.vocab = hf["vocab_size"]
    for name in ("hidden", "layers", "heads", "ffn", "vocab", "batch", "seq", "rank"):
      if int(getattr(self, name)) < 1:
        raise ValueError(f"BenchConfig.{name}={getattr(self, name)} must be >= 1")
    if self.loss_chunk < 0:
      raise ValueError(f"BenchConfig.loss_chunk={self.loss_chunk} must be >= 0 (0: whole logits)")
    if self.hidden % self.heads:
      raise ValueError(f"BenchConfig.heads={self.heads} must divide hidden={self.hidden}")
    if self.lora_layout not in LORA_LAYOUTS:
      raise ValueError(
          f"BenchConfig.lora_layout={self.lora_layout!r} must be one of {LORA_LAYOUTS}"
      )
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"BenchConfig.dtype={self.dtype!r} must be 'float32' or 'bfloat16'")
    if self.torch_autocast not in ("same", "off"):
      raise ValueError(
          f"BenchConfig.torch_autocast={self.torch_autocast!r} must be 'same' or 'off'"
      )
    if self.matmul_dtype not in ("", "bfloat16"):
      raise ValueError(f"BenchConfig.matmul_dtype={self.matmul_dtype!r} must be '' or 'bfloat16'")
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


def tree_size(tree) -> int:
  """Number of array elements in a pytree (e.g. LoRA parameters)."""
  import jax

  return int(sum(x.size for x in jax.tree.leaves(tree)))


def tree_bytes(tree) -> int:
  """Bytes of the arrays in a pytree (e.g. an optimizer state)."""
  import jax

  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def write_json(path: str, data, indent: int = 2) -> None:
  """A script's results, as its ``--json`` / ``--out`` file."""
  with open(path, "w") as f:
    json.dump(data, f, indent=indent)


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
      matmul_dtype=cfg.matmul_dtype or None,
  )


def build_jax_lora_model(cfg: BenchConfig, *, attention: str = "einsum", max_positions: int = 2048):
  """``(graphdef, lora, frozen, extra)``: the benchmark LLaMA (random weights, seed 0) with LoRA
  (seed 1, no dropout) on ``cfg.targets``, split as :func:`anlr_jax.train.step.split_model` does."""
  from flax import nnx

  from anlr_jax.methods import inject_method
  from anlr_jax.models.llama import LlamaForCausalLM
  from anlr_jax.train.step import split_model

  if cfg.model:
    import jax.numpy as jnp

    from anlr_jax.models import load_hf_model

    model, _ = load_hf_model(
        cfg.model,
        dtype=jnp.dtype(cfg.dtype),
        attention_impl=attention,
        matmul_dtype=cfg.matmul_dtype or None,
    )
  else:
    config = model_config(cfg, attention=attention, max_positions=max_positions)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(0))
  inject_method(
      model,
      "lora",
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


BENCH_OPTIMIZERS = {"adamw": "lora", "anlr": "anlr", "anlr-unbatched": "anlr"}  # label: method


def jax_optimizer(name: str, *, batch_modules: bool | None = None):
  """The benchmarks' optimizers (lr 1e-4, weight decay 0.01, no clipping) from the one method
  assembly, :func:`anlr_jax.methods.method_optimizer`: ``adamw`` (method ``lora``), ``anlr``
  (``warmup_steps=0``: every timed step anisotropic) and ``anlr-unbatched`` (``batch_modules``
  False: statistics module by module)."""
  from anlr_jax.methods import method_optimizer

  if name not in BENCH_OPTIMIZERS:
    raise ValueError(f"optimizer {name!r} must be one of {list(BENCH_OPTIMIZERS)}")
  batched = False if name == "anlr-unbatched" else batch_modules
  kwargs = dict(weight_decay=WEIGHT_DECAY, clip_norm=None, anlr_kwargs={"warmup_steps": 0})
  return method_optimizer(BENCH_OPTIMIZERS[name], LEARNING_RATE, **kwargs, batch_modules=batched)


class JaxStep:
  """One jitted train step, compiled ahead of time for the benchmark batch, with its own state.

  ``anlr_jax.train.make_train_step`` over the split model ``parts`` (default: a fresh
  :func:`build_jax_lora_model` of ``cfg``; the LoRA params stacked per projection when
  ``cfg.lora_layout`` is ``stacked``) and ``batch`` (default :func:`jax_batch`), with ``cfg``'s
  compute dtype and remat and ``step_kwargs`` passed on; the train state is donated. ``copy_state``
  gives the state its own copy of the LoRA and extra arrays (several steps over one model).
  ``on_phase(name)`` is called once the state is ``built``, the step ``lowered`` and ``compiled``;
  ``compile_fn(lowered)`` replaces ``lowered.compile()``. Calling the object runs ``window`` steps
  back to back, waits for them and returns the last metrics.
  """

  def __init__(
      self,
      cfg: BenchConfig,
      tx,
      parts=None,
      batch: dict | None = None,
      *,
      copy_state: bool = False,
      on_phase=None,
      compile_fn=None,
      **step_kwargs,
  ):
    import jax
    import jax.numpy as jnp

    from anlr_jax.train import make_train_step, stack_layers
    from anlr_jax.train.step import init_train_state

    # Unpacked at once: of a model built here, the per-layer LoRA arrays are freed once stacked.
    graphdef, lora, self.frozen, extra = parts or build_jax_lora_model(cfg)
    stacked = cfg.lora_layout == "stacked"
    if stacked:
      lora = stack_layers(lora)
    if copy_state:
      lora, extra = jax.tree.map(jnp.copy, (lora, extra))
    dtype = jnp.dtype(cfg.dtype)
    train_step = make_train_step(
        graphdef,
        tx,
        compute_dtype=None if dtype == jnp.float32 else dtype,
        remat=cfg.remat,
        stacked_layers=stacked,
        **{"loss_chunk": cfg.loss_chunk, **step_kwargs},
    )
    self.batch = jax_batch(cfg) if batch is None else batch
    self.state = init_train_state(lora, extra, tx)
    self.lora_params, self.opt_state_bytes = tree_size(lora), tree_bytes(self.state.opt_state)
    phase = on_phase or (lambda name: None)
    phase("built")
    start = time.perf_counter()
    lowered = jax.jit(train_step, donate_argnums=(0,)).lower(self.state, self.frozen, self.batch)
    phase("lowered")
    self.compiled = (compile_fn or (lambda low: low.compile()))(lowered)
    self.compile_s = time.perf_counter() - start
    del lowered
    phase("compiled")
    self.xla = xla_memory(self.compiled)
    self.metrics = None

  def __call__(self, window: int = 1) -> dict:
    import jax

    state = self.state
    for _ in range(window):  # dispatched back to back, one wait at the end
      state, metrics = self.compiled(state, self.frozen, self.batch)
    jax.block_until_ready((state, metrics))
    self.state, self.metrics = state, metrics
    return metrics


def build_torch_step(
    cfg: BenchConfig, compile_model: bool, *, device=None, max_positions: int = 2048
):
  """``(step, info)``: the PyTorch side of one LoRA train step on ``device`` (default CPU).

  :func:`build_peft_model` with its LoRA factors (and so ``torch.optim.AdamW``'s state) in float32,
  as in the JAX step; ``torch.compile`` on the PEFT model if ``compile_model``; a random ``B x T``
  batch (torch seed 0). ``step()`` runs forward (``bfloat16`` autocast when ``cfg.dtype`` or
  ``cfg.matmul_dtype`` is, unless ``cfg.torch_autocast`` is ``'off'``),
  backward, the AdamW update and ``zero_grad``, waits for the device and returns the loss tensor.
  """
  import peft
  import torch
  import transformers

  dev = torch.device(device or "cpu")
  # the autocast dtype (float32: no autocast)
  dtype = getattr(
      torch, cfg.dtype if cfg.torch_autocast == "off" else cfg.matmul_dtype or cfg.dtype
  )
  model = build_peft_model(cfg, device=dev, max_positions=max_positions)
  params = [p for p in model.parameters() if p.requires_grad]
  for p in params:
    p.data = p.data.float()
  model.train()
  opt = torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
  forward = torch.compile(model) if compile_model else model
  ids = torch.randint(
      0, cfg.vocab, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(0)
  )
  ids = ids.to(dev)
  mask = torch.ones_like(ids)

  def step():
    with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
      loss = forward(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if dev.type == "cuda":
      torch.cuda.synchronize()
    return loss

  info = dict(
      attn=model.config._attn_implementation,
      versions=dict(
          torch=torch.__version__, transformers=transformers.__version__, peft=peft.__version__
      ),
      lora_params=int(sum(p.numel() for p in params)),
  )
  return step, info


# --------------------------------------------------------------------------------------------------
# Interleaved timing


def timed(fn):
  """``fn`` (which waits for its own work) as a step that returns its wall time in seconds."""

  def step() -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start

  return step


def paired_ratio(times, base_times) -> float:
  """Median over rounds of ``times[i] / base_times[i]``: two steps of one round ran seconds apart,
  so their quotient cancels the slow drifts of a shared machine's load."""
  return statistics.median(t / b for t, b in zip(times, base_times))


@dataclasses.dataclass
class Timings:
  """What :func:`interleave` measured, per step name: ``times`` of the timed rounds and ``settle``
  of the untimed rounds before them, in the unit the steps return; with blocks, ``block_first`` the
  dropped first step of each timed block."""

  times: dict
  settle: dict
  block_first: dict = dataclasses.field(default_factory=dict)

  def median(self, name) -> float:
    return statistics.median(self.times[name])

  def paired(self, name, base) -> float:
    """:func:`paired_ratio` of ``name`` over ``base``."""
    return paired_ratio(self.times[name], self.times[base])


def interleave(
    steps: dict,
    rounds: int,
    *,
    warmup: int = 0,
    settle: int = 0,
    shuffle: bool = True,
    seed: int = 0,
    pause: float = 0.0,
    on_round=None,
    block: int = 1,
) -> Timings:
  """Times ``steps`` (name -> a no-argument callable that runs one step and returns its time, e.g.
  :func:`timed`) side by side: ``warmup`` untimed rounds in the given order and without pauses
  (compilation, caches), then ``settle`` untimed and ``rounds`` timed rounds of one call of each
  step. With ``shuffle`` every round runs in a fresh random order (``random.Random(seed)``): a step
  can be slowed by the one just before it (its idle threads still spinning on the same cores), and
  shuffling makes every step follow every other about equally often; ``pause`` seconds of sleep
  before each call let the previous step settle. ``on_round(i)`` is called after timed round ``i``.
  Only one step runs at any moment, so slow drifts of the machine's load hit all alike.

  With ``block > 1`` each turn is ``block`` back-to-back calls of a step, as a training run makes
  them: the first call of a block (the one after another step ran) goes to ``block_first``, the
  other ``block - 1`` to ``times``. A step whose speed depends on having just run (memory the
  previous step left mapped, warm caches) is measured both ways.
  """
  if block < 1:
    raise ValueError(f"interleave: block={block} must be >= 1")
  for _ in range(warmup):
    for fn in steps.values():
      fn()
  rng = random.Random(seed)
  settle_times = {name: [] for name in steps}
  times = {name: [] for name in steps}
  first = {name: [] for name in steps} if block > 1 else {}
  for i in range(settle + rounds):
    order = list(steps)
    if shuffle:
      rng.shuffle(order)
    for name in order:
      time.sleep(pause)
      turn = [steps[name]() for _ in range(block)]
      if i < settle:
        settle_times[name].extend(turn)
      elif block > 1:
        first[name].append(turn[0])
        times[name].extend(turn[1:])
      else:
        times[name].extend(turn)
    if on_round is not None and i >= settle:
      on_round(i - settle)
  return Timings(times, settle_times, first)


# --------------------------------------------------------------------------------------------------
# Worker side


def serve(step, info: dict, warmup: int):
  """Worker loop: warm ``step`` up, report ``info`` + RSS, then time one ``step()`` per stdin line."""
  info["first_step_s"] = timed(step)()
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
      out.write(f"{1e3 * timed(step)()!r}\n")
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


def emit_result(result: dict) -> None:
  """Worker side of :func:`run_worker`: ``result`` as one ``RESULT {json}`` line on stdout."""
  sys.__stdout__.write("RESULT " + json.dumps(result) + "\n")
  sys.__stdout__.flush()


# --------------------------------------------------------------------------------------------------
# Parent side


def stderr_tail(file, lines: int = 3) -> str:
  """The last non-empty ``lines`` of a worker's stderr file, joined by `` | ``."""
  file.seek(0)
  return " | ".join([l for l in file.read().strip().splitlines() if l.strip()][-lines:])


def run_worker(
    argv: list[str], *, timeout: float | None = None, env=None, capture_stderr: bool = False
) -> dict:
  """Runs a worker process to its end; returns what it passed to :func:`emit_result`.

  Raises ``RuntimeError`` when it runs past ``timeout`` seconds or exits without a result (naming
  the last lines of its stderr with ``capture_stderr``; otherwise its stderr is this process's).
  """
  with tempfile.TemporaryFile("w+") as err:
    try:
      proc = subprocess.run(
          argv,
          stdout=subprocess.PIPE,
          stderr=err if capture_stderr else None,
          text=True,
          env=env,
          timeout=timeout,
      )
    except subprocess.TimeoutExpired:
      raise RuntimeError(f"no result within {timeout:.0f} s") from None
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode == 0 and lines:
      return json.loads(lines[-1][len("RESULT ") :])
    tail = f": {stderr_tail(err)}" if capture_stderr else ""
    raise RuntimeError(f"worker exited with code {proc.returncode} and no result{tail}")


def run_settings(script: str, settings: list[str], args: list[str]) -> list[dict]:
  """Runs ``script --worker --setting S`` plus ``args`` for each setting, one process after the
  other (each its own memory peak); returns their results (:func:`emit_result`), each with its
  process's ``wall_s``, or ``{"setting": S, "error": ...}`` for one that gave none. Each is
  printed as one JSON line as it comes."""
  results = []
  for setting in settings:
    argv = [sys.executable, os.path.abspath(script), "--worker", "--setting", setting, *args]
    start = time.perf_counter()
    try:
      result = run_worker(argv, capture_stderr=True)
      result["wall_s"] = round(time.perf_counter() - start, 1)
    except RuntimeError as err:
      result = {"setting": setting, "error": str(err)}
    results.append(result)
    print(json.dumps(result), flush=True)
  return results


def write_record(path: str | None, results: list[dict]) -> None:
  """Writes ``results`` to ``path`` (nothing when None) with the machine, its load average, the
  date (UTC) and the command line."""
  if path:
    record = {
        "machine": f"{machine_line()}, load average {os.getloadavg()}",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "results": results,
    }
    write_json(path, record, indent=1)


class Worker:
  """A framework's step in its own subprocess, driven one step at a time (:func:`serve`)."""

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
    self.times_ms: list[float] = []  # the timed rounds
    self.settle_ms: list[float] = []  # the untimed rounds before them (interleave's ``settle``)

  def _expect(self, tag: str) -> dict:
    for line in self.proc.stdout:
      if line.startswith(tag + " "):
        return json.loads(line[len(tag) + 1 :])
    code = self.proc.wait()
    raise RuntimeError(f"worker {self.name!r} exited (code {code}) before printing {tag}")

  def step(self) -> float:
    """One step in the worker; its time in ms, measured there."""
    self.proc.stdin.write("step\n")
    self.proc.stdin.flush()
    line = self.proc.stdout.readline()
    if not line:
      raise RuntimeError(f"worker {self.name!r} died during a step (code {self.proc.wait()})")
    return float(line)

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

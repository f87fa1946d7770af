r"""``anlr train --dry_run``: the memory a run needs per device, computed without weights or data.

The model is built abstractly (``nnx.eval_shape``: shapes and dtypes only) from the base model's
``config.json`` (``model.path``) or a named preset (``--preset llama2_7b``), the method's adapter
layers are injected and its optimizer initialised abstractly (:func:`anlr_jax.app.assemble.
build_method`), and every array is placed on the run's ``('data', 'fsdp', 'tensor')`` mesh by the
trainer's own rules (:func:`anlr_jax.train.mesh.state_shardings`, on an abstract mesh of the
given device count), so the parameter and optimizer-state bytes per device are exact. Activations
are an estimate for one micro-batch of ``b = global_batch / (micro_batches * data * fsdp)`` rows of
``T = data.max_length`` tokens with hidden size ``h``, ``L`` layers, MLP width ``f``, ``a`` heads,
vocabulary ``V`` and ``t`` tensor shards, in the compute dtype (``c`` bytes). One layer's
activations, as the backward pass keeps them (``k = 1 + 2 n_{kv}/a``: the query, key and value
projections; the attention scores and probabilities in float32 and the probabilities in ``c``),
and what ``trainer.remat`` keeps of each layer through the forward pass:

.. math::

   \text{layer} = c\,b\,T\,(6h + 4f/t + 2hk/t) + (8 + c)\,b\,a T^2 / t, \qquad
   \text{kept} = \begin{cases} \text{layer} & \text{none} \\ c\,b\,T\,h & \text{full} \\
   c\,b\,T\,(6h + hk/t + 2f/t) & \text{dots (matmul outputs, norms)} \end{cases}

The loss holds float32 logits and their gradient, :math:`\text{loss} = 2 \cdot 4\,n\,V/t` for
``n = min(trainer.loss_chunk, b T)`` tokens (``b T`` with ``loss_chunk = 0``: the whole logits).
Without remat every layer's activations are alive when the loss is computed:
:math:`L \cdot \text{layer} + \text{loss}`; with remat only the kept parts are, and one layer is
recomputed at a time after the loss: :math:`L \cdot \text{kept} + \max(\text{layer},
\text{loss})`. On XLA's CPU backend this is within 25 % of the compiled step's temporary memory
(``compiled.memory_analysis()``, tests/test_dryrun.py: every remat setting, whole and chunked
loss); accelerators' compilers fuse and schedule differently, so treat the activation figure as
the order of magnitude to plan a mesh with, not a guarantee.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Any

import jax
import numpy as np
from flax import nnx

from anlr_jax.app.config import RunConfig
from anlr_jax.app.assemble import build_method
from anlr_jax.app.paths import resolve_path
from anlr_jax.settings import DTYPES, ConfigError
from anlr_jax.models import LlamaForCausalLM
from anlr_jax.models.config import PRESETS as MODEL_PRESETS
from anlr_jax.models.config import ModelConfig
from anlr_jax.models.gguf import read_gguf
from anlr_jax.models.hf_files import is_gguf
from anlr_jax.models.llava import LlavaForConditionalGeneration
from anlr_jax.models.llava_config import LlavaConfig, is_llava_config
from anlr_jax.nn.quant import QuantEmbed, QuantizedParam, is_quantized
from anlr_jax.train.mesh import MESH_AXES, matching_shardings, state_shardings

PRESETS = (*(name for name in MODEL_PRESETS if name != "tiny"), "llava1_5_7b")
"""Model presets of :class:`anlr_jax.models.config.ModelConfig` a dry run can use."""

GIB = 2**30


def mesh_sizes(config: RunConfig, devices: int) -> dict[str, int]:
  """The run's mesh axis sizes over ``devices`` devices (one ``-1`` takes the rest)."""
  tc = config.trainer
  sizes = {"data": tc.mesh_data, "fsdp": tc.mesh_fsdp, "tensor": tc.mesh_tensor}
  fixed = math.prod(s for s in sizes.values() if s != -1)
  free = [name for name, size in sizes.items() if size == -1]
  if free:
    sizes[free[0]] = devices // fixed if devices % fixed == 0 else 0
  if math.prod(sizes.values()) != devices or min(sizes.values()) < 1:
    raise ConfigError(
        f"trainer.mesh_data/mesh_fsdp/mesh_tensor = {tc.mesh_data}/{tc.mesh_fsdp}/"
        f"{tc.mesh_tensor} do not fit {devices} devices"
    )
  return sizes


def _model_config(config: RunConfig, preset: str | None) -> ModelConfig | LlavaConfig:
  dtypes = dict(dtype=DTYPES[config.model.dtype], param_dtype=DTYPES[config.model.dtype])
  if preset is not None:
    if preset not in PRESETS:
      raise ConfigError(f"--preset {preset!r}: allowed {', '.join(PRESETS)}")
    if preset == "llava1_5_7b":
      return LlavaConfig.llava1_5_7b(dtype=DTYPES[config.model.dtype])
    return ModelConfig.preset(preset, **dtypes)
  path = resolve_path(config.model.path)
  if path is None or not os.path.exists(path):
    raise FileNotFoundError(
        f"model.path {config.model.path}: no such directory (a dry run reads its config.json"
        f" only; or name a preset: --preset {PRESETS[0]})"
    )
  if is_gguf(path):  # the config from the file's metadata; its tensors are not read
    hf_config, _ = read_gguf(path, lazy=True)
    return ModelConfig.from_hf_config(hf_config, **dtypes)
  if is_llava_config(path):
    return LlavaConfig.from_pretrained(path, dtype=DTYPES[config.model.dtype])
  return ModelConfig.from_pretrained(path, **dtypes)


def _per_device_bytes(tree, shardings) -> int:
  total = 0
  for leaf, sharding in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
    shape = sharding.shard_shape(tuple(leaf.shape))
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


def activation_bytes(
    config: RunConfig, model: ModelConfig | LlavaConfig, sizes: dict[str, int]
) -> int:
  """The module docstring's estimate of one micro-batch's activation bytes per device."""
  tc = config.trainer
  if isinstance(model, LlavaConfig):
    return activation_bytes(config, model.text_config, sizes) + _vision_bytes(config, model, sizes)
  rows = tc.global_batch / (tc.micro_batches * sizes["data"] * sizes["fsdp"])
  b, t_len, t = max(rows, 1.0), config.data.max_length, sizes["tensor"]
  h, f, a = model.hidden_size, model.intermediate_size, model.num_attention_heads
  c = np.dtype(DTYPES[tc.compute_dtype]).itemsize
  k = 1 + 2 * model.num_key_value_heads / a
  layer = c * b * t_len * (6 * h + 4 * f / t + 2 * h * k / t) + (8 + c) * b * a * t_len**2 / t
  tokens = b * t_len if tc.loss_chunk == 0 else min(tc.loss_chunk, b * t_len)
  loss = 2 * 4 * tokens * model.vocab_size / t
  if tc.remat == "none":
    return int(model.num_hidden_layers * layer + loss)
  kept = c * b * t_len * (h if tc.remat == "full" else 6 * h + h * k / t + 2 * f / t)
  return int(model.num_hidden_layers * kept + max(layer, loss))


def _vision_bytes(config: RunConfig, model: LlavaConfig, sizes: dict[str, int]) -> int:
  """LLaVA's frozen vision tower on one image per row: no activation is kept for a gradient
  (nothing below the projector trains), so one layer's working set at a time."""
  tc = config.trainer
  rows = max(tc.global_batch / (tc.micro_batches * sizes["data"] * sizes["fsdp"]), 1.0)
  v = model.vision_config
  tokens, c = v.num_patches + 1, np.dtype(DTYPES[tc.compute_dtype]).itemsize
  layer = c * rows * tokens * (6 * v.hidden_size + 2 * v.intermediate_size)
  return int(layer + c * rows * v.num_attention_heads * tokens**2)


def _base_params(model: nnx.Module, frozen_tree) -> int:
  """The base's weights, a quantised layer's counted as ``d_in * d_out`` (not its packed bytes)."""
  count = sum(math.prod(x.shape) for x in jax.tree.leaves(frozen_tree))
  for _, layer in nnx.iter_modules(model):
    if is_quantized(layer) or isinstance(layer, QuantEmbed):
      packed = jax.tree.leaves(nnx.state(layer, QuantizedParam))
      weights = math.prod(layer.kernel.shape if is_quantized(layer) else layer.embedding.shape)
      count += weights - sum(math.prod(x.shape) for x in packed)
  return int(count)


def _total_bytes(tree) -> int:
  return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


@contextlib.contextmanager
def _unnamed_tracer_origins():
  """Within: JAX's error for a traced value that has no ``sharding`` leaves out where the value came
  from.

  Building the abstract model, every RNG draw makes flax's ``Variable.set_value`` read
  ``.sharding`` of a traced value; JAX raises an AttributeError for it (caught by ``getattr``) whose
  message names the value's origin by walking every operation traced so far. Over a model's
  thousands of draws that walk is quadratic, and most of a large model's dry-run time. The messages
  are discarded either way; other errors are untouched."""
  from jax._src.interpreters import partial_eval  # private: the hook has no public name

  tracer = getattr(partial_eval, "DynamicJaxprTracer", None)
  original = getattr(tracer, "_origin_msg", None)
  if original is None:
    yield
    return
  tracer._origin_msg = lambda self: ""
  try:
    yield
  finally:
    tracer._origin_msg = original


def estimate(config: RunConfig, *, devices: int, preset: str | None = None) -> dict[str, Any]:
  """Bytes per device of the base params, LoRA params, optimizer state and (estimated)
  activations of ``config``'s run on ``devices`` devices; see the module docstring."""
  model_config = _model_config(config, preset)
  sizes = mesh_sizes(config, devices)
  mesh = jax.sharding.AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES)
  total = config.trainer.steps or 1000
  method = config.method

  def build():
    cls = (
        LlavaForConditionalGeneration if isinstance(model_config, LlavaConfig) else LlamaForCausalLM
    )
    model = cls(model_config, rngs=nnx.Rngs(0))
    build_method(config, model=model)
    return model

  with nnx.use_eager_sharding(False), _unnamed_tracer_origins():
    abstract = nnx.eval_shape(build)
  _, lora, frozen, _ = nnx.split(abstract, nnx.LoRAParam, nnx.Param, ...)
  lora_sh = state_shardings(lora, mesh)
  frozen_sh = state_shardings(frozen, mesh)
  lora_tree, frozen_tree = nnx.to_pure_dict(lora), nnx.to_pure_dict(frozen)
  if config.trainer.base_dtype:
    base = DTYPES[config.trainer.base_dtype]
    frozen_tree = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, base) if np.issubdtype(x.dtype, np.floating) else x,
        frozen_tree,
    )
  tx = build_method(config, total_steps=total, check=False).tx
  opt = jax.eval_shape(tx.init, lora_tree)
  opt_sh = matching_shardings(opt, lora_tree, lora_sh, mesh)
  out = {
      "model": preset or config.model.path,
      "method": method,
      "devices": devices,
      "mesh": sizes,
      "base_params": _base_params(abstract, frozen_tree),
      "base_bytes_per_param": _total_bytes(frozen_tree) / _base_params(abstract, frozen_tree),
      "lora_params": int(sum(math.prod(x.shape) for x in jax.tree.leaves(lora_tree))),
      "base_bytes": _per_device_bytes(frozen_tree, frozen_sh),
      "lora_bytes": _per_device_bytes(lora_tree, lora_sh),
      "optimizer_bytes": _per_device_bytes(opt, opt_sh),
      "activation_bytes": activation_bytes(config, model_config, sizes),
  }
  out["total_bytes"] = sum(out[k] for k in ("base_bytes", "lora_bytes", "optimizer_bytes"))
  out["total_bytes"] += 2 * out["lora_bytes"] + out["activation_bytes"]  # + gradients, update
  return out


def describe(result: dict[str, Any], config: RunConfig) -> str:
  """The dry run's report: a few lines, figures per device."""
  tc = config.trainer
  mesh = " x ".join(f"{a} {n}" for a, n in result["mesh"].items())
  mib = lambda n: f"{n / 2**20:,.1f} MiB"  # noqa: E731
  gib = lambda n: f"{n / GIB:,.2f} GiB"  # noqa: E731
  quantized = (
      ""
      if config.model.quantize == "none"
      else f", linear layers and embedding table {config.model.quantize}"
  )
  return "\n".join(
      [
          f"dry run: {result['model']} ({result['base_params'] / 1e9:.2f} B base params),"
          f" method {result['method']}, LoRA r={config.lora.rank} on"
          f" {','.join(config.lora.targets)} ({result['lora_params'] / 1e6:.2f} M params)",
          f"mesh {mesh} = {result['devices']} devices; batch {tc.global_batch} x"
          f" {config.data.max_length} tokens in {tc.micro_batches} micro-batch(es); compute"
          f" {tc.compute_dtype}, remat {tc.remat}, loss chunk"
          f" {tc.loss_chunk or 'none (whole logits)'}",
          "per device:",
          f"  base params      {gib(result['base_bytes'])}"
          f" ({config.trainer.base_dtype or config.model.dtype}{quantized};"
          f" {result['base_bytes_per_param']:.3f} bytes per base parameter)",
          f"  LoRA params      {mib(result['lora_bytes'])} (their gradient and update: as much"
          " again each)",
          f"  optimizer state  {mib(result['optimizer_bytes'])}",
          f"  activations      ~{gib(result['activation_bytes'])} (estimate, one micro-batch)",
          f"  total            ~{gib(result['total_bytes'])}",
      ]
  )


def dry_run(config: RunConfig, *, devices: int | None = None, preset: str | None = None) -> str:
  """``anlr train --dry_run``: the report of :func:`describe` (of the first method compared)."""
  config = dataclasses.replace(config, method=config.methods()[0])
  devices = devices or config.trainer.devices or jax.device_count()  # --devices, then the config
  result = estimate(config, devices=devices, preset=preset)
  return describe(result, config)


__all__ = ["PRESETS", "activation_bytes", "dry_run", "estimate", "mesh_sizes"]

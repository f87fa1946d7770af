r"""AdaLoRA's SVD-form adapter around a frozen ``nnx.Linear``, its injection and PEFT adapter I/O.

With the Flax layout (kernel ``W0`` ``(d_in, d_out)``, ``A = Q^T`` ``(d_in, r)``, ``E = Λ``
``(r,)``, ``B = P^T`` ``(r, d_out)``) the layer computes, exactly as PEFT's ``SVDLinear.forward``:

.. math::

   y = x W_0 + b + \mathrm{drop}(x) \, A \operatorname{diag}(E) \, B \cdot \alpha / (r + 10^{-5}),

i.e. ``ΔW = P Λ Q`` scaled by ``scaling = lora_alpha`` and divided by ``ranknum + 1e-5`` where
``ranknum`` is the initial rank ``r`` (kept when triplets are pruned). Init as PEFT's
``reset_lora_parameters``: ``E = 0``, ``A`` and ``B`` normal with std 0.02 (so the output is
unchanged). ``lora_a``, ``lora_e``, ``lora_b`` are float32 ``nnx.LoRAParam``. Pruning is done by
the allocator (:mod:`anlr_jax.optim.adalora`) zeroing ``E`` entries; shapes never change.

PEFT's on-disk format (``AdaLoraModel._get_adapter_state_dict``), for the module at path ``p``:

    base_model.model.<p>.lora_A = A^T               (r', d_in)
    base_model.model.<p>.lora_E = E[:, None]        (r', 1)
    base_model.model.<p>.lora_B = B^T               (d_out, r')

with ``adapter_config.json`` of ``peft_type`` ``ADALORA``. When the config carries a
``rank_pattern`` (``{"<p>.lora_E": [kept flags]}``) the tensors hold only the kept triplets
(``r' <= r``) and PEFT resizes the modules on load, keeping ``ranknum = init_r``, so the output is
unchanged. ``ranknum`` itself is not saved.

References:
  Zhang et al., "Adaptive Budget Allocation for Parameter-Efficient Fine-Tuning" (AdaLoRA), 2023.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import typing as tp

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from anlr_jax.nn.inject import (
    PAPER_TARGET_MODULES,
    adapter_scope,
    get_submodule,
    path_str,
    set_submodule,
    target_linears,
)
from anlr_jax.nn.lora import ADAPTER_DTYPE, drop_adapter_input, kernel_axes, low_rank_product
from anlr_jax.nn.peft_io import KEY_PREFIX, read_adapter, write_adapter
from anlr_jax.optim.adalora import AdaLoRAConfig

INIT_STD = 0.02
"""Standard deviation of PEFT's normal init of ``lora_A`` and ``lora_B``."""

RANKNUM_EPS = 1e-5
"""Added to ``ranknum`` in PEFT's ``SVDLinear.forward`` and ``get_delta_weight``."""

FACTOR_KEYS = {"lora_a": ".lora_A", "lora_e": ".lora_E", "lora_b": ".lora_B"}
"""Flax factor name -> suffix of its PEFT tensor key (AdaLoRA keys have no ``.weight``)."""


class AdaLoRALinear(nnx.Module):
  r"""A frozen ``nnx.Linear`` plus AdaLoRA's SVD-form update (see the module docstring).

  Args:
    base: the ``nnx.Linear`` to adapt (2-D kernel, optional bias), kept as ``self.base``.
    rank: ``r``, the initial rank (PEFT's ``init_r``), ``>= 1``.
    alpha: PEFT's ``lora_alpha`` (the scaling itself, not divided by ``r``), ``> 0``.
    dropout: dropout rate on the adapter input, active only in train mode (``model.train()``).
    rngs: random streams: ``params`` for ``A`` and ``B``, ``dropout`` for the dropout masks.

  Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> layer = AdaLoRALinear(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), 3, 6.0, rngs=nnx.Rngs(1))
    >>> layer.lora_a.shape, layer.lora_e.shape, layer.lora_b.shape
    ((8, 3), (3,), (3, 4))
    >>> bool(jnp.all(layer(jnp.ones((2, 8))) == layer.base(jnp.ones((2, 8)))))
    True
  """

  def __init__(
      self,
      base: nnx.Linear,
      rank: int,
      alpha: float,
      dropout: float = 0.0,
      *,
      rngs: nnx.Rngs,
  ):
    if not isinstance(base, nnx.Linear):
      raise TypeError(f"base must be an nnx.Linear, got {type(base).__name__}")
    if base.kernel.ndim != 2:
      raise ValueError(f"base.kernel must be 2-D (d_in, d_out), got shape {base.kernel.shape}")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
      raise ValueError(f"rank must be a positive int, got {rank!r}")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
      raise ValueError(f"alpha must be a positive finite number, got {alpha!r}")
    if not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):
      raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    d_in, d_out = base.kernel.shape
    rank = int(rank)
    self.base = base
    self.in_features = d_in
    self.out_features = d_out
    self.rank = rank
    self.alpha = float(alpha)
    # PEFT: result += (...) * scaling / (ranknum + 1e-5), ranknum a float32 tensor equal to r
    self.ranknum = float(np.float32(rank) + np.float32(RANKNUM_EPS))
    self.custom_backward = None  # see LoRALinear
    self.dropout = nnx.Dropout(float(dropout), deterministic=True, rngs=rngs)

    axes = functools.partial(kernel_axes, base.kernel)

    a = INIT_STD * jax.random.normal(rngs.params(), (d_in, rank), ADAPTER_DTYPE)
    b = INIT_STD * jax.random.normal(rngs.params(), (rank, d_out), ADAPTER_DTYPE)
    self.lora_a = nnx.LoRAParam(a, **axes(0, None))
    self.lora_e = nnx.LoRAParam(jnp.zeros((rank,), ADAPTER_DTYPE), **axes(None))
    self.lora_b = nnx.LoRAParam(b, **axes(None, 1))

  def delta_kernel(self) -> jax.Array:
    r"""``(A diag(E)) B · alpha / (r + 1e-5)`` in float32, shape ``(d_in, d_out)``."""
    a = self.lora_a[...].astype(jnp.float32) * self.lora_e[...].astype(jnp.float32)
    return (a @ self.lora_b[...].astype(jnp.float32)) * self.alpha / self.ranknum

  def merged_kernel(self) -> jax.Array:
    """``W0 + ΔW`` in the base dtype (for export of a merged model; the layer is not changed)."""
    kernel = self.base.kernel[...]
    return (kernel.astype(jnp.float32) + self.delta_kernel()).astype(kernel.dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    base_out = self.base(x)
    dropout_active = self.dropout.rate > 0.0 and not self.dropout.deterministic
    x_adapter = drop_adapter_input(self.dropout, x) if dropout_active else x
    a_e = self.lora_a[...] * self.lora_e[...]
    x_adapter, a_e, b = nnx.nn.dtypes.promote_dtype(
        (x_adapter, a_e, self.lora_b[...]), dtype=self.base.dtype
    )
    lora_out = low_rank_product(
        x_adapter, a_e, b, precision=self.base.precision, custom_backward=self.custom_backward
    )
    return base_out + (lora_out * self.alpha / self.ranknum).astype(base_out.dtype)


def iter_adalora_layers(model: nnx.Module) -> tp.Iterator[tuple[str, AdaLoRALinear]]:
  """``(dotted path, layer)`` for every ``AdaLoRALinear`` of ``model``, sorted by path."""
  found = [(path_str(p), m) for p, m in nnx.iter_modules(model) if isinstance(m, AdaLoRALinear)]
  yield from sorted(found, key=lambda item: item[0])


def inject_adalora(
    model: nnx.Module,
    *,
    target_modules: tp.Sequence[str] = PAPER_TARGET_MODULES,
    rank: int,
    alpha: float,
    dropout: float = 0.05,
    rngs: nnx.Rngs,
) -> nnx.Module:
  r"""Replace every ``nnx.Linear`` of ``model`` named in ``target_modules`` by an
  ``AdaLoRALinear(linear, rank, alpha, dropout)``, in place, in sorted path order (the layers of
  :func:`anlr_jax.nn.inject.target_linears`). Returns ``model``.

  Raises:
    ValueError: as :func:`anlr_jax.nn.inject.target_linears`.
  """
  for path in target_linears(model, target_modules):
    linear = get_submodule(model, path)
    set_submodule(model, path, AdaLoRALinear(linear, rank, alpha, dropout, rngs=rngs))
  return model


# ----------------------------------------------------------------------------- PEFT adapter I/O
def _shared(layers, name: str):
  values = {getattr(layer, name) for _, layer in layers}
  if len(values) > 1:
    raise ValueError(f"AdaLoRA layers disagree on {name}: {sorted(values)}; PEFT needs one value")
  return values.pop()


def export_adalora_adapter(
    model: nnx.Module,
    out_dir: tp.Union[str, os.PathLike],
    *,
    config: AdaLoRAConfig,
    base_model_name_or_path: str = "",
    target_modules: tp.Optional[tp.Sequence[str]] = None,
    rank_pattern: tp.Optional[tp.Mapping[str, tp.Sequence[bool]]] = None,
    task_type: tp.Optional[str] = "CAUSAL_LM",
) -> None:
  r"""Write the ``AdaLoRALinear`` layers of ``model`` as a PEFT AdaLoRA adapter directory.

  ``peft.PeftModel.from_pretrained`` loads it with the same outputs (see the module docstring).

  Args:
    model: an NNX module holding ``AdaLoRALinear`` layers of rank ``config.init_r``, all with the
      same alpha and dropout.
    out_dir: directory to create or overwrite files in.
    config: the :class:`~anlr_jax.optim.AdaLoRAConfig` (schedule fields are recorded).
    base_model_name_or_path: recorded in ``adapter_config.json``.
    target_modules: PEFT's ``target_modules``; default: the sorted last names of the layers' paths
      (their full paths for a model with an ``ADAPTER_SCOPE``, e.g. LLaVA's language model).
    rank_pattern: module path -> ``r`` kept flags (e.g. ``anlr_jax.optim.rank_pattern(state)``):
      only the kept triplets are written and the pattern is recorded, as PEFT does after
      allocation. ``None``: all ``r`` triplets, ``rank_pattern: null``. Pruned triplets have
      ``E = 0`` after the allocator's masking, so dropping them leaves the output unchanged.
    task_type: PEFT task type, or None for a bare ``PeftModel``.

  Raises:
    ValueError: no ``AdaLoRALinear``, layers disagreeing on alpha/dropout, a rank that is not
      ``config.init_r``, or a ``rank_pattern`` naming an unknown module or of the wrong length.
  """
  layers = list(iter_adalora_layers(model))
  if not layers:
    raise ValueError(f"{type(model).__name__} holds no AdaLoRALinear layer to export")
  alpha = _shared(layers, "alpha")
  dropout = _shared([(p, l.dropout) for p, l in layers], "rate")
  ranks = {p: l.rank for p, l in layers if l.rank != config.init_r}
  if ranks:
    raise ValueError(f"config.init_r={config.init_r} but layers have ranks {ranks}")
  paths = {p for p, _ in layers}
  pattern = {} if rank_pattern is None else {k: list(map(bool, v)) for k, v in rank_pattern.items()}
  unknown = sorted(set(pattern) - paths)
  if unknown:
    raise ValueError(f"rank_pattern names modules that are not AdaLoRA layers: {unknown[:5]}")

  tensors = {}
  for path, layer in layers:
    a, e, b = (np.asarray(getattr(layer, f)[...], np.float32) for f in FACTOR_KEYS)
    kept = pattern.get(path)
    if kept is not None:
      if len(kept) != layer.rank:
        raise ValueError(
            f"rank_pattern[{path!r}] has {len(kept)} flags, the layer rank {layer.rank}"
        )
      idx = np.flatnonzero(kept)
      a, e, b = a[:, idx], e[idx], b[idx, :]
    tensors[KEY_PREFIX + path + FACTOR_KEYS["lora_a"]] = np.ascontiguousarray(a.T)
    tensors[KEY_PREFIX + path + FACTOR_KEYS["lora_e"]] = np.ascontiguousarray(e[:, None])
    tensors[KEY_PREFIX + path + FACTOR_KEYS["lora_b"]] = np.ascontiguousarray(b.T)

  if target_modules is None and adapter_scope(model):  # short names would reach out of the scope
    target_modules = sorted(paths)
  elif target_modules is None:
    target_modules = sorted({p.rsplit(".", 1)[-1] for p in paths})
  write_adapter(
      out_dir,
      tensors,
      peft_type="ADALORA",
      task_type=task_type,
      base_model_name_or_path=base_model_name_or_path,
      alpha=alpha,
      dropout=dropout,
      target_modules=target_modules,
      init_r=config.init_r,
      target_r=config.target_r,
      tinit=config.tinit,
      tfinal=config.tfinal,
      deltaT=config.deltaT,
      beta1=config.beta1,
      beta2=config.beta2,
      orth_reg_weight=config.orth_reg_weight,
      total_step=config.total_step,
      rank_pattern=({f"{p}{FACTOR_KEYS['lora_e']}": v for p, v in sorted(pattern.items())} or None),
  )


def import_adalora_adapter(
    model: nnx.Module,
    adapter_dir: tp.Union[str, os.PathLike],
    *,
    rngs: tp.Optional[nnx.Rngs] = None,
) -> AdaLoRAConfig:
  r"""Load a PEFT AdaLoRA adapter directory into ``model`` (in place), injecting where needed.

  Every module path with tensors must be an ``nnx.Linear`` (wrapped in an ``AdaLoRALinear`` of
  rank ``init_r``) or an ``AdaLoRALinear`` of that rank. Triplets dropped by the file's
  ``rank_pattern`` come back as zero rows with ``E = 0`` at their original positions, so the
  layer keeps rank ``init_r`` and PEFT's output.

  Args:
    model: the NNX model, its module paths mirroring the torch module names.
    adapter_dir: directory with ``adapter_config.json`` and ``adapter_model.safetensors``.
    rngs: random streams for the new layers (default ``nnx.Rngs(0)``); their init is overwritten.

  Returns:
    The adapter's :class:`~anlr_jax.optim.AdaLoRAConfig`.

  Raises:
    FileNotFoundError: a file is missing. KeyError: a tensor is missing or names no module.
    ValueError: not an ADALORA adapter, or a shape mismatch.
  """
  raw, tensors, weights_path = read_adapter(adapter_dir, "ADALORA")
  config = AdaLoRAConfig(
      **{f.name: raw.get(f.name, f.default) for f in dataclasses.fields(AdaLoRAConfig)}
  )
  alpha, dropout = raw.get("lora_alpha", 8), float(raw.get("lora_dropout", 0.0))
  alpha = float(alpha) if alpha > 0 else float(config.init_r)  # PEFT: scaling = r if alpha <= 0
  pattern = {
      k[: -len(FACTOR_KEYS["lora_e"])]: v
      for k, v in (raw.get("rank_pattern") or {}).items()
      if k.endswith(FACTOR_KEYS["lora_e"])
  }
  rngs = nnx.Rngs(0) if rngs is None else rngs
  suffix = FACTOR_KEYS["lora_a"]
  module_paths = sorted(
      k[len(KEY_PREFIX) : -len(suffix)]
      for k in tensors
      if k.startswith(KEY_PREFIX) and k.endswith(suffix)
  )
  if not module_paths:
    raise KeyError(f"{weights_path} has no '{KEY_PREFIX}<module>{suffix}' key")

  for dotted in module_paths:
    path = tuple(int(p) if p.isdigit() else p for p in dotted.split("."))
    module = get_submodule(model, path)
    if isinstance(module, AdaLoRALinear):
      if module.rank != config.init_r:
        raise ValueError(f"AdaLoRALinear at '{dotted}' has rank {module.rank}, not {config.init_r}")
      layer = module
    elif isinstance(module, nnx.Linear):
      layer = AdaLoRALinear(module, config.init_r, alpha, dropout, rngs=rngs)
    else:
      raise ValueError(f"'{dotted}' in {weights_path} is a {type(module).__name__}, not nnx.Linear")
    kept = pattern.get(dotted, [True] * config.init_r)
    idx = np.flatnonzero(kept)
    r = len(idx)
    shapes = {"lora_a": (r, layer.in_features), "lora_e": (r, 1), "lora_b": (layer.out_features, r)}
    full = {
        "lora_a": np.zeros((layer.in_features, config.init_r), np.float32),
        "lora_e": np.zeros((config.init_r,), np.float32),
        "lora_b": np.zeros((config.init_r, layer.out_features), np.float32),
    }
    for name, key_suffix in FACTOR_KEYS.items():
      key = KEY_PREFIX + dotted + key_suffix
      if key not in tensors:
        raise KeyError(f"{weights_path} has no key '{key}'")
      t = tensors[key]
      if tuple(t.shape) != shapes[name]:
        raise ValueError(f"{weights_path}: '{key}' has shape {t.shape}, expected {shapes[name]}")
      if name == "lora_a":
        full[name][:, idx] = t.T
      elif name == "lora_e":
        full[name][idx] = t[:, 0]
      else:
        full[name][idx, :] = t.T
    for name, value in full.items():
      getattr(layer, name)[...] = jnp.asarray(value, ADAPTER_DTYPE)
    if layer is not module:
      set_submodule(model, path, layer)
  return config

r"""Read-outs of AnLR state and spectra of LoRA updates (docs/method.md, "What is logged").

* coefficient of variation of per-rank velocity :math:`\mathrm{CV} = \mathrm{std}_k \bar\nu_k /
  \mathrm{mean}_k \bar\nu_k`, max/min velocity ratio, multiplier spread :math:`\max_k s_k / \min_k s_k`;
* effective rank of :math:`AB`: :math:`\exp(-\sum_i p_i \log p_i)` with
  :math:`p_i = \sigma_i^2 / \sum_j \sigma_j^2` (equals ``k`` for energy spread evenly over ``k``
  directions);
* cumulative singular energy :math:`E_j = \sum_{i \le j} \sigma_i^2 / \sum_i \sigma_i^2`.

Singular values of :math:`AB` come from the ``r x r`` core :math:`R_A R_B^\top` of the QR factorisations
:math:`A = Q_A R_A`, :math:`B^\top = Q_B R_B`, so the ``d_in x d_out`` product is never formed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from anlr_jax.optim.dims import LoraDimsSpec, find_lora_modules
from anlr_jax.optim.transform import AnLRState, variable_value

__all__ = [
    "DIAG_MODULES",
    "find_anlr_state",
    "diagnostics",
    "singular_values",
    "effective_rank",
    "cumulative_energy",
]


DIAG_MODULES = "modules"
"""Key of the per-module entries of :func:`diagnostics`' tree: ``{module: {field: array}}``."""


def find_anlr_state(opt_state) -> AnLRState:
  """The (single) :class:`AnLRState` inside any optimizer state: a chain, a wrapper such as
  ``optax.apply_if_finite`` / ``optax.MultiSteps``, or ``nnx.Optimizer.opt_state``."""
  found = [
      x
      for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, AnLRState))
      if isinstance(x, AnLRState)
  ]
  if len(found) != 1:
    raise ValueError(f"expected exactly one AnLRState in the optimizer state, found {len(found)}")
  s = found[0]
  unwrap = lambda tree: jax.tree.map(
      variable_value, tree, is_leaf=lambda x: hasattr(x, "get_value")
  )
  return AnLRState(
      count=variable_value(s.count),
      inner_state=s.inner_state,
      nu_bar=unwrap(s.nu_bar),
      snr=unwrap(s.snr),
      multipliers=unwrap(s.multipliers),
      sensitivity=unwrap(s.sensitivity),
  )


def diagnostics(opt_state) -> dict:
  """Per-module summaries of the AnLR state (jittable; no recomputation).

  Returns:
    ``{"modules": {name: {...}}, "mean": {...}, "count": t}`` (module names: the ``.``-joined
    :func:`anlr_jax.naming.module_name` of :func:`anlr_jax.find_lora_modules`) where each module
    entry has ``velocity_cv``, ``velocity_max_min``, ``multiplier_max_min``, ``multiplier_min``,
    ``multiplier_max`` (averaged over leading batch axes, e.g. stacked layers) and the raw per-rank
    ``nu_bar``, ``snr``, ``multipliers`` arrays; ``mean`` averages the scalar summaries over modules.
  """
  state = find_anlr_state(opt_state)
  tiny = jnp.finfo(jnp.float32).tiny
  modules = {}
  for name, nu in state.nu_bar.items():
    s = state.multipliers[name]
    mean = jnp.mean(nu, axis=-1)
    modules[name] = dict(
        velocity_cv=jnp.mean(jnp.std(nu, axis=-1) / jnp.maximum(mean, tiny)),
        velocity_max_min=jnp.mean(jnp.max(nu, axis=-1) / jnp.maximum(jnp.min(nu, axis=-1), tiny)),
        multiplier_max_min=jnp.mean(jnp.max(s, axis=-1) / jnp.min(s, axis=-1)),
        multiplier_min=jnp.min(s),
        multiplier_max=jnp.max(s),
        nu_bar=nu,
        snr=state.snr[name],
        multipliers=s,
    )
  keys = ("velocity_cv", "velocity_max_min", "multiplier_max_min")
  summary = (
      {k: jnp.mean(jnp.stack([m[k] for m in modules.values()])) for k in keys} if modules else {}
  )
  return {DIAG_MODULES: modules, "mean": summary, "count": state.count}


def singular_values(a, b):
  """Singular values of ``A @ B`` for ``A (..., d_in, r)``, ``B (..., r, d_out)``, descending,
  ``(..., r)`` (``min(d_in, d_out, r)`` of them are meaningful; the rest are ~0)."""
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  _, ra = jnp.linalg.qr(a)  # (..., r, r) when d_in >= r
  _, rb = jnp.linalg.qr(jnp.swapaxes(b, -1, -2))
  core = ra @ jnp.swapaxes(rb, -1, -2)
  return jnp.linalg.svd(core, compute_uv=False)


def _energy(a, b):
  sq = singular_values(a, b) ** 2
  total = jnp.sum(sq, axis=-1, keepdims=True)
  return sq / jnp.where(total > 0, total, 1.0), total


def effective_rank(a, b):
  """Effective rank of ``A @ B``: exp of the Shannon entropy of the normalised squared singular
  values; ``0`` for a zero product. Shape ``(...)``."""
  p, total = _energy(a, b)
  ent = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
  return jnp.where(total[..., 0] > 0, jnp.exp(ent), 0.0)


def cumulative_energy(a, b):
  """Cumulative share of squared singular energy of ``A @ B`` over the top-j directions,
  ``(..., r)``, non-decreasing, ending at 1 (all zeros for a zero product)."""
  p, _ = _energy(a, b)
  return jnp.cumsum(p, axis=-1)


def rank_magnitudes(lora_params, lora_dims: LoraDimsSpec = None) -> dict:
  r"""Per-rank contribution magnitude of every LoRA module,
  :math:`\lVert A_{:,k} B_{k,:}\rVert_F = \lVert A_{:,k}\rVert\,\lVert B_{k,:}\rVert` (the paper's
  "per-rank-one magnitude", Sec. 3), jittable.

  Args:
    lora_params: any pytree holding LoRA factor siblings (``nnx.state(model, nnx.LoRAParam)``, a
      nested dict, ...).
    lora_dims: the layout spec of :func:`anlr_jax.find_lora_modules` (``None``: Flax, Qwix and
      PEFT names).

  Returns:
    ``{module name: (..., r)}`` in float32, with the module names of :func:`diagnostics`
    (:func:`anlr_jax.naming.module_name`).
  """
  # in the order find_lora_modules indexes them
  leaves = [variable_value(x) for x in jax.tree.leaves(lora_params)]
  out = {}
  for module in find_lora_modules(lora_params, lora_dims):
    a = jnp.asarray(leaves[module.a_index], jnp.float32)
    b = jnp.asarray(leaves[module.b_index], jnp.float32)
    # sqrt of a sum of squares over the feature axis or axes (jnp.linalg.norm takes at most two)
    out[module.name] = jnp.sqrt(
        jnp.sum(a * a, axis=module.a_feature_axis) * jnp.sum(b * b, axis=module.b_feature_axis)
    )
  return out

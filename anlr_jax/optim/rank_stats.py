r"""Per-rank statistics of one LoRA module, and the multipliers fused from them (docs/method.md, steps 2-7).

All functions are pure, act on one module's arrays (any leading batch axes), reduce along the feature
axis of each factor with axis reductions (no loop over ranks) and compute in float32 whatever the
parameter dtype. ``a_axis`` / ``b_axis`` are the *feature* axes of ``A`` and ``B`` (the axes summed
over): ``-2`` / ``-1`` in the Flax layout ``A (..., d_in, r)``, ``B (..., r, d_out)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "rank_velocity",
    "rank_snr",
    "rank_sensitivity",
    "module_multipliers",
    "score_multipliers",
    "random_multipliers",
]

_TINY = float(jnp.finfo(jnp.float32).tiny)


def stat_dtype(*xs):
  """float32, or wider when an input is wider (float64 under ``jax_enable_x64``)."""
  return jnp.result_type(jnp.float32, *[x.dtype for x in xs])


def _dot(x, y, axis):
  dt = stat_dtype(x, y)
  return jnp.sum(x.astype(dt) * y.astype(dt), axis=axis)


def rank_velocity(a, b, grad_a, grad_b, *, a_axis: int = -2, b_axis: int = -1):
  r"""Per-rank velocity :math:`\nu_k = \|g_{A,k} B_k^\top + A_k g_{B,k}^\top\|_F`, never materialised.

  With :math:`u = g_A[:, k],\ v = B[k, :],\ w = A[:, k],\ z = g_B[k, :]`:
  :math:`\nu_k^2 = |u|^2 |v|^2 + |w|^2 |z|^2 + 2 (u \cdot w)(v \cdot z)`, clamped at 0.

  Returns:
    float32 array ``(..., r)``.
  """
  uu = _dot(grad_a, grad_a, a_axis)
  ww = _dot(a, a, a_axis)
  uw = _dot(grad_a, a, a_axis)
  vv = _dot(b, b, b_axis)
  zz = _dot(grad_b, grad_b, b_axis)
  vz = _dot(b, grad_b, b_axis)
  sq = uu * vv + ww * zz + 2.0 * uw * vz
  return jnp.sqrt(jnp.maximum(sq, 0.0))


def rank_snr(dir_a, dir_b, *, a_axis: int = -2, b_axis: int = -1):
  r"""Per-rank Adam SNR :math:`\sqrt{\sum_{A_k} d^2 + \sum_{B_k} d^2}` of the Adam direction
  :math:`d = \hat m / (\sqrt{\hat v} + \epsilon)` (its sign does not matter).

  Returns:
    float32 array ``(..., r)``.
  """
  return jnp.sqrt(_dot(dir_a, dir_a, a_axis) + _dot(dir_b, dir_b, b_axis))


def rank_sensitivity(a, b, grad_a, grad_b, *, a_axis: int = -2, b_axis: int = -1):
  r"""Per-rank parameter sensitivity :math:`\sum_{A_k} |g \odot \theta| + \sum_{B_k} |g \odot \theta|`
  (AdaLoRA's importance score aggregated over the component's parameters).

  Returns:
    float32 array ``(..., r)``.
  """
  da, db = stat_dtype(a, grad_a), stat_dtype(b, grad_b)
  return jnp.sum(jnp.abs(grad_a.astype(da) * a.astype(da)), axis=a_axis) + jnp.sum(
      jnp.abs(grad_b.astype(db) * b.astype(db)), axis=b_axis
  )


def _normalised_log(x):
  """``log(x_k / mean_j x_j)`` (finite: zeros floored) and whether the module mean is positive."""
  mean = jnp.mean(x, axis=-1, keepdims=True)
  ok = mean > 0
  ratio = jnp.where(ok, x / jnp.where(ok, mean, 1.0), 1.0)
  return jnp.log(jnp.maximum(ratio, _TINY)), ok


def _clamp_normalise(log_s, log_kappa, valid):
  """Clamp to ``[-log kappa, log kappa]``, exponentiate, mean-normalise; ``1`` where not ``valid``."""
  s = jnp.exp(jnp.clip(log_s, -log_kappa, log_kappa))
  s = s / jnp.mean(s, axis=-1, keepdims=True)
  return jnp.where(valid, s, 1.0)


def module_multipliers(nu_bar, snr, *, alpha, beta, kappa):
  r"""AnLR multipliers of one module (docs/method.md, steps 5-6).

  .. math::
    \log s_k = \mathrm{clip}\big(\alpha \log(1/\tilde\nu_k) + \beta \log \widetilde{\mathrm{snr}}_k,
    \ -\log\kappa,\ \log\kappa\big),\qquad s_k \leftarrow s_k / \mathrm{mean}_j s_j,

  with :math:`\tilde x_k = x_k / \mathrm{mean}_j x_j`. A module whose mean velocity (when
  ``alpha != 0``) or mean SNR (when ``beta != 0``) is zero gets ``s = 1``; a single zero signal is
  floored before the log so its term is clamped, never NaN.

  Args:
    nu_bar: EMA velocity, ``(..., r)``.
    snr: Adam SNR, ``(..., r)``.
    alpha, beta, kappa: fusion weights and clamp bound (Python or traced scalars).

  Returns:
    float32 multipliers ``(..., r)`` with mean 1 over the last axis.
  """
  dt = stat_dtype(nu_bar, snr)
  log_nu, nu_ok = _normalised_log(nu_bar.astype(dt))
  log_snr, snr_ok = _normalised_log(snr.astype(dt))
  valid = (nu_ok | (alpha == 0)) & (snr_ok | (beta == 0))
  log_s = -alpha * log_nu + beta * log_snr
  return _clamp_normalise(log_s, jnp.log(jnp.asarray(kappa, dt)), valid)


def score_multipliers(score, *, kappa):
  r"""Multipliers from a single importance score: :math:`\log s_k = \mathrm{clip}(\log \tilde x_k)`,
  mean-normalised (used for the parameter-sensitivity ablation)."""
  log_x, ok = _normalised_log(score.astype(stat_dtype(score)))
  return _clamp_normalise(log_x, jnp.log(jnp.asarray(kappa, log_x.dtype)), ok)


def random_multipliers(key, shape, *, kappa, dtype=jnp.float32):
  r"""Control: :math:`\log s_k \sim U[-\log\kappa, \log\kappa]`, mean-normalised."""
  log_kappa = jnp.log(jnp.asarray(kappa, dtype))
  log_s = jax.random.uniform(key, shape, dtype, -1.0, 1.0) * log_kappa
  return _clamp_normalise(log_s, log_kappa, True)

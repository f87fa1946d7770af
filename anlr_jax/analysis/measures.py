r"""The paper's measurements of rank-one dynamics (Sec. 3, Sec. 6, App. C) as pure NumPy functions.

Per module with ``r`` rank-one components and per-rank velocities :math:`\nu_k` (the trainer logs the
EMA :math:`\bar\nu_k`):

* normalised velocity :math:`\tilde\nu_k = \nu_k / \mathrm{mean}_j \nu_j` (Fig. 1; the mean line is 1);
* max/min ratio :math:`\max_k \nu_k / \min_k \nu_k` and coefficient of variation
  :math:`\mathrm{CV} = \mathrm{std}_k \nu_k / \mathrm{mean}_k \nu_k` (population std, ``ddof=0``);
* ordering stability: Spearman's :math:`\rho` between the early-window mean velocity and the final
  velocity of the ``r`` components, i.e. the Pearson correlation of their ranks (ties get the mean rank);
  :math:`\rho = 1` for an ordering that persists, :math:`-1` for one that reverses (Fig. 2a);
* velocity quartile of component ``k`` inside its module: :math:`q_k = \lfloor 4\,\pi_k / r \rfloor`
  where :math:`\pi_k \in \{0..r-1\}` is its position in ascending velocity order (ties broken by index);
  quartile 3 holds the fastest quarter (Fig. 2b);
* rank-one magnitude :math:`m_k = \lVert A_{:,k} B_{k,:} \rVert_F = \lVert A_{:,k}\rVert\,\lVert B_{k,:}\rVert`
  (the Frobenius norm of an outer product is the product of the vector norms);
* spectrum of :math:`AB` with singular values :math:`\sigma_i`, energy shares
  :math:`p_i = \sigma_i^2 / \sum_j \sigma_j^2`: effective rank :math:`\exp(-\sum_i p_i \log p_i)`,
  cumulative energy :math:`E_j = \sum_{i \le j} p_i`, and the **spectral concentration**
  :math:`c = 1 - \mathrm{erank} / r \in [0, 1 - 1/r]` (0: energy spread evenly over all ``r`` directions;
  :math:`1 - 1/r`: a rank-one update). A module is **spectrally concentrated** when
  :math:`\mathrm{erank} < r/2`, i.e. :math:`c > 1/2`: it uses less than half its nominal rank budget
  (Fig. 2c, Fig. 3b/3c and the summary table).

Leading axes of every array are batch axes (modules, steps, ...); the rank axis is last.
"""

from __future__ import annotations


import numpy as np

from anlr_jax.optim.diagnostics import rank_magnitudes  # noqa: F401 (re-exported)

__all__ = [
    'CONCENTRATED_BELOW',
    'normalised_velocity',
    'max_min_ratio',
    'velocity_cv',
    'average_ranks',
    'spearman',
    'ordering_stability',
    'velocity_quartiles',
    'quartile_means',
    'energy_shares',
    'effective_rank_np',
    'spectral_concentration',
    'top_k_energy',
    'is_concentrated',
    'energy_shift',
    'rank_magnitudes',
    'rank_magnitudes_np',
    'percentile_summary',
]

CONCENTRATED_BELOW = 0.5
"""A module is spectrally concentrated when its effective rank is below this fraction of ``r``."""

_TINY = np.finfo(np.float64).tiny


def _float(x) -> np.ndarray:
  return np.asarray(x, dtype=np.float64)


def normalised_velocity(nu) -> np.ndarray:
  """:math:`\\nu_k / \\mathrm{mean}_j \\nu_j` over the last axis (all ones for a zero module)."""
  nu = _float(nu)
  mean = nu.mean(axis=-1, keepdims=True)
  return np.where(mean > 0, nu / np.where(mean > 0, mean, 1.0), 1.0)


def max_min_ratio(nu) -> np.ndarray:
  """:math:`\\max_k \\nu_k / \\min_k \\nu_k` over the last axis; ``inf`` when the minimum is 0 but the
  maximum is not, 1 for an all-zero module."""
  nu = _float(nu)
  hi, lo = nu.max(axis=-1), nu.min(axis=-1)
  with np.errstate(divide='ignore', invalid='ignore'):
    return np.where(hi > 0, hi / lo, 1.0)


def velocity_cv(nu) -> np.ndarray:
  """Coefficient of variation :math:`\\mathrm{std}_k \\nu_k / \\mathrm{mean}_k \\nu_k` (``ddof=0``) over
  the last axis; 0 for an all-zero module."""
  nu = _float(nu)
  mean = nu.mean(axis=-1)
  return np.where(mean > 0, nu.std(axis=-1) / np.where(mean > 0, mean, 1.0), 0.0)


def average_ranks(x) -> np.ndarray:
  """0-based ranks along the last axis; tied values share the mean of their ranks."""
  x = _float(x)
  order = np.argsort(x, axis=-1, kind='stable')
  ranks = np.empty_like(x)
  np.put_along_axis(
      ranks, order, np.broadcast_to(np.arange(x.shape[-1], dtype=np.float64), x.shape), axis=-1
  )
  flat_x = x.reshape(-1, x.shape[-1])
  flat_r = ranks.reshape(-1, x.shape[-1])
  for row_x, row_r in zip(flat_x, flat_r):  # host-side analysis; ties are rare, fix them per row
    values, inverse, counts = np.unique(row_x, return_inverse=True, return_counts=True)
    if len(values) < len(row_x):
      sums = np.bincount(inverse, weights=row_r)
      row_r[:] = (sums / counts)[inverse]
  return flat_r.reshape(x.shape)


def spearman(x, y) -> np.ndarray:
  r"""Spearman's :math:`\rho` between ``x`` and ``y`` along the last axis: the Pearson correlation of
  their (average) ranks. ``nan`` where either side is constant (no ordering to compare)."""
  x, y = np.broadcast_arrays(_float(x), _float(y))
  if x.shape[-1] < 2:
    raise ValueError(f'spearman needs at least 2 values along the last axis, got shape {x.shape}')
  rx = average_ranks(x)
  ry = average_ranks(y)
  rx = rx - rx.mean(axis=-1, keepdims=True)
  ry = ry - ry.mean(axis=-1, keepdims=True)
  den = np.sqrt((rx**2).sum(axis=-1) * (ry**2).sum(axis=-1))
  with np.errstate(divide='ignore', invalid='ignore'):
    return np.where(den > 0, (rx * ry).sum(axis=-1) / den, np.nan)


def ordering_stability(
    trajectory, *, early_fraction: float = 0.1, min_early: int = 1
) -> np.ndarray:
  r"""Spearman's :math:`\rho` between the early-window mean velocity and the final velocity.

  Args:
    trajectory: ``(T, ..., r)`` velocities at ``T`` logged steps (in step order).
    early_fraction: the early window is the first ``max(min_early, floor(early_fraction * T))`` logged
      steps (the paper finds the ordering set "within approximately the first 1k steps").
    min_early: the smallest early window.

  Returns:
    ``(...)``: one :math:`\rho` per module.
  """
  traj = _float(trajectory)
  if traj.ndim < 2 or traj.shape[0] < 2:
    raise ValueError(
        f'ordering_stability needs a (T>=2, ..., r) trajectory, got shape {traj.shape}'
    )
  if not 0.0 < early_fraction < 1.0:
    raise ValueError(f'early_fraction={early_fraction} must be in (0, 1)')
  n_early = min(max(min_early, int(early_fraction * traj.shape[0])), traj.shape[0] - 1)
  return spearman(traj[:n_early].mean(axis=0), traj[-1])


def velocity_quartiles(nu) -> np.ndarray:
  r"""Within-module velocity quartile :math:`\lfloor 4 \pi_k / r \rfloor` of each component (int, 0 =
  slowest quarter, 3 = fastest), ``pi_k`` its ascending-order position (ties broken by index)."""
  nu = _float(nu)
  r = nu.shape[-1]
  order = np.argsort(nu, axis=-1, kind='stable')
  position = np.empty(nu.shape, dtype=np.int64)
  np.put_along_axis(position, order, np.broadcast_to(np.arange(r), nu.shape), axis=-1)
  return (4 * position) // r


def quartile_means(values, quartiles) -> np.ndarray:
  """Mean of ``values (..., r)`` over all components in each quartile, ``(4,)`` (``nan`` for an empty
  quartile, e.g. when ``r < 4``). ``values`` may carry extra leading axes (e.g. steps): ``values
  (T, M, r)`` with ``quartiles (M, r)`` gives ``(T, 4)``."""
  values = _float(values)
  quartiles = np.asarray(quartiles)
  extra = values.ndim - quartiles.ndim
  if extra < 0 or values.shape[extra:] != quartiles.shape:
    raise ValueError(
        f'values shape {values.shape} does not end with quartiles shape {quartiles.shape}'
    )
  flat = values.reshape(values.shape[:extra] + (-1,))
  q = quartiles.reshape(-1)
  out = np.full(values.shape[:extra] + (4,), np.nan)
  for g in range(4):
    if np.any(q == g):
      out[..., g] = flat[..., q == g].mean(axis=-1)
  return out


def energy_shares(singular_values) -> np.ndarray:
  """:math:`p_i = \\sigma_i^2 / \\sum_j \\sigma_j^2`, sorted descending, along the last axis (zeros for
  a zero spectrum)."""
  sq = np.sort(_float(singular_values) ** 2, axis=-1)[..., ::-1]
  total = sq.sum(axis=-1, keepdims=True)
  return np.where(total > 0, sq / np.where(total > 0, total, 1.0), 0.0)


def effective_rank_np(singular_values) -> np.ndarray:
  """exp of the Shannon entropy of the energy shares (0 for a zero spectrum)."""
  p = energy_shares(singular_values)
  ent = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)
  return np.where(p.sum(axis=-1) > 0, np.exp(ent), 0.0)


def spectral_concentration(singular_values) -> np.ndarray:
  r""":math:`c = 1 - \mathrm{erank}/r` with ``r`` the length of the last axis (the nominal rank)."""
  sv = _float(singular_values)
  return 1.0 - effective_rank_np(sv) / sv.shape[-1]


def top_k_energy(singular_values, k: int = 1) -> np.ndarray:
  """Share of energy in the top-``k`` directions, :math:`E_k`."""
  if k < 1:
    raise ValueError(f'k={k} must be >= 1')
  return energy_shares(singular_values)[..., :k].sum(axis=-1)


def is_concentrated(singular_values, *, below: float = CONCENTRATED_BELOW) -> np.ndarray:
  """True where the effective rank is below ``below * r`` (and the update is not zero)."""
  sv = _float(singular_values)
  erank = effective_rank_np(sv)
  return (erank > 0) & (erank < below * sv.shape[-1])


def energy_shift(shares_a, shares_b) -> np.ndarray:
  """Per-index energy shift from run A to run B: mean over modules of :math:`p^B_i - p^A_i`, ``(r,)``.
  Both are ``(M, r)`` energy shares (sorted descending); positive at index ``i`` means B puts more of
  its energy into the ``i``-th direction."""
  a, b = _float(shares_a), _float(shares_b)
  if a.shape[-1] != b.shape[-1]:
    raise ValueError(f'energy_shift: ranks differ ({a.shape[-1]} vs {b.shape[-1]})')
  return b.reshape(-1, b.shape[-1]).mean(axis=0) - a.reshape(-1, a.shape[-1]).mean(axis=0)


def percentile_summary(values, percentiles=(50, 90, 99)) -> dict[str, float]:
  """``{'p50': ..., 'p90': ..., 'p99': ...}`` of the finite entries of ``values`` (``nan`` if none)."""
  v = _float(values).reshape(-1)
  v = v[np.isfinite(v)]
  return {f'p{p:g}': float(np.percentile(v, p)) if v.size else float('nan') for p in percentiles}


def rank_magnitudes_np(a, b, *, a_rank_axis: int = -1, b_rank_axis: int = -2) -> np.ndarray:
  r""":math:`m_k = \lVert A_{:,k}\rVert \lVert B_{k,:}\rVert` for one module, ``(..., r)`` (NumPy)."""
  a, b = _float(a), _float(b)
  a_feature = -2 if a_rank_axis == -1 else -1
  b_feature = -2 if b_rank_axis == -1 else -1
  return np.linalg.norm(a, axis=a_feature) * np.linalg.norm(b, axis=b_feature)

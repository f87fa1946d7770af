r"""LoRA-Pro (Wang et al., 2024): LoRA gradients adjusted so that the step approximates full fine-tuning.

In the paper's layout a LoRA module is :math:`W = W_0 + s\,BA` with :math:`B \in \mathbb{R}^{m\times r}`,
:math:`A \in \mathbb{R}^{r\times n}` (:math:`m = d_{out}`, :math:`n = d_{in}`, :math:`s` the LoRA scale
``scale``). With :math:`g = \partial L/\partial W` the full fine-tuning gradient, the LoRA gradients are
:math:`g_A^{lora} = s B^\top g` and :math:`g_B^{lora} = s\, g A^\top`. Stepping ``A`` and ``B`` along
:math:`(g^A, g^B)` moves ``W`` (to first order) along the *equivalent gradient*

.. math::
  \tilde g = s\,B g^A + s\,g^B A .

LoRA-Pro picks :math:`(g^A, g^B)` minimising :math:`\|\tilde g - g\|_F^2`; the minimisers are (closed
form, for :math:`B` of full column rank and :math:`A` of full row rank)

.. math::
  g^A &= \tfrac{1}{s^2}(B^\top B)^{-1} g_A^{lora} + XA, \\
  g^B &= \tfrac{1}{s^2}\big[I - B(B^\top B)^{-1}B^\top\big] g_B^{lora} (AA^\top)^{-1} - BX,

for any :math:`X \in \mathbb{R}^{r\times r}` (:math:`X` cancels in :math:`\tilde g`), and the one closest
to the LoRA gradients, :math:`\min_X \|g^A - g_A^{lora}\|_F^2 + \|g^B - g_B^{lora}\|_F^2`, has :math:`X`
solving the Sylvester equation

.. math::
  B^\top B\,X + X\,AA^\top = -\tfrac{1}{s^2}(B^\top B)^{-1} g_A^{lora} A^\top

(unique when :math:`B^\top B` and :math:`AA^\top` are positive definite: the spectra of
:math:`B^\top B` and :math:`-AA^\top` are then disjoint).

**AdamW (the paper's Algorithm 1, ``mode="full"``).** Adam runs on the equivalent gradient, in the full
:math:`m\times n` space, and its direction is projected back onto the factors:

.. math::
  \tilde g_t &= s\,B g^A + s\,g^B A \quad (X = 0), \qquad
  m_t = \beta_1 m_{t-1} + (1-\beta_1)\tilde g_t, \quad v_t = \beta_2 v_{t-1} + (1-\beta_2)\tilde g_t^2, \\
  \tilde d_t &= \hat m_t / (\sqrt{\hat v_t} + \epsilon), \qquad
  g_A^{lora} \leftarrow s B^\top \tilde d_t, \quad g_B^{lora} \leftarrow s\,\tilde d_t A^\top, \\
  (g^A, g^B) &= \text{the closed form above with the Sylvester } X, \qquad
  A \leftarrow \sqrt{1-\eta_t\lambda}\,A - \eta_t g^A, \quad B \leftarrow \sqrt{1-\eta_t\lambda}\,B - \eta_t g^B .

The weight decay :math:`\sqrt{1-\eta_t\lambda}` on both factors decays :math:`sBA` by
:math:`1-\eta_t\lambda`; the paper also decays the frozen :math:`W_0`, which is not among the optimised
parameters here and is left alone. **Memory:** two moments of :math:`d_{in} d_{out}` entries per LoRA
module (``moment_dtype``, float32 by default) — as much optimizer state as full fine-tuning with Adam
for the adapted matrices. ``mode="efficient"`` is the official code's low-memory variant: the adjusted
gradients (closed form with the Sylvester :math:`X`, from the raw LoRA gradients) go through a plain
AdamW on ``A`` and ``B`` (moments of the factors' shapes, decay :math:`A \leftarrow (1-\eta_t\lambda)A`).

Every leaf that is not a LoRA factor gets exactly ``optax.adamw``'s update.

**Layouts.** The pure functions take one module (or a stack of them: leading axes are independent
modules) in the layout given by a :class:`~anlr_jax.optim.dims.LoraDims`; this project's Flax layout
(:data:`~anlr_jax.optim.dims.FLAX`) has ``a = A^T`` of shape ``(..., d_in, r)`` and ``b = B^T`` of shape
``(..., r, d_out)`` (so :math:`\tilde g` comes back as :math:`\tilde g^\top`, the kernel's
``(d_in, d_out)``); the PEFT layout (:data:`~anlr_jax.optim.dims.PEFT`) *is* the paper's. Code symbols:
``a, b, grad_a, grad_b`` = :math:`A, B, g_A^{lora}, g_B^{lora}`; ``scale`` = :math:`s`; ``x`` = :math:`X`.

**Numerics.** Everything is computed in float32, or wider when an input is wider (float64 under
``jax_enable_x64``). Each Gram matrix :math:`G` (:math:`B^\top B`, :math:`AA^\top`) is eigendecomposed
once (``jnp.linalg.eigh``, eigenvalues clamped at 0); :math:`(G)^{-1}` is the pseudo-inverse
:math:`(G + \delta I)^{+}` with ``ridge`` :math:`\delta` (default ``1e-8``, the official code's) and
``pinv``'s cutoff (eigenvalues below :math:`r\,\varepsilon_{mach}\,\lambda_{max}` give 0), and the
Sylvester equation is solved in the two eigenbases,
:math:`X = U_B\,[(U_B^\top C U_A)_{ij} / (\lambda^B_i + \lambda^A_j)]\,U_A^\top`, with the same kind of
cutoff (pairs with :math:`\lambda^B_i + \lambda^A_j \approx 0` get 0: the minimum-norm solution). At the
usual initialisation :math:`B = 0`: :math:`g_A^{lora} = 0`, so :math:`g^A = 0`, :math:`X = 0` and
:math:`g^B = \tfrac{1}{s^2} g_B^{lora}(AA^\top + \delta I)^{-1}`: finite, as in the official code.

**AnLR.** LoRA-Pro does not compose with :func:`anlr_jax.anlr` / :func:`anlr_jax.scale_by_anlr`, and is
not meant to: (1) ``anlr`` is itself the AdamW optimizer, so ``optax.chain(lorapro(...), anlr(...))``
would run Adam on LoRA-Pro's finished step; (2) AnLR's SNR needs per-factor Adam moments of ``A`` and
``B``, which the paper's LoRA-Pro does not have (its moments live in the :math:`m \times n` space), and
the state here keeps no per-parameter ``mu``/``nu`` for LoRA factors, so ``scale_by_anlr(lorapro(...))``
raises a ``ValueError`` at the first update; (3) LoRA-Pro's step is the solution of one joint problem
over all ranks (:math:`X` mixes the rank components), so rescaling rank-one components moves the step
away from the optimum LoRA-Pro computes.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from anlr_jax.optim import rank_stats
from anlr_jax.optim.dims import FLAX, LoraDims, LoraDimsSpec, LoraModule, find_lora_modules
from anlr_jax.optim.transform import check_hyperparameter, check_unique_names, variable_value

__all__ = [
    "MODES",
    "LoraProState",
    "lorapro",
    "lorapro_gradients",
    "equivalent_gradient",
    "solve_sylvester_psd",
]

MODES = ("full", "efficient")
RIDGE = 1e-8  # the official code's delta in pinv(G + delta I)


class LoraProState(NamedTuple):
  """State of :func:`lorapro`: AdamW state of the other leaves and LoRA-Pro moments per module."""

  count: jax.Array  # int32, number of updates applied so far
  adam_state: optax.OptState  # optax.adamw state; LoRA factors masked out (optax.MaskedNode)
  lora_mu: dict  # module name -> first moment: (..., *weight) ("full") or (m_a, m_b) ("efficient")
  lora_nu: dict  # module name -> second moment, same structure


# ----------------------------------------------------------------------------------------------------
# One module (or a stack of modules), in the paper's layout: A (..., r, n), B (..., m, r).


def _mT(x):
  return jnp.swapaxes(x, -1, -2)


def _psd_eigh(gram):
  w, u = jnp.linalg.eigh(gram)
  return jnp.maximum(w, 0.0), u


def _safe_reciprocal(d, cutoff):
  """``1 / d`` where ``d > cutoff``, else 0 (``pinv``'s truncation)."""
  keep = d > cutoff
  return jnp.where(keep, 1.0 / jnp.where(keep, d, 1.0), 0.0)


def _pinv_from_eigh(w, u, ridge):
  """:math:`(G + \\delta I)^+` from :math:`G = U \\mathrm{diag}(w) U^\\top`."""
  d = w + ridge
  cutoff = d.shape[-1] * jnp.finfo(d.dtype).eps * jnp.max(d, axis=-1, keepdims=True)
  inv = _safe_reciprocal(d, cutoff)
  return (u * inv[..., None, :]) @ _mT(u)


def _sylvester_from_eigh(wp, up, wq, uq, c):
  """Solves :math:`PX + XQ = C` from :math:`P = U_p w_p U_p^\\top`, :math:`Q = U_q w_q U_q^\\top`."""
  den = wp[..., :, None] + wq[..., None, :]
  cutoff = (
      max(den.shape[-2:]) * jnp.finfo(den.dtype).eps * jnp.max(den, axis=(-2, -1), keepdims=True)
  )
  y = (_mT(up) @ c @ uq) * _safe_reciprocal(den, cutoff)
  return up @ y @ _mT(uq)


def solve_sylvester_psd(p: jax.Array, q: jax.Array, c: jax.Array) -> jax.Array:
  r"""Solves :math:`PX + XQ = C` for symmetric positive semi-definite ``p`` and ``q``.

  With :math:`P = U_p \mathrm{diag}(\lambda) U_p^\top` and :math:`Q = U_q \mathrm{diag}(\mu) U_q^\top`,
  :math:`X = U_p\,[(U_p^\top C U_q)_{ij} / (\lambda_i + \mu_j)]\,U_q^\top`; pairs with
  :math:`\lambda_i + \mu_j` below ``pinv``'s cutoff get 0 (the minimum-norm least-squares solution when
  the equation is singular). Negative rounding noise in the eigenvalues is clamped to 0. Runs on every
  backend (unlike ``jax.scipy.linalg.solve_sylvester``'s default Schur method) and batches over
  leading axes.

  Args:
    p: ``(..., r, r)``, symmetric PSD.
    q: ``(..., k, k)``, symmetric PSD.
    c: ``(..., r, k)``.

  Returns:
    ``X`` of shape ``(..., r, k)``, in float32 or wider.
  """
  dt = rank_stats.stat_dtype(p, q, c)
  wp, up = _psd_eigh(p.astype(dt))
  wq, uq = _psd_eigh(q.astype(dt))
  return _sylvester_from_eigh(wp, up, wq, uq, c.astype(dt))


class _Factors(NamedTuple):
  """Per-step quantities of one module that depend only on ``A`` and ``B`` (paper layout)."""

  a: jax.Array
  b: jax.Array
  btb: tuple  # eigendecomposition (w, U) of B^T B
  aat: tuple  # eigendecomposition (w, U) of A A^T
  btb_inv: jax.Array  # (B^T B + ridge I)^+
  aat_inv: jax.Array  # (A A^T + ridge I)^+


def _factors(a, b, ridge) -> _Factors:
  btb = _psd_eigh(_mT(b) @ b)
  aat = _psd_eigh(a @ _mT(a))
  return _Factors(a, b, btb, aat, _pinv_from_eigh(*btb, ridge), _pinv_from_eigh(*aat, ridge))


def _adjust(f: _Factors, grad_a, grad_b, scale, sylvester: bool):
  """The closed form: ``(g^A, g^B, X)``, with the Sylvester ``X`` or ``X = 0``."""
  inv_s2 = 1.0 / (scale * scale)
  ga = inv_s2 * (f.btb_inv @ grad_a)
  # [I - B (B^T B)^-1 B^T] g_B without forming the m x m projector
  gb = inv_s2 * ((grad_b - f.b @ (f.btb_inv @ (_mT(f.b) @ grad_b))) @ f.aat_inv)
  if not sylvester:
    return ga, gb, jnp.zeros_like(f.btb_inv)
  x = _sylvester_from_eigh(*f.btb, *f.aat, -(ga @ _mT(f.a)))
  return ga + x @ f.a, gb - f.b @ x, x


def _equivalent(f: _Factors, ga, gb, scale):
  """:math:`\\tilde g = s B g^A + s g^B A` (paper layout, ``(..., m, n)``)."""
  return scale * (f.b @ ga + gb @ f.a)


# ----------------------------------------------------------------------------------------------------
# Layout conversion: a LoraDims layout <-> the paper's.


def _a_to_paper(x, dims: LoraDims):
  return x if dims.a_rank_axis == -2 else _mT(x)


def _b_to_paper(x, dims: LoraDims):
  return x if dims.b_rank_axis == -1 else _mT(x)


def _weight_from_paper(w, dims: LoraDims):
  """``(..., m, n)`` -> the weight layout: ``(..., n, m)`` when ``A``'s rank axis is last (Flax)."""
  return w if dims.a_rank_axis == -2 else _mT(w)


def _weight_to_paper(w, dims: LoraDims):
  return _weight_from_paper(w, dims)  # a transpose or nothing: its own inverse


def _weight_shape(a_shape, b_shape, dims: LoraDims) -> tuple[int, ...]:
  n = a_shape[-2] if dims.a_rank_axis == -1 else a_shape[-1]
  m = b_shape[-1] if dims.b_rank_axis == -2 else b_shape[-2]
  return tuple(a_shape[:-2]) + ((m, n) if dims.a_rank_axis == -2 else (n, m))


def _paper_inputs(a, b, grad_a, grad_b, dims, ridge):
  dt = rank_stats.stat_dtype(a, b, grad_a, grad_b)
  a_p, b_p = _a_to_paper(a.astype(dt), dims), _b_to_paper(b.astype(dt), dims)
  ga_p, gb_p = _a_to_paper(grad_a.astype(dt), dims), _b_to_paper(grad_b.astype(dt), dims)
  return _factors(a_p, b_p, ridge), ga_p, gb_p


def lorapro_gradients(
    a: jax.Array,
    b: jax.Array,
    grad_a: jax.Array,
    grad_b: jax.Array,
    *,
    scale: float,
    ridge: float = RIDGE,
    sylvester: bool = True,
    dims: LoraDims = FLAX,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  r"""LoRA-Pro's adjusted gradients :math:`(g^A, g^B)` of one LoRA module (or a stack of them).

  .. math::
    g^A = \tfrac{1}{s^2}(B^\top B)^{-1} g_A^{lora} + XA, \quad
    g^B = \tfrac{1}{s^2}\big[I - B(B^\top B)^{-1}B^\top\big] g_B^{lora} (AA^\top)^{-1} - BX,

  with :math:`B^\top B X + X AA^\top = -\tfrac{1}{s^2}(B^\top B)^{-1} g_A^{lora} A^\top` (or
  :math:`X = 0`), in the paper's layout; inputs and outputs are in the layout ``dims`` (module
  docstring). :math:`(B^\top B)^{-1}` and :math:`(AA^\top)^{-1}` are :math:`(G + \delta I)^+`.

  Args:
    a, b: the factors, e.g. Flax ``(..., d_in, r)`` and ``(..., r, d_out)``; leading axes are
      independent modules.
    grad_a, grad_b: their gradients :math:`g_A^{lora}, g_B^{lora}` (same shapes).
    scale: the LoRA scale :math:`s` (``alpha / r``, or ``alpha / sqrt(r)`` for rsLoRA).
    ridge: :math:`\delta \ge 0`.
    sylvester: the Sylvester :math:`X` (True, LoRA-Pro) or :math:`X = 0`.
    dims: the layout of ``a`` and ``b`` (:data:`~anlr_jax.optim.dims.FLAX` by default).

  Returns:
    ``(g_a, g_b, x)``: the adjusted gradients in the shapes of ``a`` and ``b`` and :math:`X`
    ``(..., r, r)``, in float32 or wider.
  """
  f, ga_p, gb_p = _paper_inputs(a, b, grad_a, grad_b, dims, ridge)
  ga, gb, x = _adjust(f, ga_p, gb_p, scale, sylvester)
  return _a_to_paper(ga, dims), _b_to_paper(gb, dims), x


def equivalent_gradient(
    a: jax.Array,
    b: jax.Array,
    grad_a: jax.Array,
    grad_b: jax.Array,
    *,
    scale: float,
    ridge: float = RIDGE,
    dims: LoraDims = FLAX,
) -> jax.Array:
  r"""LoRA-Pro's equivalent gradient :math:`\tilde g = s B g^A + s g^B A` (independent of :math:`X`).

  With :math:`\delta = 0` and factors of full rank it is the projection of the full gradient :math:`g`
  onto :math:`\{s(B\,\Delta_A + \Delta_B A)\}`, computed from :math:`g_A^{lora}, g_B^{lora}` alone.

  Args:
    a, b, grad_a, grad_b, scale, ridge, dims: as in :func:`lorapro_gradients`.

  Returns:
    :math:`\tilde g` in the weight layout: ``(..., d_in, d_out)`` for Flax (the kernel's),
    ``(..., d_out, d_in)`` for PEFT (the paper's).
  """
  f, ga_p, gb_p = _paper_inputs(a, b, grad_a, grad_b, dims, ridge)
  ga, gb, _ = _adjust(f, ga_p, gb_p, scale, sylvester=False)
  return _weight_from_paper(_equivalent(f, ga, gb, scale), dims)


# ----------------------------------------------------------------------------------------------------
# The optax transformation.


def _validate(learning_rate, scale, b1, b2, eps, weight_decay, ridge, mode, moment_dtype):
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  check_hyperparameter(
      "learning_rate", learning_rate, lambda v: np.isfinite(v) and v > 0, "a finite number > 0"
  )
  if scale is None:
    raise ValueError("scale must be a finite number > 0 (the LoRA scale alpha / r), got None")
  check_hyperparameter("scale", scale, lambda v: np.isfinite(v) and v > 0, "a finite number > 0")
  check_hyperparameter("b1", b1, lambda v: 0.0 <= v < 1.0, "in [0, 1)")
  check_hyperparameter("b2", b2, lambda v: 0.0 <= v < 1.0, "in [0, 1)")
  check_hyperparameter("eps", eps, lambda v: np.isfinite(v) and v >= 0, "a finite number >= 0")
  check_hyperparameter(
      "weight_decay", weight_decay, lambda v: np.isfinite(v) and v >= 0, "a finite number >= 0"
  )
  check_hyperparameter("ridge", ridge, lambda v: np.isfinite(v) and v >= 0, "a finite number >= 0")
  if moment_dtype is not None and not jnp.issubdtype(jnp.dtype(moment_dtype), jnp.floating):
    raise ValueError(f"moment_dtype must be None or a floating dtype, got {moment_dtype!r}")


def _decay_flags(mask, params, num_leaves: int) -> list:
  """The weight-decay mask, one entry per leaf (``True`` everywhere without a mask)."""
  if mask is None:
    return [True] * num_leaves
  tree = mask(params) if callable(mask) else mask
  flags = jax.tree.leaves(jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), tree, params))
  if len(flags) != num_leaves:
    raise ValueError(
        "mask must be a pytree of booleans matching the parameters (or a prefix of them)"
    )
  return flags


def _adam_moments(mu, nu, g, b1, b2, count_inc):
  """``optax.scale_by_adam``'s moment updates and bias correction, in the moments' dtype."""
  mu = ((1.0 - b1) * g + b1 * mu.astype(g.dtype)).astype(mu.dtype)
  nu = ((1.0 - b2) * (g * g) + b2 * nu.astype(g.dtype)).astype(nu.dtype)
  mu_hat = mu.astype(g.dtype) / (1.0 - jnp.asarray(b1, g.dtype) ** count_inc.astype(g.dtype))
  nu_hat = nu.astype(g.dtype) / (1.0 - jnp.asarray(b2, g.dtype) ** count_inc.astype(g.dtype))
  return mu, nu, mu_hat, nu_hat


def lorapro(
    learning_rate: optax.ScalarOrSchedule,
    *,
    scale: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask: Optional[Any] = None,
    mode: str = "full",
    ridge: float = RIDGE,
    moment_dtype: Optional[Any] = None,
    lora_dims: LoraDimsSpec = None,
) -> optax.GradientTransformation:
  r"""LoRA-Pro with AdamW: the paper's Algorithm 1 on every LoRA module, ``optax.adamw`` elsewhere.

  Per module (paper layout, module docstring): equivalent gradient :math:`\tilde g` of the raw LoRA
  gradients, Adam moments of :math:`\tilde g` (``mode="full"``), the Adam direction :math:`\tilde d`
  projected back onto the factors by the closed form with the Sylvester :math:`X`, and the delta
  :math:`-\eta_t g^A + (\sqrt{1-\eta_t\lambda} - 1)A` (likewise for ``B``). With
  ``mode="efficient"`` the raw gradients are adjusted (closed form, Sylvester :math:`X`) and fed to AdamW
  on the factors. Other leaves: exactly ``optax.adamw(learning_rate, b1, b2, eps, weight_decay, mask)``.

  Args:
    learning_rate: :math:`\eta_t` or a schedule (indexed by the number of past updates, as in
      ``optax.adamw``).
    scale: the LoRA scale :math:`s` of the model's adapters (``alpha / r``; ``alpha / sqrt(r)`` for
      rsLoRA): it must be the scale the forward pass uses.
    b1, b2, eps: Adam constants.
    weight_decay: :math:`\lambda`; on LoRA factors :math:`\sqrt{1-\eta_t\lambda}` per factor
      (``"full"``, the paper's) or :math:`1-\eta_t\lambda` (``"efficient"``, the official code's).
      :math:`1 - \eta_t\lambda` is clamped at 0 under the square root.
    mask: weight-decay mask, as in ``optax.adamw`` (a pytree of booleans or a callable
      ``params -> tree``); for a LoRA factor it switches that factor's decay.
    mode: ``"full"`` (paper: :math:`d_{in} d_{out}` moments per module) or ``"efficient"`` (moments of
      the factors' shapes).
    ridge: :math:`\delta` in :math:`(G + \delta I)^+` for :math:`G = B^\top B, AA^\top`.
    moment_dtype: dtype of the LoRA-Pro moments; None: float32, or the factors' dtype if wider.
    lora_dims: how to find LoRA factors (see :func:`anlr_jax.find_lora_modules`).

  Returns:
    An ``optax.GradientTransformation`` whose state is a :class:`LoraProState`. It does not compose
    with :func:`anlr_jax.anlr` (module docstring).

  Raises:
    ValueError: on an invalid argument (the message names it); at ``init``/``update`` for malformed
      LoRA pairs or a mask that does not match the parameters.

  Example:
    >>> import jax.numpy as jnp, optax, anlr_jax
    >>> params = {"q": {"lora_a": jnp.ones((8, 2)) * 0.1, "lora_b": jnp.zeros((2, 6))},
    ...           "norm": jnp.ones(6)}
    >>> tx = anlr_jax.lorapro(1e-3, scale=2.0)
    >>> state = tx.init(params)
    >>> state.lora_mu["q"].shape  # full-weight moments, kernel layout (d_in, d_out)
    (8, 6)
    >>> updates, state = tx.update(params, state, params)
    >>> updates["q"]["lora_b"].shape
    (2, 6)

  References:
    Wang, Liang, He, Wang, Tan, *LoRA-Pro: Are Low-Rank Adapters Properly Optimized?*, ICLR 2025
    (arXiv:2407.18242, 2024).
  """
  _validate(learning_rate, scale, b1, b2, eps, weight_decay, ridge, mode, moment_dtype)

  def rest_adamw(num_leaves, flags, lora_indices):
    """``optax.adamw`` on the non-LoRA leaves of the flat list (LoRA ones masked out)."""
    decay_mask = None if mask is None else flags
    return optax.masked(
        optax.adamw(
            learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask
        ),
        [i not in lora_indices for i in range(num_leaves)],
    )

  def moment_dt(*xs):
    return rank_stats.stat_dtype(*xs) if moment_dtype is None else jnp.dtype(moment_dtype)

  def split(tree):
    modules = find_lora_modules(tree, lora_dims)
    check_unique_names(modules)
    for m in modules:
      if isinstance(m.a_feature_axis, tuple) or isinstance(m.b_feature_axis, tuple):
        raise ValueError(
            f"lorapro: LoRA module {m.name!r} has factors with several feature axes; lorapro "
            "takes 2-D factors (..., d, r) only"
        )
    lora_indices = {i for m in modules for i in (m.a_index, m.b_index)}
    return modules, lora_indices

  def init_fn(params):
    modules, lora_indices = split(params)
    leaves = [variable_value(x) for x in jax.tree.leaves(params)]
    flags = _decay_flags(mask, params, len(leaves))
    mu, nu = {}, {}
    for m in modules:
      a, b = leaves[m.a_index], leaves[m.b_index]
      if mode == "full":
        shape = _weight_shape(a.shape, b.shape, m.dims)
        mu[m.name] = jnp.zeros(shape, moment_dt(a, b))
        nu[m.name] = jnp.zeros(shape, moment_dt(a, b))
      else:
        mu[m.name] = (jnp.zeros(a.shape, moment_dt(a)), jnp.zeros(b.shape, moment_dt(b)))
        nu[m.name] = (jnp.zeros(a.shape, moment_dt(a)), jnp.zeros(b.shape, moment_dt(b)))
    adam = rest_adamw(len(leaves), flags, lora_indices)
    return LoraProState(
        count=jnp.zeros([], jnp.int32), adam_state=adam.init(leaves), lora_mu=mu, lora_nu=nu
    )

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError(optax.NO_PARAMS_MSG)
    modules, lora_indices = split(updates)
    grads, treedef = jax.tree.flatten(updates)
    flat_params = [variable_value(p) for p in treedef.flatten_up_to(params)]
    flags = _decay_flags(mask, params, len(grads))
    adam = rest_adamw(len(grads), flags, lora_indices)
    out, adam_state = adam.update(grads, state.adam_state, flat_params)

    count_inc = optax.safe_increment(state.count)
    lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
    mu, nu = {}, {}
    for m in modules:
      da, db, mu[m.name], nu[m.name] = _module_step(
          m, flat_params, grads, state.lora_mu[m.name], state.lora_nu[m.name], count_inc, lr, flags
      )
      out[m.a_index] = da.astype(grads[m.a_index].dtype)
      out[m.b_index] = db.astype(grads[m.b_index].dtype)
    new_state = LoraProState(count=count_inc, adam_state=adam_state, lora_mu=mu, lora_nu=nu)
    return treedef.unflatten(out), new_state

  def _module_step(m: LoraModule, flat_params, grads, mu, nu, count_inc, lr, flags):
    """One module's delta (in its factors' layouts) and new moments."""
    f, ga, gb = _paper_inputs(
        flat_params[m.a_index],
        flat_params[m.b_index],
        grads[m.a_index],
        grads[m.b_index],
        m.dims,
        ridge,
    )
    dt = f.a.dtype
    lr = jnp.asarray(lr, dt)
    decay_a = lr * jnp.asarray(weight_decay, dt) * jnp.asarray(flags[m.a_index], dt)
    decay_b = lr * jnp.asarray(weight_decay, dt) * jnp.asarray(flags[m.b_index], dt)
    if mode == "full":
      pa, pb, _ = _adjust(f, ga, gb, scale, sylvester=False)
      g_eq = _weight_from_paper(_equivalent(f, pa, pb, scale), m.dims)  # stored in weight layout
      mu, nu, mu_hat, nu_hat = _adam_moments(mu, nu, g_eq, b1, b2, count_inc)
      d = _weight_to_paper(mu_hat / (jnp.sqrt(nu_hat) + eps), m.dims)
      ua, ub, _ = _adjust(f, scale * (_mT(f.b) @ d), scale * (d @ _mT(f.a)), scale, sylvester=True)
      da = -lr * ua + (jnp.sqrt(jnp.maximum(1.0 - decay_a, 0.0)) - 1.0) * f.a
      db = -lr * ub + (jnp.sqrt(jnp.maximum(1.0 - decay_b, 0.0)) - 1.0) * f.b
      return _a_to_paper(da, m.dims), _b_to_paper(db, m.dims), mu, nu
    ua, ub, _ = _adjust(f, ga, gb, scale, sylvester=True)
    ua, ub = _a_to_paper(ua, m.dims), _b_to_paper(ub, m.dims)  # the factors' layouts
    a, b = _a_to_paper(f.a, m.dims), _b_to_paper(f.b, m.dims)
    mu_a, nu_a, mh_a, nh_a = _adam_moments(mu[0], nu[0], ua, b1, b2, count_inc)
    mu_b, nu_b, mh_b, nh_b = _adam_moments(mu[1], nu[1], ub, b1, b2, count_inc)
    da = -lr * (mh_a / (jnp.sqrt(nh_a) + eps)) - decay_a * a
    db = -lr * (mh_b / (jnp.sqrt(nh_b) + eps)) - decay_b * b
    return da, db, (mu_a, mu_b), (nu_a, nu_b)

  return optax.GradientTransformation(init_fn, update_fn)

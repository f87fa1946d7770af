r"""LoRA adapter around a frozen ``nnx.Linear``: LoRA, rsLoRA, PiSSA, MiLoRA and DoRA.

With the Flax layout (kernel ``W0`` of shape ``(d_in, d_out)``, ``A`` of shape ``(d_in, r)``,
``B`` of shape ``(r, d_out)``) and scale ``c`` the layer computes

.. math::

   y = x W_0 + b + c \, \mathrm{drop}(x) A B, \qquad
   c = \alpha / r \ \text{(LoRA)} \quad\text{or}\quad c = \alpha / \sqrt{r} \ \text{(rsLoRA)}.

DoRA (Liu et al., 2024) re-normalises every output unit ``j`` (a column of the Flax kernel):

.. math::

   y = x W_0 + b + (m / n - 1) \odot (x' W_0) + (m / n) \odot c \, x' A B, \qquad
   n_j = \big\| W_0[:, j] + c\,(\mathrm{sg}[A B])[:, j] \big\|_2,

where ``m`` is the trainable magnitude vector ``lora_magnitude`` of shape ``(d_out,)``, ``sg`` is
stop-gradient (``n`` is detached, DoRA Sec. 4.3), and ``x' = drop(x)``. As in PEFT
(``peft/tuners/lora/variants.py``, ``DoraLinearVariant.forward``), when dropout is inactive
``x' W_0`` reuses the base output (minus its bias); when it is active it is recomputed from the
dropped input. Without dropout this is ``y = b + (m / n) \odot (x W_0 + c\, x A B)``.

The adapter parameters ``lora_a``, ``lora_b`` (and ``lora_magnitude`` for DoRA) are
``nnx.LoRAParam``; the base kernel and bias stay ``nnx.Param``, so
``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)`` trains only the adapter. Adapters are kept in
float32 whatever the base dtype (as PEFT's ``autocast_adapter_dtype``). When the base kernel carries
logical axis names (``out_sharding=(in_axis, out_axis)``), ``A`` gets ``(in_axis, None)``, ``B``
``(None, out_axis)`` and the magnitude ``(out_axis,)``: the rank axis is never sharded.

The base may be a quantised :class:`~anlr_jax.nn.quant.QuantLinear` (QLoRA): ``base.kernel[...]``
is then its dequantised weight, which DoRA's magnitude and norms read; PiSSA/MiLoRA's residual is
quantised when written back; ``merge()`` is refused (``merged_kernel()`` still works).

References:
  Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021.
  Kalajdzievski, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA", 2023.
  Meng et al., "PiSSA: Principal Singular Values and Singular Vectors Adaptation", 2024.
  Wang et al., "MiLoRA: Harnessing Minor Singular Components for Parameter-Efficient LLM
  Finetuning", 2024.
  Liu et al., "DoRA: Weight-Decomposed Low-Rank Adaptation", 2024.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

LORA_INITS = ("default", "pissa", "milora")
"""Accepted values of ``LoRALinear(init=...)``."""

ADAPTER_DTYPE = jnp.float32
"""Storage dtype of the adapter parameters, whatever the base dtype."""


class InitialAdapter(nnx.Variable):
  """Frozen copy of the initial ``A``/``B`` of a PiSSA/MiLoRA adapter (for PEFT export)."""


class DoRAMergedNorm(nnx.Variable):
  """Column norms ``n`` of ``W0 + c A B`` saved by a DoRA ``merge()`` so ``unmerge()`` is exact."""


def kernel_axes(kernel: nnx.Variable, *which: int | None) -> dict:
  """Variable metadata giving an adapter tensor the kernel's logical axis names: ``which[i]`` is
  the kernel axis (0 = in, 1 = out) that axis ``i`` of the tensor follows, or None (never sharded:
  the rank axis). Empty when the kernel carries no names."""
  kernel_meta = kernel.get_metadata()
  names = kernel_meta.get("out_sharding")
  if names is None:
    return {}
  meta = {"out_sharding": tuple(None if w is None else names[w] for w in which)}
  if "eager_sharding" in kernel_meta:
    meta["eager_sharding"] = kernel_meta["eager_sharding"]
  return meta


def lora_scale(rank: int, alpha: float, use_rslora: bool) -> float:
  r"""LoRA output scale: ``c = alpha / r``, or ``c = alpha / sqrt(r)`` for rsLoRA."""
  return float(alpha) / (math.sqrt(rank) if use_rslora else float(rank))


def kaiming_uniform_a(key: jax.Array, d_in: int, rank: int) -> jax.Array:
  r"""PEFT's default ``A``: torch ``kaiming_uniform_(a=sqrt(5))`` on a ``(r, d_in)`` weight.

  The gain is ``sqrt(2 / (1 + a^2)) = sqrt(1/3)`` and the bound ``gain * sqrt(3 / d_in)``, i.e.
  ``A ~ U(-1/sqrt(d_in), 1/sqrt(d_in))``; returned in the Flax layout ``(d_in, r)``.
  """
  bound = 1.0 / math.sqrt(d_in)
  return jax.random.uniform(key, (d_in, rank), ADAPTER_DTYPE, -bound, bound)


def svd_init_factors(kernel: jax.Array, rank: int, scale: float, *, minor: bool):
  r"""PiSSA (``minor=False``) / MiLoRA (``minor=True``) factors of a Flax kernel.

  With ``W0 = U diag(S) V^T`` (``W0`` of shape ``(d_in, d_out)``) and ``I`` the top-``r``
  (PiSSA) or bottom-``r`` (MiLoRA) singular indices:

  .. math::

     A = U_{:, I} \operatorname{diag}(\sqrt{S_I / c}), \quad
     B = \operatorname{diag}(\sqrt{S_I / c}) V^T_{I, :}, \quad
     W_{res} = W_0 - c A B,

  so ``c A B`` is the rank-``r`` truncation on those triplets (PEFT's ``pissa_init`` in the
  transposed layout). Computed in float32.

  Returns:
    ``(A, B, W_res)`` with ``W_res`` in float32.
  """
  w = kernel.astype(jnp.float32)
  u, s, vt = jnp.linalg.svd(w, full_matrices=False)
  idx = slice(s.shape[0] - rank, s.shape[0]) if minor else slice(0, rank)
  root = jnp.sqrt(s[idx] / scale)
  a = u[:, idx] * root[None, :]
  b = root[:, None] * vt[idx, :]
  residual = w - scale * (a @ b)
  return a.astype(ADAPTER_DTYPE), b.astype(ADAPTER_DTYPE), residual


def dora_column_norm(kernel: jax.Array, delta: jax.Array) -> jax.Array:
  r"""``n_j = || W0[:, j] + delta[:, j] ||_2`` in float32, one value per output unit."""
  w = kernel.astype(jnp.float32) + delta.astype(jnp.float32)
  return jnp.linalg.norm(w, axis=0)


def _custom_backward_default() -> bool:
  return jax.default_backend() == "cpu"


def _product(x, a, b, precision):
  return jnp.matmul(jnp.matmul(x, a, precision=precision), b, precision=precision)


_low_rank_product = jax.custom_vjp(_product, nondiff_argnums=(3,))


def _low_rank_product_fwd(x, a, b, precision):
  xa = jnp.matmul(x, a, precision=precision)
  return jnp.matmul(xa, b, precision=precision), (x, xa, a, b)


def _low_rank_product_bwd(precision, residuals, dy):
  x, xa, a, b = residuals
  mm = functools.partial(jnp.matmul, precision=precision)
  g = mm(dy, b.T)  # (N, r): the cotangent of x A
  dx = mm(g, a.T)
  # dA = x^T g computed as (g^T x)^T: XLA CPU runs the (r, N) x (N, d_in) GEMM ~3-4x faster than
  # the (d_in, N) x (N, r) one, and the barrier keeps the algebraic simplifier from turning it back;
  # the transpose is then a copy of r * d_in values.
  da = jax.lax.optimization_barrier(mm(g.T, x)).T
  db = mm(xa.T, dy)
  return dx, da, db


_low_rank_product.defvjp(_low_rank_product_fwd, _low_rank_product_bwd)


def low_rank_product(
    x: jax.Array,
    a: jax.Array,
    b: jax.Array,
    *,
    precision=None,
    custom_backward: bool | None = None,
) -> jax.Array:
  r"""``(x A) B`` for ``x`` of shape ``(..., d_in)``, ``A (d_in, r)``, ``B (r, d_out)``.

  With ``custom_backward`` (default: on the CPU backend) the backward pass is written by hand, on
  2-D ``(tokens, features)`` operands: ``g = dy B^T``, ``dx = g A^T``, ``dB = (x A)^T dy`` and
  ``dA = x^T g`` computed as ``(g^T x)^T``, the GEMM layout XLA CPU runs fastest (see
  ``docs/benchmarks.md``). The same values as automatic differentiation, which is used otherwise;
  forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``) needs ``custom_backward=False``.

  Args:
    x, a, b: operands in one floating dtype (promote them first).
    precision: ``jax.lax.Precision`` of every matmul, forward and backward.
    custom_backward: see above; ``None`` picks by backend.
  """
  if custom_backward is None:
    custom_backward = _custom_backward_default()
  if not custom_backward:  # automatic differentiation
    return _product(x, a, b, precision)
  lead = x.shape[:-1]
  y = _low_rank_product(x.reshape(-1, x.shape[-1]), a, b, precision)
  return y.reshape(*lead, b.shape[-1])


def drop_adapter_input(dropout: nnx.Dropout, x: jax.Array) -> jax.Array:
  """``dropout(x)`` (train mode) with the mask drawn only once ``x`` exists.

  A dropout mask depends on the dropout key alone, so XLA may draw every layer's masks at the
  start of the step and keep them all alive until their layer runs (at SmolLM2-135M's size and a
  16 x 320 batch, 30 layers x 5 projections of random bits: 3.8 GiB). The key passes through
  ``k + 0 * x[0]`` first: the same key and mask (a non-finite ``x``, whose loss is not finite
  either, gives another), drawn after ``x``.
  """
  if dropout.rngs is None:  # no stream of its own: nnx's error (or a key given at the call)
    return dropout(x)
  key = dropout.rngs()
  zero = 0 * jax.lax.stop_gradient(x).reshape(-1)[0].astype(jnp.float32)
  data = jax.random.key_data(key)
  key = jax.random.wrap_key_data(data + zero.astype(data.dtype), impl=jax.random.key_impl(key))
  return dropout(x, rngs=key)


class LoRALinear(nnx.Module):
  r"""A frozen ``nnx.Linear`` plus a trainable low-rank update (see the module docstring).

  Args:
    base: the ``nnx.Linear`` to adapt (2-D kernel ``(d_in, d_out)``, optional bias). It is kept as
      ``self.base``; PiSSA/MiLoRA overwrite its kernel with the residual ``W0 - c A0 B0``.
    rank: ``r``, the adapter rank (``1 <= r``; ``r <= min(d_in, d_out)`` for PiSSA/MiLoRA).
    alpha: ``alpha`` of the scale ``c``.
    dropout: dropout rate on the adapter input only, active only in train mode
      (``model.train()``); the layer is created in eval mode, like a Hugging Face model.
    use_rslora: scale ``alpha / sqrt(r)`` instead of ``alpha / r``.
    init: ``'default'`` (PEFT: Kaiming-uniform ``A``, zero ``B``), ``'pissa'`` (top-``r``
      singular triplets) or ``'milora'`` (bottom-``r``). Every init leaves the output unchanged.
    use_dora: add DoRA's magnitude ``lora_magnitude`` (``(d_out,)``, initialised to the column
      norms of ``W0 + c A B``).
    rngs: random streams: ``params`` for ``A``, ``dropout`` for the dropout masks.

  Attribute ``custom_backward`` (default ``None``) is passed to :func:`low_rank_product`: on the
  CPU backend the adapter then has a hand-written backward pass (faster, same values), which
  forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``) cannot go through; set it to ``False``
  on the layers (e.g. ``for _, l in iter_lora_layers(model): l.custom_backward = False``) to use
  automatic differentiation everywhere. Reverse mode and forward-over-reverse (Hessian-vector
  products) work either way.

  Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> layer = LoRALinear(nnx.Linear(8, 4, rngs=nnx.Rngs(0)), rank=2, alpha=4.0,
    ...                    rngs=nnx.Rngs(1))
    >>> layer.lora_a.shape, layer.lora_b.shape, layer.scale
    ((8, 2), (2, 4), 2.0)
    >>> layer(jnp.ones((3, 8))).shape
    (3, 4)
  """

  def __init__(
      self,
      base: nnx.Linear,
      *,
      rank: int,
      alpha: float,
      dropout: float = 0.0,
      use_rslora: bool = False,
      init: str = "default",
      use_dora: bool = False,
      rngs: nnx.Rngs,
  ):
    if not isinstance(base, nnx.Linear):
      raise TypeError(f"base must be an nnx.Linear, got {type(base).__name__}")
    if base.kernel.ndim != 2:
      raise ValueError(f"base.kernel must be 2-D (d_in, d_out), got shape {base.kernel.shape}")
    d_in, d_out = base.kernel.shape
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
      raise ValueError(f"rank must be a positive int, got {rank!r}")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
      raise ValueError(f"alpha must be a positive finite number, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
      raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    if init not in LORA_INITS:
      raise ValueError(f"init must be one of {LORA_INITS}, got {init!r}")
    if init != "default" and rank > min(d_in, d_out):
      raise ValueError(
          f"rank={rank} exceeds min(d_in, d_out)={min(d_in, d_out)}, needed by init={init!r}"
      )

    self.base = base
    self.in_features = d_in
    self.out_features = d_out
    self.rank = rank
    self.alpha = float(alpha)
    self.use_rslora = bool(use_rslora)
    self.init = init
    self.use_dora = bool(use_dora)
    self.scale = lora_scale(rank, alpha, use_rslora)
    self.merged = False
    self.custom_backward = None
    self.dropout = nnx.Dropout(float(dropout), deterministic=True, rngs=rngs)

    axes = functools.partial(kernel_axes, base.kernel)

    if init == "default":
      a = kaiming_uniform_a(rngs.params(), d_in, rank)
      b = jnp.zeros((rank, d_out), ADAPTER_DTYPE)
    else:
      a, b, residual = svd_init_factors(
          base.kernel[...], rank, self.scale, minor=(init == "milora")
      )
      base.kernel[...] = residual.astype(base.kernel.dtype)
      self.init_lora_a = InitialAdapter(a, **axes(0, None))
      self.init_lora_b = InitialAdapter(b, **axes(None, 1))
    self.lora_a = nnx.LoRAParam(a, **axes(0, None))
    self.lora_b = nnx.LoRAParam(b, **axes(None, 1))
    if self.use_dora:
      self.lora_magnitude = nnx.LoRAParam(
          dora_column_norm(base.kernel[...], self.scale * (a @ b)).astype(ADAPTER_DTYPE), **axes(1)
      )
      self.dora_merged_norm = DoRAMergedNorm(jnp.zeros((d_out,), jnp.float32), **axes(1))

  # ------------------------------------------------------------------ maths helpers
  def delta_kernel(self) -> jax.Array:
    r"""``c A B`` in float32, shape ``(d_in, d_out)``."""
    return self.scale * (
        self.lora_a[...].astype(jnp.float32) @ self.lora_b[...].astype(jnp.float32)
    )

  def _unmerged_kernel(self) -> jax.Array:
    """``W0`` (float32) whether or not the adapter is currently merged."""
    kernel = self.base.kernel[...].astype(jnp.float32)
    if not self.merged:
      return kernel
    delta = self.delta_kernel()
    if self.use_dora:
      factor = self.lora_magnitude[...].astype(jnp.float32) / self.dora_merged_norm[...]
      return kernel / factor[None, :] - delta
    return kernel - delta

  def merged_kernel(self) -> jax.Array:
    r"""The base kernel with the adapter folded in, in the base dtype.

    ``W0 + c A B`` for LoRA; ``(m / n) \odot (W0 + c A B)`` for DoRA. The bias is unchanged.
    """
    if self.merged:
      return self.base.kernel[...]
    kernel = self.base.kernel[...]
    delta = self.delta_kernel()
    merged = kernel.astype(jnp.float32) + delta
    if self.use_dora:
      norm = dora_column_norm(kernel, delta)
      merged = merged * (self.lora_magnitude[...].astype(jnp.float32) / norm)[None, :]
    return merged.astype(kernel.dtype)

  # ------------------------------------------------------------------ merge / unmerge
  def merge(self) -> None:
    """Fold the adapter into ``base.kernel`` (the forward then calls only the base)."""
    if self.merged:
      raise ValueError("LoRALinear.merge: the adapter is already merged")
    if getattr(self.base, "quantize", "none") != "none":
      raise ValueError(
          f"LoRALinear.merge: the base is quantised ({self.base.quantize}); merging would"
          " quantise the adapter too (merged_kernel() gives the dequantised, merged weight)"
      )
    if self.use_dora:
      self.dora_merged_norm[...] = dora_column_norm(self.base.kernel[...], self.delta_kernel())
    self.base.kernel[...] = self.merged_kernel()
    self.merged = True

  def unmerge(self) -> None:
    """Exact inverse of ``merge()`` (up to rounding): restore ``W0`` in ``base.kernel``."""
    if not self.merged:
      raise ValueError("LoRALinear.unmerge: the adapter is not merged")
    self.base.kernel[...] = self._unmerged_kernel().astype(self.base.kernel.dtype)
    self.merged = False
    if self.use_dora:
      self.dora_merged_norm[...] = jnp.zeros_like(self.dora_merged_norm[...])

  # ------------------------------------------------------------------ forward
  def _adapter_out(self, x: jax.Array) -> jax.Array:
    """``x A B`` (unscaled) in the promoted compute dtype."""
    x, a, b = nnx.nn.dtypes.promote_dtype(
        (x, self.lora_a[...], self.lora_b[...]), dtype=self.base.dtype
    )
    return low_rank_product(
        x, a, b, precision=self.base.precision, custom_backward=self.custom_backward
    )

  def _added_out(self, x: jax.Array) -> jax.Array:
    """What the adapter adds to the base output without DoRA, ``c x A B``, for the adapter input
    ``x`` (after dropout); a layer with more trainable terms (LoRA-Dash) adds them here."""
    return self.scale * self._adapter_out(x)

  def __call__(self, x: jax.Array) -> jax.Array:
    base_out = self.base(x)
    if self.merged:
      return base_out
    dropout_active = self.dropout.rate > 0.0 and not self.dropout.deterministic
    x_adapter = drop_adapter_input(self.dropout, x) if dropout_active else x
    if not self.use_dora:
      return base_out + self._added_out(x_adapter).astype(base_out.dtype)
    lora_out = self._adapter_out(x_adapter)

    kernel = self.base.kernel[...]
    norm = jax.lax.stop_gradient(
        dora_column_norm(kernel, jax.lax.stop_gradient(self.delta_kernel()))
    )
    mag_norm_scale = self.lora_magnitude[...].astype(jnp.float32) / norm
    if dropout_active:
      xd, k = nnx.nn.dtypes.promote_dtype((x_adapter, kernel), dtype=self.base.dtype)
      kernel_out = jnp.matmul(xd, k, precision=self.base.precision)
    else:
      kernel_out = base_out
      if self.base.bias is not None:
        kernel_out = base_out - self.base.bias[...].astype(base_out.dtype)
    dora_out = (mag_norm_scale - 1.0) * kernel_out.astype(
        jnp.float32
    ) + mag_norm_scale * self.scale * lora_out.astype(jnp.float32)
    return base_out + dora_out.astype(base_out.dtype)

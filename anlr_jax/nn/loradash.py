r"""LoRA-Dash: LoRA plus a learned amplification of the task-specific directions of ``W0``.

Flax layout: the frozen kernel ``W0`` has shape ``(d_in, d_out)`` and the layer computes ``x W0``.
Its thin SVD, with ``k = min(d_in, d_out)``, is

.. math::

   W_0 = P \operatorname{diag}(\sigma) Q^\top, \qquad p_i = P[:, i] \in \mathbb{R}^{d_{in}},\
   q_i = Q[:, i] \in \mathbb{R}^{d_{out}},\ \sigma_1 \ge \dots \ge \sigma_k \ge 0,

and ``p_i q_i^T`` is the ``i``-th *direction* of ``W0``, whose coordinate in ``W0`` is ``σ_i``
(Si et al., the section defining task-specific directions: bases and directions of a matrix).

**Change rate** of direction ``i`` under an update ``ΔW`` (the coordinate of ``ΔW`` along
``p_i q_i^T`` relative to its coordinate in ``W0``: the paper's definition of task-specific
directions, with the unknown final update replaced by the LoRA update learnt so far, as in its
pre-launch phase):

.. math::

   \delta_i = \frac{|p_i^\top \Delta W\, q_i|}{\sigma_i}, \qquad i = 1, \dots, k,

taken as ``+inf`` when ``σ_i = 0 < |p_i^T ΔW q_i|`` and ``0`` when both are zero.

The method has two phases (the paper's LoRA-Dash section):

* **pre-launch** (updates ``1 .. t``): plain LoRA, ``y = x W0 + b + c drop(x) A B`` with
  ``A (d_in, r)``, ``B (r, d_out)``, ``c = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), exactly
  as :class:`~anlr_jax.nn.lora.LoRALinear`;
* **launch** (after update ``t``): with ``ΔW = c A B`` the LoRA update at that moment, the
  task-specific directions are the ``s`` directions of largest change rate,
  ``I = top_s(δ)`` (sorted by decreasing ``δ``); their vectors ``U_s = P[:, I]`` ``(d_in, s)`` and
  ``V_s = Q[:, I]^T`` ``(s, d_out)`` are stored and frozen;
* **dash** (updates ``t + 1, ...``): LoRA continues and a vector ``δ̂ ∈ R^s`` (``dash_scale``,
  zero at launch, trainable) amplifies the chosen directions:

.. math::

   y = x W_0 + b + c\,\mathrm{drop}(x) A B + \mathrm{drop}(x)\, U_s \operatorname{diag}(\hat\delta) V_s,
   \qquad \Delta W_{total} = c A B + \sum_{j=1}^{s} \hat\delta_j\, p_{I_j} q_{I_j}^\top .

The dash term is not multiplied by ``c``. Paper defaults: ``t = 100``, ``s = 8``
(:data:`LORADASH_DEFAULTS`).

In the torch layout of the paper and of the authors' code (``W = W0^T`` of shape
``(d_out, d_in)``, ``h = W x``, ``ΔW = c B_t A_t`` with ``A_t = A^T``, ``B_t = B^T``) the SVD is
``W = Q diag(σ) P^T``: its left singular vectors are our ``q_i`` and its right ones our ``p_i``, so
``u_i^T ΔW_t v_i = p_i^T ΔW q_i`` and the same directions are chosen. This follows the authors'
reference implementation (``Chongjie-Si/Subspace-Tuning``, ``CR_MR/peft/src/peft/tuners/
lora-dash.py``, ``Linear.forward``): SVD of the frozen weight in float32, projection
``diag(U^T ΔW V)`` of the scaled LoRA update, ``topk(|proj| / |σ|, s)``, and the dash term
``drop(x) (U_s diag(δ̂) V_s^T)^T`` added unscaled. Two deliberate differences: the dash term uses
the same dropout mask as the LoRA term (the reference draws a second one), and ``t`` counts
optimizer updates (the reference counts a layer's training forward passes, the same without
gradient accumulation). As in the reference's torch AdamW, which creates a parameter's moments at
its first gradient, ``δ̂``'s Adam moments and bias-correction count start at the launch
(:func:`dash_optimizer`): its first update is ``-η g / (|g| + ε) ≈ -η sign(g)``. A count started
at update 1 would make it ``(1 - b1) / (1 - b1^{t+1}) · sqrt((1 - b2^{t+1}) / (1 - b2))`` times
that (0.52 at ``t = 5``, 0.98 at ``t = 100``).

The phase switch is in the values only, so a jitted step compiles once for both phases: until
launch ``dash_u``, ``dash_v`` are zero, hence the dash term and the gradient of ``dash_scale`` are
exactly zero (and AdamW leaves ``dash_scale`` at exactly zero); launch overwrites them in place
with arrays of the same shape, dtype and sharding. ``dash_u``, ``dash_v``, ``dash_change_rate``
and ``dash_index`` (``-1`` until launch) are :class:`DashDirections` variables: neither
``nnx.Param`` nor ``nnx.LoRAParam``, so they are never trained, and a trainer that splits the model
into ``(nnx.LoRAParam, nnx.Param, ...)`` carries them in the third (``extra``) part.
``dash_scale`` is an ``nnx.LoRAParam`` next to ``lora_a``/``lora_b``; :func:`dash_optimizer` gives it
its own AdamW, and the LoRA factors the optimizer it wraps (``optax.adamw``, ``anlr_jax.anlr``).

Use from a trainer: build the model with :func:`inject_loradash` (``s``, ``t``), train its
``nnx.LoRAParam`` leaves (``lora_a``, ``lora_b``, ``dash_scale``) with
``dash_optimizer(tx, learning_rate, launch_step=t)``; right after optimizer update
``t`` (:func:`dash_launch_step`; ``t = 0``: before the first), call :func:`launch_dash` eagerly on
the model holding the current params (e.g. ``nnx.merge(graphdef, lora, frozen, extra)``), then take
the new ``extra`` part back (``nnx.split(model, nnx.LoRAParam, nnx.Param, ...)``); no optimizer
state changes, and the jitted step is not recompiled. On resume, :func:`dash_launched` tells
whether the checkpoint is past the launch. The directions are model state: save them with the
adapter (``nnx.state(model, DashDirections)``), they cannot be recomputed later.

References:
  Si, Shi, Zhang, Yang, Pfister, Shen, "Unleashing the Power of Task-Specific Directions in
  Parameter Efficient Fine-tuning", ICLR 2025 (arXiv:2409.01035), 2024.
  Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021.
"""

from __future__ import annotations

import functools
import typing as tp

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from anlr_jax.nn.inject import (
    PAPER_TARGET_MODULES,
    get_submodule,
    path_str,
    set_submodule,
    target_linears,
)
from anlr_jax.nn.lora import ADAPTER_DTYPE, LoRALinear, kernel_axes, low_rank_product

LORADASH_DEFAULTS = dict(
    num_directions=8,  # s: the paper's setting and the authors' code (`index = 8`)
    launch_step=100,  # t: the paper's setting and the authors' code (`warmup = 100`)
)
"""LoRA-Dash defaults of the paper: ``s = 8`` directions, launched after ``t = 100`` updates."""


class DashDirections(nnx.Variable):
  """Frozen LoRA-Dash state fixed at launch: directions ``U_s``, ``V_s``, change rates, indices."""


class TaskDirections(tp.NamedTuple):
  r"""The ``s`` task-specific directions of a kernel, by decreasing change rate.

  ``u`` ``(d_in, s)``: ``p_{I_j}`` (left singular vectors of the Flax kernel); ``v`` ``(s, d_out)``:
  ``q_{I_j}^T`` (right singular vectors, as rows); ``change_rate`` ``(s,)``: ``δ_{I_j}``; ``index``
  ``(s,)`` int32: ``I_j``, the position of the direction in the descending singular spectrum.
  """

  u: jax.Array
  v: jax.Array
  change_rate: jax.Array
  index: jax.Array


def validate_dash_config(
    num_directions: int,
    launch_step: int = LORADASH_DEFAULTS["launch_step"],
    d_in: int | None = None,
    d_out: int | None = None,
) -> None:
  r"""Checks LoRA-Dash's ``s`` (``num_directions``) and ``t`` (``launch_step``).

  ``1 <= s <= min(d_in, d_out)`` (the bound only when both sizes are given) and ``t >= 0``
  (``t = 0``: launch before the first update, when ``ΔW = 0`` ranks every direction 0 and the tie
  is broken by index, i.e. the top-``s`` singular directions).

  Raises:
    ValueError: naming ``num_directions`` or ``launch_step``.
  """
  if isinstance(num_directions, bool) or not isinstance(num_directions, int) or num_directions < 1:
    raise ValueError(f"num_directions (LoRA-Dash s) must be a positive int, got {num_directions!r}")
  if isinstance(launch_step, bool) or not isinstance(launch_step, int) or launch_step < 0:
    raise ValueError(f"launch_step (LoRA-Dash t) must be a non-negative int, got {launch_step!r}")
  if d_in is not None and d_out is not None and num_directions > min(d_in, d_out):
    raise ValueError(
        f"num_directions (LoRA-Dash s) = {num_directions} exceeds min(d_in, d_out) = "
        f"{min(d_in, d_out)} of a ({d_in}, {d_out}) kernel: it has only that many directions"
    )


# ---------------------------------------------------------------------------------- pure maths
def _compute_dtype(*xs):
  return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


def _spectrum_and_rates(kernel: jax.Array, delta_w: jax.Array):
  """``(P, σ, Q^T, δ)`` of the thin SVD of ``kernel`` and the change rates under ``delta_w``."""
  dtype = _compute_dtype(kernel, delta_w)
  w, dw = kernel.astype(dtype), delta_w.astype(dtype)
  p, sigma, qt = jnp.linalg.svd(w, full_matrices=False)
  # p_i^T ΔW q_i for every i at once: rows of P^T ΔW dotted with the rows of Q^T
  proj = jnp.sum(jnp.matmul(p.T, dw, precision=jax.lax.Precision.HIGHEST) * qt, axis=1)
  mag = jnp.abs(proj)
  safe = jnp.where(sigma > 0, sigma, jnp.ones_like(sigma))
  rates = jnp.where(
      sigma > 0, mag / safe, jnp.where(mag > 0, jnp.asarray(jnp.inf, dtype), jnp.zeros_like(mag))
  )
  return p, sigma, qt, rates


def _check_operands(kernel, delta_w):
  if kernel.ndim != 2:
    raise ValueError(f"kernel must be 2-D (d_in, d_out), got shape {kernel.shape}")
  if delta_w.shape != kernel.shape:
    raise ValueError(
        f"delta_w must have the kernel's shape {kernel.shape} (Flax layout (d_in, d_out)), "
        f"got {delta_w.shape}"
    )


def direction_change_rates(kernel: jax.Array, delta_w: jax.Array) -> jax.Array:
  r"""Change rates ``δ_i = |p_i^T ΔW q_i| / σ_i`` of every direction of ``kernel`` (module doc).

  Args:
    kernel: ``W0``, Flax layout ``(d_in, d_out)``.
    delta_w: ``ΔW``, same shape (for LoRA-Dash: ``c A B``).

  Returns:
    ``(k,)`` rates, ``k = min(d_in, d_out)``, in the order of the descending singular values;
    computed in float32 (float64 for float64 inputs).
  """
  _check_operands(kernel, delta_w)
  return _spectrum_and_rates(kernel, delta_w)[3]


@functools.partial(jax.jit, static_argnums=2)
def _select(kernel, delta_w, num_directions):
  p, _, qt, rates = _spectrum_and_rates(kernel, delta_w)
  top, index = jax.lax.top_k(rates, num_directions)  # descending; ties: lower index first
  return TaskDirections(p[:, index], qt[index, :], top, index.astype(jnp.int32))


def select_task_directions(
    kernel: jax.Array, delta_w: jax.Array, num_directions: int = LORADASH_DEFAULTS["num_directions"]
) -> TaskDirections:
  r"""The ``s`` task-specific directions of ``kernel`` under the update ``delta_w`` (LoRA-Dash).

  SVD ``W0 = P diag(σ) Q^T`` of ``kernel`` (not of ``ΔW``), change rates
  ``δ_i = |p_i^T ΔW q_i| / σ_i`` (projection of ``ΔW`` on each direction ``p_i q_i^T`` of ``W0``,
  relative to ``σ_i``), and ``I`` the indices of the ``s`` largest rates, by decreasing rate (ties:
  lower index first): the paper's change rate of a direction, as used by its pre-launch phase.
  Pure and jittable (``num_directions`` static); one thin SVD of ``kernel``.

  Args:
    kernel: ``W0``, Flax layout ``(d_in, d_out)``.
    delta_w: ``ΔW``, same shape; for LoRA-Dash the scaled LoRA update ``c A B`` after ``t`` updates.
    num_directions: ``s``, ``1 <= s <= min(d_in, d_out)``.

  Returns:
    :class:`TaskDirections` ``(u (d_in, s), v (s, d_out), change_rate (s,), index (s,))`` with
    ``u[:, j] = p_{I_j}``, ``v[j] = q_{I_j}^T``, so the amplification is ``u diag(δ̂) v``.

  Raises:
    ValueError: ``num_directions`` out of range, or ``delta_w``'s shape differs from ``kernel``'s.

  Example:
    >>> import jax.numpy as jnp
    >>> w0 = jnp.diag(jnp.array([4.0, 2.0, 1.0]))
    >>> dw = jnp.diag(jnp.array([0.4, 0.4, 0.3]))  # rates 0.1, 0.2, 0.3
    >>> select_task_directions(w0, dw, 2).index.tolist()
    [2, 1]
  """
  _check_operands(kernel, delta_w)
  validate_dash_config(num_directions, d_in=kernel.shape[0], d_out=kernel.shape[1])
  return _select(kernel, delta_w, num_directions)


# ---------------------------------------------------------------------------------- the layer
def _assign(variable: nnx.Variable, value) -> None:
  """``variable[...] = value`` keeping the variable's dtype and (for a concrete array) placement."""
  old = variable[...]
  new = jnp.asarray(value, old.dtype)
  if isinstance(old, jax.Array) and not isinstance(old, jax.core.Tracer) and old.committed:
    new = jax.device_put(new, old.sharding)
  variable[...] = new


class LoRADashLinear(LoRALinear):
  r"""LoRA-Dash around a frozen ``nnx.Linear`` (see the module docstring for the maths).

  A :class:`~anlr_jax.nn.lora.LoRALinear` (plain LoRA or rsLoRA init: Kaiming-uniform ``A``,
  zero ``B``, the same random draws) plus

  * ``dash_scale``: ``nnx.LoRAParam`` ``(s,)``, ``δ̂``, zero;
  * ``dash_u`` ``(d_in, s)``, ``dash_v`` ``(s, d_out)``: :class:`DashDirections`, zero until
    :meth:`launch` writes ``U_s``, ``V_s``; ``dash_change_rate`` ``(s,)`` and ``dash_index``
    ``(s,)`` int32 (``-1`` until launch) record the choice.

  Args:
    base: the ``nnx.Linear`` to adapt (2-D kernel ``(d_in, d_out)``), kept as ``self.base``.
    rank, alpha, dropout, use_rslora, rngs: as for ``LoRALinear``.
    num_directions: ``s``, the number of task-specific directions, ``1 <= s <= min(d_in, d_out)``.
    launch_step: ``t``, the number of plain-LoRA updates before :func:`launch_dash` (kept for the
      trainer, see :func:`dash_launch_step`; the layer itself does not count steps).

  ``delta_kernel()`` (and so ``merge()``/``unmerge()``/``merged_kernel()``) includes the dash term;
  :meth:`lora_delta_kernel` is ``c A B`` alone.

  Example:
    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> layer = LoRADashLinear(nnx.Linear(8, 6, rngs=nnx.Rngs(0)), rank=2, alpha=4.0,
    ...                        num_directions=3, rngs=nnx.Rngs(1))
    >>> layer.dash_u.shape, layer.dash_v.shape, layer.dash_scale.shape, layer.launched
    ((8, 3), (3, 6), (3,), False)
    >>> layer.lora_b[...] = jnp.ones((2, 6))
    >>> layer.launch().u.shape, layer.launched
    ((8, 3), True)
  """

  def __init__(
      self,
      base: nnx.Linear,
      *,
      rank: int,
      alpha: float,
      num_directions: int = LORADASH_DEFAULTS["num_directions"],
      launch_step: int = LORADASH_DEFAULTS["launch_step"],
      dropout: float = 0.0,
      use_rslora: bool = False,
      rngs: nnx.Rngs,
  ):
    validate_dash_config(num_directions, launch_step)
    kernel = getattr(base, "kernel", None)
    if isinstance(base, nnx.Linear) and kernel is not None and kernel.ndim == 2:
      validate_dash_config(num_directions, launch_step, *kernel.shape)
    super().__init__(
        base, rank=rank, alpha=alpha, dropout=dropout, use_rslora=use_rslora, rngs=rngs
    )
    self.num_directions = num_directions
    self.launch_step = launch_step
    d_in, d_out, s = self.in_features, self.out_features, num_directions

    axes = functools.partial(kernel_axes, base.kernel)

    self.dash_scale = nnx.LoRAParam(jnp.zeros((s,), ADAPTER_DTYPE), **axes(None))
    self.dash_u = DashDirections(jnp.zeros((d_in, s), ADAPTER_DTYPE), **axes(0, None))
    self.dash_v = DashDirections(jnp.zeros((s, d_out), ADAPTER_DTYPE), **axes(None, 1))
    self.dash_change_rate = DashDirections(jnp.zeros((s,), jnp.float32), **axes(None))
    self.dash_index = DashDirections(jnp.full((s,), -1, jnp.int32), **axes(None))

  # ------------------------------------------------------------------ maths helpers
  def lora_delta_kernel(self) -> jax.Array:
    r"""``c A B`` in float32, shape ``(d_in, d_out)``: the LoRA part of the update."""
    return super().delta_kernel()

  def dash_delta_kernel(self) -> jax.Array:
    r"""``U_s diag(δ̂) V_s`` in float32, shape ``(d_in, d_out)``; zero before launch."""
    u = self.dash_u[...].astype(jnp.float32)
    return (u * self.dash_scale[...].astype(jnp.float32)[None, :]) @ self.dash_v[...].astype(
        jnp.float32
    )

  def delta_kernel(self) -> jax.Array:
    r"""The whole update ``c A B + U_s diag(δ̂) V_s`` in float32, shape ``(d_in, d_out)``."""
    return self.lora_delta_kernel() + self.dash_delta_kernel()

  @property
  def launched(self) -> bool:
    """Whether the dash phase has started (directions chosen). Reads a device value: eager only."""
    return bool(self.dash_index[...][0] >= 0)

  # ------------------------------------------------------------------ launch
  def task_directions(self) -> TaskDirections:
    r"""The directions the layer would choose now: :func:`select_task_directions` of ``W0`` under
    ``c A B`` with its ``s``. Pure: changes nothing."""
    if self.merged:
      raise ValueError("LoRADashLinear: unmerge() before choosing directions (W0 is needed)")
    return select_task_directions(
        self.base.kernel[...], self.lora_delta_kernel(), self.num_directions
    )

  def set_task_directions(self, directions: TaskDirections) -> None:
    """Start the dash phase with ``directions``: store them and reset ``dash_scale`` to zero."""
    s = self.num_directions
    shapes = {
        "u": (self.in_features, s),
        "v": (s, self.out_features),
        "change_rate": (s,),
        "index": (s,),
    }
    for field, shape in shapes.items():
      got = tuple(getattr(directions, field).shape)
      if got != shape:
        raise ValueError(f"directions.{field} must have shape {shape}, got {got}")
    _assign(self.dash_u, directions.u)
    _assign(self.dash_v, directions.v)
    _assign(self.dash_change_rate, directions.change_rate)
    _assign(self.dash_index, directions.index)
    _assign(self.dash_scale, jnp.zeros((s,)))

  def launch(self) -> TaskDirections:
    """End the pre-launch phase: choose the directions from the current ``c A B`` and store them.

    Call eagerly (outside ``jit``), once. Returns the chosen :class:`TaskDirections`.
    """
    if self.launched:
      raise ValueError("LoRADashLinear.launch: the dash phase has already started")
    directions = self.task_directions()
    self.set_task_directions(directions)
    return directions

  # ------------------------------------------------------------------ forward
  def _dash_out(self, x: jax.Array) -> jax.Array:
    """``x U_s diag(δ̂) V_s`` in the promoted compute dtype."""
    x, u, scale, v = nnx.nn.dtypes.promote_dtype(
        (x, self.dash_u[...], self.dash_scale[...], self.dash_v[...]), dtype=self.base.dtype
    )
    return low_rank_product(
        x,
        u * scale[None, :],
        v,
        precision=self.base.precision,
        custom_backward=self.custom_backward,
    )

  def _added_out(self, x: jax.Array) -> jax.Array:
    """``c x A B + x U_s diag(δ̂) V_s``: LoRA's term plus the dash term (the forward is
    :class:`~anlr_jax.nn.lora.LoRALinear`'s)."""
    return super()._added_out(x) + self._dash_out(x)


# ---------------------------------------------------------------------------------- model level
def iter_loradash_layers(model: nnx.Module) -> tp.Iterator[tuple[str, LoRADashLinear]]:
  """``(dotted path, layer)`` for every ``LoRADashLinear`` in ``model``, sorted by path."""
  found = [(path_str(p), m) for p, m in nnx.iter_modules(model) if isinstance(m, LoRADashLinear)]
  yield from sorted(found, key=lambda item: item[0])


def _layers(model: nnx.Module) -> list[tuple[str, LoRADashLinear]]:
  layers = list(iter_loradash_layers(model))
  if not layers:
    raise ValueError(f"{type(model).__name__} has no LoRADashLinear layer (inject_loradash first)")
  return layers


def inject_loradash(
    model: nnx.Module,
    *,
    target_modules: tp.Sequence[str] = PAPER_TARGET_MODULES,
    rank: int,
    alpha: float,
    num_directions: int = LORADASH_DEFAULTS["num_directions"],
    launch_step: int = LORADASH_DEFAULTS["launch_step"],
    dropout: float = 0.05,
    use_rslora: bool = False,
    rngs: nnx.Rngs,
) -> nnx.Module:
  r"""Replace every targeted ``nnx.Linear`` of ``model`` by a ``LoRADashLinear``, in place.

  As :func:`anlr_jax.nn.inject_lora` (same targets, same sorted order, same random ``A``), with
  LoRA-Dash's ``num_directions`` (``s``) and ``launch_step`` (``t``). Returns ``model``.

  Raises:
    ValueError: as ``inject_lora``, or a bad ``num_directions``/``launch_step`` (checked on every
      layer before any is replaced).
  """
  validate_dash_config(num_directions, launch_step)
  paths = target_linears(model, target_modules)
  for path in paths:
    d_in, d_out = get_submodule(model, path).kernel.shape
    try:
      validate_dash_config(num_directions, launch_step, d_in, d_out)
    except ValueError as err:
      raise ValueError(f"'{path_str(path)}': {err}") from None
  for path in paths:
    linear = get_submodule(model, path)
    set_submodule(
        model,
        path,
        LoRADashLinear(
            linear,
            rank=rank,
            alpha=alpha,
            num_directions=num_directions,
            launch_step=launch_step,
            dropout=dropout,
            use_rslora=use_rslora,
            rngs=rngs,
        ),
    )
  return model


def dash_launch_step(model: nnx.Module) -> int:
  """The ``t`` shared by every ``LoRADashLinear`` of ``model`` (ValueError if none or they differ)."""
  steps = {layer.launch_step for _, layer in _layers(model)}
  if len(steps) > 1:
    raise ValueError(f"LoRADashLinear layers disagree on launch_step: {sorted(steps)}")
  return steps.pop()


def dash_launched(model: nnx.Module) -> bool:
  """Whether the dash phase has started in ``model`` (every layer launched, or none: else error).

  Reads device values: eager only. Useful when resuming from a checkpoint past step ``t``.
  """
  flags = {path: layer.launched for path, layer in _layers(model)}
  if len(set(flags.values())) > 1:
    launched = sorted(p for p, f in flags.items() if f)
    raise ValueError(f"only some LoRADashLinear layers are launched: {launched}")
  return next(iter(flags.values()))


def launch_dash(model: nnx.Module, num_directions: int | None = None) -> dict[str, TaskDirections]:
  r"""Start LoRA-Dash's dash phase on every ``LoRADashLinear`` of ``model``, in place.

  For each layer: SVD of its frozen kernel ``W0``, change rates of ``ΔW = c A B`` (its current
  LoRA update), top-``s`` directions stored in ``dash_u``/``dash_v`` and ``dash_scale`` set to zero
  (:func:`select_task_directions`). All directions are computed before any layer is changed. Call
  eagerly, once, after the ``t``-th optimizer update (:func:`dash_launch_step`).

  Args:
    model: an NNX module with ``LoRADashLinear`` layers (unmerged, not yet launched).
    num_directions: ``s``; ``None`` takes the layers' own. Shapes are fixed at construction, so a
      value other than the layers' ``num_directions`` is an error.

  Returns:
    ``{dotted layer path: TaskDirections}``, sorted by path.

  Raises:
    ValueError: no ``LoRADashLinear`` layer, a layer already launched or merged, or
      ``num_directions`` different from a layer's.
  """
  layers = _layers(model)
  if num_directions is not None:
    validate_dash_config(num_directions)
    wrong = {p: l.num_directions for p, l in layers if l.num_directions != num_directions}
    if wrong:
      raise ValueError(
          f"num_directions={num_directions} differs from the layers' (fixed at construction): "
          f"{wrong}"
      )
  already = [p for p, l in layers if l.launched]
  if already:
    raise ValueError(f"launch_dash: the dash phase has already started in {already}")
  chosen = {path: layer.task_directions() for path, layer in layers}
  for path, layer in layers:
    layer.set_task_directions(chosen[path])
  return chosen


# ---------------------------------------------------------------------------------- optimizer
DASH_PARAM = "dash_scale"
"""The name of ``δ̂`` in a LoRA param tree (:func:`dash_optimizer` finds it by this key)."""


def scale_by_adam_since_launch(
    launch_step: int, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
) -> optax.GradientTransformation:
  r"""``optax.scale_by_adam`` with the bias correction counted from update ``t + 1``.

  .. math::

     m_n = b_1 m_{n-1} + (1 - b_1) g_n, \quad v_n = b_2 v_{n-1} + (1 - b_2) g_n^2, \quad
     u_n = \frac{m_n / (1 - b_1^{k})}{\sqrt{v_n / (1 - b_2^{k})} + \epsilon},
     \quad k = \max(n - t, 1),

  at update ``n`` (1-based), ``t`` = ``launch_step``. ``δ̂``'s gradient is exactly zero up to the
  launch, so ``m`` and ``v`` are zero there and this is Adam started at update ``t + 1``. The state
  (``optax.ScaleByAdamState``) keeps the updates' count ``n``, so a resumed run goes on with it.
  """
  validate_dash_config(1, launch_step)
  adam = optax.scale_by_adam(b1, b2, eps)

  def update_fn(updates, state, params=None):
    since = jnp.maximum(state.count - launch_step, 0).astype(state.count.dtype)
    updates, new = adam.update(updates, state._replace(count=since), params)
    return updates, new._replace(count=optax.safe_increment(state.count))

  return optax.GradientTransformation(adam.init, update_fn)


def dash_labels(params) -> tp.Any:
  """``"dash"`` for every ``dash_scale`` leaf of a LoRA param tree, ``"lora"`` for the others."""

  def label(path, _):
    return "dash" if any(getattr(k, "key", None) == DASH_PARAM for k in path) else "lora"

  return jax.tree_util.tree_map_with_path(label, params)


def dash_optimizer(
    tx: optax.GradientTransformation,
    learning_rate: optax.ScalarOrSchedule,
    *,
    launch_step: int,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
  r"""``tx`` on the LoRA factors and AdamW counted from the launch on ``dash_scale``.

  ``dash_scale`` gets ``-η_n (u_n + λ δ̂)`` with ``u_n`` from :func:`scale_by_adam_since_launch`
  (``η_n`` the ``learning_rate`` schedule at update ``n``, as for the factors); every other leaf
  gets ``tx``'s update, as if ``dash_scale`` were not there (``optax.partition``).

  Args:
    tx: the LoRA factors' optimizer (``optax.adamw``, ``anlr_jax.anlr``, ...).
    learning_rate: ``η``, a float or the run's schedule.
    launch_step: ``t``, the number of updates before the launch (:func:`dash_launch_step`).
    b1, b2, eps, weight_decay: AdamW's constants for ``dash_scale`` (``λ`` = ``weight_decay``).
  """
  dash = optax.chain(
      scale_by_adam_since_launch(launch_step, b1, b2, eps),
      optax.add_decayed_weights(weight_decay),
      optax.scale_by_learning_rate(learning_rate),
  )
  return optax.partition({"lora": tx, "dash": dash}, dash_labels)

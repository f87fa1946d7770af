r"""AdaLoRA's rank allocator and orthogonal regulariser as pure, jittable JAX functions.

An AdaLoRA module (``anlr_jax.nn.AdaLoRALinear``) holds sibling leaves ``lora_a`` ``(..., d_in, r)``
(``Q^T``), ``lora_e`` ``(..., r)`` (``Λ``) and ``lora_b`` ``(..., r, d_out)`` (``P^T``); leading
``...`` axes are independent stacked modules. With ``θ`` any entry of ``A``, ``E`` or ``B``, ``g``
its gradient and the *updated* parameters, at step ``t`` (PEFT's ``RankAllocator``):

.. math::

   I_t = |θ_t \, g_t|, \quad
   \bar I_t = β_1 \bar I_{t-1} + (1 - β_1) I_t, \quad
   \bar U_t = β_2 \bar U_{t-1} + (1 - β_2) |I_t - \bar I_t|, \quad
   s(θ) = \bar I_t \, \bar U_t,

   S_k = s(Λ_k) + \big(\mathrm{mean}_i\, s(Q_{k,i}) + \mathrm{mean}_j\, s(P_{j,k})\big),

and the total budget (number of kept triplets over all modules, ``b_0 = Σ r``,
``b_T = target_r · #modules``) follows the cubic schedule

.. math::

   b(t) = b_0 \ (t \le t_i), \qquad b(t) = b_T \ (t > T - t_f), \qquad
   b(t) = \Big\lfloor (b_0 - b_T)\Big(1 - \frac{t - t_i}{T - t_f - t_i}\Big)^3 + b_T \Big\rfloor
   \ \text{otherwise}.

Every ``deltaT`` steps of the middle phase (``t_i < t < T - t_f``, ``t mod deltaT = 0``), the
triplets whose ``S_k`` is at most the ``(b_0 - b(t))``-th smallest score over *all* modules get
``Λ_k = 0`` (``A`` and ``B`` are kept; a pruned triplet can grow back before the next masking).
At ``t = T - t_f`` the scores are not updated, the mask to ``b_T`` is computed, stored and the EMAs
reset; for ``t > T - t_f`` that stored mask is applied at every step. Shapes never change.

Order of operations, as PEFT's ``optimizer.step(); model.base_model.update_and_allocate(t)``: the
optimizer update comes first, then the allocator uses the gradients of that step and the
*updated* parameters. :func:`update_and_allocate` takes those explicitly;
:func:`rank_allocator` wraps an optax transform and does both inside one ``update``.

The orthogonal regulariser added to the loss is PEFT's (``AdaLoraModel.forward``): the mean over
all ``2 · #modules`` factors of the (non-squared) Frobenius norms, times ``orth_reg_weight``:

.. math::

   R = w \, \frac{1}{2M} \sum_{m=1}^{M} \big(\|Q_m Q_m^T - I\|_F + \|P_m^T P_m - I\|_F\big).

References:
  Zhang et al., "Adaptive Budget Allocation for Parameter-Efficient Fine-Tuning" (AdaLoRA), 2023.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from anlr_jax.naming import module_name
from anlr_jax.optim.transform import variable_value

__all__ = [
    "AdaLoRAConfig",
    "AdaLoRAState",
    "RankAllocatorState",
    "budget_at",
    "budget_schedule",
    "mask_to_budget",
    "orth_regularization",
    "rank_allocator",
    "rank_allocator_init",
    "rank_pattern",
    "sensitivity",
    "triplet_scores",
    "update_and_allocate",
]

FACTOR_NAMES = ("lora_a", "lora_e", "lora_b")
"""Sibling leaf names of one AdaLoRA module: ``Q^T (..., d_in, r)``, ``Λ (..., r)``, ``P^T``."""


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class AdaLoRAConfig:
  r"""AdaLoRA's allocator settings, with PEFT's ``AdaLoraConfig`` names and defaults.

  Attributes:
    init_r: initial rank ``r`` of every module (the rank of the ``AdaLoRALinear`` layers).
    target_r: target average rank per module: final budget ``b_T = target_r · #modules``.
    tinit: steps of initial warm-up ``t_i`` (no pruning while ``t <= tinit``).
    tfinal: steps of final fine-tuning ``t_f`` (the final mask is kept for ``t > T - tfinal``).
    deltaT: interval between two maskings in the budget-decrease phase.
    total_step: ``T``, the total number of training steps (required).
    beta1: EMA coefficient of the sensitivity ``β_1``.
    beta2: EMA coefficient of the uncertainty ``β_2``.
    orth_reg_weight: weight ``w`` of :func:`orth_regularization`.

  Raises:
    ValueError: naming the offending key: ``target_r > init_r``, ``tinit + tfinal >= total_step``
      (no budget-decrease phase), a non-positive ``deltaT``/``total_step``/``init_r``, negative
      ``tinit``/``tfinal``/``target_r``, ``beta1``/``beta2`` outside ``(0, 1)``, or a negative
      ``orth_reg_weight``.
  """

  init_r: int = 12
  target_r: int = 8
  tinit: int = 0
  tfinal: int = 0
  deltaT: int = 1  # pylint: disable=invalid-name  (PEFT's name)
  total_step: int | None = None  # required, as in PEFT
  beta1: float = 0.85
  beta2: float = 0.85
  orth_reg_weight: float = 0.5

  def __post_init__(self):
    for key, low in (("init_r", 1), ("target_r", 0), ("tinit", 0), ("tfinal", 0)):
      value = getattr(self, key)
      if not _is_int(value) or value < low:
        raise ValueError(f"AdaLoRAConfig.{key} must be an int >= {low}, got {value!r}")
    for key in ("deltaT", "total_step"):
      value = getattr(self, key)
      if not _is_int(value) or value < 1:
        raise ValueError(f"AdaLoRAConfig.{key} must be a positive int, got {value!r}")
    if self.target_r > self.init_r:
      raise ValueError(
          f"AdaLoRAConfig.target_r={self.target_r} exceeds init_r={self.init_r}: the final budget "
          "cannot be larger than the initial rank"
      )
    if self.tinit + self.tfinal >= self.total_step:
      raise ValueError(
          f"AdaLoRAConfig.tinit + tfinal = {self.tinit} + {self.tfinal} must be < total_step="
          f"{self.total_step}: the schedule leaves no budget-decrease phase"
      )
    for key in ("beta1", "beta2"):
      value = getattr(self, key)
      if not (isinstance(value, (int, float)) and 0.0 < value < 1.0):
        raise ValueError(f"AdaLoRAConfig.{key} must be in the open interval (0, 1), got {value!r}")
    w = self.orth_reg_weight
    if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
      raise ValueError(f"AdaLoRAConfig.orth_reg_weight must be finite and >= 0, got {w!r}")


class RankAllocatorState(NamedTuple):
  """Allocator state: per-entry EMAs of sensitivity and uncertainty, and the last mask."""

  exp_avg_ipt: dict  # module name -> {"lora_a", "lora_e", "lora_b"}: EMA of |θ g| (param shape)
  exp_avg_unc: dict  # module name -> {...}: EMA of |I - Ī| (param shape)
  mask: dict  # module name -> bool (..., r): triplets kept at the last masking (all True before)


class AdaLoRAState(NamedTuple):
  """State of :func:`rank_allocator`: the inner optimizer's state and the allocator's."""

  count: jax.Array  # int32, number of updates applied so far (the step passed to the allocator)
  inner_state: optax.OptState
  allocator: RankAllocatorState
  budget: jax.Array  # int32, the budget b(t) of the last update


# ----------------------------------------------------------------------------- module discovery
@dataclasses.dataclass(frozen=True)
class _Triplet:
  name: str
  index: tuple[int, int, int]  # flat leaf indices of lora_a, lora_e, lora_b
  lead: tuple[int, ...]  # leading (stacked) axes
  rank: int

  @property
  def count(self) -> int:
    return math.prod(self.lead)


def _entry_name(entry) -> Any:
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return getattr(entry, attr)
  return str(entry)


def _find_triplets(tree) -> tuple[list[_Triplet], list, Any]:
  """``(triplets, flat leaves, treedef)``: sibling ``lora_a``/``lora_e``/``lora_b`` groups.

  A leaf belongs to a module when the last entry of its key path named one of ``FACTOR_NAMES``
  splits the path into a parent (the module, its ``'.'``-joined names are the module name) and a
  suffix (e.g. ``.value`` for ``nnx.Variable`` leaves), both shared by the three factors.
  """
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  groups: dict[tuple, dict[str, int]] = {}
  for index, (path, _) in enumerate(flat):
    names = [_entry_name(e) for e in path]
    for j in range(len(names) - 1, -1, -1):
      if names[j] in FACTOR_NAMES:
        key = (tuple(str(n) for n in names[:j]), tuple(str(n) for n in names[j + 1 :]))
        groups.setdefault(key, {})[names[j]] = index
        break
  leaves = [variable_value(leaf) for _, leaf in flat]
  triplets = []
  for (parent, _), found in sorted(groups.items()):
    name = module_name(parent) or "<root>"
    missing = [f for f in FACTOR_NAMES if f not in found]
    if missing:
      raise ValueError(f"AdaLoRA module {name!r}: found {sorted(found)} but not {missing}")
    a, e, b = (np.shape(leaves[found[f]]) for f in FACTOR_NAMES)
    lead, rank = e[:-1], e[-1] if e else None
    if len(a) < 2 or len(b) < 2 or not e or a[:-2] != lead or b[:-2] != lead:
      raise ValueError(
          f"AdaLoRA module {name!r}: expected lora_a (..., d_in, r), lora_e (..., r), "
          f"lora_b (..., r, d_out); got {a}, {e}, {b}"
      )
    if a[-1] != rank or b[-2] != rank:
      raise ValueError(
          f"AdaLoRA module {name!r}: ranks disagree: lora_a {a}, lora_e {e}, lora_b {b}"
      )
    triplets.append(_Triplet(name, tuple(found[f] for f in FACTOR_NAMES), tuple(lead), int(rank)))
  if len({t.name for t in triplets}) != len(triplets):
    raise ValueError(f"two AdaLoRA modules share a name: {[t.name for t in triplets]}")
  return triplets, leaves, treedef


def _checked_triplets(tree, config: AdaLoRAConfig, what: str):
  triplets, leaves, treedef = _find_triplets(tree)
  if not triplets:
    raise ValueError(f"{what} holds no AdaLoRA module (sibling leaves {FACTOR_NAMES})")
  wrong = {t.name: t.rank for t in triplets if t.rank != config.init_r}
  if wrong:
    raise ValueError(f"AdaLoRAConfig.init_r={config.init_r} but modules have ranks {wrong}")
  return triplets, leaves, treedef


def _budgets(triplets) -> tuple[int, int]:
  return sum(t.count * t.rank for t in triplets), sum(t.count for t in triplets)


# ----------------------------------------------------------------------------- pure maths
def sensitivity(param: jax.Array, grad: jax.Array) -> jax.Array:
  r"""PEFT's importance of every entry: ``I = |θ g|`` (``RankAllocator.update_ipt``'s ``ipt``)."""
  return jnp.abs(param * grad)


def _smooth(avg, unc, ipt, beta1: float, beta2: float):
  """The two EMAs of ``update_ipt``: sensitivity smoothing, then uncertainty (uses the new avg)."""
  avg = beta1 * avg + (1 - beta1) * ipt
  unc = beta2 * unc + (1 - beta2) * jnp.abs(ipt - avg)
  return avg, unc


def triplet_scores(exp_avg_ipt: dict, exp_avg_unc: dict) -> dict:
  r"""``S_k = s(Λ_k) + (mean_i s(Q_{k,i}) + mean_j s(P_{j,k}))`` with ``s = Ī Ū``, per module.

  Args:
    exp_avg_ipt, exp_avg_unc: the ``RankAllocatorState`` fields.

  Returns:
    module name -> ``(..., r)`` scores (PEFT's ``mask_to_budget`` ``triplet_ipt``).
  """
  out = {}
  for name, avg in exp_avg_ipt.items():
    unc = exp_avg_unc[name]
    s_a = jnp.mean(avg["lora_a"] * unc["lora_a"], axis=-2)
    s_b = jnp.mean(avg["lora_b"] * unc["lora_b"], axis=-1)
    out[name] = avg["lora_e"] * unc["lora_e"] + (s_a + s_b)
  return out


def mask_to_budget(scores: dict, budget) -> dict:
  r"""Keep masks for a global budget: ``keep_k = not (S_k <= τ)``, ``τ`` the ``(n - budget)``-th
  smallest of all ``n`` scores (``torch.kthvalue``); nothing is masked when ``budget >= n``.

  Ties at ``τ`` are all masked, as PEFT's ``masked_fill_(score <= threshold, 0)``.

  Args:
    scores: module name -> ``(..., r)`` scores, e.g. from :func:`triplet_scores`.
    budget: number of triplets to keep (int or int32 scalar, may be traced).

  Returns:
    module name -> bool ``(..., r)``.
  """
  flat = jnp.concatenate([jnp.ravel(s) for s in scores.values()])
  k = flat.shape[0] - jnp.asarray(budget, jnp.int32)
  ordered = jnp.sort(flat)
  threshold = jnp.where(k > 0, ordered[jnp.clip(k - 1, 0, flat.shape[0] - 1)], -jnp.inf)
  return {name: ~(s <= threshold) for name, s in scores.items()}


def budget_schedule(step: int, init_bgt: int, target_bgt: int, config: AdaLoRAConfig):
  r"""PEFT's ``RankAllocator.budget_schedule``: ``(b(t), mask_now)`` for a Python int ``step``.

  ``b(t)`` is the cubic schedule of the module docstring (``int()`` of a float64 value, as PEFT);
  ``mask_now`` is ``False`` in the warm-up, ``True`` in the final phase and ``t mod deltaT == 0``
  in between. :func:`update_and_allocate` reads a table of these values inside the trace.
  """
  tinit, tfinal, total = config.tinit, config.tfinal, config.total_step
  if step <= tinit:
    return init_bgt, False
  if step > total - tfinal:
    return target_bgt, True
  mul_coeff = 1 - (step - tinit) / (total - tfinal - tinit)
  return int((init_bgt - target_bgt) * (mul_coeff**3) + target_bgt), step % config.deltaT == 0


def budget_at(step, init_bgt: int, target_bgt: int, config: AdaLoRAConfig) -> jax.Array:
  """:func:`budget_schedule`'s budget ``b(step)`` for a traced ``step``: its exact Python values,
  tabulated for ``0 <= t <= T`` (steps outside are clipped into that range)."""
  table = np.array(
      [budget_schedule(s, init_bgt, target_bgt, config)[0] for s in range(config.total_step + 1)],
      np.int32,
  )
  return jnp.asarray(table)[jnp.clip(step, 0, config.total_step)]


# ----------------------------------------------------------------------------- the allocator
def rank_allocator_init(params, config: AdaLoRAConfig) -> RankAllocatorState:
  """Zero EMAs and all-true masks for the AdaLoRA modules of ``params`` (ranks ``init_r``)."""
  triplets, leaves, _ = _checked_triplets(params, config, "params")

  def zeros(t):
    return {f: jnp.zeros_like(leaves[i]) for f, i in zip(FACTOR_NAMES, t.index)}

  return RankAllocatorState(
      exp_avg_ipt={t.name: zeros(t) for t in triplets},
      exp_avg_unc={t.name: zeros(t) for t in triplets},
      mask={t.name: jnp.ones_like(leaves[t.index[1]], dtype=bool) for t in triplets},
  )


def _allocate(params, grads, state: RankAllocatorState, step, config: AdaLoRAConfig):
  """``(triplets, leaves, treedef, keep masks, new state, budget)``; see ``update_and_allocate``."""
  triplets, leaves, treedef = _checked_triplets(params, config, "params")
  grad_triplets, grad_leaves, _ = _find_triplets(grads)
  grad_index = {t.name: t.index for t in grad_triplets}
  if set(grad_index) != {t.name for t in triplets}:
    raise ValueError(
        f"grads hold AdaLoRA modules {sorted(grad_index)}, params {[t.name for t in triplets]}"
    )
  step = jnp.asarray(step, jnp.int32)
  final_start = config.total_step - config.tfinal
  updating = step < final_start  # PEFT: update_ipt only while t < T - tfinal

  avg, unc = {}, {}
  for t in triplets:
    avg[t.name], unc[t.name] = {}, {}
    for f, i, gi in zip(FACTOR_NAMES, t.index, grad_index[t.name]):
      old_avg, old_unc = state.exp_avg_ipt[t.name][f], state.exp_avg_unc[t.name][f]
      ipt = sensitivity(leaves[i], grad_leaves[gi]).astype(old_avg.dtype)
      new_avg, new_unc = _smooth(old_avg, old_unc, ipt, config.beta1, config.beta2)
      avg[t.name][f] = jnp.where(updating, new_avg, old_avg)
      unc[t.name][f] = jnp.where(updating, new_unc, old_unc)

  init_bgt, modules = _budgets(triplets)
  budget = budget_at(step, init_bgt, config.target_r * modules, config)
  fresh = mask_to_budget(triplet_scores(avg, unc), budget)
  mask_now = (updating & (step > config.tinit) & (step % config.deltaT == 0)) | (
      step == final_start
  )
  apply = mask_now | (step > final_start)
  mask, keep = {}, {}
  for t in triplets:
    mask[t.name] = jnp.where(mask_now, fresh[t.name], state.mask[t.name])
    keep[t.name] = mask[t.name] | ~apply
  reset = step == final_start  # PEFT's reset_ipt() after the final masking

  def maybe_reset(tree):
    return jax.tree.map(lambda x: jnp.where(reset, jnp.zeros_like(x), x), tree)

  new_state = RankAllocatorState(maybe_reset(avg), maybe_reset(unc), mask)
  return triplets, leaves, treedef, keep, new_state, budget


def update_and_allocate(params, grads, state: RankAllocatorState, step, config: AdaLoRAConfig):
  r"""One call of PEFT's ``model.base_model.update_and_allocate(step)``, as a pure function.

  Call it after the optimizer update, with the gradients of that step and the *updated*
  parameters (PEFT's ``loss.backward(); optimizer.step(); update_and_allocate(t)``). It updates
  the EMAs (while ``t < T - tfinal``), and zeroes ``lora_e`` entries per the module docstring.

  Args:
    params: pytree holding the AdaLoRA modules (e.g. ``nnx.state(model, nnx.LoRAParam)``), after
      the optimizer update; other leaves are passed through.
    grads: gradients with the same AdaLoRA modules (same module names).
    state: from :func:`rank_allocator_init` or the previous call.
    step: ``t`` (int or traced int32 scalar), PEFT's ``global_step``.
    config: the :class:`AdaLoRAConfig`.

  Returns:
    ``(params, state, budget)``: ``params`` with pruned ``lora_e`` entries set to 0, the new
    state, and ``b(t)`` (int32 scalar).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> cfg = AdaLoRAConfig(init_r=2, target_r=1, tinit=0, tfinal=1, total_step=3)
    >>> p = {"q": {"lora_a": jnp.ones((3, 2)), "lora_e": jnp.array([1.0, 2.0]),
    ...            "lora_b": jnp.ones((2, 4))}}
    >>> state = rank_allocator_init(p, cfg)
    >>> p, state, budget = jax.jit(update_and_allocate, static_argnums=4)(p, p, state, 1, cfg)
    >>> p["q"]["lora_e"], int(budget)
    (Array([0., 2.], dtype=float32), 1)
  """
  triplets, leaves, treedef, keep, new_state, budget = _allocate(params, grads, state, step, config)
  leaves = list(leaves)
  for t in triplets:
    e = leaves[t.index[1]]
    leaves[t.index[1]] = jnp.where(keep[t.name], e, jnp.zeros_like(e))
  return treedef.unflatten(leaves), new_state, budget


def rank_allocator(
    inner: optax.GradientTransformation, config: AdaLoRAConfig
) -> optax.GradientTransformationExtraArgs:
  r"""``inner`` followed by AdaLoRA's rank allocation, as one optax transformation.

  ``update(grads, state, params)`` runs ``inner``, forms the updated parameters
  ``θ' = θ + u``, calls :func:`update_and_allocate` on ``(θ', grads)`` with ``t = state.count``
  (0, 1, 2, ...: PEFT's example loop, ``update_and_allocate(global_step)`` with ``global_step``
  from 0), and returns ``u`` with the update of every pruned ``Λ_k`` replaced by ``-Λ_k``, so that
  ``optax.apply_updates`` gives exactly 0 there. Other entries keep ``inner``'s update. The
  inner optimizer state is not touched by the masking (as in PEFT).

  Works as the ``tx`` of ``nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)``; add
  :func:`orth_regularization` to the loss yourself. The sensitivities use the gradients this
  transform receives: ``optax.chain(optax.clip_by_global_norm(c), rank_allocator(adamw, cfg))``
  sees clipped gradients, like PEFT after ``clip_grad_norm_`` (which clips ``.grad`` in place).

  Args:
    inner: the optimizer (e.g. ``optax.adamw(lr)``).
    config: the :class:`AdaLoRAConfig` (its ``init_r`` must be the modules' rank).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`AdaLoRAState`.
  """
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return AdaLoRAState(
        count=jnp.zeros([], jnp.int32),
        inner_state=inner.init(params),
        allocator=rank_allocator_init(params, config),
        budget=jnp.zeros([], jnp.int32),
    )

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(optax.NO_PARAMS_MSG)
    inner_updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    new_params = optax.apply_updates(params, inner_updates)
    _, _, _, keep, allocator, budget = _allocate(
        new_params, updates, state.allocator, state.count, config
    )
    p_triplets, p_leaves, _ = _find_triplets(params)
    u_triplets, u_leaves, u_treedef = _find_triplets(inner_updates)
    p_index = {t.name: t.index[1] for t in p_triplets}
    u_leaves = list(u_leaves)
    for t in u_triplets:
      u, p = u_leaves[t.index[1]], p_leaves[p_index[t.name]]
      u_leaves[t.index[1]] = jnp.where(keep[t.name], u, (-p).astype(u.dtype))
    new_state = AdaLoRAState(
        count=optax.safe_increment(state.count),
        inner_state=inner_state,
        allocator=allocator,
        budget=budget,
    )
    return u_treedef.unflatten(u_leaves), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def rank_pattern(state) -> dict[str, list[bool]]:
  """Host copy of the last mask: module name -> list of kept flags (PEFT's ``rank_pattern``).

  Args:
    state: a :class:`RankAllocatorState`, or an :class:`AdaLoRAState` (its ``allocator``).

  Raises:
    ValueError: a module has leading (stacked) axes: unstack them first.
  """
  if isinstance(state, AdaLoRAState):
    state = state.allocator
  out = {}
  for name, mask in state.mask.items():
    mask = np.asarray(mask)
    if mask.ndim != 1:
      raise ValueError(f"rank_pattern: module {name!r} has a stacked mask of shape {mask.shape}")
    out[name] = [bool(v) for v in mask]
  return out


# ----------------------------------------------------------------------------- regulariser
def _fro_norm(x: jax.Array) -> jax.Array:
  """Frobenius norm over the last two axes, with gradient 0 (not NaN) at 0, as ``torch.norm``."""
  sq = jnp.sum(jnp.square(x), axis=(-2, -1))
  positive = sq > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, sq, 1.0)), 0.0)


def orth_regularization(lora_params, orth_reg_weight: float = 0.5) -> jax.Array:
  r"""PEFT's AdaLoRA orthogonal regulariser (module docstring): add it to the training loss.

  .. math::

     R = w \, \frac{1}{2M} \sum_{m} \big(\|A_m^T A_m - I_r\|_F + \|B_m B_m^T - I_r\|_F\big)

  with the Flax factors ``A = lora_a`` ``(d_in, r)`` and ``B = lora_b`` ``(r, d_out)`` (PEFT's
  ``lora_A A^T`` and ``lora_B^T lora_B``); ``M`` counts every stacked slice as a module.

  Args:
    lora_params: pytree with the AdaLoRA modules (other leaves are ignored).
    orth_reg_weight: ``w`` (``AdaLoRAConfig.orth_reg_weight``).

  Returns:
    A float32 scalar.
  """
  triplets, leaves, _ = _find_triplets(lora_params)
  if not triplets:
    raise ValueError(f"lora_params holds no AdaLoRA module (sibling leaves {FACTOR_NAMES})")
  hi = jax.lax.Precision.HIGHEST
  total, count = jnp.zeros([], jnp.float32), 0
  for t in triplets:
    a = leaves[t.index[0]].astype(jnp.float32)
    b = leaves[t.index[2]].astype(jnp.float32)
    eye = jnp.eye(t.rank, dtype=jnp.float32)
    cov_a = jnp.einsum("...ir,...is->...rs", a, a, precision=hi)
    cov_b = jnp.einsum("...ri,...si->...rs", b, b, precision=hi)
    total = total + jnp.sum(_fro_norm(cov_a - eye)) + jnp.sum(_fro_norm(cov_b - eye))
    count += 2 * t.count
  return orth_reg_weight * (total / count)

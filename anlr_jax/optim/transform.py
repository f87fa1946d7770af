r"""AnLR-LoRA as an optax transformation: AdamW with per-rank-one learning-rate multipliers.

For every LoRA module (a pair ``A``, ``B`` found from the pytree structure, see
:mod:`anlr_jax.optim.dims`) and update step ``t``:

.. math::
  \nu_k &= \|g_{A,k} B_k^\top + A_k g_{B,k}^\top\|_F,\qquad
  \bar\nu_k \leftarrow \rho\,\bar\nu_k + (1-\rho)\,\nu_k,\\
  \mathrm{snr}_k &= \Big(\textstyle\sum_{A_k, B_k} \big(\hat m / (\sqrt{\hat v} + \epsilon)\big)^2\Big)^{1/2},\\
  \log s_k &= \mathrm{clip}\big(\alpha \log(1/\tilde\nu_k) + \beta \log \widetilde{\mathrm{snr}}_k,
  -\log\kappa, \log\kappa\big),\quad s_k \leftarrow s_k / \mathrm{mean}_j s_j,

and the AdamW delta of component ``k`` (weight decay included) is multiplied by ``s_k``; for
``t <= warmup_steps``, ``s_k = 1``. Every other leaf gets the plain AdamW update. See
``docs/method.md`` for the rule this follows to the letter.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from anlr_jax.settings import Range
from anlr_jax.optim import rank_stats
from anlr_jax.optim.detect import require_lora_modules
from anlr_jax.optim.dims import LoraDimsSpec, LoraModule, find_lora_modules

__all__ = ["AnLRState", "SIGNALS", "DEFAULTS", "Signal", "scale_by_anlr", "anlr"]


class Signal(enum.StrEnum):
  """The per-rank signal of :func:`anlr` (see ``signal`` in :func:`scale_by_anlr`)."""

  ANLR = "anlr"
  VELOCITY = "velocity"
  SNR = "snr"
  UNIFORM = "uniform"
  RANDOM = "random"
  SENSITIVITY = "sensitivity"


SIGNALS = tuple(s.value for s in Signal)
"""The signal names :func:`anlr` accepts."""

DEFAULTS = dict(alpha=2.0, beta=1.0, kappa=3.0, rho=0.95, warmup_steps=100)
"""The AnLR hyperparameter defaults, in one place (:func:`anlr`, :func:`scale_by_anlr`, the run
config's ``anlr`` section).

``alpha = 2``, ``beta = 1``, ``kappa = 3`` are the paper's (App. B). The paper gives no ``rho`` and
no ``warmup_steps``; these are chosen here:

- ``rho = 0.95`` averages the velocity over ~20 steps: long enough to smooth the per-batch noise of
  a single-batch gradient estimate, short enough to follow the ordering of the rank-one components,
  which the paper finds is set within the first ~1k of ~30k steps (Sec. 3.2).
- ``warmup_steps = 100`` is 5 EMA horizons at ``rho = 0.95``: the velocity EMA has forgotten its
  zero start (``0.95^100 < 0.6%``) and Adam's second moment has seen ~100 batches before the
  multipliers move; it is ~0.3% of the paper's commonsense run (3 epochs of 170K at batch 16).
"""


class AnLRState(NamedTuple):
  """State of :func:`scale_by_anlr`: the inner state and per-module ``(..., r)`` statistics."""

  count: jax.Array  # int32, number of updates applied so far
  inner_state: optax.OptState
  nu_bar: dict  # module name -> EMA velocity (..., r), float32
  snr: dict  # module name -> Adam SNR of the last update (..., r), float32
  multipliers: dict  # module name -> s_k applied at the last update (..., r), float32
  sensitivity: dict  # module name -> EMA sensitivity (only for signal="sensitivity", else empty)


def _is_tracer(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def check_hyperparameter(name: str, value, ok: Callable[[float], bool], requirement: str):
  """ValueError ``'<name> must be <requirement>, got <value>'`` unless ``ok(value)``; None, a
  schedule (callable) or a traced value (e.g. under ``optax.inject_hyperparams``) passes."""
  if value is None or callable(value) or _is_tracer(value):
    return
  v = float(np.asarray(value))
  if not ok(v):
    raise ValueError(f"{name} must be {requirement}, got {value!r}")


RULES = {
    "alpha": Range(),
    "beta": Range(),
    "kappa": Range(1, lo_open=True),
    "rho": Range(0, 1, hi_open=True),
    "warmup_steps": Range(0),
}
"""The allowed values of AnLR's constants (the run config's ``anlr:`` section uses the same rules)."""


def _make_rule(*, alpha, beta, kappa, rho, warmup_steps, signal, seed) -> "_Rule":
  """Checks AnLR's constants (``ValueError`` naming a bad one) and returns the per-rank rule, the
  signal's overrides applied (``velocity``: beta = 0, ``snr``: alpha = 0)."""
  if signal not in SIGNALS:
    raise ValueError(f"signal must be one of {SIGNALS}, got {signal!r}")
  values = dict(alpha=alpha, beta=beta, kappa=kappa, rho=rho, warmup_steps=warmup_steps)
  for name, rule in RULES.items():
    check_hyperparameter(name, values[name], rule.allows, str(rule))
  check_hyperparameter("warmup_steps", warmup_steps, lambda v: v == int(v), "an integer")
  signal = Signal(signal)
  if signal is Signal.VELOCITY:
    beta = 0.0
  elif signal is Signal.SNR:
    alpha = 0.0
  return _Rule(alpha, beta, kappa, rho, warmup_steps, signal, seed)


def variable_value(x):
  """The array of a params-tree leaf: an ``nnx.Variable``'s value, or the leaf itself."""
  return x.get_value() if hasattr(x, "get_value") else x


def _reduced_sharding(x, axes: tuple[int, ...]):
  """The sharding of ``x`` with ``axes`` removed, for a concrete ``x`` whose sharding allows it
  (one device, or a ``NamedSharding`` over this process's devices); None otherwise (traced values,
  other shardings, arrays spanning several processes)."""
  if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
    return None
  sharding = x.sharding
  if not sharding.is_fully_addressable:
    return None
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    return sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    kept = [entry for i, entry in enumerate(spec) if i not in axes]
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*kept))
  return None


def _per_rank_filled(leaf, feature_axis, value: float):
  """A per-rank array (``leaf``'s shape without its feature axis or axes) filled with ``value``,
  placed like ``leaf``: from the host for a concrete ``leaf`` (no XLA program compiled or run for
  it, as eager ``jnp`` ops would), else reduced from ``leaf`` inside the trace (XLA folds it)."""
  x = variable_value(leaf)
  dtype = rank_stats.stat_dtype(x)
  axes = tuple(sorted(int(a) % x.ndim for a in np.atleast_1d(feature_axis)))
  sharding = _reduced_sharding(x, axes)
  if sharding is None:
    return jnp.sum(jnp.zeros_like(x, dtype=dtype), axis=axes) + jnp.asarray(value, dtype)
  shape = tuple(n for i, n in enumerate(x.shape) if i not in axes)
  # an uncommitted parameter (default device) gives uncommitted state, as jnp ops would: a jitted
  # update then sees the same argument placement on every call and compiles once
  return jax.device_put(np.full(shape, value, dtype), sharding if x.committed else None)


class _AdamRerun(NamedTuple):
  """``scale_by_adam`` run again on a group's stacked leaves (fused AdamW path, batched groups)."""

  # leaf index -> that leaf's Adam moments (mu, nu) before this update
  prev_moments: Callable[[int], tuple[jax.Array, jax.Array]]
  # (g, mu, nu), stacked -> the Adam direction scale_by_adam gives for them
  direction: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


class _InnerStep(NamedTuple):
  """One inner-optimizer update, and how to get its Adam direction m_hat / (sqrt(v_hat) + eps).

  The direction comes one of three ways (:func:`_group_directions` picks):
    - generic wrapper (:func:`scale_by_anlr`): ``direction``, recomputed from the new moments;
    - fused AdamW (:func:`anlr`), per module: ``direction``, read from ``scale_by_adam``'s output;
    - fused AdamW, batched group: ``adam_rerun``, fused into the statistics' kernels.
  """

  updates: Any  # the inner optimizer's delta (learning rate and weight decay included)
  state: optax.OptState  # the inner optimizer's new state
  direction: Callable[[int], jax.Array]  # flat leaf index -> that leaf's Adam direction
  adam_rerun: Optional[_AdamRerun]  # None for the generic wrapper


class _Rule(NamedTuple):
  """The hyperparameters of the per-rank rule (``alpha``, ``beta`` after the signal's overrides)."""

  alpha: float
  beta: float
  kappa: float
  rho: float
  warmup_steps: int
  signal: Signal
  seed: int  # of the "random" control


class _ModuleSearch(NamedTuple):
  """How the transform finds its LoRA modules and groups their per-rank statistics."""

  lora_dims: LoraDimsSpec  # see anlr_jax.find_lora_modules
  batch_modules: bool | None  # one batched pass per group of same-shaped modules
  require_lora: bool  # init raises when it finds no LoRA module
  who: str  # the public function's name, for errors


class _RankStats(NamedTuple):
  """Per-rank statistics of one module, or of a group of modules stacked on a leading axis."""

  nu_bar: jax.Array  # EMA velocity
  snr: jax.Array  # Adam SNR of this update
  multipliers: jax.Array  # s_k applied to this update
  sensitivity: Optional[jax.Array]  # EMA sensitivity for signal="sensitivity", else None


def _stack(xs, batched: bool):
  """A group's per-module arrays stacked on a new leading axis; a per-module group's one array."""
  return jnp.stack(xs) if batched else xs[0]


def _group_directions(step: _InnerStep, grads, mods, batched: bool):
  """``(ga, gb, dir_a, dir_b)``: the group's stacked gradients of its ``A`` and ``B`` factors,
  passed through an optimization barrier, and the Adam directions of those factors."""
  ga, gb = [grads[m.a_index] for m in mods], [grads[m.b_index] for m in mods]
  if batched and step.adam_rerun is not None:
    return _rerun_directions(step.adam_rerun, ga, gb, mods)
  # The barrier stops XLA merging the statistics' g*g with Adam's, so each reduction fuses its own.
  ga, gb = jax.lax.optimization_barrier((ga, gb))
  dir_a = _stack([step.direction(m.a_index) for m in mods], batched)
  dir_b = _stack([step.direction(m.b_index) for m in mods], batched)
  return _stack(ga, batched), _stack(gb, batched), dir_a, dir_b


def _rerun_directions(rerun: _AdamRerun, ga, gb, mods):
  """:func:`_group_directions` of a batched group, by ``scale_by_adam`` on its stacked inputs."""
  mas, vas = zip(*[rerun.prev_moments(m.a_index) for m in mods])
  mbs, vbs = zip(*[rerun.prev_moments(m.b_index) for m in mods])
  # The barrier keeps XLA from merging the rerun (its g*g included) with the real Adam update, so
  # the rerun fuses into the statistics' kernels instead of Adam's output being kept for them.
  ga, gb, mas, vas, mbs, vbs = jax.lax.optimization_barrier(
      (ga, gb, list(mas), list(vas), list(mbs), list(vbs))
  )
  ga, gb = jnp.stack(ga), jnp.stack(gb)
  dir_a = rerun.direction(ga, jnp.stack(mas), jnp.stack(vas))
  dir_b = rerun.direction(gb, jnp.stack(mbs), jnp.stack(vbs))
  return ga, gb, dir_a, dir_b


def _group_stats(
    a,
    b,
    ga,
    gb,
    dir_a,
    dir_b,
    *,
    nu_bar,
    sensitivity,
    count,
    module_indices,
    a_axis: int,
    b_axis: int,
    rule: _Rule,
    batched: bool,
) -> _RankStats:
  """The per-rank statistics and multipliers of one group of modules.

  From the factors ``a``, ``b``, their gradients ``ga``, ``gb`` and Adam directions ``dir_a``,
  ``dir_b`` (stacked on a leading module axis when ``batched``), the previous EMAs ``nu_bar`` and
  ``sensitivity`` (None unless ``signal="sensitivity"``), the update number ``count`` and the
  modules' indices, which seed the ``"random"`` control's draws with ``rule.seed`` and ``count``.
  """
  axes = dict(a_axis=a_axis, b_axis=b_axis)
  velocity = rank_stats.rank_velocity(a, b, ga, gb, **axes)
  nu_bar = rule.rho * nu_bar + (1.0 - rule.rho) * velocity
  snr = rank_stats.rank_snr(dir_a, dir_b, **axes)
  if rule.signal is Signal.UNIFORM:
    s = jnp.ones_like(velocity)
  elif rule.signal is Signal.RANDOM:
    shape = velocity.shape[1:] if batched else velocity.shape
    draws = [
        rank_stats.random_multipliers(
            jax.random.fold_in(jax.random.fold_in(jax.random.key(rule.seed), count), index),
            shape,
            kappa=rule.kappa,
            dtype=velocity.dtype,
        )
        for index in module_indices
    ]
    s = _stack(draws, batched)
  elif rule.signal is Signal.SENSITIVITY:
    score = rank_stats.rank_sensitivity(a, b, ga, gb, **axes)
    sensitivity = rule.rho * sensitivity + (1.0 - rule.rho) * score
    s = rank_stats.score_multipliers(sensitivity, kappa=rule.kappa)
  else:
    s = rank_stats.module_multipliers(
        nu_bar, snr, alpha=rule.alpha, beta=rule.beta, kappa=rule.kappa
    )
  s = jnp.where(count <= rule.warmup_steps, jnp.ones_like(s), s)
  return _RankStats(nu_bar=nu_bar, snr=snr, multipliers=s, sensitivity=sensitivity)


def scale_by_anlr(
    inner: optax.GradientTransformation,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    alpha: float = DEFAULTS["alpha"],
    beta: float = DEFAULTS["beta"],
    kappa: float = DEFAULTS["kappa"],
    rho: float = DEFAULTS["rho"],
    warmup_steps: int = DEFAULTS["warmup_steps"],
    signal: str = "anlr",
    lora_dims: LoraDimsSpec = None,
    seed: int = 0,
    batch_modules: bool | None = None,
    require_lora: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""Wraps an Adam-family transformation with AnLR per-rank-one multipliers.

  ``inner`` computes the full update (e.g. ``optax.adamw(...)``, ``optax.inject_hyperparams(
  optax.adamw)(...)``); its state must hold Adam moments named ``mu`` and ``nu`` (found with
  ``optax.tree_utils.tree_get``). The SNR uses the bias-corrected moments
  :math:`\hat m = \mu/(1-b_1^t)`, :math:`\hat v = \nu/(1-b_2^t)` of the same step, so ``b1``, ``b2``,
  ``eps`` and ``eps_root`` must equal the inner optimizer's. The inner update of each LoRA
  component is multiplied by its :math:`s_k` (post-step delta scaling, paper Prop. 2).

  Args:
    inner: the Adam-family transformation producing the update (learning rate included).
    b1, b2, eps, eps_root: the inner optimizer's Adam constants.
    alpha: weight of the velocity term :math:`\alpha`.
    beta: weight of the SNR term :math:`\beta`.
    kappa: clamp bound :math:`\kappa > 1` on :math:`s_k` before normalisation.
    rho: velocity EMA coefficient :math:`\rho \in [0, 1)`.
    warmup_steps: updates with :math:`s = 1`; update ``warmup_steps + 1`` is the first anisotropic.
    signal: ``"anlr"`` (velocity + SNR), ``"velocity"`` (:math:`\beta = 0`), ``"snr"``
      (:math:`\alpha = 0`), ``"uniform"`` (:math:`s = 1`, plain LoRA), ``"random"`` (log-uniform in
      :math:`[-\log\kappa, \log\kappa]`, redrawn every step from ``seed`` and the step, mean-normalised)
      or ``"sensitivity"`` (EMA of :math:`\sum |g \odot \theta|` per component in place of the fused
      score). Velocity and SNR are tracked for diagnostics whatever the signal.
    lora_dims: how to find LoRA factors (see :func:`anlr_jax.find_lora_modules`; the default finds
      Flax, Qwix and PEFT names). Check what it finds with :func:`anlr_jax.describe`.
    seed: seed of the ``"random"`` control.
    batch_modules: compute the per-rank statistics of modules whose factors share shape, dtype and
      layout in one batched pass (stacked along a new axis) instead of one pass per module. Same
      values; on GPUs one kernel per group instead of per module (a 32-layer model has 160 modules
      but 3 groups). False: per module. None (default): batched except on the CPU backend, where
      XLA materialises the stacked copies and per-module passes are faster.
    require_lora: ``init`` raises a ``ValueError`` when it finds no LoRA module (every leaf would
      train as plain AdamW), naming the leaves that look like LoRA factors; False accepts a tree
      without LoRA modules.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; extra args are passed to ``inner``.
  """
  rule = _make_rule(
      alpha=alpha,
      beta=beta,
      kappa=kappa,
      rho=rho,
      warmup_steps=warmup_steps,
      signal=signal,
      seed=seed,
  )
  search = _ModuleSearch(lora_dims, batch_modules, require_lora, who="scale_by_anlr")

  def inner_update(updates, inner_state, params, count, **extra_args):
    new_updates, new_state = inner.update(updates, inner_state, params, **extra_args)
    # Keep the inner state's dtypes fixed step to step (float32 injected hyperparameters would
    # otherwise promote bf16 moments, changing the state type and forcing a recompile).
    new_state = optax.tree.cast_like(new_state, inner_state)
    mu = optax.tree_utils.tree_get(new_state, "mu")
    nu = optax.tree_utils.tree_get(new_state, "nu")
    if mu is None or nu is None:
      raise ValueError(
          "scale_by_anlr: the inner optimizer's state has no Adam moments 'mu' and 'nu'; "
          "wrap an Adam-family transformation such as optax.adamw"
      )
    m, v = jax.tree.leaves(mu), jax.tree.leaves(nu)
    if len(m) != len(jax.tree.leaves(updates)):
      raise ValueError(
          f"scale_by_anlr: the inner state's 'mu' has {len(m)} leaves, the updates have "
          f"{len(jax.tree.leaves(updates))}; the inner optimizer must keep one moment per parameter"
      )

    def direction(i):  # from the bias-corrected moments of this step
      dt = rank_stats.stat_dtype(m[i], v[i])
      t = count.astype(dt)
      m_hat = m[i].astype(dt) / (1.0 - jnp.asarray(b1, dt) ** t)
      v_hat = v[i].astype(dt) / (1.0 - jnp.asarray(b2, dt) ** t)
      return m_hat / (jnp.sqrt(v_hat + eps_root) + eps)

    return _InnerStep(new_updates, new_state, direction, adam_rerun=None)

  return _anlr_transform(inner.init, inner_update, rule, search)


def _anlr_transform(inner_init, inner_update, rule: _Rule, search: _ModuleSearch):
  """The AnLR machinery around ``inner_update(updates, inner_state, params, count, **extra_args)
  -> _InnerStep``, with the per-rank ``rule`` over the LoRA modules ``search`` finds."""
  lora_dims, batch_modules, require_lora, who = search
  signal = rule.signal

  def init_fn(params):
    modules = require_lora_modules(params, lora_dims, who, require_lora=require_lora)
    check_unique_names(modules)
    leaves = jax.tree.leaves(params)

    def per_rank(value):
      return {m.name: _per_rank_filled(leaves[m.a_index], m.a_feature_axis, value) for m in modules}

    # every state leaf gets its own buffer: a train step that donates its state must never see
    # one buffer twice
    return AnLRState(
        count=jnp.zeros([], jnp.int32),
        inner_state=inner_init(params),
        nu_bar=per_rank(0.0),
        snr=per_rank(0.0),
        multipliers=per_rank(1.0),
        sensitivity=per_rank(0.0) if signal is Signal.SENSITIVITY else {},
    )

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(optax.NO_PARAMS_MSG)
    count = optax.safe_increment(state.count)
    step = inner_update(updates, state.inner_state, params, count, **extra_args)
    modules = find_lora_modules(updates, lora_dims)
    grads, treedef = jax.tree.flatten(updates)
    flat_params = treedef.flatten_up_to(params)
    out = treedef.flatten_up_to(step.updates)
    batched = jax.default_backend() != "cpu" if batch_modules is None else bool(batch_modules)
    stats = {}  # module name -> _RankStats
    for group in _group_modules(modules, flat_params, batched):
      mods = [mod for _, mod in group]
      stack = lambda xs: _stack(xs, batched)  # noqa: E731
      ga, gb, dir_a, dir_b = _group_directions(step, grads, mods, batched)
      group_stats = _group_stats(
          stack([flat_params[m.a_index] for m in mods]),
          stack([flat_params[m.b_index] for m in mods]),
          ga,
          gb,
          dir_a,
          dir_b,
          nu_bar=stack([state.nu_bar[m.name] for m in mods]),
          sensitivity=(
              stack([state.sensitivity[m.name] for m in mods])
              if signal is Signal.SENSITIVITY
              else None
          ),
          count=count,
          module_indices=[index for index, _ in group],
          a_axis=mods[0].a_feature_axis,
          b_axis=mods[0].b_feature_axis,
          rule=rule,
          batched=batched,
      )
      for j, mod in enumerate(mods):
        mod_stats = jax.tree.map(lambda x: x[j], group_stats) if batched else group_stats
        stats[mod.name] = mod_stats
        out[mod.a_index] = _scale_along(out[mod.a_index], mod_stats.multipliers, mod.a_feature_axis)
        out[mod.b_index] = _scale_along(out[mod.b_index], mod_stats.multipliers, mod.b_feature_axis)

    new_state = AnLRState(
        count=count,
        inner_state=step.state,
        nu_bar={name: st.nu_bar for name, st in stats.items()},
        snr={name: st.snr for name, st in stats.items()},
        multipliers={name: st.multipliers for name, st in stats.items()},
        sensitivity={
            name: st.sensitivity for name, st in stats.items() if st.sensitivity is not None
        },
    )
    return treedef.unflatten(out), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _group_modules(modules, flat_params, batched: bool):
  """Lists of ``(module index, module)``: one per module, or by factor shapes/dtypes/layout.

  A group's statistics are computed in one pass over its modules stacked on a leading axis (q/k/v
  of every layer, ...): the same arithmetic per module, one set of kernels per group.
  """
  if not batched:
    return [[(i, m)] for i, m in enumerate(modules)]
  groups = {}
  for i, m in enumerate(modules):
    a, b = variable_value(flat_params[m.a_index]), variable_value(flat_params[m.b_index])
    key = (a.shape, b.shape, a.dtype, b.dtype, m.a_feature_axis, m.b_feature_axis)
    groups.setdefault(key, []).append((i, m))
  return list(groups.values())


def _scale_along(update, s, feature_axis):
  """``update * s`` with ``s (..., r)`` broadcast along the factor's feature axis (or axes)."""
  dt = rank_stats.stat_dtype(update, s)
  scaled = update.astype(dt) * jnp.expand_dims(s, feature_axis).astype(dt)
  return scaled.astype(update.dtype)


def check_unique_names(modules: list[LoraModule]):
  """ValueError naming the first module name that two LoRA modules share."""
  seen = set()
  for m in modules:
    if m.name in seen:
      raise ValueError(
          f"two LoRA modules share the name {m.name!r}; declare lora_dims to separate them"
      )
    seen.add(m.name)


def anlr(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask: Optional[Any] = None,
    *,
    alpha: float = DEFAULTS["alpha"],
    beta: float = DEFAULTS["beta"],
    kappa: float = DEFAULTS["kappa"],
    rho: float = DEFAULTS["rho"],
    warmup_steps: int = DEFAULTS["warmup_steps"],
    signal: str = "anlr",
    lora_dims: LoraDimsSpec = None,
    seed: int = 0,
    batch_modules: bool | None = None,
    require_lora: bool = True,
) -> optax.GradientTransformationExtraArgs:
  r"""AdamW with AnLR-LoRA per-rank-one learning rates.

  Same arguments and meaning as ``optax.adamw`` (``learning_rate`` may be a schedule, indexed as
  ``optax.adamw`` indexes it; ``mask`` masks the weight decay), plus the AnLR knobs documented in
  :func:`scale_by_anlr`. Non-LoRA leaves are updated exactly as ``optax.adamw`` would.

  Args:
    learning_rate: global learning rate :math:`\eta_t` or schedule.
    b1, b2, eps: Adam constants.
    weight_decay: decoupled weight decay :math:`\lambda` (scaled by :math:`s_k` with the rest of the
      delta on LoRA components).
    mask: weight-decay mask, as in ``optax.adamw``.
    alpha, beta, kappa, rho, warmup_steps, signal, lora_dims, seed, batch_modules, require_lora:
      see :func:`scale_by_anlr`.
      Defaults: ``alpha=2``, ``beta=1``, ``kappa=3`` (paper); ``rho=0.95`` and
      ``warmup_steps=100`` (chosen here, see ``DEFAULTS``).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Example:
    >>> import jax.numpy as jnp, optax, anlr_jax
    >>> params = {"q": {"lora_a": jnp.ones((8, 4)) * 0.1, "lora_b": jnp.ones((4, 6)) * 0.1}}
    >>> tx = optax.chain(optax.clip_by_global_norm(1.0), anlr_jax.anlr(1e-3, warmup_steps=0))
    >>> state = tx.init(params)
    >>> updates, state = tx.update(params, state, params)
    >>> updates["q"]["lora_a"].shape
    (8, 4)

  References:
    Wang et al., *Adaptive Anisotropic Learning Rates for LoRA Fine-Tuning* (AnLR-LoRA), 2026.
  """
  rule = _make_rule(
      alpha=alpha,
      beta=beta,
      kappa=kappa,
      rho=rho,
      warmup_steps=warmup_steps,
      signal=signal,
      seed=seed,
  )
  search = _ModuleSearch(lora_dims, batch_modules, require_lora, who="anlr")
  # optax.adamw is chain(scale_by_adam, add_decayed_weights, scale_by_learning_rate). Running the
  # three pieces here exposes scale_by_adam's output, the Adam direction m_hat / (sqrt(v_hat) + eps),
  # to the SNR, so it is computed once; the state has exactly optax.adamw's structure.
  adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
  decay = optax.add_decayed_weights(weight_decay, mask)
  lr = optax.scale_by_learning_rate(learning_rate)

  def inner_init(params):
    return (adam.init(params), decay.init(params), lr.init(params))

  def inner_update(updates, inner_state, params, count, **extra_args):
    del count, extra_args
    direction, adam_state = adam.update(updates, inner_state[0], params)
    decayed, decay_state = decay.update(direction, inner_state[1], params)
    delta, lr_state = lr.update(decayed, inner_state[2], params)
    new_state = optax.tree.cast_like((adam_state, decay_state, lr_state), inner_state)
    flat_direction = jax.tree.leaves(direction)
    old_mu, old_nu = jax.tree.leaves(inner_state[0].mu), jax.tree.leaves(inner_state[0].nu)

    def rerun(g, mu, nu):  # scale_by_adam itself, on (stacked) arrays of the previous state
      prev = optax.ScaleByAdamState(count=inner_state[0].count, mu=mu, nu=nu)
      return adam.update(g, prev)[0]

    return _InnerStep(
        delta,
        new_state,
        direction=lambda i: flat_direction[i],
        adam_rerun=_AdamRerun(prev_moments=lambda i: (old_mu[i], old_nu[i]), direction=rerun),
    )

  return _anlr_transform(inner_init, inner_update, rule, search)

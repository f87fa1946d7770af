r"""The method table: what ``method: <name>`` means, in one place.

A fine-tuning method is a pair (how the LoRA layers are built, how their params are updated):

.. math::

   y = x W_0 + c\,x A B \quad (c = \alpha_{lora}/r \text{ or } \alpha_{lora}/\sqrt r),
   \qquad \theta_{t+1} = \theta_t + \mathrm{tx}\big(\mathrm{clip}_c(\nabla_\theta L)\big),

with the layer (``layer``) one of :class:`anlr_jax.nn.LoRALinear` (``init``, ``use_rslora``,
``use_dora`` passed to :func:`anlr_jax.nn.inject_lora`), :class:`anlr_jax.nn.AdaLoRALinear`
(AdaLoRA's SVD form ``x A diag(E) B``, :func:`anlr_jax.nn.inject_adalora`) or
:class:`anlr_jax.nn.LoRADashLinear` (LoRA plus the amplified task-specific directions of ``W_0``
after ``loradash.launch_step`` updates, :func:`anlr_jax.nn.inject_loradash`), and ``tx`` one of
``optax.adamw`` (LoRA and its layer variants), :func:`anlr_jax.loraplus`
(``\eta_B = \lambda \eta_A``), :func:`anlr_jax.anlr` with a ``signal`` (AnLR-LoRA and the paper's
ablations, Tab. 6/9), AdaLoRA's :func:`anlr_jax.optim.adalora.rank_allocator` over AdamW (the
orthogonal regulariser is added to the loss by the trainer) or :func:`anlr_jax.optim.lorapro.lorapro`
(``scale = c``). Every ``tx`` runs on the trainer's schedule ``\eta_t`` after
``clip_by_global_norm`` (when ``clip_norm`` is set).

==================  ========  =========  ======  ====  ====================================
method              layer     init       rsLoRA  DoRA  optimizer
==================  ========  =========  ======  ====  ====================================
lora                lora      default    no      no    adamw
rslora              lora      default    yes     no    adamw
loraplus            lora      default    no      no    loraplus (lr_ratio)
anlr                lora      default    no      no    anlr (signal="anlr")
pissa / milora      lora      pissa/...  no      no    adamw
dora                lora      default    no      yes   adamw
anlr+pissa/milora   lora      pissa/...  no      no    anlr
anlr+dora           lora      default    no      yes   anlr
anlr-velocity       lora      default    no      no    anlr (signal="velocity", beta = 0)
anlr-snr            lora      default    no      no    anlr (signal="snr", alpha = 0)
random              lora      default    no      no    anlr (signal="random")
sensitivity         lora      default    no      no    anlr (signal="sensitivity")
adalora             adalora   (PEFT's)   no      no    adalora (rank_allocator over adamw)
lorapro             lora      default    no      no    lorapro (scale = alpha / r)
loradash            loradash  default    no      no    adamw; dash_scale: AdamW from t
anlr+loradash       loradash  default    no      no    anlr; dash_scale: AdamW from t
==================  ========  =========  ======  ====  ====================================

The ``loradash`` layer's ``dash_scale`` gets AdamW whose moments and step count start at the
launch ``t`` (:func:`anlr_jax.nn.dash_optimizer`), the LoRA factors the optimizer of the table.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import TYPE_CHECKING, Any, Callable, Mapping

import optax
from flax import nnx

from anlr_jax.fields import ConfigError
from anlr_jax.nn import (
    dash_launched,
    dash_optimizer,
    inject_adalora,
    inject_lora,
    inject_loradash,
    launch_dash,
    lora_scale,
)
from anlr_jax.models.llava import PROJECTOR_PATH
from anlr_jax.nn.trainable import train_in_full, with_full_params
from anlr_jax.optim import Signal, anlr, loraplus
from anlr_jax.optim.adalora import AdaLoRAConfig, orth_regularization, rank_allocator
from anlr_jax.optim.lorapro import lorapro
from anlr_jax.optim.transform import DEFAULTS as ANLR_DEFAULTS

from anlr_jax.train.distributed import put_global

if TYPE_CHECKING:
  from anlr_jax.app.config import RunConfig


class Optimizer(enum.StrEnum):
  """Optimizer families a method can use (the value is the name in the method table)."""

  ADAMW = "adamw"
  LORAPLUS = "loraplus"
  ANLR = "anlr"
  ADALORA = "adalora"
  LORAPRO = "lorapro"


class Layer(enum.StrEnum):
  """Adapter layers a method can use: ``LoRALinear``, ``AdaLoRALinear``, ``LoRADashLinear``."""

  LORA = "lora"
  ADALORA = "adalora"
  LORADASH = "loradash"


OPTIMIZERS = tuple(o.value for o in Optimizer)
"""Optimizer families a method can use, by name."""

LAYERS = tuple(layer.value for layer in Layer)
"""Adapter layers a method can use, by name."""


@dataclasses.dataclass(frozen=True)
class Method:
  """One row of the method table: LoRA layer settings and the optimizer that trains them.

  ``layer``, ``optimizer`` and ``signal`` may be given by name; a name that is none of
  :class:`Layer`, :class:`Optimizer`, :class:`anlr_jax.optim.Signal` raises ``ValueError``.
  """

  name: str
  description: str
  layer: Layer = Layer.LORA
  init: str = "default"  # LoRALinear init: 'default', 'pissa' or 'milora'
  use_rslora: bool = False  # scale c = alpha / sqrt(r) instead of alpha / r
  use_dora: bool = False  # DoRA magnitude/direction decomposition
  optimizer: Optimizer = Optimizer.ADAMW
  signal: Signal | None = None  # anlr_jax.anlr(signal=...) for Optimizer.ANLR

  def __post_init__(self):
    object.__setattr__(self, "layer", Layer(self.layer))
    object.__setattr__(self, "optimizer", Optimizer(self.optimizer))
    if self.signal is not None:
      object.__setattr__(self, "signal", Signal(self.signal))

  def lora_kwargs(self) -> dict[str, Any]:
    """Keyword arguments for :func:`anlr_jax.nn.inject_lora` that this method fixes."""
    return dict(init=self.init, use_rslora=self.use_rslora, use_dora=self.use_dora)

  @property
  def uses_anlr(self) -> bool:
    return self.optimizer is Optimizer.ANLR

  @property
  def uses_adalora(self) -> bool:
    return self.layer is Layer.ADALORA

  @property
  def uses_loradash(self) -> bool:
    return self.layer is Layer.LORADASH

  @property
  def sections(self) -> tuple[str, ...]:
    """The method-specific run-config sections this method reads (``anlr``, ``loraplus``,
    ``adalora``, ``lorapro``, ``loradash``): part of its run's identity."""
    used = {
        "anlr": self.uses_anlr,
        "loraplus": self.optimizer is Optimizer.LORAPLUS,
        "adalora": self.uses_adalora,
        "lorapro": self.optimizer is Optimizer.LORAPRO,
        "loradash": self.uses_loradash,
    }
    return tuple(name for name, uses in used.items() if uses)


def _table(*methods: Method) -> dict[str, Method]:
  return {m.name: m for m in methods}


METHODS: dict[str, Method] = _table(
    Method("lora", "LoRA (Hu et al., 2021) with AdamW"),
    Method("rslora", "rank-stabilised LoRA: c = alpha / sqrt(r)", use_rslora=True),
    Method(
        "loraplus",
        "LoRA+: B factors get lr_ratio times the learning rate",
        optimizer=Optimizer.LORAPLUS,
    ),
    Method(
        "anlr",
        "AnLR-LoRA: per-rank-one learning rates (velocity + Adam SNR)",
        optimizer=Optimizer.ANLR,
        signal=Signal.ANLR,
    ),
    Method("pissa", "PiSSA: adapters initialised from the top-r singular triplets", init="pissa"),
    Method(
        "milora", "MiLoRA: adapters initialised from the bottom-r singular triplets", init="milora"
    ),
    Method("dora", "DoRA: weight-decomposed LoRA", use_dora=True),
    Method(
        "anlr+pissa",
        "AnLR-LoRA on PiSSA-initialised adapters",
        init="pissa",
        optimizer=Optimizer.ANLR,
        signal=Signal.ANLR,
    ),
    Method(
        "anlr+milora",
        "AnLR-LoRA on MiLoRA-initialised adapters",
        init="milora",
        optimizer=Optimizer.ANLR,
        signal=Signal.ANLR,
    ),
    Method(
        "anlr+dora",
        "AnLR-LoRA on DoRA layers",
        use_dora=True,
        optimizer=Optimizer.ANLR,
        signal=Signal.ANLR,
    ),
    Method(
        "anlr-velocity",
        "ablation: velocity signal only (beta = 0)",
        optimizer=Optimizer.ANLR,
        signal=Signal.VELOCITY,
    ),
    Method(
        "anlr-snr",
        "ablation: Adam SNR signal only (alpha = 0)",
        optimizer=Optimizer.ANLR,
        signal=Signal.SNR,
    ),
    Method(
        "random",
        "control: random log-uniform multipliers in [1/kappa, kappa]",
        optimizer=Optimizer.ANLR,
        signal=Signal.RANDOM,
    ),
    Method(
        "sensitivity",
        "ablation: AdaLoRA's |grad * W| sensitivity as the signal",
        optimizer=Optimizer.ANLR,
        signal=Signal.SENSITIVITY,
    ),
    Method(
        "adalora",
        "AdaLoRA: SVD-form adapters, rank budget pruned by sensitivity, orthogonal regulariser",
        layer=Layer.ADALORA,
        optimizer=Optimizer.ADALORA,
    ),
    Method(
        "lorapro",
        "LoRA-Pro: LoRA steps that approximate full fine-tuning's AdamW step",
        optimizer=Optimizer.LORAPRO,
    ),
    Method(
        "loradash",
        "LoRA-Dash: LoRA plus amplified task-specific directions of W0 after launch_step updates",
        layer=Layer.LORADASH,
    ),
    Method(
        "anlr+loradash",
        "AnLR-LoRA on LoRA-Dash layers",
        layer=Layer.LORADASH,
        optimizer=Optimizer.ANLR,
        signal=Signal.ANLR,
    ),
)
"""Method name -> :class:`Method`; the one source of truth for ``method:``."""

METHOD_NAMES = tuple(METHODS)


def get_method(name: str) -> Method:
  """The :class:`Method` called ``name``; ``ValueError`` listing the allowed names otherwise."""
  if name not in METHODS:
    raise ValueError(f"unknown method {name!r}; allowed methods: {', '.join(METHOD_NAMES)}")
  return METHODS[name]


def method_optimizer(
    method: str | Method,
    learning_rate: optax.ScalarOrSchedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    clip_norm: float | None = 1.0,
    anlr_kwargs: Mapping[str, Any] | None = None,
    lr_ratio: float = 16.0,
    seed: int = 0,
    track_rank_stats: bool = False,
    adalora_config: Any = None,
    lora_scale: float | None = None,
    lorapro_mode: str = "full",
    dash_launch_step: int | None = None,
) -> optax.GradientTransformation:
  r"""``clip_by_global_norm(clip_norm)`` followed by the method's optimizer on ``learning_rate``.

  Args:
    method: a name from :data:`METHODS` or a :class:`Method`.
    learning_rate: :math:`\eta_t` (a float or an optax schedule, indexed as ``optax.adamw`` does).
    b1, b2, eps, weight_decay: the AdamW constants, shared by every optimizer family.
    clip_norm: global-norm clipping threshold, or None for no clipping.
    anlr_kwargs: AnLR knobs (``alpha``, ``beta``, ``kappa``, ``rho``, ``warmup_steps``) for AnLR
      methods; missing ones take :data:`anlr_jax.DEFAULTS`. Ignored by the other methods.
    lr_ratio: LoRA+'s :math:`\lambda = \eta_B / \eta_A` (``loraplus`` only).
    seed: seed of the ``random`` signal.
    track_rank_stats: for the AdamW methods, use ``anlr_jax.anlr(signal="uniform")`` instead of
      ``optax.adamw``: the same updates (``s = 1``), plus per-rank velocity and SNR in the optimizer
      state, so that a plain-LoRA run logs the diagnostics that ``anlr analyze`` draws. Ignored by
      ``adalora`` (its ``lora_a``/``lora_b`` are not a LoRA pair: ``E`` sits between them) and
      ``lorapro`` (it keeps no per-factor Adam moments).
    adalora_config: the :class:`anlr_jax.optim.adalora.AdaLoRAConfig` of ``adalora`` (required
      there: its ``total_step`` is the run's number of updates). Ignored by the other methods.
    lora_scale: the LoRA scale ``c`` the adapters' forward pass uses (``alpha / r``), required by
      ``lorapro``. Ignored by the other methods.
    lorapro_mode: ``lorapro``'s ``mode``: ``"full"`` (the paper's Algorithm 1) or ``"efficient"``.
    dash_launch_step: LoRA-Dash's ``t`` (``loradash.launch_step``), required by the ``loradash``
      layer's methods: ``dash_scale`` gets AdamW with its step count starting at the launch
      (:func:`anlr_jax.nn.dash_optimizer`). Ignored by the other methods.

  Returns:
    An optax transformation over the LoRA param tree.
  """
  spec = method if isinstance(method, Method) else get_method(method)
  adam = dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
  if spec.optimizer is Optimizer.ADAMW and track_rank_stats:
    inner = anlr(learning_rate, **adam, signal=Signal.UNIFORM)
  elif spec.optimizer is Optimizer.ADAMW:
    inner = optax.adamw(learning_rate, **adam)
  elif spec.optimizer is Optimizer.LORAPLUS:
    inner = loraplus(learning_rate, lr_ratio=lr_ratio, **adam)
  elif spec.optimizer is Optimizer.ANLR:
    knobs = dict(anlr_kwargs or {})
    unknown = sorted(set(knobs) - set(ANLR_DEFAULTS))
    if unknown:
      raise ValueError(f"anlr_kwargs has unknown keys {unknown}; allowed: {sorted(ANLR_DEFAULTS)}")
    inner = anlr(learning_rate, **adam, **knobs, signal=spec.signal, seed=seed)
  elif spec.optimizer is Optimizer.ADALORA:
    if not isinstance(adalora_config, AdaLoRAConfig):
      raise ValueError(
          f"method {spec.name!r} needs adalora_config=AdaLoRAConfig(...) (with total_step), got"
          f" {adalora_config!r}"
      )
    inner = rank_allocator(optax.adamw(learning_rate, **adam), adalora_config)
  else:  # Optimizer.LORAPRO
    if lora_scale is None:
      raise ValueError(
          f"method {spec.name!r} needs lora_scale (the adapters' c = alpha / r), got None"
      )
    inner = lorapro(learning_rate, scale=lora_scale, mode=lorapro_mode, **adam)
  if spec.uses_loradash:
    if dash_launch_step is None:
      raise ValueError(
          f"method {spec.name!r} needs dash_launch_step (LoRA-Dash's t, loradash.launch_step)"
      )
    inner = dash_optimizer(inner, learning_rate, launch_step=dash_launch_step, **adam)
  if clip_norm is None:
    return inner
  return optax.chain(optax.clip_by_global_norm(clip_norm), inner)


def inject_method(model: nnx.Module, config: RunConfig, method: str) -> nnx.Module:
  """Wraps the targeted layers with the adapter layer of ``method`` (seeded by ``config.seed``):
  ``LoRALinear`` (its init/rsLoRA/DoRA), ``AdaLoRALinear`` (initial rank ``lora.rank``) or
  ``LoRADashLinear`` (``loradash.num_directions``, ``loradash.launch_step``)."""
  spec = get_method(method)
  _train_projector(model, config)
  common = dict(
      target_modules=tuple(config.lora.targets),
      rank=config.lora.rank,
      alpha=config.lora.alpha,
      dropout=config.lora.dropout,
      rngs=nnx.Rngs(params=config.seed, dropout=config.seed + 1),
  )
  if spec.layer is Layer.ADALORA:
    return inject_adalora(model, **common)
  if spec.layer is Layer.LORADASH:
    try:
      return inject_loradash(
          model,
          num_directions=config.loradash.num_directions,
          launch_step=config.loradash.launch_step,
          use_rslora=spec.use_rslora,
          **common,
      )
    except ValueError as err:
      if "num_directions" not in str(err):
        raise
      raise ConfigError(
          f"loradash.num_directions={config.loradash.num_directions}: {err}"
      ) from None
  return inject_lora(model, **common, **spec.lora_kwargs())


def _train_projector(model: nnx.Module, config: RunConfig) -> None:
  """With ``model.projector_lr`` set, the LLaVA projector's weights become trained
  (:func:`anlr_jax.nn.train_in_full`); :func:`build_method` gives them that learning rate."""
  if config.model.projector_lr is None:
    return
  if not hasattr(model, "PROJECTOR"):
    raise ConfigError(
        f"model.projector_lr={config.model.projector_lr}: {type(model).__name__} has no"
        " multimodal projector (a LLaVA setting); leave model.projector_lr unset"
    )
  train_in_full(model, model.PROJECTOR)


# ------------------------------------------------------------------ what a method adds to a run
ADALORA_TOTAL_STEP = "adalora_total_step"
"""Metadata key of an AdaLoRA run's ``lora_final.safetensors``: its number of updates (export)."""


def adalora_target_r(config: RunConfig) -> int:
  """``adalora.target_r``, or by default ``round(lora.rank / 1.5)`` (at least 1): AdaLoRA's paper
  starts from ``b(0) = 1.5 b(T)`` and PEFT's defaults are ``init_r = 12``, ``target_r = 8``."""
  if config.adalora.target_r is not None:
    return config.adalora.target_r
  return max(1, round(config.lora.rank / 1.5))


def adalora_config(config: RunConfig, total_step: int):
  """The :class:`~anlr_jax.optim.adalora.AdaLoRAConfig` of a run: ``init_r = lora.rank``, the
  ``adalora`` section, and ``total_step`` the run's number of updates."""
  ada = config.adalora
  try:
    return AdaLoRAConfig(
        init_r=config.lora.rank,
        target_r=adalora_target_r(config),
        tinit=ada.tinit,
        tfinal=ada.tfinal,
        deltaT=ada.delta_t,
        total_step=total_step,
        beta1=ada.beta1,
        beta2=ada.beta2,
        orth_reg_weight=ada.orth_reg_weight,
    )
  except ValueError as err:  # names AdaLoRAConfig's field; say which config key that is
    text = str(err).replace("AdaLoRAConfig.init_r", "lora.rank").replace("deltaT", "delta_t")
    raise ConfigError(text.replace("AdaLoRAConfig.", "adalora.")) from None


def dash_launcher(launch_step: int) -> Callable[[Any, int], None]:
  r"""LoRA-Dash's launch as a :class:`~anlr_jax.train.Trainer` ``on_step`` hook.

  Once ``step >= launch_step`` updates are done (``t``; 0: before the first update), the hook
  rebuilds the model from the trainer's state (current LoRA params, frozen weights, ``extra``),
  reads whether its ``LoRADashLinear`` layers are launched already (a run resumed past ``t``
  restores the chosen directions from the checkpoint's ``extra``: they are kept, never chosen
  again), otherwise calls :func:`anlr_jax.nn.launch_dash` and writes the new ``extra`` (the
  ``DashDirections``) back into ``trainer.state`` with the state's shardings, so the step is not
  recompiled. ``dash_scale`` is exactly zero until the launch (its gradient is), so the LoRA
  params and the optimizer state are left as they are.
  """
  done = []

  def on_step(trainer, step: int) -> None:
    if done or step < launch_step:
      return
    state = trainer.state
    model = nnx.merge(trainer.graphdef, trainer.lora_params(), trainer.frozen, state.extra)
    if not dash_launched(model):
      launch_dash(model)
      *_, extra = nnx.split(model, nnx.LoRAParam, nnx.Param, ...)
      extra = put_global(nnx.to_pure_dict(extra), trainer.state_shardings.extra)
      trainer.state = state._replace(extra=extra)
    done.append(step)

  return on_step


def method_hooks(config: RunConfig, method: str) -> dict[str, Any]:
  """The :class:`~anlr_jax.train.Trainer` keyword arguments ``method`` needs beyond ``tx``:
  AdaLoRA's orthogonal regulariser (``loss_regularizer``; none when its weight is 0), LoRA-Dash's
  launch (``on_step``, :func:`dash_launcher`)."""
  spec = get_method(method)
  hooks = {}
  if spec.uses_adalora and config.adalora.orth_reg_weight > 0:
    hooks["loss_regularizer"] = functools.partial(
        orth_regularization, orth_reg_weight=config.adalora.orth_reg_weight
    )
  if spec.uses_loradash:
    hooks["on_step"] = dash_launcher(config.loradash.launch_step)
  return hooks


def check_schedule(
    config: RunConfig, method: str, total: int, log: Callable[[str], None] | None = None
) -> None:
  """ConfigError if a method's phase would never start; a note when the LR warmup is cut."""
  spec = get_method(method)
  if spec.uses_anlr and spec.signal is not Signal.UNIFORM and config.anlr.warmup_steps >= total:
    raise ConfigError(
        f"anlr.warmup_steps={config.anlr.warmup_steps} is not below the run's {total} updates:"
        f" every multiplier would stay 1 and method={method} would train exactly like lora;"
        f" lower anlr.warmup_steps (e.g. anlr.warmup_steps={max(1, total // 10)})"
    )
  if spec.uses_loradash and config.loradash.launch_step >= total:
    raise ConfigError(
        f"loradash.launch_step={config.loradash.launch_step} is not below the run's {total}"
        f" updates: the dash phase would never start and method={method} would train exactly like"
        f" {'anlr' if spec.uses_anlr else 'lora'}; lower loradash.launch_step (e.g."
        f" loradash.launch_step={total // 2})"
    )
  if spec.uses_adalora:
    ada = config.adalora
    if ada.tinit + ada.tfinal >= total:
      raise ConfigError(
          f"adalora.tinit + adalora.tfinal = {ada.tinit} + {ada.tfinal} is not below the run's"
          f" {total} updates: AdaLoRA's budget would never decrease; lower adalora.tinit or"
          " adalora.tfinal"
      )
  warmup = config.trainer.lr_warmup_steps
  if warmup > total and log is not None:
    log(
        f"[{method}] trainer.lr_warmup_steps={warmup} is more than the run's {total} updates:"
        f" the learning rate warms up over all {total} and never decays"
    )


@dataclasses.dataclass(frozen=True)
class MethodRun:
  """What :func:`build_method` assembles for a run of ``spec`` over ``total_steps`` updates:
  ``Trainer(model, batches, config.trainer, tx, schedule=schedule, **hooks)``."""

  spec: Method
  tx: optax.GradientTransformation
  schedule: optax.ScalarOrSchedule
  hooks: dict[str, Any]
  total_steps: int


def build_method(
    config: RunConfig,
    method: str | None = None,
    *,
    total_steps: int,
    model: nnx.Module | None = None,
    learning_rate: optax.ScalarOrSchedule | None = None,
    check: bool = True,
    log: Callable[[str], None] | None = None,
) -> MethodRun:
  r"""The one assembly of a method's run from a config: every entry point (``anlr train``, the
  examples, the benchmarks) calls it, so a method cannot work in one and not in another.

  With ``model`` given, its targeted layers are first wrapped with the method's adapter layer
  (:func:`inject_method`); the optimizer is :func:`method_optimizer` with every constant from
  ``config`` (``trainer`` AdamW constants and clipping, ``anlr``, ``loraplus``, ``adalora`` with
  ``total_step = total_steps``, ``lorapro`` with ``c`` from ``lora``), on the trainer's schedule
  ``config.trainer.schedule(total_steps)`` unless ``learning_rate`` replaces it; ``hooks`` are the
  :class:`~anlr_jax.train.Trainer` keyword arguments of :func:`method_hooks`.

  Args:
    config: the run's config (``method`` is used when ``method`` is None).
    method: a name from :data:`METHODS`.
    total_steps: the run's number of updates.
    model: a base model to inject the adapter layers into (in place), or None when the caller
      built the adapted model itself.
    learning_rate: a float or schedule instead of the trainer's schedule.
    check: refuse (``ConfigError``) a method whose phase would never start within
      ``total_steps`` (:func:`check_schedule`).
    log: where :func:`check_schedule`'s notes go (None: nowhere).

  Returns:
    A :class:`MethodRun`.
  """
  name = config.method if method is None else method
  spec = get_method(name)
  tc = config.trainer
  if total_steps < 1:
    raise ValueError(f"total_steps={total_steps} must be >= 1")
  if check:
    check_schedule(config, name, total_steps, log)
  if model is not None:
    inject_method(model, config, name)
  schedule = tc.schedule(total_steps) if learning_rate is None else learning_rate
  projector_lr = config.model.projector_lr
  tx = method_optimizer(
      spec,
      schedule,
      b1=tc.b1,
      b2=tc.b2,
      eps=tc.eps,
      weight_decay=tc.weight_decay,
      clip_norm=tc.clip_norm if projector_lr is None else None,
      anlr_kwargs=config.anlr.as_kwargs(),
      lr_ratio=config.loraplus.lr_ratio,
      seed=config.seed,
      track_rank_stats=tc.diag_every > 0,
      adalora_config=adalora_config(config, total_steps) if spec.uses_adalora else None,
      lora_scale=lora_scale(config.lora.rank, config.lora.alpha, spec.use_rslora),
      lorapro_mode=config.lorapro.mode,
      dash_launch_step=config.loradash.launch_step,
  )
  if projector_lr is not None:  # LLaVA's projector: AdamW at its own rate, on the same schedule
    scale = (lambda step: schedule(step) / tc.learning_rate) if callable(schedule) else None
    tx = with_full_params(
        tx,
        (lambda step: projector_lr * scale(step)) if scale else projector_lr,
        [PROJECTOR_PATH],
        clip_norm=tc.clip_norm,
        b1=tc.b1,
        b2=tc.b2,
        eps=tc.eps,
        weight_decay=tc.weight_decay,
    )
  return MethodRun(spec, tx, schedule, method_hooks(config, name), total_steps)


__all__ = [
    "ADALORA_TOTAL_STEP",
    "LAYERS",
    "Layer",
    "METHODS",
    "METHOD_NAMES",
    "OPTIMIZERS",
    "Optimizer",
    "Method",
    "MethodRun",
    "adalora_config",
    "adalora_target_r",
    "build_method",
    "check_schedule",
    "dash_launcher",
    "get_method",
    "inject_method",
    "method_hooks",
    "method_optimizer",
]

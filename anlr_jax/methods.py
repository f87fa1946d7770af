r"""The method table: what ``method: <name>`` means, in one place, and its layers and optimizer.

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

:func:`inject_method` wraps a model's targeted layers with a method's adapter layer and
:func:`method_optimizer` builds its optimizer, both from explicit settings; the ``anlr`` command
assembles a run from its config with :func:`anlr_jax.app.assemble.build_method`, which calls both.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping, Sequence

import optax
from flax import nnx

from anlr_jax.nn import dash_optimizer, inject_adalora, inject_lora, inject_loradash
from anlr_jax.nn.inject import PAPER_TARGET_MODULES
from anlr_jax.nn.loradash import LORADASH_DEFAULTS
from anlr_jax.optim import Signal, anlr, loraplus
from anlr_jax.optim.adalora import AdaLoRAConfig, rank_allocator
from anlr_jax.optim.lorapro import lorapro
from anlr_jax.optim.transform import DEFAULTS as ANLR_DEFAULTS


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
    batch_modules: bool | None = None,
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
    batch_modules: AnLR methods: :func:`anlr_jax.anlr`'s ``batch_modules`` (None: its default).
      Ignored by the other methods.

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
    inner = anlr(
        learning_rate, **adam, **knobs, signal=spec.signal, seed=seed, batch_modules=batch_modules
    )
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


def inject_method(
    model: nnx.Module,
    method: str | Method,
    *,
    target_modules: Sequence[str] = PAPER_TARGET_MODULES,
    rank: int,
    alpha: float,
    dropout: float = 0.05,
    rngs: nnx.Rngs,
    num_directions: int = LORADASH_DEFAULTS["num_directions"],
    launch_step: int = LORADASH_DEFAULTS["launch_step"],
) -> nnx.Module:
  """Wraps the targeted layers of ``model`` (in place) with the adapter layer of ``method``:
  ``LoRALinear`` with the method's init/rsLoRA/DoRA (:func:`anlr_jax.nn.inject_lora`),
  ``AdaLoRALinear`` of initial rank ``rank`` (:func:`anlr_jax.nn.inject_adalora`) or
  ``LoRADashLinear`` with ``num_directions`` and ``launch_step``
  (:func:`anlr_jax.nn.inject_loradash`). Returns ``model``.

  Raises:
    ValueError: an unknown method, or as the ``inject_*`` function of its layer.
  """
  spec = method if isinstance(method, Method) else get_method(method)
  common = dict(target_modules=target_modules, rank=rank, alpha=alpha, dropout=dropout, rngs=rngs)
  if spec.layer is Layer.ADALORA:
    return inject_adalora(model, **common)
  if spec.layer is Layer.LORADASH:
    return inject_loradash(
        model,
        num_directions=num_directions,
        launch_step=launch_step,
        use_rslora=spec.use_rslora,
        **common,
    )
  return inject_lora(model, **common, **spec.lora_kwargs())


ADALORA_TOTAL_STEP = "adalora_total_step"
"""Metadata key of an AdaLoRA run's ``lora_final.safetensors``: its number of updates (export)."""


__all__ = [
    "ADALORA_TOTAL_STEP",
    "LAYERS",
    "Layer",
    "METHODS",
    "METHOD_NAMES",
    "OPTIMIZERS",
    "Optimizer",
    "Method",
    "get_method",
    "inject_method",
    "method_optimizer",
]

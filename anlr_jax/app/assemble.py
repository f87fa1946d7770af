"""A method's run assembled from a run config: layers, optimizer, schedule and trainer hooks.

The method table (:mod:`anlr_jax.methods`) says what each ``method:`` is; :func:`build_method` is the
one assembly of a method's run from a :class:`~anlr_jax.app.config.RunConfig`: ``anlr train``,
``anlr eval`` / ``anlr export`` of a run directory, the dry run, the GPU-mesh example and the
benchmarks call it, so a method cannot work in one and not in another.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Callable

import optax
from flax import nnx

from anlr_jax.settings import ConfigError
from anlr_jax.methods import Method, get_method, inject_method, method_optimizer
from anlr_jax.nn import dash_launched, launch_dash, lora_scale
from anlr_jax.optim import Signal
from anlr_jax.optim.adalora import AdaLoRAConfig, orth_regularization
from anlr_jax.models.llava import PROJECTOR_PATH
from anlr_jax.models.quantize import quantize_model
from anlr_jax.nn.trainable import train_in_full, with_full_params
from anlr_jax.train.distributed import put_global
from anlr_jax.train.mesh import check_quantized_blocks, make_mesh
from anlr_jax.train.trainer import first_devices

if TYPE_CHECKING:
  from anlr_jax.app.config import RunConfig


def _inject_layers(model: nnx.Module, config: RunConfig) -> nnx.Module:
  """Wraps the targeted layers with the adapter layer of ``config.method`` (seeded by
  ``config.seed``): :func:`anlr_jax.methods.inject_method` with the ``lora`` and ``loradash``
  sections; a bad ``loradash.num_directions`` is a ConfigError naming the key. With
  ``model.projector_lr`` set, LLaVA's projector is trained too (:func:`_train_projector`)."""
  _train_projector(model, config)
  try:
    return _quantize(
        inject_method(
            model,
            config.method,
            target_modules=tuple(config.lora.targets),
            rank=config.lora.rank,
            alpha=config.lora.alpha,
            dropout=config.lora.dropout,
            rngs=nnx.Rngs(params=config.seed, dropout=config.seed + 1),
            num_directions=config.loradash.num_directions,
            launch_step=config.loradash.launch_step,
        ),
        config,
    )
  except ValueError as err:
    if not get_method(config.method).uses_loradash or "num_directions" not in str(err):
      raise
    raise ConfigError(f"loradash.num_directions={config.loradash.num_directions}: {err}") from None


def _quantize(model: nnx.Module, config: RunConfig) -> nnx.Module:
  """``model.quantize`` on the layers still in float (all of them after a PiSSA/MiLoRA init from
  the float weight; none when the base was quantised on load); a layer or model type that cannot
  be quantised is a ConfigError."""
  try:
    return quantize_model(model, config.model.quantize)
  except ValueError as err:
    raise ConfigError(str(err)) from None


def check_quantized_mesh(model: nnx.Module, config: RunConfig, mesh=None) -> None:
  """A ConfigError when the run's mesh (``trainer.mesh_*``, or ``mesh``) would split a block of a
  quantised layer (:func:`anlr_jax.train.mesh.check_quantized_blocks`); nothing without ``model.quantize``.
  """
  if config.model.quantize == "none":
    return
  tc = config.trainer
  try:
    if mesh is None:
      devices = None if tc.devices is None else first_devices(tc.devices)
      mesh = make_mesh(tc.mesh_data, tc.mesh_fsdp, tc.mesh_tensor, devices=devices)
    check_quantized_blocks(model, mesh)
  except ValueError as err:
    raise ConfigError(str(err)) from None


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


def method_hooks(config: RunConfig) -> dict[str, Any]:
  """The :class:`~anlr_jax.train.Trainer` keyword arguments ``config.method`` needs beyond ``tx``:
  AdaLoRA's orthogonal regulariser (``loss_regularizer``; none when its weight is 0), LoRA-Dash's
  launch (``on_step``, :func:`dash_launcher`)."""
  spec = get_method(config.method)
  hooks = {}
  if spec.uses_adalora and config.adalora.orth_reg_weight > 0:
    hooks["loss_regularizer"] = functools.partial(
        orth_regularization, orth_reg_weight=config.adalora.orth_reg_weight
    )
  if spec.uses_loradash:
    hooks["on_step"] = dash_launcher(config.loradash.launch_step)
  return hooks


def check_schedule(config: RunConfig, total: int, log: Callable[[str], None] | None = None) -> None:
  """ConfigError if a phase of ``config.method`` would never start within ``total`` updates; a note
  when the LR warmup is cut."""
  method = config.method
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
  ``Trainer(model, batches, config.trainer, tx, schedule=schedule, **hooks)``; ``tx`` and
  ``schedule`` are None and ``hooks`` empty when it was built without ``total_steps`` (the adapter
  layers of a trained run, to load its adapter into)."""

  spec: Method
  tx: optax.GradientTransformation | None
  schedule: optax.ScalarOrSchedule | None
  hooks: dict[str, Any]
  total_steps: int | None


def build_method(
    config: RunConfig,
    *,
    model: nnx.Module | None = None,
    total_steps: int | None = None,
    learning_rate: optax.ScalarOrSchedule | None = None,
    check: bool = True,
    log: Callable[[str], None] | None = None,
) -> MethodRun:
  r"""The one assembly of ``config.method``'s run from a config: every entry point that runs a
  method from a run config (``anlr train``, ``anlr eval`` and ``anlr export`` of a run directory,
  ``anlr train --dry_run``, the GPU-mesh example, the benchmarks) calls it, so a method cannot work
  in one and not in another.

  With ``model`` given, its targeted layers are wrapped with the method's adapter layer
  (:func:`anlr_jax.methods.inject_method` with the ``lora`` and ``loradash`` sections, seeded by
  ``seed``). With ``total_steps`` given, the optimizer is :func:`anlr_jax.methods.method_optimizer`
  with every constant from ``config`` (``trainer`` AdamW constants and clipping, ``anlr``,
  ``loraplus``, ``adalora`` with ``total_step = total_steps``, ``lorapro`` with ``c`` from
  ``lora``), on the trainer's schedule ``config.trainer.schedule(total_steps)`` unless
  ``learning_rate`` replaces it; ``hooks`` are the :class:`~anlr_jax.train.Trainer` keyword
  arguments of :func:`method_hooks`.

  Args:
    config: the run's config; ``config.method`` is the method.
    model: a base model to inject the adapter layers into (in place), or None (the optimizer alone,
      e.g. for a model built elsewhere or abstractly).
    total_steps: the run's number of updates, or None (the adapter layers alone, e.g. of a
      trained run whose adapter file is loaded next).
    learning_rate: a float or schedule instead of the trainer's schedule.
    check: refuse (``ConfigError``) a method whose phase would never start within
      ``total_steps`` (:func:`check_schedule`).
    log: where :func:`check_schedule`'s notes go (None: nowhere).

  Returns:
    A :class:`MethodRun`.
  """
  spec = get_method(config.method)
  if model is None and total_steps is None:
    raise ValueError("build_method needs a model to adapt, total_steps for an optimizer, or both")
  if total_steps is not None and total_steps < 1:
    raise ValueError(f"total_steps={total_steps} must be >= 1")
  if total_steps is not None and check:
    check_schedule(config, total_steps, log)
  if model is not None:
    _inject_layers(model, config)
  if total_steps is None:
    return MethodRun(spec, None, None, {}, None)
  tc = config.trainer
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
  return MethodRun(spec, tx, schedule, method_hooks(config), total_steps)


__all__ = [
    "MethodRun",
    "adalora_config",
    "adalora_target_r",
    "build_method",
    "check_quantized_mesh",
    "check_schedule",
    "dash_launcher",
    "method_hooks",
]

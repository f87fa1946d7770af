r"""The method-specific parts of a training run (see :mod:`anlr_jax.methods` for the table).

* AdaLoRA (``adalora``): the allocator's :class:`~anlr_jax.optim.adalora.AdaLoRAConfig` has
  ``init_r = lora.rank`` and ``total_step = T``, the run's number of updates (stored in
  ``lora_final.safetensors``' metadata for the PEFT export); the orthogonal regulariser
  :math:`R = w \frac{1}{2M}\sum_m (\|A_m^T A_m - I\|_F + \|B_m B_m^T - I\|_F)` is added to the loss
  (:func:`method_hooks`: the trainer's ``loss_regularizer``).
* LoRA-Dash (``loradash``, ``anlr+loradash``): the directions are chosen right after update
  ``t = loradash.launch_step`` (:func:`dash_launcher`: the trainer's ``on_step``), and kept when a
  run resumes past ``t``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from anlr_jax.config import ConfigError, RunConfig, resolve_path
from anlr_jax.methods import get_method

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
  from anlr_jax.optim.adalora import AdaLoRAConfig

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
  from anlr_jax.nn import dash_launched, launch_dash

  done = []

  def on_step(trainer, step: int) -> None:
    if done or step < launch_step:
      return
    state = trainer.state
    model = nnx.merge(trainer.graphdef, trainer.lora_params(), trainer.frozen, state.extra)
    if not dash_launched(model):
      launch_dash(model)
      *_, extra = nnx.split(model, nnx.LoRAParam, nnx.Param, ...)
      extra = jax.device_put(nnx.to_pure_dict(extra), trainer.state_shardings.extra)
      trainer.state = state._replace(extra=extra)
    done.append(step)

  return on_step


def method_hooks(config: RunConfig, method: str) -> dict[str, Any]:
  """The :class:`~anlr_jax.train.Trainer` keyword arguments ``method`` needs beyond ``tx``:
  AdaLoRA's orthogonal regulariser (``loss_regularizer``; none when its weight is 0), LoRA-Dash's
  launch (``on_step``, :func:`dash_launcher`)."""
  import functools

  from anlr_jax.optim.adalora import orth_regularization

  spec = get_method(method)
  hooks = {}
  if spec.uses_adalora and config.adalora.orth_reg_weight > 0:
    hooks["loss_regularizer"] = functools.partial(
        orth_regularization, orth_reg_weight=config.adalora.orth_reg_weight
    )
  if spec.uses_loradash:
    hooks["on_step"] = dash_launcher(config.loradash.launch_step)
  return hooks


def export_adalora_run(model, config: RunConfig, lora_path: str, out: str) -> None:
  """A PEFT AdaLoRA adapter of an ``adalora`` run: only the triplets with ``E != 0`` are written
  (``rank_pattern``; a pruned triplet has ``E = 0``, so the output is unchanged), and the
  allocator settings with the run's ``total_step`` (from the adapter file's metadata)."""
  from safetensors import safe_open

  from anlr_jax.nn import export_adalora_adapter, iter_adalora_layers

  with safe_open(lora_path, framework="numpy") as f:
    metadata = f.metadata() or {}
  if ADALORA_TOTAL_STEP not in metadata:
    raise ValueError(
        f"{lora_path}: no {ADALORA_TOTAL_STEP} in its metadata (written by an older anlr): the"
        " PEFT AdaLoRA config needs the run's total_step; use --format merged"
    )
  pattern = {
      path: [bool(v) for v in np.asarray(layer.lora_e[...]) != 0]
      for path, layer in iter_adalora_layers(model)
  }
  export_adalora_adapter(
      model,
      out,
      config=adalora_config(config, int(metadata[ADALORA_TOTAL_STEP])),
      base_model_name_or_path=resolve_path(config.model.path),
      target_modules=list(config.lora.targets),
      rank_pattern=pattern,
  )


__all__ = [
    "ADALORA_TOTAL_STEP",
    "adalora_config",
    "adalora_target_r",
    "dash_launcher",
    "export_adalora_run",
    "method_hooks",
]

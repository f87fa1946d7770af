r"""LoRA+ (Hayou et al., 2024): AdamW where the ``B`` factors get ``lr_ratio`` times the learning rate.

Since the AdamW delta is :math:`-\eta_t u`, giving ``B`` the learning rate :math:`\lambda\eta_t` is the
same as multiplying its delta (weight decay included) by :math:`\lambda`; that is what this does, on the
modules found by :func:`anlr_jax.find_lora_modules`.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from anlr_jax.optim.detect import require_lora_modules
from anlr_jax.optim.dims import LoraDimsSpec, find_lora_modules

__all__ = ["scale_lora_b", "loraplus"]


def scale_lora_b(
    ratio: float, lora_dims: LoraDimsSpec = None, *, require_lora: bool = True
) -> optax.GradientTransformation:
  """Multiplies the updates of every LoRA ``B`` factor by ``ratio``; other leaves pass through.

  ``init`` raises a ``ValueError`` when it finds no LoRA module, unless ``require_lora=False``.
  """
  if not callable(ratio) and not isinstance(ratio, jax.core.Tracer) and float(ratio) <= 0:
    raise ValueError(f"lr_ratio must be > 0, got {ratio!r}")

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    for mod in find_lora_modules(updates, lora_dims):
      u = leaves[mod.b_index]
      leaves[mod.b_index] = (u.astype(jnp.float32) * ratio).astype(u.dtype)
    return treedef.unflatten(leaves), state

  def init_fn(params):
    require_lora_modules(params, lora_dims, "loraplus", require_lora=require_lora)
    return optax.EmptyState()

  return optax.GradientTransformation(init_fn, update_fn)


def loraplus(
    learning_rate: optax.ScalarOrSchedule,
    lr_ratio: float = 16.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    mask: Optional[Any] = None,
    *,
    lora_dims: LoraDimsSpec = None,
    require_lora: bool = True,
) -> optax.GradientTransformation:
  r"""The LoRA+ baseline: ``optax.adamw`` with :math:`\eta_B = \lambda \eta_A`.

  Args:
    learning_rate: learning rate (or schedule) of the ``A`` factors and of every non-LoRA leaf.
    lr_ratio: :math:`\lambda = \eta_B / \eta_A` (LoRA+ recommends 16).
    b1, b2, eps, weight_decay, mask: as in ``optax.adamw``.
    lora_dims: how to find LoRA factors (see :func:`anlr_jax.find_lora_modules`).
    require_lora: ``init`` raises a ``ValueError`` when it finds no LoRA module; False accepts a
      tree without any (then this is ``optax.adamw``).

  References:
    Hayou, Ghosh, Yu, *LoRA+: Efficient Low Rank Adaptation of Large Models*, 2024.
  """
  return optax.chain(
      optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask),
      scale_lora_b(lr_ratio, lora_dims, require_lora=require_lora),
  )

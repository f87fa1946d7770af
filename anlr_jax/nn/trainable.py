r"""Base weights trained in full next to the adapters (LLaVA's multimodal projector).

LLaVA's LoRA recipe adapts the language model with LoRA and trains the projector between the vision
tower and the language model in full, at its own learning rate. :func:`train_in_full` turns the
``nnx.Param`` s below a module into :class:`FullParam`, a subclass of ``nnx.LoRAParam``: everything
that splits a model into trained (``nnx.LoRAParam``) and frozen (``nnx.Param``) parameters, the
trainer included, then trains them, while the adapter layers (``iter_lora_layers``) stay what they
were. :func:`with_full_params` gives those leaves their own optimizer (``optax.multi_transform``):

    update = clip_c(g)  ->  adapter leaves: the method's optimizer;  FullParam leaves: AdamW(eta_full)

with one global-norm clip over all trained leaves, as a single optimizer over them would clip.
"""

from __future__ import annotations

import typing as tp

import jax
import optax
from flax import nnx

from anlr_jax.nn.inject import get_submodule, path_str
from anlr_jax.nn.lora import ADAPTER_DTYPE

FULL = "full"
ADAPTER = "adapter"


class FullParam(nnx.LoRAParam):
  """A base-model weight trained in full next to the adapters (an ``nnx.LoRAParam`` subclass)."""


def train_in_full(
    model: nnx.Module, module_path: tp.Sequence[str | int], *, dtype=ADAPTER_DTYPE
) -> list[str]:
  """Turns every ``nnx.Param`` below ``module_path`` into a :class:`FullParam`, in place.

  The values are stored in ``dtype`` (float32, as the adapters are, whatever the base weights'
  dtype): AdamW steps of ``lr ~ 1e-5`` on bfloat16 weights would mostly round away. The layers
  still compute in their own ``dtype``.

  Returns:
    The dotted names of the converted variables (``<module path>.<attribute>``), sorted.

  Raises:
    KeyError: ``module_path`` names no submodule. ValueError: it holds no ``nnx.Param``.
  """
  root = get_submodule(model, tuple(module_path))
  names = []
  for path, module in nnx.iter_modules(root):
    for attr, value in list(vars(module).items()):
      if isinstance(value, nnx.Param) and not isinstance(value, nnx.LoRAParam):
        stored = value.get_value().astype(dtype)
        setattr(module, attr, FullParam(stored, **value.get_metadata()))
        names.append(path_str((*module_path, *path, attr)))
  if not names:
    raise ValueError(f"'{path_str(tuple(module_path))}' holds no nnx.Param to train in full")
  return sorted(names)


def _key_name(key) -> str | int:
  for attr in ("key", "idx", "name"):
    if hasattr(key, attr):
      return getattr(key, attr)
  return str(key)


def full_param_labels(prefixes: tp.Sequence[tp.Sequence[str | int]]) -> tp.Callable:
  """A ``multi_transform`` label function: :data:`FULL` for the leaves below one of
  ``prefixes`` (module paths), :data:`ADAPTER` for every other leaf."""
  prefixes = [tuple(p) for p in prefixes]

  def labels(params):
    def label(path, _):
      names = tuple(_key_name(k) for k in path)
      return FULL if any(names[: len(p)] == p for p in prefixes) else ADAPTER

    return jax.tree_util.tree_map_with_path(label, params)

  return labels


def with_full_params(
    adapter_tx: optax.GradientTransformation,
    full_learning_rate: optax.ScalarOrSchedule,
    prefixes: tp.Sequence[tp.Sequence[str | int]],
    *,
    clip_norm: float | None = None,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
  """``clip_by_global_norm(clip_norm)`` then ``adapter_tx`` on the adapter leaves and
  ``adamw(full_learning_rate)`` on the leaves below ``prefixes`` (see the module docstring).

  ``adapter_tx`` must not clip itself (build it with ``clip_norm=None``)."""
  tx = optax.multi_transform(
      {
          ADAPTER: adapter_tx,
          FULL: optax.adamw(full_learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay),
      },
      full_param_labels(prefixes),
  )
  return tx if clip_norm is None else optax.chain(optax.clip_by_global_norm(clip_norm), tx)

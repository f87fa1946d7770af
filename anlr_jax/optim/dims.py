r"""Finding LoRA modules in a parameter pytree.

A LoRA module is a pair of sibling leaves: a factor ``A`` and a factor ``B`` whose product is the
adapter update. Which leaves they are, and which of their axes is the rank axis, is declared with a
:class:`LoraDims` spec, in the style of ``optax.contrib.MuonDimensionNumbers``:

* Flax NNX layout (:data:`FLAX`, the default): ``lora_a`` of shape ``(..., d_in, r)`` and ``lora_b`` of
  shape ``(..., r, d_out)``;
* PEFT layout (:data:`PEFT`): ``lora_A`` of shape ``(..., r, d_in)`` and ``lora_B`` of shape
  ``(..., d_out, r)`` (with or without a trailing ``weight`` key).

Leading ``...`` axes are batch axes: every slice is an independent module (e.g. layers stacked under
``nnx.scan``).

Leaves are paired by *structure*, not by regex on path strings: for each leaf the last path entry
whose name is ``a_name`` or ``b_name`` splits its key path into a parent (the module) and a suffix
(e.g. ``.value`` for ``nnx.Variable`` leaves, or ``['weight']``); an ``A`` leaf and a ``B`` leaf with
the same parent and suffix form one module, named by :func:`anlr_jax.rundir.module_name` of the
parent path (``.``-joined, e.g. ``model.layers.0.self_attn.q_proj``: the name the LoRA injection, the
adapter file, the diagnostics and the analysis use for the same module).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Union

import jax

from anlr_jax.rundir import key_name, module_name

__all__ = [
    "LoraDims",
    "LoraModule",
    "FLAX",
    "PEFT",
    "find_lora_modules",
]


@dataclasses.dataclass(frozen=True)
class LoraDims:
  """Names and rank axes of the two factors of a LoRA module.

  Attributes:
    a_name: key (dict key or attribute name) of the ``A`` factor.
    b_name: key of the ``B`` factor.
    a_rank_axis: rank axis of ``A``; ``-1`` for ``(..., d_in, r)``, ``-2`` for ``(..., r, d_in)``.
    b_rank_axis: rank axis of ``B``; ``-2`` for ``(..., r, d_out)``, ``-1`` for ``(..., d_out, r)``.
  """

  a_name: str = "lora_a"
  b_name: str = "lora_b"
  a_rank_axis: int = -1
  b_rank_axis: int = -2

  def __post_init__(self):
    for arg in ("a_rank_axis", "b_rank_axis"):
      if getattr(self, arg) not in (-1, -2):
        raise ValueError(
            f"LoraDims.{arg} must be -1 or -2 (one of the two trailing matrix axes), "
            f"got {getattr(self, arg)!r}"
        )
    if self.a_name == self.b_name:
      raise ValueError(f"LoraDims.a_name and b_name must differ, both are {self.a_name!r}")


FLAX = LoraDims("lora_a", "lora_b", a_rank_axis=-1, b_rank_axis=-2)
PEFT = LoraDims("lora_A", "lora_B", a_rank_axis=-2, b_rank_axis=-1)

LoraDimsSpec = Union[None, LoraDims, Sequence[LoraDims], Callable[[Any], Any], Any]


@dataclasses.dataclass(frozen=True)
class LoraModule:
  """One LoRA module found in a pytree: flat leaf indices of its factors and its layout."""

  name: str
  a_index: int
  b_index: int
  dims: LoraDims
  rank: int

  @property
  def a_feature_axis(self) -> int:
    """The axis of ``A`` summed over to get per-rank quantities (``d_in``)."""
    return -2 if self.dims.a_rank_axis == -1 else -1

  @property
  def b_feature_axis(self) -> int:
    """The axis of ``B`` summed over to get per-rank quantities (``d_out``)."""
    return -2 if self.dims.b_rank_axis == -1 else -1


def _is_spec_leaf(x) -> bool:
  return x is None or isinstance(x, LoraDims)


def _leaf_specs(tree, lora_dims: LoraDimsSpec, num_leaves: int) -> list[tuple[LoraDims, ...]]:
  """Candidate specs for every leaf of ``tree`` (flat order)."""
  if callable(lora_dims) and not isinstance(lora_dims, LoraDims):
    lora_dims = lora_dims(tree)
  if lora_dims is None:
    return [(FLAX,)] * num_leaves
  if isinstance(lora_dims, LoraDims):
    return [(lora_dims,)] * num_leaves
  if isinstance(lora_dims, (list, tuple)) and all(isinstance(d, LoraDims) for d in lora_dims):
    return [tuple(lora_dims)] * num_leaves
  # A prefix pytree of LoraDims / None.
  try:
    per_leaf = jax.tree.map(
        lambda spec, sub: [() if spec is None else (spec,)] * len(jax.tree.leaves(sub)),
        lora_dims,
        tree,
        is_leaf=_is_spec_leaf,
    )
  except (ValueError, TypeError) as e:
    raise ValueError(
        "lora_dims must be None, a LoraDims, a sequence of LoraDims, a callable params -> spec, "
        f"or a prefix pytree of LoraDims/None matching the parameters; it did not match: {e}"
    ) from None
  flat = [
      s for group in jax.tree.leaves(per_leaf, is_leaf=lambda x: isinstance(x, list)) for s in group
  ]
  if len(flat) != num_leaves:  # pragma: no cover - defensive
    raise ValueError("lora_dims prefix tree does not cover every parameter leaf")
  return flat


def find_lora_modules(tree, lora_dims: LoraDimsSpec = None) -> list[LoraModule]:
  """Finds the LoRA modules of a pytree, from its structure.

  Args:
    tree: parameters (or updates: any pytree with the same structure). Leaves may be arrays,
      ``jax.ShapeDtypeStruct`` or ``nnx.Variable`` s.
    lora_dims: the layout spec: ``None`` (Flax ``lora_a``/``lora_b``), a :class:`LoraDims`, a sequence
      of them (several layouts in one tree), a prefix pytree of ``LoraDims``/``None``, or a callable
      ``params -> spec``.

  Returns:
    The modules, in flat-leaf order of their ``A`` factor. Each module's ``name`` is
    :func:`anlr_jax.rundir.module_name` of its parent path (names joined with ``.``; ``''`` for
    factors at the root).

  Raises:
    ValueError: an ``A`` factor without its ``B`` sibling (or the reverse), factors that are not at
      least 2-D, or whose rank axes disagree; the message names the module path.
  """
  leaves_with_path, _ = jax.tree_util.tree_flatten_with_path(tree)
  specs = _leaf_specs(tree, lora_dims, len(leaves_with_path))
  # (parent, suffix, dims) -> {"a": index, "b": index}
  groups: dict[tuple, dict[str, int]] = {}
  order: list[tuple] = []
  for index, ((path, _leaf), candidates) in enumerate(zip(leaves_with_path, specs)):
    names = [key_name(e) for e in path]
    for dims in candidates:
      hit = None
      for j in range(len(names) - 1, -1, -1):
        if names[j] == dims.a_name:
          hit = (j, "a")
          break
        if names[j] == dims.b_name:
          hit = (j, "b")
          break
      if hit is None:
        continue
      j, role = hit
      key = (tuple(path[:j]), tuple(path[j + 1 :]), dims)
      if key not in groups:
        groups[key] = {}
        order.append(key)
      if role in groups[key]:  # pragma: no cover - impossible for distinct leaves
        raise ValueError(f"duplicate LoRA factor {role!r} at {jax.tree_util.keystr(path)}")
      groups[key][role] = index
      break

  leaves = [leaf for _, leaf in leaves_with_path]
  modules = []
  for key in order:
    parent, suffix, dims = key
    name = module_name(parent)
    found = groups[key]
    if "a" not in found or "b" not in found:
      missing = dims.b_name if "a" in found else dims.a_name
      present = dims.a_name if "a" in found else dims.b_name
      raise ValueError(
          f"LoRA module {name!r}: found {present!r} but no sibling {missing!r} "
          f"(lora_dims={dims})"
      )
    a_shape = _shape(leaves[found["a"]])
    b_shape = _shape(leaves[found["b"]])
    if len(a_shape) < 2 or len(b_shape) < 2:
      raise ValueError(
          f"LoRA module {name!r}: factors must be at least 2-D, got {dims.a_name} {a_shape} "
          f"and {dims.b_name} {b_shape}"
      )
    r_a = a_shape[dims.a_rank_axis]
    r_b = b_shape[dims.b_rank_axis]
    if r_a != r_b or a_shape[:-2] != b_shape[:-2]:
      raise ValueError(
          f"LoRA module {name!r}: rank axes disagree: {dims.a_name} {a_shape} has rank {r_a} "
          f"(axis {dims.a_rank_axis}), {dims.b_name} {b_shape} has rank {r_b} "
          f"(axis {dims.b_rank_axis}); leading axes {a_shape[:-2]} vs {b_shape[:-2]}"
      )
    modules.append(LoraModule(name, found["a"], found["b"], dims, int(r_a)))
  return modules


def _shape(leaf) -> tuple[int, ...]:
  value = leaf.get_value() if hasattr(leaf, "get_value") else leaf  # nnx.Variable -> array
  return tuple(getattr(value, "shape", ()))

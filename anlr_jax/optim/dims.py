r"""Finding LoRA modules in a parameter pytree.

A LoRA module is a pair of sibling leaves: a factor ``A`` and a factor ``B`` whose product is the
adapter update. Which leaves they are, and which of their axes is the rank axis, is declared with a
:class:`LoraDims` spec, in the style of ``optax.contrib.MuonDimensionNumbers``:

* Flax NNX layout (:data:`FLAX`): ``lora_a`` of shape ``(..., *in, r)`` and ``lora_b`` of shape
  ``(..., r, *out)``;
* Qwix layout (:data:`QWIX`): the same axes, named ``<weight>_lora_a`` / ``<weight>_lora_b`` for any
  weight name (``kernel_lora_a``, ``w_lora_a``);
* PEFT layout (:data:`PEFT`): ``lora_A`` of shape ``(..., r, d_in)`` and ``lora_B`` of shape
  ``(..., d_out, r)`` (with or without a trailing ``weight`` key);
* quax's ``LoraArray`` (:data:`QUAX`): ``a (..., out, r)``, ``b (..., r, in)``.

The default (``lora_dims=None``) is :data:`AUTO`, the first three together: their names never clash.

A factor may have several feature axes (``*in``, ``*out``: Qwix on ``nnx.Einsum`` and ``nnx.Conv``
kernels, e.g. ``A (2, 8, r)`` with ``B (r, 16)``): it is the 2-D factor obtained by flattening them,
and the rank-one contribution of rank ``k`` is ``A[..., k] ⊗ B[k, ...]``. Leading ``...`` axes that
``A`` and ``B`` share are batch axes: every slice is an independent module (e.g. layers stacked
under ``nnx.scan``). The batch axes are the longest common leading axes that leave each factor at
least one feature axis and give both the same rank.

Leaves are paired by *structure*, not by regex on path strings: each path entry's name (dict key,
attribute, index; a dict key with dots, as in the flat dict ``safetensors.load_file`` returns, counts
as its dotted parts) is compared with ``a_name`` / ``b_name``; the last entry that matches splits the
path into a parent (the module) and a suffix (e.g. ``.value`` for ``nnx.Variable`` leaves, or
``weight``); an ``A`` leaf and a ``B`` leaf with the same parent, suffix and wildcard stem form one
module, named by the parent's names joined with ``.`` (``model.layers.0.self_attn.q_proj``: the name
the LoRA injection, the adapter file, the diagnostics and the analysis use for the same module),
followed by the stem for wildcard names (``layers.0.attn.q_einsum.w``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Union

import jax

from anlr_jax.naming import key_name

__all__ = [
    "LoraDims",
    "LoraModule",
    "FLAX",
    "QWIX",
    "PEFT",
    "QUAX",
    "AUTO",
    "find_lora_modules",
]


@dataclasses.dataclass(frozen=True)
class LoraDims:
  """Names and rank axes of the two factors of a LoRA module.

  Attributes:
    a_name: key (dict key or attribute name) of the ``A`` factor; may hold one ``*`` standing for
      any non-empty stem (``"*_lora_a"``), which ``b_name`` must then hold too.
    b_name: key of the ``B`` factor.
    a_rank_axis: rank axis of ``A``; ``-1`` for ``(..., *in, r)``, ``-2`` for ``(..., r, *in)``
      (the first axis after the batch axes).
    b_rank_axis: rank axis of ``B``; ``-2`` for ``(..., r, *out)`` (the first axis after the batch
      axes), ``-1`` for ``(..., *out, r)``.
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
    stars = (self.a_name.count("*"), self.b_name.count("*"))
    if stars not in ((0, 0), (1, 1)):
      raise ValueError(
          f"LoraDims names hold one '*' each or none, got a_name={self.a_name!r}, "
          f"b_name={self.b_name!r}"
      )

  def match(self, name) -> tuple[str, str] | None:
    """``(role, stem)`` if ``name`` is this spec's ``A`` (role ``"a"``) or ``B`` (``"b"``) name."""
    if not isinstance(name, str):
      return None
    for role, pattern in (("a", self.a_name), ("b", self.b_name)):
      prefix, star, suffix = pattern.partition("*")
      if not star:
        if name == pattern:
          return role, ""
      elif (
          len(name) > len(prefix) + len(suffix)
          and name.startswith(prefix)
          and name.endswith(suffix)
      ):
        return role, name[len(prefix) : len(name) - len(suffix)]
    return None


FLAX = LoraDims("lora_a", "lora_b", a_rank_axis=-1, b_rank_axis=-2)
QWIX = LoraDims("*_lora_a", "*_lora_b", a_rank_axis=-1, b_rank_axis=-2)
PEFT = LoraDims("lora_A", "lora_B", a_rank_axis=-2, b_rank_axis=-1)
QUAX = LoraDims("a", "b", a_rank_axis=-1, b_rank_axis=-2)
AUTO = (FLAX, QWIX, PEFT)
"""The default layouts: names no other library gives a non-LoRA leaf. :data:`QUAX`'s ``a``/``b`` are
left out: a model may well have leaves named so that are no LoRA factors."""

LoraDimsSpec = Union[None, LoraDims, Sequence[LoraDims], Callable[[Any], Any], Any]


@dataclasses.dataclass(frozen=True)
class LoraModule:
  """One LoRA module found in a pytree: flat leaf indices of its factors, its layout and axes."""

  name: str
  a_index: int
  b_index: int
  dims: LoraDims
  rank: int
  a_feature_axes: tuple[int, ...] = ()  # negative axes of A's *in; () for the single axis
  b_feature_axes: tuple[int, ...] = ()  # negative axes of B's *out; () for the single axis

  @property
  def a_feature_axis(self) -> int | tuple[int, ...]:
    """The axis (or axes) of ``A`` summed over to get per-rank quantities (``d_in``)."""
    return _one_or_all(self.a_feature_axes, -2 if self.dims.a_rank_axis == -1 else -1)

  @property
  def b_feature_axis(self) -> int | tuple[int, ...]:
    """The axis (or axes) of ``B`` summed over to get per-rank quantities (``d_out``)."""
    return _one_or_all(self.b_feature_axes, -2 if self.dims.b_rank_axis == -1 else -1)


def _one_or_all(axes: tuple[int, ...], single: int) -> int | tuple[int, ...]:
  return single if len(axes) <= 1 else axes


def _is_spec_leaf(x) -> bool:
  return x is None or isinstance(x, LoraDims)


def _leaf_specs(tree, lora_dims: LoraDimsSpec, num_leaves: int) -> list[tuple[LoraDims, ...]]:
  """Candidate specs for every leaf of ``tree`` (flat order)."""
  if callable(lora_dims) and not isinstance(lora_dims, LoraDims):
    lora_dims = lora_dims(tree)
  if lora_dims is None:
    return [AUTO] * num_leaves
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
    lora_dims: the layout spec: ``None`` (:data:`AUTO`: Flax, Qwix and PEFT names), a
      :class:`LoraDims`, a sequence of them (several layouts in one tree), a prefix pytree of
      ``LoraDims``/``None`` (``None``: no LoRA under that subtree), or a callable ``params -> spec``.

  Returns:
    The modules, in flat-leaf order of their ``A`` factor. Each module's ``name`` is its parent
    path's names joined with ``.`` (``''`` for factors at the root), then ``.<stem>`` for wildcard
    names.

  Raises:
    ValueError: an ``A`` factor without its ``B`` sibling (or the reverse), factors that are not at
      least 2-D, or whose rank axes disagree; the message names the module path.
  """
  leaves_with_path, _ = jax.tree_util.tree_flatten_with_path(tree)
  specs = _leaf_specs(tree, lora_dims, len(leaves_with_path))
  # (parent, suffix, dims, stem) -> {"a": index, "b": index}
  groups: dict[tuple, dict[str, int]] = {}
  for index, ((path, _leaf), candidates) in enumerate(zip(leaves_with_path, specs)):
    names = path_names(path)
    for dims in candidates:
      hit = None
      for j in range(len(names) - 1, -1, -1):
        hit = dims.match(names[j])
        if hit is not None:
          break
      if hit is None:
        continue
      role, stem = hit
      key = (tuple(names[:j]), tuple(names[j + 1 :]), dims, stem)
      found = groups.setdefault(key, {})
      if role in found:
        raise ValueError(f"duplicate LoRA factor {role!r} at {jax.tree_util.keystr(path)}")
      found[role] = index
      break

  leaves = [leaf for _, leaf in leaves_with_path]
  modules = []
  for key, found in groups.items():
    parent, _, dims, stem = key
    name = ".".join(str(n) for n in parent + ((stem,) if stem else ()))
    a_role, b_role = (dims.a_name.replace("*", stem), dims.b_name.replace("*", stem))
    if "a" not in found or "b" not in found:
      missing, present = (b_role, a_role) if "a" in found else (a_role, b_role)
      raise ValueError(
          f"LoRA module {name!r}: found {present!r} but no sibling {missing!r} "
          f"(lora_dims={dims})"
      )
    a_shape = leaf_shape(leaves[found["a"]])
    b_shape = leaf_shape(leaves[found["b"]])
    if len(a_shape) < 2 or len(b_shape) < 2:
      raise ValueError(
          f"LoRA module {name!r}: factors must be at least 2-D, got {a_role} {a_shape} "
          f"and {b_role} {b_shape}"
      )
    axes = _module_axes(a_shape, b_shape, dims)
    if axes is None:
      raise ValueError(
          f"LoRA module {name!r}: rank axes disagree: {a_role} {a_shape} (rank axis "
          f"{dims.a_rank_axis}) and {b_role} {b_shape} (rank axis {dims.b_rank_axis}) give no "
          "common rank over shared leading (batch) axes"
      )
    rank, a_axes, b_axes = axes
    _check_low_rank(name, a_shape, b_shape, dims, a_role, b_role, axes)
    modules.append(LoraModule(name, found["a"], found["b"], dims, rank, a_axes, b_axes))
  return sorted(modules, key=lambda m: m.a_index)


def _feature_sizes(a_shape, b_shape, axes) -> tuple[int, int]:
  """``(d_in, d_out)``: the products of ``A``'s and ``B``'s feature axes."""
  _, a_axes, b_axes = axes
  return math.prod(a_shape[i] for i in a_axes), math.prod(b_shape[i] for i in b_axes)


def _check_low_rank(name, a_shape, b_shape, dims: LoraDims, a_role, b_role, axes) -> None:
  """Refuses a pairing that reads the other layout's factors with their axes swapped.

  A square layer's factors in PEFT's layout, ``A (r, d)`` and ``B (d, r)``, fit Flax's layout too,
  with rank ``d`` over ``r`` features: the names cannot tell the layouts apart, the shapes can. A
  pairing whose rank is not smaller than both feature sizes while the other layout pairs the same
  shapes with a smaller rank is refused. Factors only this layout pairs are kept whatever their
  rank (a rank above both feature sizes is a well-defined, if wasteful, module), and so is the
  square full-rank case (``r = d_in = d_out``), which reads the same in every layout.
  """
  rank = axes[0]
  d_in, d_out = _feature_sizes(a_shape, b_shape, axes)
  if rank < d_in or rank < d_out or rank == d_in == d_out:
    return
  flipped = dataclasses.replace(
      dims, a_rank_axis=-3 - dims.a_rank_axis, b_rank_axis=-3 - dims.b_rank_axis
  )
  other = _module_axes(a_shape, b_shape, flipped)
  if other is None or other[0] >= rank:
    return
  axes_of = "PEFT" if flipped.a_rank_axis == -2 else "FLAX"
  layout = "A (r, d_in), B (d_out, r)" if axes_of == "PEFT" else "A (d_in, r), B (r, d_out)"
  raise ValueError(
      f"LoRA module {name or '<root>'!r}: {a_role} {a_shape} and {b_role} {b_shape} pair with rank "
      f"{rank} in the layout of lora_dims={spec_repr(dims)}, not smaller than their feature sizes "
      f"{d_in} and {d_out} (each feature would get its own multiplier); read in {axes_of}'s layout "
      f"({layout}) they pair with rank {other[0]}: if that is theirs, pass "
      f"lora_dims={spec_repr(flipped)}"
      + ("" if _preset_name(flipped) else f" (anlr_jax.{axes_of}'s axes under these names)")
  )


def spec_repr(dims: LoraDims) -> str:
  preset = _preset_name(dims)
  if preset:
    return f"anlr_jax.{preset}"
  return (
      f"anlr_jax.LoraDims({dims.a_name!r}, {dims.b_name!r}, a_rank_axis={dims.a_rank_axis}, "
      f"b_rank_axis={dims.b_rank_axis})"
  )


def _preset_name(dims: LoraDims) -> str | None:
  for name, preset in (("FLAX", FLAX), ("QWIX", QWIX), ("PEFT", PEFT), ("QUAX", QUAX)):
    if dims == preset:
      return name
  return None


def path_names(path) -> list:
  """The names of a key path's entries, a dotted string key counted as its parts."""
  names = []
  for entry in path:
    name = key_name(entry)
    names.extend(name.split(".") if isinstance(name, str) and name else [name])
  return names


def _module_axes(a_shape, b_shape, dims: LoraDims):
  """``(rank, a_feature_axes, b_feature_axes)`` (negative axes) of a module, or None.

  The batch axes are the longest common leading axes of ``A`` and ``B`` that leave each factor a
  rank axis and at least one feature axis and give both factors the same rank.
  """
  for n_batch in range(min(len(a_shape), len(b_shape)) - 2, -1, -1):
    if a_shape[:n_batch] != b_shape[:n_batch]:
      continue
    a_rank = len(a_shape) - 1 if dims.a_rank_axis == -1 else n_batch
    b_rank = n_batch if dims.b_rank_axis == -2 else len(b_shape) - 1
    if a_shape[a_rank] != b_shape[b_rank]:
      continue
    a_axes = tuple(i - len(a_shape) for i in range(n_batch, len(a_shape)) if i != a_rank)
    b_axes = tuple(i - len(b_shape) for i in range(n_batch, len(b_shape)) if i != b_rank)
    return int(a_shape[a_rank]), a_axes, b_axes
  return None


def leaf_shape(leaf) -> tuple[int, ...]:
  """The shape of a params-tree leaf (an ``nnx.Variable``'s value, an array; ``()`` otherwise)."""
  value = leaf.get_value() if hasattr(leaf, "get_value") else leaf  # nnx.Variable -> array
  return tuple(getattr(value, "shape", ()))

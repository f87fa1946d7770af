r"""What the optimizers see in a parameter tree: :func:`describe`, and the check that they see LoRA.

``anlr``, ``scale_by_anlr`` and ``loraplus`` act on the LoRA modules :func:`~anlr_jax.find_lora_modules`
finds and update every other leaf as plain AdamW. A tree where none is found would silently train
plain AdamW; :func:`require_lora_modules` makes that an error at ``init`` instead, naming the leaves
that look like LoRA factors and the ``lora_dims`` that would pair them.
"""

from __future__ import annotations

import jax

from anlr_jax.optim.dims import (
    FLAX,
    PEFT,
    QUAX,
    QWIX,
    LoraDimsSpec,
    LoraModule,
    find_lora_modules,
    leaf_shape,
    path_names,
)

__all__ = ["describe", "require_lora_modules", "PRESETS"]

PRESETS = {"FLAX": FLAX, "QWIX": QWIX, "PEFT": PEFT, "QUAX": QUAX}
"""The named layouts, as ``anlr_jax.<NAME>``: what an error message proposes as ``lora_dims``."""

_SHOWN = 6  # leaves named in one message


def _leaf_names(tree) -> list[tuple[str, tuple[int, ...]]]:
  """``(dotted path, shape)`` of every leaf, in flat order."""
  return [
      (".".join(str(n) for n in path_names(path)), leaf_shape(leaf))
      for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]


def _spec_name(lora_dims: LoraDimsSpec) -> str:
  if lora_dims is None:
    return "None (Flax lora_a/lora_b, Qwix *_lora_a/*_lora_b, PEFT lora_A/lora_B)"
  for name, spec in PRESETS.items():
    if lora_dims == spec:
      return f"anlr_jax.{name}"
  return repr(lora_dims)


def _suggestions(tree) -> list[str]:
  """``'lora_dims=anlr_jax.QUAX (3 modules)'`` for each preset that finds modules in ``tree``."""
  out = []
  for name, spec in PRESETS.items():
    try:
      found = find_lora_modules(tree, spec)
    except ValueError:
      continue
    if found:
      out.append(f"lora_dims=anlr_jax.{name} ({len(found)} modules)")
  return out


def _looks_like_factor(name: str) -> bool:
  """A name with ``lora`` in it, or quax's ``a`` / ``b`` as one of its last two parts."""
  parts = name.split(".")
  return "lora" in name.lower() or any(QUAX.match(p) is not None for p in parts[-2:])


def require_lora_modules(
    tree, lora_dims: LoraDimsSpec, who: str, *, require_lora: bool = True
) -> list[LoraModule]:
  """:func:`~anlr_jax.find_lora_modules`, raising a one-line ``ValueError`` when it finds none.

  Args:
    tree: the parameters ``init`` is given.
    lora_dims: the layout spec (see :func:`~anlr_jax.find_lora_modules`).
    who: the optimizer's name, for the message.
    require_lora: False accepts a tree without LoRA modules (then every leaf is plain AdamW).
  """
  modules = find_lora_modules(tree, lora_dims)
  if modules or not require_lora or not jax.tree.leaves(tree):
    return modules
  leaves = _leaf_names(tree)
  lookalikes = [f"{n} {s}" for n, s in leaves if len(s) >= 2 and _looks_like_factor(n)]
  hints = _suggestions(tree) if lookalikes else []
  seen = (
      f"leaves that look like LoRA factors: {', '.join(lookalikes[:_SHOWN])}"
      + (f" (+{len(lookalikes) - _SHOWN} more)" if len(lookalikes) > _SHOWN else "")
      if lookalikes
      else f"no leaf looks like a LoRA factor ({len(leaves)} leaves)"
  )
  fix = (
      f"try {' or '.join(hints)}"
      if hints
      else "pass lora_dims=anlr_jax.LoraDims(a_name, b_name, a_rank_axis, b_rank_axis) naming them"
  )
  raise ValueError(
      f"{who}: no LoRA module found with lora_dims={_spec_name(lora_dims)}, so every leaf would "
      f"train as plain AdamW; {seen}; {fix}; or pass require_lora=False if the tree has no LoRA"
  )


def describe(tree, lora_dims: LoraDimsSpec = None) -> str:
  """A table of what AnLR does with ``tree``: its LoRA modules and the leaves left on plain AdamW.

  Args:
    tree: parameters, as given to the optimizer's ``init`` (arrays, ``jax.ShapeDtypeStruct`` or
      ``nnx.Variable`` leaves; an ``nnx.State`` of ``nnx.LoRAParam``, an Equinox module, ...).
    lora_dims: the layout spec the optimizer is given (see :func:`~anlr_jax.find_lora_modules`).

  Returns:
    Lines ``<module>  A <shape>  B <shape>  rank <r>[  x<batch> stacked]`` for each module, then
    the other leaves with their shapes: print it before a long run.

  Example:
    >>> import jax.numpy as jnp, anlr_jax
    >>> params = {"q": {"lora_a": jnp.zeros((8, 4)), "lora_b": jnp.zeros((4, 6))},
    ...           "head": jnp.zeros((6, 2))}
    >>> print(anlr_jax.describe(params))
    1 LoRA module (per-rank multipliers), 1 leaf on plain AdamW
      q  A (8, 4)  B (4, 6)  rank 4
    plain AdamW: head (6, 2)
  """
  modules = find_lora_modules(tree, lora_dims)
  leaves = _leaf_names(tree)
  factor_leaves = {i for m in modules for i in (m.a_index, m.b_index)}
  others = [f"{n} {s}" for i, (n, s) in enumerate(leaves) if i not in factor_leaves]
  lines = [
      f"{len(modules)} LoRA module{'' if len(modules) == 1 else 's'} (per-rank multipliers), "
      f"{len(others)} {'leaf' if len(others) == 1 else 'leaves'} on plain AdamW"
  ]
  for m in modules:
    a_shape, b_shape = leaves[m.a_index][1], leaves[m.b_index][1]
    n_batch = len(a_shape) - 1 - len(_axes(m.a_feature_axis))
    batch = a_shape[:n_batch]
    stacked = f"  x{'x'.join(map(str, batch))} stacked" if batch else ""
    lines.append(f"  {m.name or '<root>'}  A {a_shape}  B {b_shape}  rank {m.rank}{stacked}")
  if others:
    lines.append(f"plain AdamW: {', '.join(others)}")
  return "\n".join(lines)


def _axes(axis) -> tuple[int, ...]:
  return axis if isinstance(axis, tuple) else (axis,)

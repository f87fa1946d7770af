r"""What the optimizers see in a parameter tree: :func:`describe`, and the check that they see LoRA.

``anlr``, ``scale_by_anlr`` and ``loraplus`` act on the LoRA modules :func:`~anlr_jax.find_lora_modules`
finds and update every other leaf as plain AdamW. A tree where none is found would silently train
plain AdamW; :func:`require_lora_modules` makes that an error at ``init`` instead, naming the leaves
that look like LoRA factors and the ``lora_dims`` that would pair them. Where some modules are found
and other leaves named like LoRA factors are not (``lora_down``/``lora_up`` next to Flax's
``lora_a``/``lora_b``), it warns once, naming them and the ``lora_dims`` that would pair them too.
"""

from __future__ import annotations

import warnings

import jax

from anlr_jax.optim.dims import (
    FLAX,
    PEFT,
    QUAX,
    QWIX,
    LoraDims,
    LoraDimsSpec,
    LoraModule,
    find_lora_modules,
    leaf_shape,
    path_names,
    spec_repr,
)

__all__ = ["describe", "require_lora_modules", "PRESETS", "UnpairedFactorsWarning"]

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


def _is_magnitude(parts) -> bool:
  """A DoRA magnitude vector (``lora_magnitude``, PEFT's ``lora_magnitude_vector``): not a factor,
  though stacked over layers it has two axes."""
  return any("magnitude" in str(p).lower() for p in parts)


def _looks_like_factor(name: str) -> bool:
  """A name with ``lora`` in it (not a DoRA magnitude), or quax's ``a`` / ``b`` as one of its last
  two parts."""
  parts = name.split(".")
  lora = "lora" in name.lower() and not _is_magnitude(parts)
  return lora or any(QUAX.match(p) is not None for p in parts[-2:])


class UnpairedFactorsWarning(UserWarning):
  """Leaves named like LoRA factors that are in no LoRA module found: they train as plain AdamW."""


# The last part of a factor's name in layouts AUTO does not know: ``<stem>down`` / ``<stem>up``
# (``lora_down``, ``w_down``) and quax's ``a`` / ``b``.
_FACTOR_PAIRS = (("down", "up"), ("a", "b"))


def _pair_role(name) -> tuple[str, str, str] | None:
  """``(stem, token, partner)`` if ``name`` is ``<stem><token>`` for a token of a factor pair, the
  stem empty or ending in ``_``."""
  if not isinstance(name, str):
    return None
  for pair in _FACTOR_PAIRS:
    for token, partner in (pair, pair[::-1]):
      stem = name[: len(name) - len(token)]
      if name.endswith(token) and (not stem or stem.endswith("_")):
        return stem, token, partner
  return None


def _unpaired_factors(tree, modules: list[LoraModule]):
  """The leaves outside ``modules`` that are named like LoRA factors, and a spec pairing them.

  A leaf of at least 2 axes counts when a part of its path holds ``lora`` (a DoRA magnitude
  does not) or when the last part
  naming it is ``<stem>down`` (``<stem>a``) with a sibling ``<stem>up`` (``<stem>b``).

  Returns:
    ``(names, specs)``: ``'<path> <shape>'`` of each such leaf, and the :class:`LoraDims` (Flax
    or PEFT axes, whichever pairs their shapes) for the sibling pairs among them.
  """
  in_modules = {i for m in modules for i in (m.a_index, m.b_index)}
  flat = [
      (tuple(path_names(path)), leaf_shape(leaf))
      for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]
  candidates = {names: i for i, (names, shape) in enumerate(flat) if len(shape) >= 2}
  found, specs = set(), []
  for names, i in candidates.items():
    if i in in_modules:
      continue
    if any("lora" in str(n).lower() for n in names) and not _is_magnitude(names):
      found.add(i)
    for j in range(len(names) - 1, -1, -1):
      role = _pair_role(names[j])
      if role is None:
        continue
      stem, token, partner = role
      sibling = names[:j] + (stem + partner,) + names[j + 1 :]
      k = candidates.get(sibling)
      if k is not None and k not in in_modules:
        found.update((i, k))
        if token in ("down", "a"):
          spec = _pairing_spec(stem + token, stem + partner, flat[i][1], flat[k][1])
          if spec is not None and spec not in specs:
            specs.append(spec)
      break
  names = [f"{'.'.join(map(str, flat[i][0]))} {flat[i][1]}" for i in sorted(found)]
  return names, specs


def _pairing_spec(a_name, b_name, a_shape, b_shape) -> LoraDims | None:
  """A :class:`LoraDims` with Flax's or PEFT's axes that pairs ``a_name``/``b_name``'s shapes."""
  for dims in (FLAX, PEFT):
    spec = LoraDims(a_name, b_name, dims.a_rank_axis, dims.b_rank_axis)
    try:
      if find_lora_modules(
          {
              a_name: jax.ShapeDtypeStruct(a_shape, "float32"),
              b_name: jax.ShapeDtypeStruct(b_shape, "float32"),
          },
          spec,
      ):
        return spec
    except ValueError:
      continue
  return None


def _pairs_all(tree, lora_dims: list[LoraDims]) -> bool:
  """Whether ``lora_dims`` pairs ``tree`` without an error and leaves no lookalike out."""
  try:
    return not _unpaired_factors(tree, find_lora_modules(tree, lora_dims))[0]
  except ValueError:
    return False


def _warn_unpaired(tree, lora_dims: LoraDimsSpec, modules: list[LoraModule], who: str) -> None:
  names, specs = _unpaired_factors(tree, modules)
  if not names:
    return
  layouts = list(dict.fromkeys(m.dims for m in modules))
  if specs and _pairs_all(tree, layouts + specs):
    fix = f"lora_dims=[{', '.join(spec_repr(d) for d in layouts + specs)}]"
  else:
    fix = (
        f"a LoraDims for them in a sequence with the layouts found (lora_dims=["
        f"{', '.join(spec_repr(d) for d in layouts)}, anlr_jax.LoraDims(a_name, b_name, "
        "a_rank_axis, b_rank_axis)]), or a prefix pytree of LoraDims/None where names clash"
    )
  warnings.warn(
      f"{who}: {len(modules)} LoRA module{'' if len(modules) == 1 else 's'} found with "
      f"lora_dims={_spec_name(lora_dims)}, but {len(names)} "
      f"{'leaf' if len(names) == 1 else 'leaves'} named like LoRA factors "
      f"{'is' if len(names) == 1 else 'are'} in none and train as plain AdamW: "
      f"{', '.join(names[:_SHOWN])}"
      + (f" (+{len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")
      + f"; if they are LoRA factors, declare them: {fix}",
      UnpairedFactorsWarning,
      stacklevel=4,
  )


def require_lora_modules(
    tree, lora_dims: LoraDimsSpec, who: str, *, require_lora: bool = True
) -> list[LoraModule]:
  """:func:`~anlr_jax.find_lora_modules`, raising a one-line ``ValueError`` when it finds none.

  When it finds some, leaves named like LoRA factors that are in none of them (see
  :func:`_unpaired_factors`) are named in an :class:`UnpairedFactorsWarning`.

  Args:
    tree: the parameters ``init`` is given.
    lora_dims: the layout spec (see :func:`~anlr_jax.find_lora_modules`).
    who: the optimizer's name, for the message.
    require_lora: False accepts a tree without LoRA modules (then every leaf is plain AdamW).
  """
  modules = find_lora_modules(tree, lora_dims)
  if modules:
    _warn_unpaired(tree, lora_dims, modules, who)
    return modules
  if not require_lora or not jax.tree.leaves(tree):
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

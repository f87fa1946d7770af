r"""Inject ``LoRALinear`` adapters into any Flax NNX module tree by attribute name.

Every ``nnx.Linear`` reached from the model whose own name (last key of its path, e.g. ``q_proj``
in ``model.layers.3.self_attn.q_proj``) is in ``target_modules`` is replaced in place by
``LoRALinear(linear, ...)``. Nested modules, ``nnx.List``/``nnx.Dict`` and plain lists or dicts
marked with ``nnx.data`` are all walked. Paths are ``'.'.join`` of the NNX path, which for the
project's LLaMA/Qwen2 model equals the Hugging Face module name.

A model may confine adapters to one submodule by naming its path in a class attribute
``ADAPTER_SCOPE`` (LLaVA: ``('model', 'language_model')``, so the vision tower's ``q_proj`` are
never targeted); target names are then matched only below it, and paths stay full paths.
"""

from __future__ import annotations

import typing as tp

from flax import nnx

from anlr_jax.nn.lora import LoRALinear
from anlr_jax.naming import module_name

PAPER_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "up_proj", "down_proj")
"""LoRA targets of the paper (App. B): the one source of truth for the default target names."""

PathParts = tuple[tp.Union[str, int], ...]


def path_str(path: PathParts) -> str:
  """``('model', 'layers', 0, 'q_proj') -> 'model.layers.0.q_proj'``: the project's one module-naming
  rule, :func:`anlr_jax.naming.module_name` (the optimizer and the adapter file use it too)."""
  return module_name(path)


def _child(node: tp.Any, key: tp.Union[str, int]) -> tp.Any:
  if isinstance(key, str) and hasattr(node, key) and not isinstance(node, dict):
    return getattr(node, key)
  return node[key]


def get_submodule(model: nnx.Module, path: PathParts) -> tp.Any:
  """The node at ``path`` below ``model`` (attribute, list index or dict key at each step)."""
  node = model
  for i, key in enumerate(path):
    try:
      node = _child(node, key)
    except (AttributeError, KeyError, IndexError, TypeError) as err:
      raise KeyError(
          f"no submodule at '{path_str(path[: i + 1])}' in {type(model).__name__}"
      ) from err
  return node


def set_submodule(model: nnx.Module, path: PathParts, value: nnx.Module) -> None:
  """Replace the node at ``path`` (non-empty) below ``model`` with ``value``, in place."""
  if not path:
    raise ValueError("set_submodule: cannot replace the root module")
  parent, key = get_submodule(model, path[:-1]), path[-1]
  if isinstance(parent, tuple):
    raise TypeError(f"cannot replace '{path_str(path)}': it lives in an immutable tuple")
  if isinstance(key, str) and not isinstance(parent, dict) and hasattr(parent, key):
    setattr(parent, key, value)
  else:
    parent[key] = value


def adapter_scope(model: nnx.Module) -> PathParts:
  """The path below which adapters go: the model's ``ADAPTER_SCOPE``, or ``()`` (everywhere)."""
  return tuple(getattr(model, "ADAPTER_SCOPE", ()))


def iter_scope_modules(model: nnx.Module) -> tp.Iterator[tuple[PathParts, tp.Any]]:
  """``(full path, module)`` of every module in the model's :func:`adapter_scope`."""
  scope = adapter_scope(model)
  for path, module in nnx.iter_modules(get_submodule(model, scope)):
    yield (*scope, *path), module


def iter_lora_layers(model: nnx.Module) -> tp.Iterator[tuple[str, LoRALinear]]:
  """``(dotted path, layer)`` for every ``LoRALinear`` in ``model``, in a deterministic order."""
  found = [(path_str(p), m) for p, m in nnx.iter_modules(model) if isinstance(m, LoRALinear)]
  yield from sorted(found, key=lambda item: item[0])


def target_linears(model: nnx.Module, target_modules: tp.Sequence[str]) -> list[tuple[tp.Any, ...]]:
  """The paths of the ``nnx.Linear`` layers of ``model`` named in ``target_modules``, sorted: the
  layers every ``inject_*`` function wraps, in the order it wraps them (so the random init of each
  adapter depends only on ``rngs`` and the model structure).

  Raises:
    ValueError: ``target_modules`` is a string or empty, a name matches no ``nnx.Linear``, or a
      targeted layer holds an adapter already (an adapter layer is injected once per model).
  """
  if isinstance(target_modules, str):
    raise ValueError(
        f"target_modules must be a sequence of names, got the string {target_modules!r}"
    )
  target_modules = tuple(target_modules)
  if not target_modules:
    raise ValueError("target_modules is empty")
  targets = set(target_modules)
  linears, matched = [], set()
  for path, module in iter_scope_modules(model):
    if not path or not isinstance(path[-1], str) or path[-1] not in targets:
      continue
    if isinstance(getattr(module, "base", None), nnx.Linear):  # LoRA, LoRA-Dash, AdaLoRA layers
      raise ValueError(
          f"'{path_str(path)}' already holds a {type(module).__name__}; an adapter layer is"
          " injected once per model"
      )
    if isinstance(module, nnx.Linear):
      linears.append(tuple(path))
      matched.add(path[-1])
  missing = [t for t in target_modules if t not in matched]
  if missing:
    raise ValueError(
        f"target_modules {missing} match no nnx.Linear attribute in {type(model).__name__}"
    )
  return sorted(linears, key=path_str)


def inject_lora(
    model: nnx.Module,
    *,
    target_modules: tp.Sequence[str] = PAPER_TARGET_MODULES,
    rank: int,
    alpha: float,
    dropout: float = 0.05,
    use_rslora: bool = False,
    init: str = "default",
    use_dora: bool = False,
    rngs: nnx.Rngs,
) -> nnx.Module:
  r"""Replace every targeted ``nnx.Linear`` of ``model`` by a ``LoRALinear``, in place.

  Each wrapped layer computes ``x W0 + b + c drop(x) A B`` (DoRA: see ``anlr_jax.nn.lora``) with
  ``c = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA). Layers are wrapped in sorted path order, so
  the random ``A`` of each layer depends only on ``rngs`` and the model structure.

  Args:
    model: any NNX module tree; modified in place and returned.
    target_modules: attribute names to adapt (default: the paper's ``PAPER_TARGET_MODULES``).
    rank, alpha, dropout, use_rslora, init, use_dora: see ``LoRALinear``.
    rngs: random streams for the adapter init and dropout.

  Returns:
    ``model`` itself, with the adapters inserted.

  Raises:
    ValueError: a target name matches no ``nnx.Linear``, ``target_modules`` is empty or a plain
      string, or the model already has an adapter at a targeted path.

  Example:
    >>> from flax import nnx
    >>> class Attn(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.q_proj = nnx.Linear(4, 4, rngs=rngs)
    ...     self.o_proj = nnx.Linear(4, 4, rngs=rngs)
    >>> model = inject_lora(Attn(nnx.Rngs(0)), target_modules=("q_proj",), rank=2, alpha=4.0,
    ...                     rngs=nnx.Rngs(1))
    >>> type(model.q_proj).__name__, type(model.o_proj).__name__
    ('LoRALinear', 'Linear')
  """
  for path in target_linears(model, target_modules):
    linear = get_submodule(model, path)
    set_submodule(
        model,
        path,
        LoRALinear(
            linear,
            rank=rank,
            alpha=alpha,
            dropout=dropout,
            use_rslora=use_rslora,
            init=init,
            use_dora=use_dora,
            rngs=rngs,
        ),
    )
  return model


def lora_state(model: nnx.Module) -> nnx.State:
  """The trainable adapter parameters: ``nnx.state(model, nnx.LoRAParam)``."""
  return nnx.state(model, nnx.LoRAParam)


def merge_all(model: nnx.Module) -> nnx.Module:
  """``merge()`` every ``LoRALinear`` of ``model`` (in place); returns ``model``."""
  for _, layer in iter_lora_layers(model):
    layer.merge()
  return model


def unmerge_all(model: nnx.Module) -> nnx.Module:
  """``unmerge()`` every ``LoRALinear`` of ``model`` (in place); returns ``model``."""
  for _, layer in iter_lora_layers(model):
    layer.unmerge()
  return model

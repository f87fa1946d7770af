"""The one module-naming rule, and the keys of adapter files built on it.

:func:`module_name`: the names of a module's path joined with ``.``, as PyTorch / PEFT name modules
(``model.layers.0.self_attn.q_proj``; the root module is ``""``). The optimizer's per-module state
(:func:`anlr_jax.find_lora_modules`), the LoRA injection (:func:`anlr_jax.nn.iter_lora_layers`), the
adapter file (:func:`adapter_key`), the diagnostics and the analysis all use it, so the same module
has the same name everywhere and names are compared with ``==``. The module imports nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["ADAPTER_KEY_SEP", "adapter_key", "key_name", "module_name", "split_adapter_key"]

ADAPTER_KEY_SEP = "/"
"""Separates the module name from the variable name in an adapter file key (``<module>/lora_a``);
variable names hold no ``/``, so the last one splits the key."""


def key_name(entry: Any) -> Any:
  """The name of one path entry: a ``str`` / ``int`` as is, or the key of a JAX key-path entry
  (``DictKey.key``, ``GetAttrKey.name``, ``SequenceKey.idx``, ``FlattenedIndexKey.key``)."""
  if isinstance(entry, (str, int)):
    return entry
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return getattr(entry, attr)
  return str(entry)


def module_name(path: Iterable[Any]) -> str:
  """The one module-naming rule: the names of ``path``'s entries joined with ``.``.

  ``path`` is an NNX path (``('model', 'layers', 0, 'q_proj')``, from ``nnx.iter_modules``) or a JAX
  key path (``jax.tree_util.tree_flatten_with_path``); both give ``'model.layers.0.q_proj'``, the
  PyTorch / PEFT name of the module. The empty path (the root module) is ``''``.
  """
  return ".".join(str(key_name(e)) for e in path)


def adapter_key(module: str, variable: str) -> str:
  """The key of one adapter variable in ``lora_final.safetensors``: ``'<module>/<variable>'``."""
  return f"{module}{ADAPTER_KEY_SEP}{variable}"


def split_adapter_key(key: str) -> tuple[str, str]:
  """Inverse of :func:`adapter_key`: ``'a.b/lora_a' -> ('a.b', 'lora_a')``."""
  module, _, variable = key.rpartition(ADAPTER_KEY_SEP)
  return module, variable

r"""Device mesh and parameter/batch placement for the LoRA trainer.

The mesh has three named axes ``('data', 'fsdp', 'tensor')``. The batch axis of every batch is split
over ``data x fsdp`` (so a global batch of ``B`` rows gives ``B / (n_data * n_fsdp)`` rows per shard);
parameters are split by their *logical* axis names through a rules table, e.g. ``embed -> fsdp``,
``mlp/heads/vocab -> tensor``. A logical axis that maps to mesh axes whose total size does not divide
the dimension is left replicated (so tiny test models shard wherever they can and never fail).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from anlr_jax.nn.inject import path_str
from anlr_jax.nn.quant import BLOCK, QuantEmbed, QuantizedParam, is_quantized

MESH_AXES = ('data', 'fsdp', 'tensor')
BATCH_AXES = ('data', 'fsdp')

# logical axis name -> mesh axis (None = replicated). Covers the LLaMA/Qwen2 vocabulary of
# `anlr_jax.models` and the toy models of the tests; unknown names are replicated by flax.
DEFAULT_LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ('batch', BATCH_AXES),
    ('vocab', 'tensor'),
    ('embed', 'fsdp'),
    ('mlp', 'tensor'),
    ('heads', 'tensor'),
    ('q_heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('head_dim', None),
    ('norm', None),
    ('layers', None),
    ('rank', None),
)


def make_mesh(
    data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence[jax.Device] | None = None
) -> jax.sharding.Mesh:
  """Builds the ``('data', 'fsdp', 'tensor')`` mesh; one size may be ``-1`` (takes the rest).

  Args:
    data, fsdp, tensor: axis sizes; their product must equal the number of devices.
    devices: devices to use (default ``jax.devices()``, all processes).
  """
  devices = list(jax.devices() if devices is None else devices)
  sizes = {'data': data, 'fsdp': fsdp, 'tensor': tensor}
  for name, size in sizes.items():
    if not isinstance(size, int) or (size < 1 and size != -1):
      raise ValueError(f'mesh size {name}={size!r} must be a positive int or -1')
  free = [n for n, s in sizes.items() if s == -1]
  if len(free) > 1:
    raise ValueError(f'only one mesh size may be -1, got {free}')
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if free:
    if len(devices) % fixed:
      raise ValueError(f'{len(devices)} devices are not divisible by the fixed mesh sizes {sizes}')
    sizes[free[0]] = len(devices) // fixed
  if math.prod(sizes.values()) != len(devices):
    raise ValueError(
        f'mesh sizes {sizes} need {math.prod(sizes.values())} devices, ' f'have {len(devices)}'
    )
  shape = tuple(sizes[a] for a in MESH_AXES)
  return jax.make_mesh(
      shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices
  )


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
  """Rows over ``data x fsdp``, the sequence axis replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def _fit_spec(spec: P, shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> P:
  """Drops mesh axes from dims they do not divide (and pads the spec to the rank)."""
  entries = list(spec) + [None] * (len(shape) - len(spec))
  fitted = []
  for dim, entry in zip(shape, entries[: len(shape)]):
    axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    size = math.prod(mesh.shape[a] for a in axes)
    fitted.append(entry if axes and dim % size == 0 else None)
  return P(*fitted)


def state_shardings(
    state: nnx.State,
    mesh: jax.sharding.Mesh,
    rules: Sequence[tuple[str, Any]] = DEFAULT_LOGICAL_AXIS_RULES,
) -> dict:
  """Pure-dict tree of ``NamedSharding`` for an ``nnx.State`` whose Variables carry logical names.

  Uses ``nnx.get_partition_spec`` under ``nnx.logical_axis_rules(rules)``; dims that a mesh axis does
  not divide are replicated.
  """
  with nnx.logical_axis_rules(list(rules)):
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
  shapes = nnx.to_pure_dict(state)
  return jax.tree.map(
      lambda spec, x: NamedSharding(mesh, _fit_spec(spec, np.shape(x), mesh)),
      specs,
      shapes,
      is_leaf=lambda x: isinstance(x, P),
  )


def matching_shardings(tree, params, param_shardings, mesh: jax.sharding.Mesh):
  """Shardings for a tree (e.g. optimizer state) whose leaves mirror parameters.

  A leaf whose key path ends with a parameter's key path and has that parameter's shape gets the
  parameter's sharding (Adam's ``mu``/``nu``...); every other leaf (counts, per-rank statistics) is
  replicated. ``tree`` and ``params`` may hold arrays or ``jax.ShapeDtypeStruct``.
  """
  flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
  flat_shardings = jax.tree.leaves(param_shardings)
  if len(flat_params) != len(flat_shardings):
    raise ValueError('params and param_shardings have different structures')
  by_path = {tuple(path): (np.shape(x), sh) for (path, x), sh in zip(flat_params, flat_shardings)}

  def pick(path, leaf):
    for start in range(len(path)):
      shape_sharding = by_path.get(tuple(path[start:]))
      if shape_sharding is not None and shape_sharding[0] == np.shape(leaf):
        return shape_sharding[1]
    return replicated(mesh)

  return jax.tree_util.tree_map_with_path(pick, tree)


def check_quantized_blocks(model: nnx.Module, mesh, rules=None) -> None:
  """Raises ValueError naming the first quantised layer whose blocks ``mesh`` would split.

  ``mesh``: a ``jax.sharding.Mesh`` or ``AbstractMesh``; ``rules``: the logical axis rules the
  weights are placed by (default: the trainer's). The input axis of a layer's codes is split over
  ``n`` devices without splitting a block only if ``d_in`` is a multiple of ``64 n`` (for a
  quantised embedding table, its width ``d``).
  """
  layers = [
      (p, m) for p, m in nnx.iter_modules(model) if is_quantized(m) or isinstance(m, QuantEmbed)
  ]
  if not layers:
    return
  rules = DEFAULT_LOGICAL_AXIS_RULES if rules is None else rules
  for path, layer in layers:
    spec = state_shardings(nnx.state(layer, QuantizedParam), mesh, rules)['codes'].spec
    axes = spec[0] if len(spec) else None
    axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    parts = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    width = layer.features if isinstance(layer, QuantEmbed) else layer.in_features
    if width % (BLOCK * parts):
      raise ValueError(
          f"model.quantize={layer.quantize}: the mesh splits {path_str(path)}'s input width"
          f" {width} over {parts} devices ({'x'.join(axes)}), which would split its"
          f' {BLOCK}-weight blocks; put fewer devices on that mesh axis'
      )

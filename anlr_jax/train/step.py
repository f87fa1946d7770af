r"""The jitted LoRA train step: loss of the batch contract, LoRA-only gradients, optimizer update.

Loss (batch contract): with logits ``z`` of shape ``(B, T, V)``, token ids ``x`` and response mask ``m``,

.. math::
   L = \frac{\sum_{b,t<T-1} m_{b,t+1} \, \mathrm{CE}(z_{b,t}, x_{b,t+1})}{\max(1, \sum_{b,t} m_{b,t+1})},

the mean next-token cross-entropy over every response token of the *global* batch. With ``k``
micro-batches the step scans over ``k`` interleaved slices of rows, sums the per-slice numerators,
numerator gradients and token counts, and divides once at the end, so it equals the one-batch step
up to float summation order. Only ``nnx.LoRAParam`` leaves get gradients; base weights are an input
that is never differentiated (and may be stored in bf16). LoRA params are cast to ``compute_dtype``
inside the loss, so gradients, params and optimizer state stay float32. The loss itself, whole or
chunked, is :mod:`anlr_jax.train.loss`'s.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from anlr_jax.models.llama import REMAT_POLICIES
from anlr_jax.naming import module_name
from anlr_jax.train.loss import (  # noqa: F401  the step's loss; LOSS_CHUNK and the sums re-exported
    LOSS_CHUNK,
    chunked_next_token_loss_sum,
    model_loss_sum,
    next_token_loss_sum,
)

BATCH_KEYS = ('input_ids', 'attention_mask', 'loss_mask')
# Optional: the images of a model that takes them (LLaVA), (B, K, 3, S, S): K image slots per row.
IMAGE_KEY = 'pixel_values'


class TrainState(NamedTuple):
  """Everything the step updates: update count, LoRA params, optimizer state, other model state (RNG)."""

  step: jax.Array
  lora: Any
  opt_state: Any
  extra: Any


def split_model(model: nnx.Module):
  """``graphdef, lora, frozen, extra``: LoRA params, other params, all other state, as pure dicts."""
  graphdef, lora, frozen, extra = nnx.split(model, nnx.LoRAParam, nnx.Param, ...)
  return graphdef, nnx.to_pure_dict(lora), nnx.to_pure_dict(frozen), nnx.to_pure_dict(extra)


# Key of a stacked layer list: 'model.layers.*.self_attn.q_proj' holds q_proj of every layer.
STACKED = '*'
LORA_LAYOUTS = ('stacked', 'per-layer')


def _is_layer_list(node) -> bool:
  return (
      isinstance(node, dict)
      and len(node) >= 2
      and all(isinstance(k, int) and not isinstance(k, bool) for k in node)
      and sorted(node) == list(range(len(node)))
  )


def stack_layers(tree):
  """Stacks every list of identically shaped layers (a dict keyed ``0 .. n-1``) on a new leading axis.

  ``{'layers': {0: {'q': {'lora_a': (d, r)}}, 1: ...}}`` becomes ``{'layers': {'*': {'q': {'lora_a':
  (n, d, r)}}}}``: the layout of ``nnx.scan`` models, in which each LoRA module of the optimizer
  covers one projection of every layer (a leading batch axis, see ``docs/method.md``), so the optimizer
  runs one set of kernels per projection instead of one per layer. Lists whose layers differ in
  structure, shape or dtype are left as they are. :func:`unstack_layers` is the inverse.
  """
  if not isinstance(tree, dict):
    return tree
  children = {k: stack_layers(v) for k, v in tree.items()}
  if _is_layer_list(children):
    layers = [children[i] for i in range(len(children))]
    kind = lambda t: (jax.tree.structure(t), [(x.shape, x.dtype) for x in jax.tree.leaves(t)])
    if all(kind(t) == kind(layers[0]) for t in layers[1:]) and jax.tree.leaves(layers[0]):
      return {STACKED: jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}
  return children


def unstack_layers(tree):
  """Inverse of :func:`stack_layers`: every ``'*'`` entry back into a dict of layers ``0 .. n-1``."""
  if not isinstance(tree, dict):
    return tree
  if set(tree) == {STACKED}:
    leaves, treedef = jax.tree.flatten(tree[STACKED])
    n = leaves[0].shape[0]
    # split (whose transpose is one concatenate) rather than n gathers / pads in the gradient
    pieces = [[jnp.squeeze(p, 0) for p in jnp.split(x, n, axis=0)] for x in leaves]
    return {i: unstack_layers(treedef.unflatten([p[i] for p in pieces])) for i in range(n)}
  return {k: unstack_layers(v) for k, v in tree.items()}


def stacked_shardings(stacked, shardings):
  """Shardings of a :func:`stack_layers` tree from the per-layer tree's ``NamedSharding`` s: each
  stacked leaf takes layer 0's sharding with an unsharded leading layer axis."""
  if not isinstance(stacked, dict):
    return shardings
  if set(stacked) == {STACKED} and STACKED not in shardings:
    inner = stacked_shardings(stacked[STACKED], shardings[0])
    lead = lambda sh: NamedSharding(sh.mesh, P(None, *sh.spec))  # noqa: E731
    return {STACKED: jax.tree.map(lead, inner)}
  return {k: stacked_shardings(v, shardings[k]) for k, v in stacked.items()}


def unstack_module_stats(stats: dict) -> dict:
  """Per-module statistics of a stacked tree (``{'model.layers.*.q': (n, ..., r)}``, e.g. AnLR's
  ``nu_bar``) under the per-layer names ``'model.layers.0.q'`` ... with one slice each (module names:
  :func:`anlr_jax.naming.module_name`)."""
  out = {}
  for name, value in stats.items():
    parts = name.split('.')
    if STACKED not in parts:
      out[name] = value
      continue
    j = parts.index(STACKED)
    for i in range(value.shape[0]):
      sliced = unstack_module_stats({module_name(parts[:j] + [str(i)] + parts[j + 1 :]): value[i]})
      out.update(sliced)
  return out


class LoraLayout(NamedTuple):
  """How the train state holds the LoRA params, and the one place that converts to and from it.

  ``stacked=False``: the model's per-layer pure dict as it is. ``stacked=True``: the
  :func:`stack_layers` layout, in which each optimizer module covers one projection of every layer.
  """

  stacked: bool

  def to_state(self, lora, shardings=None):
    """``(lora, shardings)`` in this layout from the model's per-layer LoRA params and their
    ``NamedSharding`` s (None: no shardings)."""
    if not self.stacked:
      return lora, shardings
    stacked = stack_layers(lora)
    return stacked, None if shardings is None else stacked_shardings(stacked, shardings)

  def to_model(self, lora):
    """The model's per-layer LoRA params from params in this layout (inside the step: its loss and
    regulariser; outside: diagnostics and export)."""
    return unstack_layers(lora) if self.stacked else lora

  def stats_to_model(self, stats: dict) -> dict:
    """Per-module statistics (e.g. AnLR's ``nu_bar``) under the model's per-layer module names."""
    return unstack_module_stats(stats) if self.stacked else stats


def _cast_floats(tree, dtype):
  if dtype is None:
    return tree
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
  )


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    *,
    schedule: optax.Schedule | None = None,
    micro_batches: int = 1,
    compute_dtype: Any = None,
    remat: str = 'none',
    loss_chunk: int = 0,
    batch_spec: P | None = None,
    stacked_layers: bool = False,
    skip_nonfinite: bool = True,
    loss_regularizer: Callable[[Any], jax.Array] | None = None,
) -> Callable[[TrainState, Any, dict], tuple[TrainState, dict]]:
  """Builds ``train_step(state, frozen, batch) -> (state, metrics)`` (not yet jitted).

  Args:
    graphdef: the model's graph definition from :func:`split_model`.
    tx: any optax transform over the LoRA pure-dict tree (clipping belongs in its chain).
    schedule: the learning-rate schedule, only to report ``lr`` (NaN if ``None``).
    micro_batches: ``k``; the batch rows are split into ``k`` interleaved micro-batches.
    compute_dtype: dtype the LoRA params (and base params) are cast to for the forward pass.
    remat: per-decoder-layer rematerialisation, ``'none'``, ``'full'`` or ``'dots'`` (keep only
      matmul outputs): one ``jax.checkpoint`` region per layer with that policy
      (:data:`REMAT_POLICIES`), given to the model's forward as ``remat=``.
    loss_chunk: tokens per chunk of the loss (:func:`chunked_next_token_loss_sum`: the ``(B, T,
      V)`` logits are never held) for models with ``hidden_states`` and ``output_matrix`` (
      :class:`~anlr_jax.models.llama.LlamaForCausalLM`); 0: the model's whole logits and
      :func:`next_token_loss_sum` (the only way for other models).
    batch_spec: ``PartitionSpec`` of a micro-batch's rows under the active mesh (None: no constraint).
    stacked_layers: the state's LoRA params are in the :func:`stack_layers` layout (the optimizer
      and its state see one stacked module per projection); ``LoraLayout(stacked_layers).to_model``
      gives the model its per-layer params.
    skip_nonfinite: keep params and optimizer state unchanged when the loss or the gradient norm
      is not finite (``skipped`` metric); False applies every update (benchmarks compare the two).
    loss_regularizer: ``R(lora) -> scalar`` added to the loss that is differentiated,
      ``L + R(θ)`` (e.g. AdaLoRA's orthogonal regulariser); it gets the LoRA params as the model's
      pure dict, per layer whatever ``stacked_layers`` (float32, evaluated once per update, not per
      micro-batch). None: no regulariser.

  Metrics (device scalars): ``loss`` (the cross-entropy ``L``, without ``R``), ``grad_norm`` (of
  the differentiated loss, before clipping), ``lr``, ``tokens`` (non-padding tokens),
  ``loss_tokens`` (response tokens), ``skipped`` (1.0 when the loss, the regulariser or the
  gradient norm was not finite: the update was not applied, params and optimizer state are
  unchanged), and with a ``loss_regularizer`` ``regularizer`` (``R(θ)``).
  """
  if micro_batches < 1:
    raise ValueError(f'micro_batches={micro_batches} must be >= 1')
  if remat not in REMAT_POLICIES:
    raise ValueError(f'remat={remat!r} must be one of {sorted(REMAT_POLICIES)}')
  if loss_chunk < 0:
    raise ValueError(f'loss_chunk={loss_chunk} must be >= 0 (0: whole logits)')
  layout = LoraLayout(stacked_layers)

  def loss_sum(lora, frozen, extra, batch):
    model = nnx.merge(graphdef, _cast_floats(layout.to_model(lora), compute_dtype), frozen, extra)
    kwargs = dict(attention_mask=batch['attention_mask'])
    images = {IMAGE_KEY: batch[IMAGE_KEY]} if IMAGE_KEY in batch else {}
    if remat != 'none':
      if 'remat' not in inspect.signature(model.__call__).parameters:
        raise ValueError(
            f'remat={remat!r}: {type(model).__name__} has no per-layer rematerialisation (its'
            " forward takes no remat= argument); use remat='none'"
        )
      kwargs['remat'] = remat
    total, count = model_loss_sum(model, batch, kwargs, images, loss_chunk=loss_chunk)
    *_, new_extra = nnx.split(model, nnx.LoRAParam, nnx.Param, ...)
    return total, (count, nnx.to_pure_dict(new_extra))

  grad_fn = jax.value_and_grad(loss_sum, has_aux=True)

  def regularizer(lora):
    return jnp.asarray(loss_regularizer(layout.to_model(lora)), jnp.float32)

  def train_step(state: TrainState, frozen, batch: dict):
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
      raise KeyError(f'batch is missing keys {missing}; expected {BATCH_KEYS}')
    frozen = _cast_floats(frozen, compute_dtype)
    rows = batch['input_ids'].shape[0]
    if rows % micro_batches:
      raise ValueError(f'batch rows {rows} not divisible by micro_batches={micro_batches}')

    def interleave(x):  # (B, T) -> (k, B/k, T): micro-batch j holds rows j, j+k, j+2k, ...
      x = x.reshape(rows // micro_batches, micro_batches, *x.shape[1:]).swapaxes(0, 1)
      if batch_spec is not None:
        x = jax.lax.with_sharding_constraint(x, P(None, *batch_spec))
      return x

    micro = {k: interleave(batch[k]) for k in BATCH_KEYS + (IMAGE_KEY,) if k in batch}

    def accumulate(carry, mb):
      grads, extra, total, count = carry
      (mb_total, (mb_count, extra)), mb_grads = grad_fn(state.lora, frozen, extra, mb)
      grads = jax.tree.map(jnp.add, grads, mb_grads)
      return (grads, extra, total + mb_total, count + mb_count), None

    zeros = jax.tree.map(jnp.zeros_like, state.lora)
    init = (zeros, state.extra, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    (grads, extra, total, count), _ = jax.lax.scan(accumulate, init, micro)
    denom = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grads)
    loss = total / denom
    finite = jnp.isfinite(loss)
    if loss_regularizer is not None:
      reg, reg_grads = jax.value_and_grad(regularizer)(state.lora)
      grads = jax.tree.map(jnp.add, grads, reg_grads)
      finite = finite & jnp.isfinite(reg)
    grad_norm = optax.tree.norm(grads)
    # A non-finite loss or gradient skips the update: params and optimizer state stay as they were
    # (the step counter still advances, so the data order is unchanged); `skipped` reports it.
    finite = finite & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state.opt_state, state.lora)
    lora = optax.apply_updates(state.lora, updates)
    if skip_nonfinite:
      keep_if_finite = lambda new, old: jax.lax.select(finite, new, old)  # noqa: E731
      lora = jax.tree.map(keep_if_finite, lora, state.lora)
      opt_state = jax.tree.map(keep_if_finite, opt_state, state.opt_state)
    lr = (
        jnp.asarray(schedule(state.step), jnp.float32)
        if schedule is not None
        else jnp.full((), jnp.nan, jnp.float32)
    )
    metrics = {
        'loss': loss,
        'grad_norm': grad_norm,
        'skipped': 1.0 - finite.astype(jnp.float32),
        'lr': lr,
        'tokens': jnp.sum(batch['attention_mask']).astype(jnp.float32),
        'loss_tokens': count,
    }
    if loss_regularizer is not None:
      metrics['regularizer'] = reg
    return TrainState(state.step + 1, lora, opt_state, extra), metrics

  return train_step


def init_train_state(lora, extra, tx: optax.GradientTransformation) -> TrainState:
  """Fresh state at update count 0 (call under ``jax.jit`` with shardings to place it)."""
  return TrainState(jnp.zeros((), jnp.int32), lora, tx.init(lora), extra)

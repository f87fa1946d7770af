r"""The jitted LoRA train step: loss of the batch contract, LoRA-only gradients, optimizer update.

Loss (batch contract): with logits ``z`` of shape ``(B, T, V)``, token ids ``x`` and response mask ``m``,

.. math::
   L = \frac{\sum_{b,t<T-1} m_{b,t+1} \, \mathrm{CE}(z_{b,t}, x_{b,t+1})}{\max(1, \sum_{b,t} m_{b,t+1})},

the mean next-token cross-entropy over every response token of the *global* batch. With ``k``
micro-batches the step scans over ``k`` interleaved slices of rows, sums the per-slice numerators,
numerator gradients and token counts, and divides once at the end, so it equals the one-batch step
up to float summation order. Only ``nnx.LoRAParam`` leaves get gradients; base weights are an input
that is never differentiated (and may be stored in bf16). LoRA params are cast to ``compute_dtype``
inside the loss, so gradients, params and optimizer state stay float32.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

BATCH_KEYS = ('input_ids', 'attention_mask', 'loss_mask')
REMAT_POLICIES = {
    'none': None,
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class TrainState(NamedTuple):
  """Everything the step updates: update count, LoRA params, optimizer state, other model state (RNG)."""

  step: jax.Array
  lora: Any
  opt_state: Any
  extra: Any


def next_token_loss_sum(
    logits: jax.Array, input_ids: jax.Array, loss_mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Returns ``(sum_t m[t+1] CE(logits[t], ids[t+1]), sum_t m[t+1])`` in float32.

  Targets are the ids shifted left by one with the last position weighted 0, so the ``(B, T, V)``
  logits are used whole: slicing off their last position would copy them (and pad their gradient)
  on every step.
  """
  targets = jnp.roll(input_ids, -1, axis=1)
  mask = loss_mask.astype(jnp.float32)
  weights = jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  return jnp.sum(nll * weights), jnp.sum(weights)


def split_model(model: nnx.Module):
  """``graphdef, lora, frozen, extra``: LoRA params, other params, all other state, as pure dicts."""
  graphdef, lora, frozen, extra = nnx.split(model, nnx.LoRAParam, nnx.Param, ...)
  return graphdef, nnx.to_pure_dict(lora), nnx.to_pure_dict(frozen), nnx.to_pure_dict(extra)


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
    batch_spec: P | None = None,
) -> Callable[[TrainState, Any, dict], tuple[TrainState, dict]]:
  """Builds ``train_step(state, frozen, batch) -> (state, metrics)`` (not yet jitted).

  Args:
    graphdef: the model's graph definition from :func:`split_model`.
    tx: any optax transform over the LoRA pure-dict tree (clipping belongs in its chain).
    schedule: the learning-rate schedule, only to report ``lr`` (NaN if ``None``).
    micro_batches: ``k``; the batch rows are split into ``k`` interleaved micro-batches.
    compute_dtype: dtype the LoRA params (and base params) are cast to for the forward pass.
    remat: ``'none'``, ``'full'`` or ``'dots'`` (save only matmul outputs) rematerialisation.
    batch_spec: ``PartitionSpec`` of a micro-batch's rows under the active mesh (None: no constraint).

  Metrics (device scalars): ``loss``, ``grad_norm`` (before clipping), ``lr``, ``tokens``
  (non-padding tokens), ``loss_tokens`` (response tokens).
  """
  if micro_batches < 1:
    raise ValueError(f'micro_batches={micro_batches} must be >= 1')
  if remat not in REMAT_POLICIES:
    raise ValueError(f'remat={remat!r} must be one of {sorted(REMAT_POLICIES)}')

  def loss_sum(lora, frozen, extra, batch):
    model = nnx.merge(graphdef, _cast_floats(lora, compute_dtype), frozen, extra)
    logits = model(batch['input_ids'], attention_mask=batch['attention_mask'])
    total, count = next_token_loss_sum(logits, batch['input_ids'], batch['loss_mask'])
    *_, new_extra = nnx.split(model, nnx.LoRAParam, nnx.Param, ...)
    return total, (count, nnx.to_pure_dict(new_extra))

  if remat != 'none':
    loss_sum = jax.checkpoint(loss_sum, policy=REMAT_POLICIES[remat])
  grad_fn = jax.value_and_grad(loss_sum, has_aux=True)

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

    micro = {k: interleave(batch[k]) for k in BATCH_KEYS}

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
    updates, opt_state = tx.update(grads, state.opt_state, state.lora)
    lora = optax.apply_updates(state.lora, updates)
    lr = (
        jnp.asarray(schedule(state.step), jnp.float32)
        if schedule is not None
        else jnp.full((), jnp.nan, jnp.float32)
    )
    metrics = {
        'loss': total / denom,
        'grad_norm': optax.tree.norm(grads),
        'lr': lr,
        'tokens': jnp.sum(batch['attention_mask']).astype(jnp.float32),
        'loss_tokens': count,
    }
    return TrainState(state.step + 1, lora, opt_state, extra), metrics

  return train_step


def init_train_state(lora, extra, tx: optax.GradientTransformation) -> TrainState:
  """Fresh state at update count 0 (call under ``jax.jit`` with shardings to place it)."""
  return TrainState(jnp.zeros((), jnp.int32), lora, tx.init(lora), extra)

"""A tiny NNX causal LM with LoRA adapters, used only by the engine tests.

Optional LoRA dropout (``dropout > 0``) puts RNG state into the model, as real LoRA layers do.

h_0 = E[x];  h_{l+1} = h_l + W_down gelu(W_up h_l + c A_up B_up h_l) + c A_down B_down (...);
logits = h_L W_head.  Base weights are `nnx.Param`, adapters `nnx.LoRAParam` (`lora_a (in, r)`,
`lora_b (r, out)`), every leaf carries logical axis names (`vocab, embed, mlp`) in `out_sharding`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class LoRALinear(nnx.Module):
  """y = x W + (alpha / r) (x A) B with W frozen (`nnx.Param`) and A, B `nnx.LoRAParam`."""

  def __init__(self, d_in, d_out, axes, *, rank, alpha, rngs, dropout=0.0):
    init = nnx.initializers.lecun_normal()
    self.dropout = nnx.Dropout(dropout, rngs=rngs) if dropout else None
    self.kernel = nnx.Param(init(rngs.params(), (d_in, d_out)), out_sharding=axes)
    self.lora_a = nnx.LoRAParam(init(rngs.params(), (d_in, rank)), out_sharding=(axes[0], None))
    self.lora_b = nnx.LoRAParam(
        0.1 * jax.random.normal(rngs.params(), (rank, d_out)), out_sharding=(None, axes[1])
    )
    self.scale = alpha / rank

  def __call__(self, x):
    dtype = x.dtype
    y = x @ self.kernel[...].astype(dtype)
    x = self.dropout(x) if self.dropout is not None else x
    return y + self.scale * ((x @ self.lora_a[...].astype(dtype)) @ self.lora_b[...].astype(dtype))


class Block(nnx.Module):

  def __init__(self, d, f, *, rank, alpha, rngs, dropout=0.0):
    kw = dict(rank=rank, alpha=alpha, rngs=rngs, dropout=dropout)
    self.up = LoRALinear(d, f, ('embed', 'mlp'), **kw)
    self.down = LoRALinear(f, d, ('mlp', 'embed'), **kw)

  def __call__(self, h):
    return h + self.down(jax.nn.gelu(self.up(h)))


class ToyCausalLM(nnx.Module):
  """Embedding -> `n_layers` residual MLP blocks with LoRA -> head. Returns float32 logits (B,T,V).

  The attention mask only zeroes padded positions' inputs (there is no attention); causality holds
  because every position sees only its own token.
  """

  def __init__(
      self,
      vocab=32,
      d=16,
      f=32,
      n_layers=2,
      rank=4,
      alpha=8.0,
      *,
      rngs,
      dtype=jnp.float32,
      dropout=0.0,
  ):
    self.embed = nnx.Param(
        jax.random.normal(rngs.params(), (vocab, d)), out_sharding=('vocab', 'embed')
    )
    self.blocks = nnx.List(
        [Block(d, f, rank=rank, alpha=alpha, rngs=rngs, dropout=dropout) for _ in range(n_layers)]
    )
    self.head = nnx.Param(
        nnx.initializers.lecun_normal()(rngs.params(), (d, vocab)), out_sharding=('embed', 'vocab')
    )
    self.dtype = dtype

  def __call__(self, input_ids, attention_mask=None):
    h = self.embed[...].astype(self.dtype)[input_ids]
    if attention_mask is not None:
      h = h * attention_mask[..., None].astype(h.dtype)
    for block in self.blocks:
      h = block(h)
    return (h @ self.head[...].astype(h.dtype)).astype(jnp.float32)


class ToyBatches:
  """Deterministic batch source following the batch contract: rows of global batch `step`."""

  def __init__(self, global_batch=8, seq_len=8, vocab=32, n_batches=4, seed=0):
    import numpy as np

    self.global_batch, self.seq_len, self.vocab, self.n_batches, self.seed = (
        global_batch,
        seq_len,
        vocab,
        n_batches,
        seed,
    )
    self._np = np

  def __len__(self):
    return self.n_batches

  def get_batch(self, step, *, process_index=0, process_count=1):
    np = self._np
    rng = np.random.default_rng([self.seed, step % self.n_batches])
    b, t = self.global_batch, self.seq_len
    ids = rng.integers(0, self.vocab, size=(b, t)).astype(np.int32)
    lengths = rng.integers(t // 2, t + 1, size=(b,))
    attn = (np.arange(t)[None, :] < lengths[:, None]).astype(np.int32)
    prompt = rng.integers(1, t // 2, size=(b,))
    loss = ((np.arange(t)[None, :] >= prompt[:, None]) & (attn == 1)).astype(np.float32)
    ids = ids * attn
    rows = slice(process_index * b // process_count, (process_index + 1) * b // process_count)
    return {'input_ids': ids[rows], 'attention_mask': attn[rows], 'loss_mask': loss[rows]}


def make_toy_model(seed=0, **kwargs) -> ToyCausalLM:
  """Builds the toy LM unsharded (logical names stay as metadata; the trainer places it)."""
  with nnx.use_eager_sharding(False):
    return ToyCausalLM(rngs=nnx.Rngs(seed), **kwargs)


def method_tx(config, method: str = 'anlr'):
  """``(tx, schedule)`` of ``method`` on the trainer config's schedule over ``config.steps``
  updates, with its AdamW constants and clipping: ``anlr_jax.app.assemble.build_method`` on a run
  config whose ``trainer`` section is ``config`` (the toy LM has its own LoRA layers)."""
  from anlr_jax.app.config import RunConfig
  from anlr_jax.app.assemble import build_method

  config = RunConfig(method=method, trainer=config)
  built = build_method(config, total_steps=config.trainer.steps, check=False)
  return built.tx, built.schedule


ONE_DEVICE = dict(mesh_data=1, mesh_fsdp=1, mesh_tensor=1)
"""Trainer-config keys of a one-device mesh."""


def make_toy_trainer(
    tx=None,
    *,
    model=None,
    batches=None,
    one_device: bool = False,
    checkpoint_dir=None,
    log_dir=None,
    schedule=None,
    trainer_kwargs=None,
    **config,
):
  """A ``Trainer`` of the toy LM (``model``, default :func:`make_toy_model`) on ``batches``
  (default :class:`ToyBatches`): ``TrainerConfig(steps=4, global_batch=8, compute_dtype='float32',
  progress=False, **config)``; ``tx`` None: AnLR on the config's schedule (:func:`method_tx`).
  ``one_device``: a one-device mesh on the first device (default: all devices).
  ``trainer_kwargs``: further ``Trainer`` arguments (hooks)."""
  from anlr_jax.train.trainer import Trainer, TrainerConfig

  fields = dict(steps=4, global_batch=8, compute_dtype='float32', progress=False)
  fields.update(ONE_DEVICE if one_device else {})
  fields.update(config)
  trainer_config = TrainerConfig(**fields)
  if tx is None:
    tx, schedule = method_tx(trainer_config)
  return Trainer(
      make_toy_model() if model is None else model,
      ToyBatches() if batches is None else batches,
      trainer_config,
      tx,
      checkpoint_dir=None if checkpoint_dir is None else str(checkpoint_dir),
      log_dir=None if log_dir is None else str(log_dir),
      schedule=schedule,
      devices=jax.devices()[:1] if one_device else None,
      **(trainer_kwargs or {}),
  )

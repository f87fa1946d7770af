"""Sharded, jitted LoRA training: mesh placement, the train step, the trainer, orbax checkpoints.

Batch contract (shared with :mod:`anlr_jax.data`): a batch source has ``__len__`` (global batches per
epoch) and ``get_batch(step, *, process_index=0, process_count=1)`` returning this process's rows
``[p b, (p+1) b)`` of global batch ``step`` as ``input_ids`` int32 ``(b, T)``, ``attention_mask``
int32 ``(b, T)`` and ``loss_mask`` float32 ``(b, T)``; the loss is the mean next-token cross-entropy
over every response token of the global batch (``logits[:, :-1]`` predict ``input_ids[:, 1:]``,
weighted by ``loss_mask[:, 1:]``).
"""

from anlr_jax.train.checkpoint import TrainCheckpointer
from anlr_jax.train.distributed import global_batch_array, initialize_distributed
from anlr_jax.train.mesh import (
    DEFAULT_LOGICAL_AXIS_RULES,
    batch_sharding,
    make_mesh,
    state_shardings,
)
from anlr_jax.train.metrics import MetricsWriter
from anlr_jax.train.schedule import linear_warmup_decay
from anlr_jax.train.loss import chunked_next_token_loss_sum, next_token_loss_sum
from anlr_jax.train.step import (
    TrainState,
    make_train_step,
    split_model,
    stack_layers,
    unstack_layers,
)
from anlr_jax.train.trainer import Trainer, TrainerConfig, train

__all__ = [
    'DEFAULT_LOGICAL_AXIS_RULES',
    'MetricsWriter',
    'TrainCheckpointer',
    'TrainState',
    'Trainer',
    'TrainerConfig',
    'batch_sharding',
    'global_batch_array',
    'initialize_distributed',
    'linear_warmup_decay',
    'make_mesh',
    'make_train_step',
    'chunked_next_token_loss_sum',
    'next_token_loss_sum',
    'split_model',
    'stack_layers',
    'state_shardings',
    'train',
    'unstack_layers',
]

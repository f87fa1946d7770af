"""The trainer's settings (:class:`TrainerConfig`), the identity they give a run, and the devices a
one-process run trains on (``trainer.devices``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import optax

from anlr_jax.settings import DTYPES, ConfigError, OneOf, Range, check_fields, identity_of, setting
from anlr_jax.train.schedule import linear_warmup_decay
from anlr_jax.train.step import LORA_LAYOUTS, LOSS_CHUNK, REMAT_POLICIES


@dataclasses.dataclass
class TrainerConfig:
  """Trainer settings; defaults follow the paper's App. B (lr 3e-4, batch 16, 3 epochs, linear).

  The optimizer is not a setting: :class:`Trainer` runs the optax transformation it is given
  (``anlr_jax.methods.method_optimizer`` builds a method's from these constants).
  """

  steps: int | None = setting(
      None, 'number of updates; None: from `epochs`', Range(1), identity=True
  )
  epochs: float | None = setting(
      3.0,
      'passes over the data when `steps` is None',
      Range(0, lo_open=True),
      identity=True,
  )
  global_batch: int = setting(
      16,
      'sequences per update, all devices and processes together',
      Range(1),
      identity=True,
  )
  micro_batches: int = setting(
      1,
      'gradient-accumulation chunks per update (global_batch must divide)',
      Range(1),
      identity=True,
  )
  learning_rate: float = setting(
      3e-4,
      'peak learning rate of the linear warmup/decay schedule',
      Range(0, lo_open=True),
      identity=True,
  )
  lr_warmup_steps: int = setting(0, 'linear learning-rate warmup updates', Range(0), identity=True)
  weight_decay: float = setting(0.0, 'decoupled (AdamW) weight decay', Range(0), identity=True)
  b1: float = setting(0.9, 'Adam first-moment decay', Range(0, 1, hi_open=True), identity=True)
  b2: float = setting(0.999, 'Adam second-moment decay', Range(0, 1, hi_open=True), identity=True)
  eps: float = setting(1e-8, 'Adam epsilon', Range(0), identity=True)
  clip_norm: float | None = setting(
      1.0,
      'global gradient-norm clipping threshold; None: no clipping',
      Range(0, lo_open=True),
      identity=True,
  )
  devices: int | None = setting(
      None,
      'train on the first N of jax.devices() (one process only); None: on all of them',
      Range(1),
  )
  mesh_data: int = setting(1, "devices on the 'data' mesh axis")
  mesh_fsdp: int = setting(-1, "devices on the 'fsdp' mesh axis (-1: all the rest)")
  mesh_tensor: int = setting(1, "devices on the 'tensor' mesh axis")
  compute_dtype: str = setting(
      'bfloat16',
      'forward/backward dtype; LoRA params and optimizer state stay float32',
      OneOf(tuple(DTYPES)),
      identity=True,
  )
  base_dtype: str | None = setting(
      None,
      'storage dtype of the frozen base weights; None: as built',
      OneOf((*DTYPES, None)),
  )
  remat: str = setting(
      'none',
      "per-decoder-layer rematerialisation: 'full' recomputes each layer's activations in the"
      " backward pass, 'dots' keeps its matmul outputs",
      OneOf(tuple(REMAT_POLICIES)),
  )
  loss_chunk: int = setting(
      0,
      f'tokens per chunk of the loss (e.g. {LOSS_CHUNK}): the (batch, length, vocab) logits are'
      ' never held whole; 0: whole logits',
      Range(0),
  )
  lora_layout: str = setting(
      'stacked',
      "LoRA params in the train state: 'stacked' (one optimizer module per projection, the"
      " layers on a leading axis: fewer kernels) or 'per-layer'; same updates",
      OneOf(LORA_LAYOUTS),
  )
  save_every: int = setting(0, 'checkpoint every N updates (0: only at the end)', Range(0))
  keep: int = setting(
      3,
      'checkpoints kept (at least 2: a corrupt newest one falls back to the previous)',
      Range(2),
  )
  async_save: bool = setting(True, 'write checkpoints in the background')
  save_full_model: bool = setting(False, 'also checkpoint the frozen base weights')
  resume: bool = setting(True, 'resume from the latest checkpoint in the checkpoint directory')
  resume_allow: list[str] = setting(
      help="keys that may differ from the checkpoint's run, e.g. [trainer.steps]", factory=list
  )
  max_nonfinite: int = setting(
      5, 'consecutive updates with a non-finite loss/gradient before stopping', Range(1)
  )
  log_every: int = setting(1, 'log metrics every N updates', Range(1))
  diag_every: int = setting(0, 'write AnLR diagnostics every N updates (0: never)', Range(0))
  progress: bool | None = setting(None, 'a progress bar; None: only on a terminal')

  def __post_init__(self):
    check_fields(self)
    if self.steps is None and self.epochs is None:
      raise ConfigError('TrainerConfig needs `steps` or `epochs`')
    if self.global_batch % self.micro_batches:
      raise ConfigError(
          f'TrainerConfig.global_batch={self.global_batch} is not divisible by '
          f'micro_batches={self.micro_batches}'
      )

  def total_steps(self, batches_per_epoch: int) -> int:
    if self.steps is not None:
      return int(self.steps)
    return max(1, math.ceil(self.epochs * batches_per_epoch))

  def schedule(self, total_steps: int) -> optax.Schedule:
    """The paper's linear warmup/decay of ``learning_rate`` over ``total_steps`` updates (the
    warmup is cut at ``total_steps``)."""
    return linear_warmup_decay(
        self.learning_rate, total_steps, min(self.lr_warmup_steps, total_steps)
    )


def trainer_identity(config: TrainerConfig) -> dict[str, Any]:
  """``{"trainer.<field>": value}`` of the :class:`TrainerConfig` fields that determine a run's
  trajectory (those declared with ``identity=True``)."""
  return identity_of(config, 'trainer.')


def first_devices(count: int) -> list[jax.Device]:
  """The first ``count`` of ``jax.devices()`` (``trainer.devices``); a multi-process run uses all.

  Raises:
    ValueError: one line naming ``trainer.devices`` when there are fewer devices, or when several
      processes run and ``count`` is not all of them.
  """
  available = jax.device_count()
  if count > available:
    raise ValueError(f'trainer.devices={count}: only {available} devices are visible')
  if jax.process_count() > 1 and count != available:
    raise ValueError(
        f'trainer.devices={count}: a run of {jax.process_count()} processes uses all'
        f' {available} devices (set trainer.devices: null)'
    )
  return jax.devices()[:count]


__all__ = ['TrainerConfig', 'first_devices', 'trainer_identity']

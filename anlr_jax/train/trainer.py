r"""The LoRA trainer: config, placement on the mesh, the compiled step, the loop, checkpoints.

Given a model with ``nnx.LoRAParam`` adapters, a batch source (``__len__`` and
``get_batch(step, *, process_index, process_count)``, see :mod:`anlr_jax.train`) and an optax
transform, :class:`Trainer` runs ``T`` updates of

.. math::  \theta_{t+1} = \theta_t + \mathrm{tx}(\nabla_\theta L(\theta_t; \text{batch}_t))

over the LoRA params ``\theta`` only, with ``L`` the mean response-token cross-entropy of global batch
``t`` and ``tx`` the transformation it is given, e.g. ``clip_by_global_norm(c) -> anlr(eta_t)`` with
``eta_t = TrainerConfig.schedule(T)``, the linear warmup/decay schedule of the paper (App. B).
Everything the step touches is placed on the mesh before the first step, so it compiles once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import threading
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from anlr_jax import optim as anlr_optim
from anlr_jax.settings import DTYPES, ConfigError, OneOf, Range, check_fields, identity_of, setting
from anlr_jax.train.checkpoint import (
    CorruptCheckpointError,
    TrainCheckpointer,
    abstract_for_checkpoint,
)
from anlr_jax.train.diskfull import DiskFullError, as_disk_full, is_disk_full
from anlr_jax.train.distributed import global_batch_array, put_global
from anlr_jax.train.mesh import (
    BATCH_AXES,
    DEFAULT_LOGICAL_AXIS_RULES,
    batch_sharding,
    make_mesh,
    matching_shardings,
    replicated,
    state_shardings,
)
from anlr_jax.train.lock import DirectoryLock
from anlr_jax.train.metrics import MetricsWriter
from anlr_jax.train.schedule import linear_warmup_decay
from anlr_jax.train.step import (
    BATCH_KEYS,
    IMAGE_KEY,
    LORA_LAYOUTS,
    LOSS_CHUNK,
    REMAT_POLICIES,
    LoraLayout,
    init_train_state,
    make_train_step,
)

logger = logging.getLogger('anlr_jax.train')

STUCK_ROWS = 3
"""Logged rows in a row with an exactly zero gradient norm before the trainer warns."""

ROLLBACK_WINDOW = 3
"""A non-finite streak that begins within this many updates of a restore is blamed on the
restored checkpoint (see :meth:`Trainer.run`).

Damage in a checkpoint's values acts from the first forward pass after the restore, but need not
make that first update non-finite: a huge but finite moment in the optimizer state moves the
parameters by a huge step in update 1 (whose loss, of the restored parameters, is finite) and
makes update 2 non-finite; a value that squares to an overflow in Adam's second moment does so in
update 1 or 2. Three updates cover these with one to spare. A streak that begins later is the
run's own divergence: the batches are a function of the step, so a clean checkpoint replayed to
that point would diverge again, and rolling back would only repeat the same updates."""


class TrainingInterrupted(Exception):
  """SIGINT/SIGTERM arrived during :meth:`Trainer.run`; the message says what was saved."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.signum = signum
    self.exit_code = 128 + signum


class NonFiniteError(RuntimeError):
  """The loss or gradient stayed non-finite for ``max_nonfinite`` consecutive updates."""


class CheckpointMismatchError(ValueError):
  """A checkpoint was written by a run with other settings (or another state structure)."""


def identity_changes(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    allow: Sequence[str] = (),
    renamed: Mapping[str, str] | None = None,
) -> list[str]:
  """``["key: old -> new", ...]`` for every key whose value differs (keys in ``allow`` aside).

  ``saved`` keys that were renamed since (``renamed``: old key -> new key) count as the new key.
  """
  saved = {(renamed or {}).get(k, k): v for k, v in saved.items()}
  out = []
  for key in sorted(set(saved) | set(current)):
    if key in allow:
      continue
    old, new = saved.get(key, '<unset>'), current.get(key, '<unset>')
    if old != new:
      out.append(f'{key}: {old!r} -> {new!r}')
  return out


def trainer_identity(config: 'TrainerConfig') -> dict[str, Any]:
  """``{"trainer.<field>": value}`` of the :class:`TrainerConfig` fields that determine a run's
  trajectory (those declared with ``identity=True``)."""
  return identity_of(config, 'trainer.')


@contextlib.contextmanager
def _quiet_orbax():
  """Silences orbax's own error logging (tracebacks through absl) while a checkpoint is read:
  the trainer names a checkpoint it cannot read in one line of its own."""
  loggers = [logging.getLogger(name) for name in ('absl', 'orbax')]
  levels = [log.level for log in loggers]
  for log in loggers:
    log.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    for log, level in zip(loggers, levels):
      log.setLevel(level)


@contextlib.contextmanager
def _deferred_signals(signums=(signal.SIGINT, signal.SIGTERM)):
  """Within the block, SIGINT/SIGTERM only record themselves (``caught[0]``) for the loop to act on.

  Outside the main thread (where handlers cannot be installed) nothing changes.
  """
  caught: list[int] = []
  if threading.current_thread() is not threading.main_thread():
    yield caught
    return
  previous = {s: signal.getsignal(s) for s in signums}

  def handler(signum, frame):
    del frame
    caught.append(signum)

  for s in signums:
    signal.signal(s, handler)
  try:
    yield caught
  finally:
    for s, h in previous.items():
      signal.signal(s, h)


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


class Trainer:
  """Places a LoRA model on a mesh and trains it; see the module docstring.

  Args:
    model: an NNX module with ``nnx.LoRAParam`` adapters whose params carry logical axis names.
    batches: a batch source (batch contract).
    config: :class:`TrainerConfig`.
    tx: the optax transformation over the LoRA param tree (clipping included), e.g.
      ``anlr_jax.methods.method_optimizer(method, config.schedule(total))``.
    checkpoint_dir: orbax checkpoint directory (saved per ``config.save_every``, resumed from when
      ``config.resume``); None: no checkpoints.
    log_dir: directory of ``metrics.jsonl``, TensorBoard and diagnostics; None: no files.
    identity: what determines the trajectory besides the trainer settings (method, seed, model
      fingerprint, LoRA and optimizer settings, data hash, ...) as ``{dotted key: JSON value}``;
      stored in every checkpoint. Resuming a checkpoint whose identity differs (keys in
      ``config.resume_allow`` aside) raises :class:`CheckpointMismatchError` naming each key.
    renamed_keys: identity keys renamed since (old -> new): a checkpoint's value stored under the
      old key is compared with the new key's.
    schedule: the learning-rate schedule ``tx`` runs on, for the ``lr`` metric (None: no metric).
    mesh: a ``('data', 'fsdp', 'tensor')`` mesh (default: from the config's sizes over ``devices``).
    devices: devices for the default mesh (default: the first ``config.devices`` of
      ``jax.devices()``, all of them when that is None).
    logical_axis_rules: logical name -> mesh axis table.
    loss_regularizer: ``R(lora) -> scalar`` added to the differentiated loss (see
      :func:`anlr_jax.train.step.make_train_step`; the ``loss`` metric stays the cross-entropy and
      ``regularizer`` reports ``R``), e.g. AdaLoRA's orthogonal regulariser.
    on_step: ``on_step(trainer, step)`` called by :meth:`run` on the host with the number of
      updates done: once before its first update and after every update (before the step's metrics
      are logged and its checkpoint is written, so a checkpoint holds what the hook did). It may
      replace ``trainer.state`` with a state of the same structure, shapes, dtypes and shardings
      (the step is not recompiled), e.g. LoRA-Dash's launch writing new ``extra`` state.
  """

  def __init__(
      self,
      model: nnx.Module,
      batches,
      config: TrainerConfig,
      tx: optax.GradientTransformation,
      *,
      checkpoint_dir: str | None = None,
      log_dir: str | None = None,
      identity: Mapping[str, Any] | None = None,
      renamed_keys: Mapping[str, str] | None = None,
      schedule: optax.Schedule | None = None,
      mesh: jax.sharding.Mesh | None = None,
      devices: Sequence[jax.Device] | None = None,
      logical_axis_rules=DEFAULT_LOGICAL_AXIS_RULES,
      loss_regularizer: Callable[[Any], jax.Array] | None = None,
      on_step: Callable[['Trainer', int], None] | None = None,
  ):
    if not hasattr(batches, 'get_batch') or not hasattr(batches, '__len__'):
      raise TypeError(f'batches={batches!r} must have __len__ and get_batch(step, ...)')
    if not isinstance(tx, optax.GradientTransformation):
      raise TypeError(
          f'tx={tx!r} must be an optax.GradientTransformation over the LoRA params, e.g.'
          ' optax.chain(optax.clip_by_global_norm(1.0), anlr_jax.anlr(schedule))'
      )
    self.config = config
    self.batches = batches
    self.total_steps = config.total_steps(len(batches))
    self.tx, self.schedule = tx, schedule
    self.checkpoint_dir, self.log_dir = checkpoint_dir, log_dir
    self.identity = {**trainer_identity(config), **dict(identity or {})}
    self.renamed_keys = dict(renamed_keys or {})
    if mesh is None and devices is None and config.devices is not None:
      devices = first_devices(config.devices)
    self.mesh = (
        mesh
        if mesh is not None
        else make_mesh(config.mesh_data, config.mesh_fsdp, config.mesh_tensor, devices=devices)
    )
    self.model = model
    self.on_step = on_step
    self._place(model, list(logical_axis_rules))
    self._host_step = None  # updates done, mirrored on the host (None: read the device once)
    self.step_fn = self._compile_step(loss_regularizer)
    self.checkpointer = None
    self.restored_step: int | None = None  # the checkpoint this run continued from
    self._rolled_back: tuple[int, int] | None = None  # (suspect checkpoint, the one restored)
    self._locks = self._lock_directories()
    if checkpoint_dir is not None:
      self.checkpointer = TrainCheckpointer(
          checkpoint_dir,
          save_every=config.save_every,
          keep=config.keep,
          async_save=config.async_save,
      )
      if config.resume and self.checkpointer.latest_step() is not None:
        self.restore()

  def _place(self, model: nnx.Module, rules: list) -> None:
    """Splits ``model`` into LoRA params, frozen params and other state, puts each on the mesh
    (frozen weights cast to ``config.base_dtype``) and builds the initial train state."""
    graphdef, lora, frozen, extra = nnx.split(model, nnx.LoRAParam, nnx.Param, ...)
    if not jax.tree.leaves(lora):
      raise ValueError('model has no nnx.LoRAParam leaves: inject LoRA adapters first')
    self.graphdef = graphdef
    lora_sh = state_shardings(lora, self.mesh, rules)
    self.frozen_shardings = state_shardings(frozen, self.mesh, rules)
    extra_sh = state_shardings(extra, self.mesh, rules)
    base_dtype = DTYPES[self.config.base_dtype] if self.config.base_dtype else None
    frozen = jax.tree.map(
        lambda x: x.astype(base_dtype)
        if base_dtype and jnp.issubdtype(x.dtype, jnp.floating)
        else x,
        nnx.to_pure_dict(frozen),
    )
    self.frozen = put_global(frozen, self.frozen_shardings)
    lora = nnx.to_pure_dict(lora)
    self.layout = LoraLayout(stacked=self.config.lora_layout == 'stacked')
    lora, lora_sh = self.layout.to_state(lora, lora_sh)
    lora, extra = put_global((lora, nnx.to_pure_dict(extra)), (lora_sh, extra_sh))

    init_fn = lambda l, e: init_train_state(l, e, self.tx)  # noqa: E731
    self.state_shardings = matching_shardings(
        jax.eval_shape(init_fn, lora, extra), lora, lora_sh, self.mesh
    )
    with jax.set_mesh(self.mesh):
      self.state = jax.jit(init_fn, out_shardings=self.state_shardings)(lora, extra)

  def _compile_step(self, loss_regularizer) -> Callable:
    """The jitted train step ``(state, frozen, batch) -> (state, metrics)`` over the placed
    shardings (``state`` donated); :attr:`step_traces` counts its traces."""
    self.batch_sharding = batch_sharding(self.mesh)
    step_fn = make_train_step(
        self.graphdef,
        self.tx,
        schedule=self.schedule,
        micro_batches=self.config.micro_batches,
        compute_dtype=DTYPES[self.config.compute_dtype],
        remat=self.config.remat,
        loss_chunk=self.config.loss_chunk,
        batch_spec=jax.sharding.PartitionSpec(BATCH_AXES),
        stacked_layers=self.layout.stacked,
        loss_regularizer=loss_regularizer,
    )
    self.step_traces = 0  # how many times the step was traced (= compiled); 1 in a healthy run

    def counted_step(state, frozen, batch):
      self.step_traces += 1
      return step_fn(state, frozen, batch)

    return jax.jit(
        counted_step,
        in_shardings=(
            self.state_shardings,
            self.frozen_shardings,
            self.batch_sharding,  # every batch array (pixel_values too) split by rows
        ),
        out_shardings=(self.state_shardings, replicated(self.mesh)),
        donate_argnums=(0,),
    )

  def _lock_directories(self) -> list[DirectoryLock]:
    """Process 0 takes the lock of the checkpoint and log directories (one writer each)."""
    if jax.process_index() != 0:
      return []
    dirs = ((self.checkpoint_dir, 'checkpoint directory'), (self.log_dir, 'log directory'))
    return [DirectoryLock(d, what=what).acquire() for d, what in dirs if d is not None]

  # -- state ------------------------------------------------------------------------------------
  @property
  def step(self) -> int:
    """Updates done so far (= the index of the next batch).

    Mirrored on the host after the first read, so that a training loop never waits for the
    previous step to finish before dispatching the next (the device queue stays full).
    """
    if self._host_step is None:
      self._host_step = int(jax.device_get(self.state.step))
    return self._host_step

  def replace_state(self, state) -> None:
    """Replaces the train state with ``state`` of the same structure, shapes, dtypes and
    shardings (the step is not recompiled); :attr:`step` is then read from ``state.step``."""
    self.state = state
    self._host_step = None

  def abstract_state(self):
    """Restore target: ``jax.eval_shape`` of the state init, with the live shardings."""
    shapes = jax.eval_shape(
        lambda l, e: init_train_state(l, e, self.tx), self.state.lora, self.state.extra
    )
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes,
        self.state_shardings,
    )

  def _state_shapes(self) -> dict[str, list]:
    flat = abstract_for_checkpoint(self.abstract_state())
    return {name: [list(x.shape), str(x.dtype)] for name, x in flat.items()}

  def save(self, *, force: bool = True) -> bool:
    """Starts a checkpoint of the current state (collective: every process must call it)."""
    if self.checkpointer is None:
      raise ValueError('the Trainer has no checkpoint_dir: nothing to save to')
    step = self.step
    meta = {
        'data_step': step,
        'total_steps': self.total_steps,
        'config': dataclasses.asdict(self.config),
        'identity': self.identity,
        'state_shapes': self._state_shapes(),
    }
    frozen = self.frozen if self.config.save_full_model else None
    return self.checkpointer.save(step, self.state, meta, frozen, force=force)

  def _check_meta(self, step: int, meta: dict) -> None:
    """Raises :class:`CheckpointMismatchError` if checkpoint ``step`` belongs to another run."""
    where = f'checkpoint {step} in {self.checkpoint_dir}'
    saved = meta.get('config', {}).get('lora_layout', 'per-layer')
    if saved != self.config.lora_layout:
      raise CheckpointMismatchError(
          f'{where} holds LoRA params in the {saved!r} layout but trainer.lora_layout='
          f'{self.config.lora_layout!r}: set trainer.lora_layout: {saved} to resume it'
      )
    if 'identity' in meta:
      changes = identity_changes(
          meta['identity'], self.identity, self.config.resume_allow, self.renamed_keys
      )
      if changes:
        raise CheckpointMismatchError(
            f'{where} belongs to a run with other settings ({"; ".join(changes)}): resume with'
            ' the same settings, use another checkpoint directory, or allow a deliberate change with'
            ' trainer.resume_allow=[<key>,...]'
        )
    if 'state_shapes' in meta:
      describe = lambda v: 'absent' if v is None else f'{tuple(v[0])} {v[1]}'  # noqa: E731
      saved_shapes, now = meta['state_shapes'], self._state_shapes()
      differ = [
          f'{k}: {describe(saved_shapes.get(k))} -> {describe(now.get(k))}'
          for k in sorted(set(saved_shapes) | set(now))
          if saved_shapes.get(k) != now.get(k)
      ]
      if differ:
        more = f' (+{len(differ) - 3} more)' if len(differ) > 3 else ''
        raise CheckpointMismatchError(
            f'{where} holds a train state of another structure (other LoRA rank, targets or'
            f' optimizer?): {"; ".join(differ[:3])}{more}'
        )

  def restore(self, step: int | None = None, *, below: int | None = None) -> int:
    """Loads checkpoint ``step`` (default: the newest valid one, older than ``below`` if given);
    returns its step.

    With ``step=None`` a checkpoint that is corrupt (checksum mismatch, unreadable or truncated
    files, non-finite values) is skipped for the one before it, and once one restores, each
    skipped one is named in one warning with the one restored instead. A checkpoint of another run
    raises :class:`CheckpointMismatchError`.
    """
    if self.checkpointer is None:
      raise ValueError('the Trainer has no checkpoint_dir: nothing to restore from')
    frozen_target = None
    if self.config.save_full_model:
      frozen_target = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.frozen
      )
    if step is not None:
      candidates = [step]
    else:
      candidates = [s for s in self.checkpointer.all_steps()[::-1] if below is None or s < below]
    if not candidates:
      older = '' if below is None else f' older than checkpoint {below}'
      raise FileNotFoundError(f'no complete checkpoint{older} under {self.checkpointer.directory}')
    skipped = []
    for candidate in candidates:
      try:
        with _quiet_orbax():
          self._check_meta(candidate, self.checkpointer.read_meta(candidate))
          state, meta, frozen = self.checkpointer.restore(
              candidate, self.abstract_state(), frozen_target, key_source=self.state
          )
        bad = _first_nonfinite(state if frozen is None else (state, frozen), self.mesh)
        if bad is not None:
          raise CorruptCheckpointError(
              f'checkpoint {candidate} in {self.checkpointer.directory} holds non-finite values'
              f' ({bad})'
          )
      except CorruptCheckpointError as err:
        skipped.append(str(err))
        continue
      for problem in skipped:
        logger.warning('%s: restored checkpoint %d instead', problem, candidate)
      self.state = state
      self._host_step = None
      self.restored_step = int(meta['step'])
      if frozen is not None:
        self.frozen = frozen
      return int(meta['step'])
    raise CorruptCheckpointError(
        '; '.join(skipped) + ': no older checkpoint to restore instead (start afresh with another'
        ' checkpoint directory)'
    )

  def _roll_back(self, step: int, skipped: int) -> bool:
    """After ``skipped`` non-finite updates in a row up to ``step``, a streak that began within
    :data:`ROLLBACK_WINDOW` updates of the restore of checkpoint ``C``: deletes ``C`` (its values
    train to NaN: damaged in a way its seal cannot show, e.g. before they were written) and any
    saved since (trained from it), and restores the newest valid checkpoint before it, once a run. Returns whether it rolled back.
    """
    restored = self.restored_step
    if self._rolled_back is not None or restored is None:
      return False
    began = step - skipped + 1  # the update that began the streak
    if not restored < began <= restored + ROLLBACK_WINDOW:
      return False
    if not any(s < restored for s in self.checkpointer.all_steps()):
      return False
    self.checkpointer.wait()
    for later in self.checkpointer.all_steps():  # it, and those saved since: trained from it
      if later >= restored:
        self.checkpointer.manager.delete(later)
    previous = self.restore(below=restored)
    self._rolled_back = (restored, previous)
    logger.warning(
        'updates %d-%d were non-finite, a streak that began %d update(s) after restoring'
        ' checkpoint %d in %s: that checkpoint is taken as corrupt and deleted; rolled back to'
        ' checkpoint %d',
        began,
        step,
        began - restored,
        restored,
        self.checkpoint_dir,
        previous,
    )
    return True

  def diagnostics_fn(self):
    """``(opt_state, lora) -> anlr_jax.diagnostics(opt_state)`` plus the per-rank contribution
    magnitudes ``|A_k| |B_k|`` of the current LoRA params (for the analysis of
    :mod:`anlr_jax.analysis`), jitted; None if the optimizer state holds no AnLR state."""
    try:
      anlr_optim.find_anlr_state(self.state.opt_state)
    except ValueError:  # no AnLRState in this optimizer
      return None

    def with_magnitudes(opt_state, lora):
      state = anlr_optim.find_anlr_state(opt_state)
      lora = self.layout.to_model(lora)  # reported per layer, whatever the layout
      per_module = {f: v for f, v in state._asdict().items() if isinstance(v, dict)}
      state = state._replace(**{f: self.layout.stats_to_model(v) for f, v in per_module.items()})
      return {**anlr_optim.diagnostics(state), 'magnitudes': anlr_optim.rank_magnitudes(lora)}

    return jax.jit(with_magnitudes)

  def lora_params(self):
    """The current LoRA params as the model's pure dict (per layer, whatever ``lora_layout``)."""
    return self.layout.to_model(self.state.lora)

  def updated_model(self) -> nnx.Module:
    """Writes the current LoRA params and model state back into ``model`` and returns it
    (collective in a multi-process run: every process gets the whole params)."""
    host = jax.tree.map(_to_host, (self.lora_params(), self.state.extra))
    nnx.update(self.model, *host)
    return self.model

  # -- stepping ---------------------------------------------------------------------------------
  def global_batch(self, step: int) -> dict[str, jax.Array]:
    """Global batch ``step`` as sharded arrays, from this process's rows."""
    pc, pi = jax.process_count(), jax.process_index()
    local = self.batches.get_batch(step, process_index=pi, process_count=pc)
    missing = [k for k in BATCH_KEYS if k not in local]
    if missing:
      raise KeyError(f'batches.get_batch({step}) is missing keys {missing}')
    rows = self.config.global_batch // pc
    for key in BATCH_KEYS:
      if np.shape(local[key])[0] != rows:
        raise ValueError(
            f'batches.get_batch({step})[{key!r}] has {np.shape(local[key])[0]} rows, '
            f'expected global_batch/process_count = {rows}'
        )
    images = local.get(IMAGE_KEY)  # (rows, K, 3, S, S) image slots of a model that takes images
    if images is not None and np.ndim(images) == 4 and hasattr(self.model, 'images_per_row'):
      # packed images in order of appearance (+ image_mask): into per-row slots, split by rows
      images = self.model.images_per_row(
          local['input_ids'], images, image_mask=local.get('image_mask')
      )
    local = {
        'input_ids': np.asarray(local['input_ids'], np.int32),
        'attention_mask': np.asarray(local['attention_mask'], np.int32),
        'loss_mask': np.asarray(local['loss_mask'], np.float32),
    }
    if images is not None:
      if np.ndim(images) != 5 or np.shape(images)[0] != rows:
        raise ValueError(
            f'batches.get_batch({step})[{IMAGE_KEY!r}] has shape {np.shape(images)}, expected'
            f' ({rows}, images_per_row, 3, size, size) or (images, 3, size, size)'
        )
      local[IMAGE_KEY] = np.asarray(images, np.float32)
    return global_batch_array(local, self.batch_sharding, self.config.global_batch)

  def train_step(self) -> dict[str, jax.Array]:
    """One update on batch ``self.step``; returns the step's metrics as device scalars."""
    step = self.step
    batch = self.global_batch(step)
    with jax.set_mesh(self.mesh):
      self.state, metrics = self.step_fn(self.state, self.frozen, batch)
    self._host_step = step + 1
    return metrics

  def run(self, steps: int | None = None) -> list[dict[str, float]]:
    """Trains until ``steps`` (default: the config's total) updates are done; returns the logged
    rows of the whole run (those of earlier processes of a resumed run included).

    SIGINT/SIGTERM during the loop finish the update in flight, save a checkpoint (when
    ``checkpoint_dir`` is set) and raise :class:`TrainingInterrupted`. ``max_nonfinite`` consecutive
    skipped updates (non-finite loss or gradient) raise :class:`NonFiniteError`, except once a run:
    a streak that began within :data:`ROLLBACK_WINDOW` updates of a restore deletes the restored
    checkpoint, restores the one before it and goes on (one warning naming both). A checkpoint,
    metrics or diagnostics write that finds no space raises
    :class:`~anlr_jax.train.diskfull.DiskFullError`, naming the file system and the checkpoint kept.
    """
    end = self.total_steps if steps is None else min(steps, self.total_steps)
    diagnostics = self.diagnostics_fn()
    step = self.step
    writer = self._metrics_writer(step)
    stuck = 0
    if self.on_step is not None:
      self.on_step(self, step)
    failed = False
    try:
      with _deferred_signals() as caught:
        while step < end:
          metrics = self.train_step()
          step += 1
          if self.on_step is not None:
            self.on_step(self, step)
          log_now = step % self.config.log_every == 0 or step == end or bool(caught)
          diag_now = bool(self.config.diag_every) and step % self.config.diag_every == 0
          extra = None
          if diagnostics is not None and (log_now or diag_now):
            diag = diagnostics(self.state.opt_state, self.state.lora)
            extra = {'anlr': diag['mean']} if log_now else None
            if diag_now:
              writer.write_diagnostics(step, diag)
          row = writer.record(step, metrics, extra, flush=log_now)
          if row is not None:
            n = writer.consecutive_skipped
            if n >= self.config.max_nonfinite and self._roll_back(step, n):
              writer.close()  # its rows after the restored step are dropped by the new one
              step = self.step
              writer = self._metrics_writer(step)
              stuck = 0
              if self.on_step is not None:
                self.on_step(self, step)
              continue
            self._check_health(writer, step)
            stuck = stuck + 1 if _looks_stuck(writer.rows) else 0
            if stuck == STUCK_ROWS:
              logger.warning(
                  'the gradient norm is 0 for %d logged steps (up to step %d, loss %.4f): the'
                  ' loss has stopped moving and the adapters no longer learn; a learning rate of'
                  ' %g may be too high (or no response tokens reach the loss)',
                  STUCK_ROWS,
                  step,
                  row.get('loss', float('nan')),
                  self.config.learning_rate,
              )
          if caught:
            raise self._interrupted(caught[0], step)
          if self.checkpointer is not None and self.checkpointer.should_save(step):
            self.save(force=False)
        if self.checkpointer is not None and step == self.total_steps:
          self.save(force=True)
          self.checkpointer.wait()
        if caught:
          raise self._interrupted(caught[0], step)
    except Exception as err:
      failed = True
      if is_disk_full(err):
        raise self._disk_full(err, step) from err
      raise
    finally:
      try:
        writer.close()
      except Exception as err:
        if not failed:  # else the error in flight is the one to report
          if is_disk_full(err):
            raise self._disk_full(err, step) from err
          raise
    return writer.rows

  def _disk_full(self, err: BaseException, step: int) -> DiskFullError:
    """``err`` (no space left) as the one line to stop with: the file system, what could not be
    written, and the checkpoint kept (once the save in flight, if any, is over)."""
    err = as_disk_full(err, self.log_dir or self.checkpoint_dir or '.', 'the run directory')
    saved = []
    if self.checkpointer is not None:
      with contextlib.suppress(DiskFullError):  # that save found no space too: it is not kept
        self.checkpointer.wait()
      saved = self.checkpointer.all_steps()
    kept = (
        f'the last complete checkpoint, step {saved[-1]} in {self.checkpoint_dir}, is kept'
        if saved
        else 'no checkpoint was written'
    )
    return err.with_detail(
        f'stopped after update {step} of {self.total_steps}; {kept}; free space on {err.mount}'
        ' and run the same command again to ' + ('resume from it' if saved else 'start again')
    )

  def _metrics_writer(self, step: int) -> MetricsWriter:
    """The metrics writer of a loop starting after ``step`` updates (later rows dropped)."""
    writer = MetricsWriter(
        self.log_dir,
        total_steps=self.total_steps,
        log_every=self.config.log_every,
        progress=self.config.progress,
        start_step=step,
    )
    writer.start(step)
    return writer

  def _check_health(self, writer: MetricsWriter, step: int) -> None:
    n = writer.consecutive_skipped
    if n < self.config.max_nonfinite:
      return
    saved = self.checkpointer.all_steps() if self.checkpointer is not None else []
    kept = (
        f'the last checkpoint (step {saved[-1]} in {self.checkpoint_dir}) is kept'
        if saved
        else 'no checkpoint was written'
    )
    rolled = ''
    if self._rolled_back is not None:
      rolled = (
          f' (already rolled back once: from checkpoint {self._rolled_back[0]}, taken as corrupt,'
          f' to checkpoint {self._rolled_back[1]})'
      )
    raise NonFiniteError(
        f'the loss or gradient was not finite for {n} consecutive updates (steps'
        f' {step - n + 1}-{step}, {writer.skipped_total} skipped in all): stopping (limit:'
        f' trainer.max_nonfinite={self.config.max_nonfinite}){rolled}; the parameters are those'
        f' before step {step - n + 1} and {kept}; lower trainer.learning_rate or check the data'
    )

  def _interrupted(self, signum: int, step: int) -> TrainingInterrupted:
    name = signal.Signals(signum).name
    if self.checkpointer is None:
      return TrainingInterrupted(
          f'{name} at update {step} of {self.total_steps}: stopped; no checkpoint was written'
          ' (a checkpoint_dir makes the run resumable)',
          signum,
      )
    self.save(force=True)
    self.checkpointer.wait()
    return TrainingInterrupted(
        f'{name} at update {step} of {self.total_steps}: checkpoint saved in'
        f' {self.checkpoint_dir}; run the same command again to resume',
        signum,
    )

  def close(self) -> None:
    """Waits for the checkpoint in flight and releases the directory locks."""
    if self.checkpointer is not None:
      self.checkpointer.close()
      self.checkpointer = None
    for lock in self._locks:
      lock.release()
    self._locks = []


def _to_host(x):
  """A global array's whole value on this host: gathered from every process when it is sharded
  over devices of other processes too (collective: every process must call it)."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return jax.device_get(x)
  if x.is_fully_replicated:
    return jax.device_get(x.addressable_data(0))
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  return multihost_utils.process_allgather(x, tiled=True)


def _looks_stuck(rows: list[dict[str, float]]) -> bool:
  """The latest row has an exactly zero gradient norm: nothing can move the adapters."""
  return bool(rows) and rows[-1].get('grad_norm') == 0.0


def _first_nonfinite(tree, mesh: jax.sharding.Mesh) -> str | None:
  """The name of the first floating leaf holding a NaN/Inf, or None (one device reduction, its
  result replicated on ``mesh`` so that every process reads it)."""
  leaves = [
      (jax.tree_util.keystr(path), x)
      for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
      if hasattr(x, 'dtype') and jnp.issubdtype(x.dtype, jnp.inexact)
  ]
  if not leaves:
    return None
  all_finite = jax.jit(
      lambda xs: jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]), out_shardings=replicated(mesh)
  )
  flags = np.asarray(all_finite([x for _, x in leaves]).addressable_data(0))
  return None if flags.all() else leaves[int(np.argmin(flags))][0]


def train(
    model: nnx.Module,
    batches,
    config: TrainerConfig,
    tx: optax.GradientTransformation,
    **kwargs,
) -> Trainer:
  """Builds a :class:`Trainer`, runs it to the end (resuming from ``checkpoint_dir`` if possible)."""
  trainer = Trainer(model, batches, config, tx, **kwargs)
  trainer.run()
  return trainer

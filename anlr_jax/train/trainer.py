r"""The LoRA trainer: placement on the mesh, the compiled step and the loop.

Given a model with ``nnx.LoRAParam`` adapters, a batch source (``__len__`` and
``get_batch(step, *, process_index, process_count)``, see :mod:`anlr_jax.train`) and an optax
transform, :class:`Trainer` runs ``T`` updates of

.. math::  \theta_{t+1} = \theta_t + \mathrm{tx}(\nabla_\theta L(\theta_t; \text{batch}_t))

over the LoRA params ``\theta`` only, with ``L`` the mean response-token cross-entropy of global batch
``t`` and ``tx`` the transformation it is given, e.g. ``clip_by_global_norm(c) -> anlr(eta_t)`` with
``eta_t = TrainerConfig.schedule(T)``, the linear warmup/decay schedule of the paper (App. B).
Everything the step touches is placed on the mesh before the first step, so it compiles once.

The trainer's settings are in :mod:`anlr_jax.train.trainer_config`, its checkpoint save, restore and
roll-back in :mod:`anlr_jax.train.resume`, what its loop reports and how it stops (metrics,
non-finite updates, signals, a full disk) in :mod:`anlr_jax.train.reporting`; the names are
importable from here too.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from anlr_jax import optim as anlr_optim
from anlr_jax.settings import DTYPES
from anlr_jax.train.checkpoint import TrainCheckpointer
from anlr_jax.train.diskfull import is_disk_full
from anlr_jax.train.distributed import global_batch_array, put_global
from anlr_jax.train.lock import DirectoryLock
from anlr_jax.train.mesh import (
    BATCH_AXES,
    DEFAULT_LOGICAL_AXIS_RULES,
    batch_sharding,
    make_mesh,
    matching_shardings,
    replicated,
    state_shardings,
)
from anlr_jax.train.reporting import (
    STUCK_ROWS,
    NonFiniteError,
    RunReporting,
    TrainingInterrupted,
    deferred_signals,
    looks_stuck,
)
from anlr_jax.train.resume import (
    ROLLBACK_WINDOW,
    CheckpointMismatchError,
    CheckpointRestore,
    identity_changes,
)
from anlr_jax.train.step import (
    BATCH_KEYS,
    IMAGE_KEY,
    LoraLayout,
    init_train_state,
    make_train_step,
)
from anlr_jax.train.trainer_config import TrainerConfig, first_devices, trainer_identity

logger = logging.getLogger('anlr_jax.train')


class Trainer(CheckpointRestore, RunReporting):
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
      with deferred_signals() as caught:
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
            stuck = stuck + 1 if looks_stuck(writer.rows) else 0
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


__all__ = [
    'ROLLBACK_WINDOW',
    'STUCK_ROWS',
    'CheckpointMismatchError',
    'NonFiniteError',
    'Trainer',
    'TrainerConfig',
    'TrainingInterrupted',
    'first_devices',
    'identity_changes',
    'train',
    'trainer_identity',
]

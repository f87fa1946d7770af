r"""How the :class:`~anlr_jax.train.trainer.Trainer` saves, restores and rolls back its
checkpoints: the checks that a checkpoint belongs to the run (its identity, LoRA layout and state
structure), the fall-back past corrupt checkpoints, and the roll-back past a checkpoint whose values
train to NaN. :class:`CheckpointRestore` holds these methods of the trainer."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from anlr_jax.train.checkpoint import CorruptCheckpointError, abstract_for_checkpoint
from anlr_jax.train.mesh import replicated
from anlr_jax.train.step import init_train_state

logger = logging.getLogger('anlr_jax.train')

ROLLBACK_WINDOW = 3
"""A non-finite streak that begins within this many updates of a restore is blamed on the
restored checkpoint (see :meth:`anlr_jax.train.trainer.Trainer.run`).

Damage in a checkpoint's values acts from the first forward pass after the restore, but need not
make that first update non-finite: a huge but finite moment in the optimizer state moves the
parameters by a huge step in update 1 (whose loss, of the restored parameters, is finite) and
makes update 2 non-finite; a value that squares to an overflow in Adam's second moment does so in
update 1 or 2. Three updates cover these with one to spare. A streak that begins later is the
run's own divergence: the batches are a function of the step, so a clean checkpoint replayed to
that point would diverge again, and rolling back would only repeat the same updates."""


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


class CheckpointRestore:
  """The :class:`~anlr_jax.train.trainer.Trainer`'s checkpoint methods (it sets ``checkpointer``,
  ``config``, ``identity``, ``state`` and the other attributes they read)."""

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


__all__ = ['ROLLBACK_WINDOW', 'CheckpointMismatchError', 'CheckpointRestore', 'identity_changes']

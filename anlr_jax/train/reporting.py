"""What the :class:`~anlr_jax.train.trainer.Trainer`'s loop reports and how it stops: its metrics
writer, the limit on non-finite updates, the stuck-loss warning, SIGINT/SIGTERM and a full disk.
:class:`RunReporting` holds these methods of the trainer."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading

from anlr_jax.train.diskfull import DiskFullError, as_disk_full
from anlr_jax.train.metrics import MetricsWriter

logger = logging.getLogger('anlr_jax.train')

STUCK_ROWS = 3
"""Logged rows in a row with an exactly zero gradient norm before the trainer warns."""


class TrainingInterrupted(Exception):
  """SIGINT/SIGTERM arrived during :meth:`Trainer.run`; the message says what was saved."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.signum = signum
    self.exit_code = 128 + signum


class NonFiniteError(RuntimeError):
  """The loss or gradient stayed non-finite for ``max_nonfinite`` consecutive updates."""


@contextlib.contextmanager
def deferred_signals(signums=(signal.SIGINT, signal.SIGTERM)):
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


def looks_stuck(rows: list[dict[str, float]]) -> bool:
  """The latest row has an exactly zero gradient norm: nothing can move the adapters."""
  return bool(rows) and rows[-1].get('grad_norm') == 0.0


class RunReporting:
  """The :class:`~anlr_jax.train.trainer.Trainer`'s reporting methods (it sets ``config``,
  ``checkpointer``, ``log_dir`` and the other attributes they read)."""

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


__all__ = [
    'STUCK_ROWS',
    'NonFiniteError',
    'RunReporting',
    'TrainingInterrupted',
    'deferred_signals',
    'looks_stuck',
]

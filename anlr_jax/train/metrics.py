r"""Training metrics: JSONL + CSV + TensorBoard in the run directory, a tqdm bar or plain log lines.

Per logged step: ``loss``, ``lr``, ``grad_norm``, ``tokens``, ``loss_tokens`` (from the step's device
scalars, fetched only every ``log_every`` steps, so no host sync per step) and
``tokens_per_s = sum(tokens) / wall seconds`` over the logging window. AnLR diagnostics (from
``anlr_jax.diagnostics(opt_state)`` when the optimizer provides it) go to ``diagnostics/step_<t>.npz``
(:mod:`anlr_jax.train.diagnostics_io`) every ``diag_every`` steps, their scalar summaries into the same
JSONL/CSV/TensorBoard rows. File names: :mod:`anlr_jax.rundir`.
Only process 0 writes; the other processes' writer is inert.

The files are a function of the step: a writer started at step ``s`` (a resumed run) first drops
every row after ``s`` from ``metrics.jsonl`` / ``metrics.csv``, tells TensorBoard to discard its
events after ``s`` (``purge_step``) and removes later diagnostics, so a run killed and resumed holds
exactly one row per logged step; :attr:`MetricsWriter.rows` is then the complete series.

Updates that the step skipped because the loss or a gradient was not finite (metric ``skipped``)
are counted: each row carries ``skipped_total``, and :attr:`MetricsWriter.consecutive_skipped`
tells the trainer how many of the latest updates in a row were skipped.

A write that finds no space (the JSONL/CSV rows, TensorBoard's events, written by its own thread,
a diagnostics snapshot) raises :class:`~anlr_jax.train.diskfull.DiskFullError` naming the file and
the file system; the trainer stops on it.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import os
import sys
import time
from typing import Any, Mapping

import jax
import numpy as np

from anlr_jax.train import diagnostics_io
from anlr_jax.fileio import atomic_write, read_jsonl
from anlr_jax.rundir import METRICS_CSV, METRICS_FILE, TENSORBOARD_DIR
from anlr_jax.train import diskfull

logger = logging.getLogger('anlr_jax.train')

TENSORBOARD_QUEUE = 1000
"""Events TensorBoard's writer queues (more than one row's scalars)."""


@contextlib.contextmanager
def _writing(path: str, what: str):
  """Raises a write's disk-full error as :class:`~anlr_jax.train.diskfull.DiskFullError`."""
  try:
    yield
  except Exception as err:
    if diskfull.is_disk_full(err):
      raise diskfull.as_disk_full(err, path, what) from err
    raise


def _scalar_items(tree: Mapping[str, Any], prefix: str = '') -> dict[str, float]:
  """Flattens nested mappings; keeps size-1 numeric leaves as floats (arrays are skipped)."""
  out = {}
  for key, value in tree.items():
    name = f'{prefix}{key}'
    if isinstance(value, Mapping):
      out.update(_scalar_items(value, prefix=f'{name}/'))
    elif np.size(value) == 1 and np.issubdtype(np.asarray(value).dtype, np.number):
      out[name] = float(np.asarray(value).reshape(()))
  return out


def _summary_writer_class():
  """tensorboardX's ``SummaryWriter``, imported without torch where torch is not loaded yet; None
  when tensorboardX cannot be imported.

  tensorboardX's writer module imports torch (when installed) only to accept torch tensors, which the
  floats written here never are; that import costs about a second of every ``anlr`` start. Hiding
  torch for the duration of the import (a ``None`` entry in ``sys.modules`` makes ``import torch``
  raise ``ImportError``, the branch tensorboardX takes without torch) leaves it unloaded.
  """
  try:
    if 'tensorboardX' not in sys.modules and 'torch' not in sys.modules:
      sys.modules['torch'] = None  # type: ignore[assignment]
      try:
        import tensorboardX  # noqa: F401  (its first import, the one that would load torch)
      finally:
        del sys.modules['torch']
    from tensorboardX import SummaryWriter
  except ImportError:
    return None
  return SummaryWriter


class MetricsWriter:
  """Writes metric rows; call :meth:`record` every step with the step's device metrics."""

  def __init__(
      self,
      run_dir: str | None,
      *,
      total_steps: int,
      log_every: int = 1,
      progress: bool | None = None,
      is_writer: bool | None = None,
      start_step: int = 0,
  ):
    if log_every < 1:
      raise ValueError(f'log_every={log_every} must be >= 1')
    self.is_writer = jax.process_index() == 0 if is_writer is None else is_writer
    self.run_dir = run_dir
    self.log_every = log_every
    self.total_steps = total_steps
    self.rows: list[dict[str, float]] = []
    self.skipped_total = 0
    self.consecutive_skipped = 0
    self.window: list[dict[str, Any]] = []  # host metrics of the last written window, per step
    self._pending: list[Any] = []
    self._window_start = time.perf_counter()
    self._csv_fields: list[str] | None = None
    self._tb = self._bar = self._jsonl = None
    if run_dir is not None:
      self.rows = read_metrics(run_dir, until_step=start_step)
      if self.rows:
        self.skipped_total = int(self.rows[-1].get('skipped_total', 0))
    if self.is_writer and run_dir is not None:
      diskfull.quiet_reports_of_disk_full()  # TensorBoard's thread reports a full disk at length
      self._background_failures = len(diskfull.background_failures)
      with _writing(run_dir, 'the metrics'):
        os.makedirs(run_dir, exist_ok=True)
        self._truncate_files(start_step)
        self._jsonl = open(os.path.join(run_dir, METRICS_FILE), 'a')
        SummaryWriter = _summary_writer_class()
        if SummaryWriter is None:  # a logging extra missing does not stop the training
          logger.warning(
              'tensorboardX is not installed: no TensorBoard events in %s (%s is written);'
              ' pip install tensorboardX',
              os.path.join(run_dir, TENSORBOARD_DIR),
              METRICS_FILE,
          )
        else:
          # a queue that one row never fills: its writer thread may have died (a full disk) since
          # the check before the row, and a put into a full queue would wait forever
          self._tb = SummaryWriter(
              os.path.join(run_dir, TENSORBOARD_DIR),
              purge_step=start_step + 1 if start_step else None,
              max_queue=TENSORBOARD_QUEUE,
          )
    use_bar = sys.stderr.isatty() if progress is None else progress
    if self.is_writer and use_bar:
      from tqdm.auto import tqdm

      self._bar = tqdm(total=total_steps, dynamic_ncols=True)

  def _truncate_files(self, start_step: int) -> None:
    """Rewrites the metric files with the rows up to ``start_step`` only (atomically)."""
    path = os.path.join(self.run_dir, METRICS_FILE)
    if os.path.exists(path):
      with atomic_write(path, 'w') as f:
        f.writelines(json.dumps(row) + '\n' for row in self.rows)
    csv_path = os.path.join(self.run_dir, METRICS_CSV)
    if os.path.exists(csv_path):
      os.remove(csv_path)
    if self.rows:
      self._csv_fields = list(dict.fromkeys(k for row in self.rows for k in row))
      with open(csv_path, 'w', newline='') as f:
        writer = csv.DictWriter(f, self._csv_fields)
        writer.writeheader()
        writer.writerows(self.rows)
    diagnostics_io.remove_diagnostics_after(self.run_dir, start_step)

  def start(self, step: int) -> None:
    """Resets the timing window (call before the first step and after a restore)."""
    self._window_start = time.perf_counter()
    if self._bar is not None:
      self._bar.n = step
      self._bar.refresh()

  def record(
      self,
      step: int,
      metrics: Mapping[str, Any],
      extra: Mapping[str, Any] | None = None,
      *,
      flush: bool = False,
  ):
    """Queues update ``step``'s (1-based) device metrics; writes a row every ``log_every`` steps,
    at the last step, or when ``flush``. ``extra``: more (nested) scalars for the row."""
    self._pending.append(metrics)
    if step % self.log_every and step != self.total_steps and not flush:
      return None
    host = jax.device_get(self._pending)  # the only host sync, once per window
    elapsed = max(time.perf_counter() - self._window_start, 1e-9)
    tokens = float(sum(np.asarray(m['tokens']) for m in host))
    for m in host:
      skipped = bool(np.asarray(m.get('skipped', 0)))
      self.skipped_total += skipped
      self.consecutive_skipped = self.consecutive_skipped + 1 if skipped else 0
    self.window = host
    last = {k: v for k, v in host[-1].items() if k != 'skipped'}
    row = {
        'step': step,
        **_scalar_items(last),
        'skipped_total': float(self.skipped_total),
        'tokens_per_s': tokens / elapsed,
    }
    if extra:
      row.update(_scalar_items(extra))
    self._pending = []
    self._window_start = time.perf_counter()
    self.rows.append(row)
    self._write(row)
    return row

  def _write(self, row: dict[str, float]) -> None:
    if not self.is_writer:
      return
    if self._jsonl is not None:
      with _writing(os.path.join(self.run_dir, METRICS_FILE), f"the metrics of step {row['step']}"):
        self._jsonl.write(json.dumps(row) + '\n')
        self._jsonl.flush()
      with _writing(os.path.join(self.run_dir, METRICS_CSV), f"the metrics of step {row['step']}"):
        self._write_csv(row)
    if self._tb is not None:
      self._raise_tensorboard_failure()
      if self._tensorboard_alive():
        for key, value in row.items():
          if key != 'step':
            self._tb.add_scalar(key, value, row['step'])
    message = (
        f"step {row['step']}/{self.total_steps} loss {row.get('loss', float('nan')):.4f} "
        f"tok/s {row['tokens_per_s']:.0f}"
    )
    if self._bar is not None:
      self._bar.n = row['step']
      self._bar.set_postfix(
          loss=f"{row.get('loss', float('nan')):.4f}", tok_s=f"{row['tokens_per_s']:.0f}"
      )
    else:
      logger.info(message)

  def _tensorboard_alive(self) -> bool:
    """False once TensorBoard's writer thread has ended (its events would queue up unread)."""
    file_writer = getattr(self._tb, 'file_writer', None)
    worker = getattr(getattr(file_writer, 'event_writer', None), '_worker', None)
    return worker is None or worker.is_alive()

  def _raise_tensorboard_failure(self) -> None:
    """Raises the disk-full error that ended TensorBoard's writer thread since this writer began."""
    failures = diskfull.background_failures[self._background_failures :]
    if failures:
      path = os.path.join(self.run_dir, TENSORBOARD_DIR)
      raise diskfull.as_disk_full(failures[0], path, 'the TensorBoard events') from failures[0]

  def _write_csv(self, row: dict[str, float]) -> None:
    path = os.path.join(self.run_dir, METRICS_CSV)
    fields = list(row)
    if self._csv_fields is not None and not set(fields) <= set(self._csv_fields):
      self._csv_fields = self._csv_fields + [f for f in fields if f not in self._csv_fields]
      rows = read_jsonl(os.path.join(self.run_dir, METRICS_FILE))
      with open(path, 'w', newline='') as f:  # a new column: rewrite the file from the JSONL
        writer = csv.DictWriter(f, self._csv_fields)
        writer.writeheader()
        writer.writerows(rows)
      return
    if self._csv_fields is None and os.path.exists(path):  # resumed run: continue the file
      with open(path, newline='') as f:
        self._csv_fields = next(csv.reader(f), None)
      if self._csv_fields is not None:
        return self._write_csv(row)
    new_file = self._csv_fields is None
    if new_file:
      self._csv_fields = fields
    with open(path, 'w' if new_file else 'a', newline='') as f:
      writer = csv.DictWriter(f, self._csv_fields)
      if new_file:
        writer.writeheader()
      writer.writerow(row)

  def write_diagnostics(self, step: int, diagnostics: Any) -> None:
    """Saves the full per-module diagnostics tree (``s_k``, ``nu_bar_k``, ``snr_k``...) of
    :func:`anlr_jax.diagnostics` (plus ``magnitudes``) as ``diagnostics/step_<step>.npz``; see
    :func:`anlr_jax.train.diagnostics_io.diagnostics_from_tree` and
    :func:`anlr_jax.train.diagnostics_io.write_diagnostics`.
    """
    if not self.is_writer or self.run_dir is None:
      return
    modules, summary = diagnostics_io.diagnostics_from_tree(jax.device_get(diagnostics))
    path = diagnostics_io.diagnostics_path(self.run_dir, step)
    with _writing(path, f'the diagnostics of step {step}'):
      diagnostics_io.write_diagnostics(self.run_dir, step, modules, summary)

  def close(self) -> None:
    """Flushes and closes the files (each one, even when another fails, the first failure raised)."""
    if self._bar is not None:
      self._bar.close()
    with contextlib.ExitStack() as stack:
      if self._jsonl is not None:
        jsonl, self._jsonl = self._jsonl, None
        stack.callback(self._close, jsonl, os.path.join(self.run_dir, METRICS_FILE), 'the metrics')
      if self._tb is not None:
        tb, self._tb = self._tb, None
        path = os.path.join(self.run_dir, TENSORBOARD_DIR)
        stack.callback(self._close, tb, path, 'the TensorBoard events')

  def _close(self, closable, path: str, what: str) -> None:
    with _writing(path, what):
      closable.close()
      if what == 'the TensorBoard events':
        self._raise_tensorboard_failure()


def read_metrics(run_dir: str, *, until_step: int | None = None) -> list[dict[str, float]]:
  """The rows of ``<run_dir>/metrics.jsonl`` (steps ``<= until_step`` if given), one per step.

  A last line cut short by a crash is left out (:func:`anlr_jax.fileio.read_jsonl`; any other
  unreadable line raises ValueError naming it); if a step appears twice (files written before rows
  were truncated on resume) the later row wins.
  """
  path = os.path.join(run_dir, METRICS_FILE)
  rows: dict[int, dict[str, float]] = {}
  if not os.path.exists(path):
    return []
  for row in read_jsonl(path, cut_last='drop'):
    if 'step' not in row:
      continue
    if until_step is None or row['step'] <= until_step:
      rows[int(row['step'])] = row
  return [rows[k] for k in sorted(rows)]

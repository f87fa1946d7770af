r"""A full file system under a run: recognised in the errors of Python's file I/O, orbax and
tensorstore, named in one line, and the reports of the writes it abandons kept off stderr.

A write that finds no space fails as ``OSError(ENOSPC)`` (or ``EDQUOT`` over a quota) in Python, but
as a ``ValueError('RESOURCE_EXHAUSTED: ... No space left on device [os_error_code=28]')`` from
tensorstore under orbax, sometimes several exceptions deep. :func:`is_disk_full` recognises both,
:class:`DiskFullError` names the file system (its mount point), the file and what it held, and the
trainer adds what is kept. Once such an error is raised, the same failure reported again by
background threads (orbax's writers, TensorBoard's event thread, a buffered file flushed at exit) is
dropped by the filters of :func:`quiet_reports_of_disk_full`, so a run stops with one line.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
import threading
import types

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = (
    'No space left on device',
    'Disk quota exceeded',
    f"os_error_code='{errno.ENOSPC}'",
    f"os_error_code='{errno.EDQUOT}'",
)
# the file a tensorstore error names: 'Failed writing: "<path>"', 'local file "<path>"'
_QUOTED_PATH = re.compile(r'(?:Failed writing|local file):? "([^"]+)"')


def _chain(err: BaseException | None):
  seen = set()
  while err is not None and id(err) not in seen:
    seen.add(id(err))
    yield err
    err = err.__cause__ or err.__context__


def is_disk_full(err: BaseException | None) -> bool:
  """Whether ``err`` (or an exception it was raised from) says that no space was left."""
  for e in _chain(err):
    if isinstance(e, OSError) and e.errno in NO_SPACE_ERRNOS:
      return True
    if any(text in str(e) for text in _NO_SPACE_TEXT):
      return True
  return False


def failed_path(err: BaseException | None) -> str | None:
  """The file ``err`` says it failed to write, if it names one (the last, innermost one)."""
  found = None
  for e in _chain(err):
    if isinstance(e, DiskFullError):
      return e.path
    if isinstance(e, OSError) and e.filename:
      found = found or os.fspath(e.filename)
    paths = _QUOTED_PATH.findall(str(e))
    if paths:
      found = found or paths[-1]
  return found


def mount_point(path: str) -> str:
  """The mount point of the file system holding ``path`` (which need not exist)."""
  path = os.path.abspath(path)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  while not os.path.ismount(path):
    path = os.path.dirname(path)
  return path


class DiskFullError(OSError):
  """No space was left on the file system of ``path`` while writing ``what``.

  ``str()`` is the one line to show: the file system's mount point, what was being written and the
  file, then ``detail`` (what is kept, what to do).
  """

  def __init__(self, path: str, what: str, detail: str = ''):
    self.mount = mount_point(path)
    self.what = what
    self.detail = detail
    self.message = (
        f'the file system at {self.mount} is full: no space left on device writing {what}'
        f' ({path})' + (f'; {detail}' if detail else '')
    )
    super().__init__(errno.ENOSPC, self.message, path)
    self.path = path

  def __str__(self) -> str:
    return self.message

  def with_detail(self, detail: str) -> 'DiskFullError':
    return DiskFullError(self.path, self.what, detail)


def as_disk_full(err: BaseException, path: str, what: str) -> DiskFullError:
  """``err`` (a disk-full error) as a :class:`DiskFullError` naming the file it failed to write
  (``path`` when it names none) and ``what``."""
  _seen.append(err)
  if isinstance(err, DiskFullError):
    return err
  return DiskFullError(failed_path(err) or path, what)


_LOCK = threading.Lock()
_seen: list[BaseException] = []  # disk-full errors met so far (one is enough)
background_failures: list[BaseException] = []
"""Disk-full errors that ended a background thread (TensorBoard's event writer): the thread's
owner raises them (:class:`~anlr_jax.train.metrics.MetricsWriter` checks after each row)."""


def _drop(exc: BaseException | None, text: str = '') -> bool:
  if is_disk_full(exc) or any(t in text for t in _NO_SPACE_TEXT):
    if not _seen:
      _seen.append(exc)
    return True
  return False


class _DropDiskFullRecords(logging.Filter):
  """Drops log records about a write failed for want of space (orbax logs its failed save from
  each of its threads, with tracebacks, before the error reaches the caller, who reports it)."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not _drop(exc, record.getMessage())


def quiet_reports_of_disk_full() -> None:
  """Installs the filters that keep the reports of writes failed for want of space off
  stderr, the caller of the write naming the failure in one line instead: orbax's error logs
  (``absl`` and ``orbax`` loggers) and asyncio's 'Task exception was never retrieved' about them;
  an exception that ends a background thread (TensorBoard's event writer: kept in
  :data:`background_failures` for its owner to raise); unraisable ones (a buffered file that
  cannot flush when collected) and tensorstore's late completions of the writes orbax abandoned
  ('Event loop is closed': the failure that made orbax abandon them reaches its caller, who names
  it; they can arrive before it does, so they are dropped whether or not a full disk was seen yet).
  Every other report passes on unchanged."""
  with _LOCK:  # each piece again if someone replaced it since (a test harness restores hooks)
    for name in ('absl', 'orbax', 'asyncio'):
      log = logging.getLogger(name)
      if not any(isinstance(f, _DropDiskFullRecords) for f in log.filters):
        log.addFilter(_DropDiskFullRecords())
    if not getattr(threading.excepthook, '_drops_disk_full', False):
      previous_thread_hook = threading.excepthook

      def thread_hook(args):
        if _drop(args.exc_value):
          background_failures.append(args.exc_value)
        else:
          previous_thread_hook(args)

      thread_hook._drops_disk_full = True
      threading.excepthook = thread_hook
    if not getattr(sys.unraisablehook, '_drops_disk_full', False):
      previous_unraisable = sys.unraisablehook

      def unraisable_hook(args):
        if _drop(args.exc_value) or is_late_completion_on_closed_loop(args):
          return
        previous_unraisable(args)

      unraisable_hook._drops_disk_full = True
      sys.unraisablehook = unraisable_hook
    if not getattr(sys.excepthook, '_drops_disk_full', False):
      previous_excepthook = sys.excepthook

      def excepthook(kind, value, tb):  # the same late completions, printed with PyErr_Print
        report = types.SimpleNamespace(exc_value=value, exc_traceback=tb)
        if is_late_completion_on_closed_loop(report):
          return
        previous_excepthook(kind, value, tb)

      excepthook._drops_disk_full = True
      sys.excepthook = excepthook


def is_late_completion_on_closed_loop(args) -> bool:
  """Whether an unraisable or uncaught report (``args.exc_value``, ``args.exc_traceback``) is
  tensorstore's late completion of an orbax write or read abandoned when another one failed:
  ``RuntimeError('Event loop is closed')`` raised by ``call_soon_threadsafe`` on the closed event
  loop of that save or restore. Its result belongs to nobody; the failure that made orbax abandon
  it reaches orbax's caller, who names it."""
  if not (
      isinstance(args.exc_value, RuntimeError) and str(args.exc_value) == 'Event loop is closed'
  ):
    return False
  frame = args.exc_traceback
  while frame is not None:
    if frame.tb_frame.f_code.co_name == 'call_soon_threadsafe':
      return True
    frame = frame.tb_next
  return False


__all__ = [
    'DiskFullError',
    'as_disk_full',
    'background_failures',
    'failed_path',
    'is_disk_full',
    'is_late_completion_on_closed_loop',
    'mount_point',
    'quiet_reports_of_disk_full',
]

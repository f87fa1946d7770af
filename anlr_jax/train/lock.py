r"""One writer per directory: an advisory ``flock`` on ``<dir>/.anlr.lock`` holding the owner's pid.

A run directory or checkpoint directory written by two processes at once ends with interleaved
metrics and final files from whichever finished last, so the trainer and ``anlr train`` take this
lock first; a second process fails at once with :class:`DirectoryLockedError` naming the holder's
pid and host. The kernel drops a ``flock`` when its process dies, however it dies, so a lock file
left behind by ``kill -9`` is not held by anyone: the next process takes it over (and says whose it
was). Locks are re-entrant within a process (the run directory of a single-method run is also its
trainer's metrics directory). In a multi-process run only process 0 locks.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import threading

from anlr_jax.rundir import LOCK_FILE

logger = logging.getLogger('anlr_jax.train')

_held: dict[str, tuple[int, int]] = {}  # real path -> (fd, reference count)
_guard = threading.Lock()


class DirectoryLockedError(RuntimeError):
  """Another live process holds the directory's lock."""


def _owner(fd: int) -> str:
  os.lseek(fd, 0, os.SEEK_SET)
  return os.read(fd, 256).decode('utf-8', 'replace').strip()


def _describe(owner: str) -> str:
  pid, _, host = owner.partition(' ')
  return f'pid {pid} on {host}' if host else f'pid {pid or "?"}'


class DirectoryLock:
  """``with DirectoryLock(path):`` or :meth:`acquire` / :meth:`release` (re-entrant per process)."""

  def __init__(self, directory: str | os.PathLike, *, what: str = 'directory'):
    self.directory = os.path.abspath(os.fspath(directory))
    self.what = what
    self._key = None

  def acquire(self) -> 'DirectoryLock':
    os.makedirs(self.directory, exist_ok=True)
    key = os.path.realpath(self.directory)
    with _guard:
      if key in _held:
        fd, count = _held[key]
        _held[key] = (fd, count + 1)
        self._key = key
        return self
      fd = os.open(os.path.join(key, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError:
        owner = _owner(fd)
        os.close(fd)
        raise DirectoryLockedError(
            f'{self.what} {self.directory} is in use by another anlr process ({_describe(owner)});'
            ' wait for it to finish, stop it, or use another directory'
        ) from None
      previous = _owner(fd)
      if previous and previous.split(' ')[0] != str(os.getpid()):
        logger.warning(
            'taking over the lock of %s left by %s, which is no longer running',
            self.directory,
            _describe(previous),
        )
      os.ftruncate(fd, 0)
      os.lseek(fd, 0, os.SEEK_SET)
      os.write(fd, f'{os.getpid()} {socket.gethostname()}\n'.encode())
      _held[key] = (fd, 1)
      self._key = key
    return self

  def release(self) -> None:
    if self._key is None:
      return
    with _guard:
      fd, count = _held[self._key]
      if count > 1:
        _held[self._key] = (fd, count - 1)
      else:
        del _held[self._key]
        os.ftruncate(fd, 0)  # a released lock names nobody; one left by a killed process does
        os.close(fd)  # drops the flock; the file stays
    self._key = None

  def __enter__(self) -> 'DirectoryLock':
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


__all__ = ['LOCK_FILE', 'DirectoryLock', 'DirectoryLockedError']

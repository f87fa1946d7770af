r"""Orbax checkpoints of the trainer: LoRA params, the whole optimizer state, step, data position, RNG.

A checkpoint of update count ``t`` holds the :class:`~anlr_jax.train.step.TrainState` after ``t``
updates (``TrainState.extra`` carries the model's RNG state), optionally the frozen base params, and
a JSON record ``{"step": t, "data_step": t, ...}``: batch ``t`` is the next one to feed, because
batch sources are deterministic in the step. Saving is collective (every process calls
:meth:`TrainCheckpointer.save`), asynchronous, and atomic: orbax writes into a temporary directory
and renames it when complete, so a process killed mid-save leaves the previous checkpoint intact and
the partial one is ignored (and cleaned) on the next start.

Integrity: every checkpoint is sealed inside orbax's own commit. Orbax renames a checkpoint's
temporary directory into place as its last act; just before, in the same background thread (the
training loop does not wait for it), process 0 writes the SHA-256 of every file of the directory
to ``anlr_checksums.json`` inside it. A checkpoint is therefore sealed from the moment it exists
under its final name, whenever the process is killed. Two files are written by orbax during the
commit itself, after the seal: ``_CHECKPOINT_METADATA`` is sealed without its commit timestamp, and
``commit_success.txt`` (a marker that no restore reads) is checked to be the one line of text it is.
:meth:`TrainCheckpointer.verify` recomputes the sums; a checkpoint without them, with a file missing
or different, is corrupt. The trainer restores the newest checkpoint that verifies, restores and
holds only finite values, and names each one it skips in one line.

A full file system: a save that finds no space (at once, or in the background after the training
loop moved on) raises :class:`~anlr_jax.train.diskfull.DiskFullError` naming the checkpoint and the
file system, from the next :meth:`TrainCheckpointer.save` or :meth:`TrainCheckpointer.wait`; the
partial checkpoint is removed (the complete ones stay), and orbax's own reports of the failure are
kept off stderr.

Trees are stored as flat ``{"a.b.0.c": array}`` dicts (integer layer keys and NamedTuple optimizer
states survive unchanged), typed PRNG keys as their raw ``uint32`` data. Restore always goes into
an abstract target (``jax.ShapeDtypeStruct`` with the live shardings), never target-less.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
from typing import Any

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from anlr_jax.fileio import atomic_write
from anlr_jax.train.diskfull import (
    DiskFullError,
    as_disk_full,
    is_disk_full,
    is_late_completion_on_closed_loop,
    quiet_reports_of_disk_full,
)

logger = logging.getLogger('anlr_jax.train')


def _is_unretrieved_read_of_abandoned_restore(record: logging.LogRecord) -> bool:
  """True for asyncio's 'Task exception was never retrieved' about one of orbax's array reads, or
  'Future exception was never retrieved' about one of tensorstore's (its error names the
  ``tensorstore_spec``): the restore failed on its first bad read and dropped the others, which
  fail alike."""
  message = record.getMessage()
  if message.startswith('Task exception was never retrieved'):
    return 'coro=<async_deserialize()' in message
  return (
      message.startswith('Future exception was never retrieved') and 'tensorstore_spec' in message
  )


class _DropAbandonedReads(logging.Filter):

  def filter(self, record: logging.LogRecord) -> bool:
    return not _is_unretrieved_read_of_abandoned_restore(record)


_QUIET_LOCK = threading.Lock()
_quiet_installed = False


def _quiet_abandoned_reads() -> None:
  """When a restore fails on one bad read (the caller names the checkpoint in one line), orbax
  drops its other reads, which still finish, on tensorstore's threads and in asyncio tasks nobody
  awaits any more, some before the error reaches the caller. Each reports a traceback: through
  ``sys.unraisablehook`` about the restore's closed event loop, and through the ``asyncio`` logger
  as a task exception never retrieved (dozens for one bad checkpoint). Installs, once, before the
  first restore, a hook and a logging filter that drop exactly those reports (a restore that
  succeeds makes none) and pass every other one on."""
  global _quiet_installed
  with _QUIET_LOCK:
    if _quiet_installed:
      return
    previous = sys.unraisablehook

    def hook(args):
      if not is_late_completion_on_closed_loop(args):
        previous(args)

    sys.unraisablehook = hook
    logging.getLogger('asyncio').addFilter(_DropAbandonedReads())
    _quiet_installed = True


def _key_name(entry) -> str:
  if isinstance(entry, DictKey):
    return str(entry.key)
  if isinstance(entry, SequenceKey):
    return str(entry.idx)
  if isinstance(entry, GetAttrKey):
    return entry.name
  if isinstance(entry, FlattenedIndexKey):
    return str(entry.key)
  raise TypeError(f'unsupported pytree key {entry!r}')


def _is_prng_key(x) -> bool:
  return hasattr(x, 'dtype') and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _named_leaves(tree) -> tuple[list[tuple[str, Any]], Any]:
  """``[("path.to.leaf", leaf), ...]`` and the treedef; names must be unique."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  named = [('.'.join(_key_name(e) for e in path) or 'root', leaf) for path, leaf in leaves]
  seen = set()
  for name, _ in named:
    if name in seen:
      raise ValueError(f'two leaves share the checkpoint name {name!r}')
    seen.add(name)
  return named, treedef


def flatten_for_checkpoint(tree) -> dict[str, Any]:
  """``{"path.to.leaf": leaf}``; typed PRNG keys become ``key_data`` (``uint32``)."""
  return {
      name: jax.random.key_data(leaf) if _is_prng_key(leaf) else leaf
      for name, leaf in _named_leaves(tree)[0]
  }


def abstract_for_checkpoint(tree) -> dict[str, jax.ShapeDtypeStruct]:
  """Abstract flat target (shape, dtype, sharding) matching :func:`flatten_for_checkpoint`.

  ``tree`` may hold live arrays or ``jax.ShapeDtypeStruct`` leaves with shardings.
  """

  def abstract(x):
    sharding = getattr(x, 'sharding', None)
    if _is_prng_key(x):
      x = jax.eval_shape(jax.random.key_data, x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return {name: abstract(leaf) for name, leaf in _named_leaves(tree)[0]}


def unflatten_from_checkpoint(flat: dict[str, Any], template, key_source=None):
  """Inverse of :func:`flatten_for_checkpoint` given the (abstract or live) template tree.

  Typed PRNG keys are re-wrapped with the implementation of the matching leaf of ``key_source``
  (a live tree of the same structure), or of ``template`` itself when it holds live keys.
  """
  named, treedef = _named_leaves(template)
  live = dict(_named_leaves(key_source)[0]) if key_source is not None else {}
  out = []
  for name, like in named:
    if name not in flat:
      raise KeyError(f'checkpoint has no entry {name!r}')
    value = flat[name]
    if _is_prng_key(like):
      source = like if isinstance(like, jax.Array) else live.get(name)
      if source is None:
        raise ValueError(f'PRNG key leaf {name!r} needs a live key in key_source to re-wrap')
      value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(source))
    out.append(value)
  return jax.tree_util.tree_unflatten(treedef, out)


CHECKSUM_FILE = 'anlr_checksums.json'
"""Per-checkpoint seal: the SHA-256 of every other file of the step directory (see the module
docstring)."""

STEP_METADATA_FILE = '_CHECKPOINT_METADATA'
"""Orbax's step metadata; it gets its commit timestamp after the seal (sealed without it)."""

COMMIT_MARKER_FILE = 'commit_success.txt'
"""Orbax's commit marker, written after the seal and never read by a restore."""

_LATE_FILES = (STEP_METADATA_FILE, COMMIT_MARKER_FILE)
_COMMIT_TIMESTAMP = 'commit_timestamp_nsecs'


def file_sha256(path: str) -> str:
  """The SHA-256 hex digest of a file's bytes (read in chunks)."""
  with open(path, 'rb') as f:
    return hashlib.file_digest(f, 'sha256').hexdigest()


def directory_checksums(root: str, *, skip: tuple[str, ...] = ()) -> dict[str, str]:
  """``{path relative to root: sha256}`` of every regular file below ``root`` (the checksum file
  and the relative paths in ``skip`` aside), hashed by a few threads at once (hashlib releases the
  GIL)."""
  paths = {}
  for folder, _, files in os.walk(root):
    for name in files:
      path = os.path.join(folder, name)
      rel = os.path.relpath(path, root)
      if rel != CHECKSUM_FILE and rel not in skip and os.path.isfile(path):
        if not os.path.islink(path):
          paths[rel] = path
  if len(paths) < 2:
    return {rel: file_sha256(path) for rel, path in paths.items()}
  workers = min(len(paths), os.cpu_count() or 1, 8)
  with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix='anlr-seal') as pool:
    digests = dict(zip(paths, pool.map(file_sha256, paths.values())))
  return dict(sorted(digests.items()))


def _step_metadata_digest(path: str) -> str | None:
  """SHA-256 of orbax's step metadata without its commit timestamp (canonical JSON); None if the
  file is absent. Raises ValueError if it is not a JSON object."""
  if not os.path.isfile(path):
    return None
  with open(path, 'rb') as f:
    record = json.loads(f.read().decode('utf-8'))
  if not isinstance(record, dict):
    raise ValueError('not a JSON object')
  stamp = record.pop(_COMMIT_TIMESTAMP, None)
  if stamp is not None and not isinstance(stamp, int):
    raise ValueError(f'{_COMMIT_TIMESTAMP} is not an integer')
  canonical = json.dumps(record, sort_keys=True, separators=(',', ':')).encode()
  return hashlib.sha256(canonical).hexdigest()


def seal_directory(folder: str) -> None:
  """Writes ``anlr_checksums.json`` of a complete (not yet committed) step directory: every file,
  orbax's step metadata without its commit timestamp; atomically."""
  record = {
      'files': directory_checksums(folder, skip=_LATE_FILES),
      'step_metadata': _step_metadata_digest(os.path.join(folder, STEP_METADATA_FILE)),
  }
  with atomic_write(os.path.join(folder, CHECKSUM_FILE), 'w') as f:
    json.dump(record, f, indent=0)


def seal_problem(folder: str) -> str | None:
  """None if step directory ``folder`` matches its seal, else what is wrong, in a few words."""
  listed = os.path.join(folder, CHECKSUM_FILE)
  if not os.path.isfile(listed):
    return f'{CHECKSUM_FILE} is missing'
  try:
    with open(listed, 'rb') as f:
      seal = json.loads(f.read().decode('utf-8'))
  except (OSError, ValueError):
    return f'{CHECKSUM_FILE} is unreadable'
  if not isinstance(seal, dict):
    return f'{CHECKSUM_FILE} is unreadable'
  if isinstance(seal.get('files'), dict):  # sealed at its commit
    expected, late = seal['files'], _LATE_FILES
  else:  # sealed after its commit by an earlier version: every file listed
    expected, late = seal, ()
  actual = directory_checksums(folder, skip=late)
  for rel, digest in expected.items():
    if rel not in actual:
      return f'{rel} is missing'
    if actual[rel] != digest:
      return f'{rel} does not match its checksum'
  if late:
    try:
      digest = _step_metadata_digest(os.path.join(folder, STEP_METADATA_FILE))
    except (OSError, ValueError):
      return f'{STEP_METADATA_FILE} is unreadable'
    if digest != seal.get('step_metadata'):
      return f'{STEP_METADATA_FILE} does not match its checksum'
    marker = os.path.join(folder, COMMIT_MARKER_FILE)
    if os.path.exists(marker):
      try:
        with open(marker, 'rb') as f:
          text = f.read().decode('utf-8')
      except (OSError, ValueError):
        return f'{COMMIT_MARKER_FILE} is unreadable'
      if not text.isprintable() or not text.strip():
        return f'{COMMIT_MARKER_FILE} is not the line of text orbax writes'
  return None


def _sealing_rename(root: str, on_sealed):
  """Orbax's atomic-rename commit of a step directory of ``root``, sealed just before the rename
  (see the module docstring); ``on_sealed(folder, seconds)`` is told of each seal. Orbax commits
  each item's directory inside a step directory the same way: those are left to the step's seal."""
  import orbax.checkpoint as ocp

  class SealingRename(ocp.path.atomicity.AtomicRenameTemporaryPath):

    async def finalize(self, *args, **kwargs):
      final = os.fspath(self.get_final())
      if os.path.dirname(os.path.abspath(final)) == root:  # a step directory
        store = getattr(self, '_checkpoint_metadata_store', None)  # its writes are asynchronous
        if store is not None:
          await asyncio.to_thread(store.wait_until_finished)
        start = time.perf_counter()
        await asyncio.to_thread(seal_directory, os.fspath(self.get()))
        on_sealed(final, time.perf_counter() - start)
      return await super().finalize(*args, **kwargs)

  return SealingRename


class CorruptCheckpointError(ValueError):
  """A checkpoint's files do not match their checksums, or its data cannot be read."""


class TrainCheckpointer:
  """Thin wrapper over orbax's ``CheckpointManager`` with items ``state`` (+ ``frozen``) and ``meta``.

  Args:
    directory: checkpoint root (created if missing).
    save_every: save when ``step % save_every == 0`` (``0``: only on ``force``).
    keep: keep the last ``keep`` checkpoints.
    async_save: write in a background thread (the next save or :meth:`wait` joins it).
  """

  def __init__(
      self,
      directory: str | os.PathLike,
      *,
      save_every: int = 0,
      keep: int = 3,
      async_save: bool = True,
  ):
    if keep < 1:
      raise ValueError(f'keep={keep} must be >= 1')
    if save_every < 0:
      raise ValueError(f'save_every={save_every} must be >= 0')
    self.directory = os.path.abspath(os.fspath(directory))
    self.save_every = save_every
    import orbax.checkpoint as ocp  # not at module import: most of a second, and `anlr eval`,
    # `export`, `generate` and `--help` never checkpoint

    options = ocp.CheckpointManagerOptions(
        save_interval_steps=max(save_every, 1),
        max_to_keep=keep,
        create=True,
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,
        temporary_path_class=_sealing_rename(self.directory, self._sealed),
    )
    quiet_reports_of_disk_full()  # orbax's threads report a save that finds no space, at length
    self.manager = ocp.CheckpointManager(self.directory, options=options)
    self._saving: int | None = None  # the step of the save in flight
    self.failure: DiskFullError | None = None
    """The save that found no space, once one has (then nothing more is saved)."""
    self.seal_seconds: dict[int, float] = {}
    """Step -> seconds its checksums took (this process's seals), for the benchmarks."""
    self._verified: set[int] = set()  # steps whose files matched their seal in this process

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    """Steps of the complete checkpoints, oldest first."""
    return sorted(self.manager.all_steps())

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(int(step)))

  def _sealed(self, folder: str, seconds: float) -> None:
    name = os.path.basename(folder)
    if name.isdigit():
      self.seal_seconds[int(name)] = seconds

  def _orbax(self, call, step: int | None):
    """``call()`` of the manager; a save (of ``step``) that found no space raises
    :class:`DiskFullError` and its partial directory is removed."""
    try:
      return call()
    except Exception as err:
      if not is_disk_full(err):
        raise
      what = 'a checkpoint' if step is None else f'checkpoint {step}'
      self.failure = as_disk_full(err, self.directory, what)
      self._saving = None
      if jax.process_index() == 0:
        for name in os.listdir(self.directory):
          if '.orbax-checkpoint-tmp' in name:  # the partial save; the complete ones stay
            shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
      raise self.failure from err

  def verify(self, step: int) -> str | None:
    """None if checkpoint ``step``'s files match their seal, else what is wrong, in a few words
    (checked once a process: a later call for the same step answers from memory)."""
    if step in self._verified:
      return None
    problem = seal_problem(self.step_dir(step))
    if problem is None:
      self._verified.add(int(step))
    return problem

  def _check(self, step: int) -> None:
    problem = self.verify(step)
    if problem is not None:
      raise CorruptCheckpointError(f'checkpoint {step} in {self.directory} is corrupt: {problem}')

  def should_save(self, step: int) -> bool:
    return self.save_every > 0 and step % self.save_every == 0

  def save(self, step: int, state, meta: dict, frozen=None, *, force: bool = False) -> bool:
    """Starts a (collective, async) save of ``state`` and ``meta`` at ``step``; True if started."""
    if not force and not self.should_save(step):
      return False
    if self.failure is not None:
      raise self.failure
    if step in self.manager.all_steps():
      return False
    self._verified.discard(int(step))  # a step deleted (rolled back) and saved anew
    import orbax.checkpoint as ocp

    items = {
        'state': ocp.args.StandardSave(flatten_for_checkpoint(state)),
        'meta': ocp.args.JsonSave(dict(meta, step=int(step))),
    }
    if frozen is not None:
      items['frozen'] = ocp.args.StandardSave(flatten_for_checkpoint(frozen))
    # orbax joins the previous save here anyway
    self._orbax(self.manager.wait_until_finished, self._saving)
    self._saving = int(step)
    return self._orbax(
        lambda: self.manager.save(step, args=ocp.args.Composite(**items), force=True), step
    )

  def restore(self, step: int | None, state_template, frozen_template=None, *, key_source=None):
    """Restores ``(state, meta, frozen_or_None)`` into the templates' shapes, dtypes and shardings.

    ``step=None`` takes the latest complete checkpoint; ``key_source``: a live state whose PRNG key
    leaves give the key implementation (see :func:`unflatten_from_checkpoint`).
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f'no complete checkpoint under {self.directory}')
    import orbax.checkpoint as ocp

    items = {
        'state': ocp.args.StandardRestore(abstract_for_checkpoint(state_template)),
        'meta': ocp.args.JsonRestore(),
    }
    if frozen_template is not None:
      items['frozen'] = ocp.args.StandardRestore(abstract_for_checkpoint(frozen_template))
    self._check(step)
    _quiet_abandoned_reads()  # before: a failed read's siblings may report before it raises
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as err:  # noqa: BLE001  (tensorstore/orbax raise many types on bad bytes)
      first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
      raise CorruptCheckpointError(
          f'checkpoint {step} in {self.directory} cannot be read: {first[:200]}'
      ) from err
    state = unflatten_from_checkpoint(restored['state'], state_template, key_source)
    frozen = (
        unflatten_from_checkpoint(restored['frozen'], frozen_template)
        if frozen_template is not None
        else None
    )
    return state, dict(restored['meta']), frozen

  def read_meta(self, step: int) -> dict:
    """The ``meta`` item of checkpoint ``step`` alone (no array is read) once its files match
    their seal."""
    import orbax.checkpoint as ocp

    self._check(step)
    _quiet_abandoned_reads()
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception as err:  # noqa: BLE001
      raise CorruptCheckpointError(
          f'checkpoint {step} in {self.directory}: its meta record cannot be read ({err})'
      ) from err
    return dict(restored['meta'])

  def wait(self) -> None:
    """Waits for the save in flight (its seal included)."""
    if self.failure is not None:  # that save is over
      return
    self._orbax(self.manager.wait_until_finished, self._saving)
    self._saving = None

  def close(self) -> None:
    """Waits for the save in flight and closes the manager; a save that found no space is raised
    once: not again by a close after it."""
    known = self.failure
    try:
      self.wait()
    except DiskFullError:
      if known is None:
        raise
    finally:
      try:
        self.manager.close()
      except Exception as err:  # noqa: BLE001
        if self.failure is None or not is_disk_full(err):
          raise


__all__ = [
    'CHECKSUM_FILE',
    'CorruptCheckpointError',
    'seal_directory',
    'seal_problem',
    'TrainCheckpointer',
    'directory_checksums',
    'flatten_for_checkpoint',
    'unflatten_from_checkpoint',
    'abstract_for_checkpoint',
]

r"""Multi-process start-up, failure detection and per-process batch feeding.

Process ``p`` of ``P`` holds rows ``[p b, (p+1) b)`` of every global batch of ``B = P b`` rows (the
batch contract); :func:`global_batch_array` stitches those local rows into one global ``jax.Array``
sharded over ``data x fsdp`` with ``jax.make_array_from_process_local_data``.

A job of ``P`` processes runs in lock-step: when one of them dies the others would wait in their
next collective until JAX's own heartbeat timeout aborts them with a C++ stack trace.
:class:`PeerWatchdog` makes that bounded and legible: every process publishes a heartbeat counter
and, on an error, its one-line message in the job's key-value store (``jax.distributed``'s
coordination service); a process that sees a peer fail, or a peer's counter stand still for
``timeout`` seconds, or loses the coordinator, says so in one line and exits with
:data:`EXIT_PEER_FAILED`.

A peer killed in the middle of a collective can also make the collectives library of a survivor
(gloo, on CPU) fail in one of its own threads: an uncaught C++ exception there (e.g.
``gloo::EnforceNotMet ... op.preamble.length <= op.nbytes``) would abort the process with
``terminate called after throwing ...`` and status -6, before any heartbeat is missed. The watchdog
therefore installs a process-wide C++ terminate handler (:func:`install_terminate_guard`) that
writes one line naming the exception's type instead and exits with :data:`EXIT_PEER_FAILED`.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from typing import Callable, Mapping

import jax
import numpy as np

ENV_COORDINATOR = 'JAX_COORDINATOR_ADDRESS'
ENV_NUM_PROCESSES = 'JAX_NUM_PROCESSES'
ENV_PROCESS_ID = 'JAX_PROCESS_ID'


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cpu_collectives: str = 'gloo',
    heartbeat_timeout_seconds: int | None = None,
) -> bool:
  """Calls ``jax.distributed.initialize`` from arguments or ``JAX_COORDINATOR_ADDRESS``,
  ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``. Must run before any JAX computation.

  Returns False (and does nothing) for a single process with no coordinator configured.
  ``heartbeat_timeout_seconds``: JAX's own limit before it aborts the job (default: JAX's).
  """
  coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR)
  if num_processes is None and ENV_NUM_PROCESSES in os.environ:
    num_processes = int(os.environ[ENV_NUM_PROCESSES])
  if process_id is None and ENV_PROCESS_ID in os.environ:
    process_id = int(os.environ[ENV_PROCESS_ID])
  if coordinator_address is None and (num_processes or 1) == 1:
    return False
  if coordinator_address is None or num_processes is None or process_id is None:
    raise ValueError(
        'multi-process run needs coordinator_address, num_processes and process_id (or the env vars '
        f'{ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}); got '
        f'{coordinator_address!r}, {num_processes!r}, {process_id!r}'
    )
  if not 0 <= process_id < num_processes:
    raise ValueError(f'process_id={process_id} must be in [0, num_processes={num_processes})')
  jax.config.update('jax_cpu_collectives_implementation', cpu_collectives)
  extra = {}
  if heartbeat_timeout_seconds is not None:
    extra['heartbeat_timeout_seconds'] = int(heartbeat_timeout_seconds)
  jax.distributed.initialize(
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
      **extra,
  )
  return True


def put_global(tree, shardings):
  """``jax.device_put(tree, shardings)`` that also works when the shardings span other processes'
  devices: each leaf (the same value on every process, e.g. a model every process built alike) is
  copied from this host into the shards this process holds. Typed PRNG keys keep their type."""
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)

  def put(x, sharding):
    is_key = hasattr(x, 'dtype') and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    data = np.asarray(jax.random.key_data(x) if is_key else x)
    out = jax.make_array_from_callback(data.shape, sharding, lambda index: data[index])
    return jax.random.wrap_key_data(out, impl=jax.random.key_impl(x)) if is_key else out

  return jax.tree.map(put, tree, shardings)


EXIT_PEER_FAILED = 4
"""Exit status of a process stopped because another process of its job failed or vanished."""

_KEY = 'anlr'


def _client():
  """The job's coordination-service client (``jax.distributed`` keeps it in private state; there
  is no public accessor)."""
  from jax._src import distributed  # pylint: disable=import-outside-toplevel

  client = distributed.global_state.client
  if client is None:
    raise RuntimeError('jax.distributed is not initialized')
  return client


def _stop_process(message: str, code: int = EXIT_PEER_FAILED) -> None:
  """One line on stderr, then exit at once (no atexit: JAX's shutdown barrier would wait)."""
  print(message, file=sys.stderr, flush=True)
  os._exit(code)  # pylint: disable=protected-access


def process0_value(name: str, value: str, timeout: float = 300.0) -> str:
  """Process 0's ``value`` on every process (e.g. a timestamp all must agree on); ``value`` itself
  in a single-process run."""
  if jax.process_count() == 1:
    return value
  key = f'{_KEY}/value/{name}'
  if jax.process_index() == 0:
    _client().key_value_set(key, value)
    return value
  return _client().blocking_key_value_get(key, int(timeout * 1000))


_terminate_handler = None  # the installed C callback, kept alive as long as the process


def _cxx_runtime() -> ctypes.CDLL | None:
  """The C++ runtime that jaxlib and its collectives libraries share (libstdc++), or None."""
  try:
    return ctypes.CDLL('libstdc++.so.6')
  except OSError:
    return None


def _current_exception_type(runtime: ctypes.CDLL) -> str:
  """The demangled type of the C++ exception being handled (``gloo::EnforceNotMet``), or ``an
  unknown error`` when there is none."""
  try:
    current = runtime.__cxa_current_exception_type
    demangle = runtime.__cxa_demangle
  except AttributeError:
    return 'an unknown error'
  current.restype = ctypes.c_void_p
  info = current()
  if not info:
    return 'an unknown error'
  mangled = ctypes.c_char_p.from_address(info + ctypes.sizeof(ctypes.c_void_p)).value or b''
  mangled = mangled.lstrip(b'*')  # std::type_info::name(): after the vtable pointer
  demangle.restype = ctypes.c_void_p
  demangle.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
  status = ctypes.c_int(1)
  text = demangle(mangled, None, None, ctypes.byref(status))
  if status.value != 0 or not text:
    return mangled.decode(errors='replace') or 'an unknown error'
  return ctypes.string_at(text).decode(errors='replace')  # a few bytes the process exits with


def install_terminate_guard(message: str, code: int = EXIT_PEER_FAILED) -> bool:
  """Makes an uncaught C++ exception in any thread (``std::terminate``) write ``message`` (its
  ``{error}`` replaced by the exception's type) as one line on stderr and exit with ``code``,
  instead of aborting with ``terminate called after throwing ...`` and a core-dump status.
  Returns False when the C++ runtime cannot be reached (nothing installed)."""
  global _terminate_handler
  runtime = _cxx_runtime()
  if runtime is None:
    return False
  try:
    set_terminate = runtime._ZSt13set_terminatePFvvE  # std::set_terminate(void (*)())
  except AttributeError:
    return False
  handler_type = ctypes.CFUNCTYPE(None)

  def on_terminate():  # runs on the failing thread, which takes the GIL for it
    line = message.replace('{error}', _current_exception_type(runtime))
    os.write(2, (line.replace('\n', ' ') + '\n').encode())
    os._exit(code)  # pylint: disable=protected-access

  handler = handler_type(on_terminate)
  set_terminate.argtypes = [handler_type]
  set_terminate.restype = ctypes.c_void_p
  set_terminate(handler)
  _terminate_handler = handler
  return True


class PeerWatchdog:
  """Heartbeats and failure reports between the processes of a ``jax.distributed`` job.

  Args:
    timeout: seconds a peer's heartbeat may stand still before it is taken for dead.
    interval: seconds between two heartbeats (and checks).
    what: the command named in the messages (``anlr train``).
    on_failure: ``on_failure(message)`` when a peer fails (default: print it, exit with
      :data:`EXIT_PEER_FAILED`).
  """

  def __init__(
      self,
      timeout: float = 60.0,
      *,
      interval: float = 1.0,
      what: str = 'anlr',
      on_failure: Callable[[str], None] | None = None,
  ):
    if timeout <= interval:
      raise ValueError(f'timeout={timeout} must be more than interval={interval}')
    self.timeout, self.interval, self.what = timeout, interval, what
    self.on_failure = on_failure or (lambda message: _stop_process(message))
    self.process_id, self.process_count = jax.process_index(), jax.process_count()
    self._client = _client()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, name='anlr-peer-watchdog', daemon=True)

  def start(self) -> PeerWatchdog:
    install_terminate_guard(
        f'{self.what}: error: process {self.process_id} of {self.process_count}: the collectives'
        ' library stopped with {error} in one of its threads (as when a peer process dies during'
        f' a collective): stopping process {self.process_id}; run the same command on every host'
        ' again to resume from the last checkpoint'
    )
    self._beat(0)
    self._thread.start()
    return self

  def _beat(self, count: int) -> None:
    self._client.key_value_set(f'{_KEY}/alive/{self.process_id}', str(count), allow_overwrite=True)

  def _entries(self, kind: str) -> dict[int, str]:
    return {
        int(k.rsplit('/', 1)[1]): v for k, v in self._client.key_value_dir_get(f'{_KEY}/{kind}/')
    }

  def _loop(self) -> None:
    seen: dict[int, tuple[str, float]] = {}
    count = 0
    while not self._stop.wait(self.interval):
      count += 1
      now = time.monotonic()
      try:
        self._beat(count)
        failed, done, alive = (self._entries(k) for k in ('failed', 'done', 'alive'))
      except Exception as err:  # noqa: BLE001  (the coordinator is gone: every call fails)
        if self._stop.is_set():
          return
        first = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        self.on_failure(
            f"{self.what}: error: process {self.process_id} of {self.process_count} lost the job's"
            f' coordinator (process 0; {first}): stopping'
        )
        return
      for peer, message in sorted(failed.items()):
        if peer != self.process_id:
          self._client.key_value_set(f'{_KEY}/seen/{self.process_id}', '1', allow_overwrite=True)
          self.on_failure(
              f'{self.what}: error: process {peer} of {self.process_count} failed ({message}):'
              f' stopping process {self.process_id} too'
          )
          return
      for peer in range(self.process_count):
        if peer == self.process_id or peer in done:
          continue
        value = alive.get(peer)
        if peer not in seen or seen[peer][0] != value:
          seen[peer] = (value, now)
        elif now - seen[peer][1] > self.timeout:
          self.on_failure(
              f'{self.what}: error: process {peer} of {self.process_count} sent no heartbeat for'
              f' {self.timeout:g} s (killed, crashed or cut off): stopping process'
              f' {self.process_id} too; run the same command on every host again to resume from'
              ' the last checkpoint'
          )
          return

  def report_failure(self, message: str) -> None:
    """Tells the peers that this process stops with ``message``; they stop at their next check.
    Process 0 hosts the job's coordinator, so it waits (a few intervals at most) until the peers
    have read the message before it goes."""
    self._stop.set()
    try:
      self._client.key_value_set(f'{_KEY}/failed/{self.process_id}', message[:500])
      if self.process_id == 0:
        deadline = time.monotonic() + 5 * self.interval
        while time.monotonic() < deadline:
          seen = self._entries('seen')
          if all(p in seen for p in range(1, self.process_count)):
            break
          time.sleep(self.interval / 10)
    except Exception:  # noqa: BLE001  (the coordinator may be gone already)
      pass

  def settle(self) -> None:
    """Gives the watchdog time to find a failed or vanished peer (``timeout`` and a few checks):
    called after a collective failed, so that a dead peer is named rather than the collective's
    error. Returns when every peer still looks alive."""
    self._stop.wait(self.timeout + 3 * self.interval)

  def finish(self, barrier_timeout: float = 600.0) -> None:
    """Marks this process done and waits for every peer to be done too, still watching them."""
    self._client.key_value_set(f'{_KEY}/done/{self.process_id}', '1')
    self._client.wait_at_barrier(f'{_KEY}/finish', int(barrier_timeout * 1000))
    self.stop()

  def stop(self) -> None:
    self._stop.set()
    if self._thread.is_alive() and threading.current_thread() is not self._thread:
      self._thread.join()


def global_batch_array(
    local: Mapping[str, np.ndarray], sharding: jax.sharding.Sharding, global_rows: int
) -> dict[str, jax.Array]:
  """This process's rows -> global arrays of ``global_rows`` rows with ``sharding``."""
  out = {}
  for key, value in local.items():
    value = np.asarray(value)
    out[key] = jax.make_array_from_process_local_data(
        sharding, value, (global_rows, *value.shape[1:])
    )
  return out

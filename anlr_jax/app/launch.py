"""The ``anlr`` process entry: sets up the process, then runs :func:`anlr_jax.app.cli.main`.

On Linux with glibc, XLA CPU takes every large buffer of a compiled step (activations, logits,
gradients: about 2 GiB per step for SmolLM2-135M at 8 x 128 tokens) from ``malloc``, which maps
fresh pages for it and unmaps them when the step ends, so every step faults the whole working set
in again, 4 KiB at a time. With transparent huge pages in ``madvise`` mode (the usual default),
glibc's ``glibc.malloc.hugetlb=1`` tunable makes those mappings huge-page backed: 512 times fewer
faults. The tunable is read when a process starts, so the entry re-executes itself once with it
set (same pid, arguments and environment otherwise). Measured on a 2-core CPU it takes the
SmolLM2-135M train step from 4.1-4.6 to about 3.65 s and the reference benchmark step from 1.02 to
0.90 s; numbers are unchanged (docs/benchmarks.md).

Nothing happens when ``ANLR_HUGE_PAGES=0``, when ``GLIBC_TUNABLES`` already names the tunable,
off Linux or glibc, or when transparent huge pages are ``always`` (already on) or ``never``.
This module imports nothing heavy, so the re-execution costs little more than starting Python.

Several processes: :func:`distributed_job` joins this process to a ``jax.distributed`` job (the
``distributed`` config section, else ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` /
``JAX_PROCESS_ID``, or the cluster's own environment with ``distributed.cluster_detection``) and
watches its peers (:class:`anlr_jax.train.distributed.PeerWatchdog`); a process of a job that
fails tells the others, and exits without JAX's shutdown barrier (which would wait for them).
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys

HUGE_PAGES_ENV = "ANLR_HUGE_PAGES"
TUNABLE = "glibc.malloc.hugetlb=1"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str | None:
  """The bracketed mode of ``THP_MODE_FILE`` (``always``, ``madvise``, ``never``), or None."""
  try:
    with open(THP_MODE_FILE) as f:
      text = f.read()
  except OSError:
    return None
  start, end = text.find("["), text.find("]")
  return text[start + 1 : end] if 0 <= start < end else None


def huge_pages_env(environ=None) -> dict | None:
  """The environment to re-execute with, or None when nothing is to be done (module docstring)."""
  environ = os.environ if environ is None else environ
  if environ.get(HUGE_PAGES_ENV, "1").strip() == "0":
    return None
  tunables = environ.get("GLIBC_TUNABLES", "")
  if "glibc.malloc.hugetlb" in tunables:
    return None
  if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
    return None
  if _thp_mode() != "madvise":
    return None
  return {**environ, "GLIBC_TUNABLES": ":".join(t for t in (tunables, TUNABLE) if t)}


@contextlib.contextmanager
def distributed_job(section, *, what: str = "anlr train"):
  """Joins the ``jax.distributed`` job that ``section`` (a ``DistributedSection``) or the
  environment describes, before any JAX computation, and watches the peers while the body runs;
  a no-op yielding None for one process. An error in the body is reported to the peers (they
  stop with one line naming this process and the error) and re-raised; at the end every process
  waits for the others, then the job shuts down."""
  import jax

  from anlr_jax.fields import ConfigError
  from anlr_jax.train.distributed import PeerWatchdog, initialize_distributed

  heartbeat = int(2 * section.peer_timeout_s) + 10  # JAX's own abort comes after ours
  if section.cluster_detection:
    jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat)
  else:
    try:
      started = initialize_distributed(
          section.coordinator_address,
          section.num_processes,
          section.process_id,
          heartbeat_timeout_seconds=heartbeat,
      )
    except ValueError as err:
      raise ConfigError(f"distributed: {err}") from None
    if not started:
      yield None
      return
  watchdog = PeerWatchdog(section.peer_timeout_s, what=what).start()
  try:
    yield watchdog
  except BaseException as err:
    if isinstance(err, jax.errors.JaxRuntimeError):  # e.g. a collective whose peer is gone
      watchdog.settle()  # a dead peer ends this process here, naming it
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    watchdog.report_failure(f"{type(err).__name__}: {text}" if text else type(err).__name__)
    raise
  watchdog.finish()
  jax.distributed.shutdown()


def _in_distributed_job() -> bool:
  jax = sys.modules.get("jax")
  return jax is not None and jax.distributed.is_initialized()


def run() -> None:
  """``anlr``: re-executes once with huge-page-backed ``malloc`` where that applies, then runs
  the command line and exits with its status (at once, in a failed multi-process job)."""
  env = huge_pages_env()
  if env is not None:
    try:
      os.execve(sys.executable, list(sys.orig_argv), env)
    except OSError:
      pass  # cannot re-execute (unusual interpreter setups): run as is
  from anlr_jax.app.cli import main

  try:
    code = main()
  except Exception as err:  # not a one-line error of the CLI: a traceback, then exit at once
    if not _in_distributed_job():
      raise
    import traceback

    traceback.print_exc()
    print(f"anlr: error: {type(err).__name__} (see above)", file=sys.stderr)
    code = 1
  if code and _in_distributed_job():  # JAX's exit-time shutdown would wait for the peers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access
  sys.exit(code)

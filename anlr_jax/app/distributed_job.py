"""``anlr train`` as a ``jax.distributed`` job.

:func:`distributed_job` joins this process to the job (the ``distributed`` config section, else
``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, or the cluster's own
environment with ``distributed.cluster_detection``) and watches its peers
(:class:`anlr_jax.train.distributed.PeerWatchdog`): a process of a job that fails tells the others,
which stop with one line naming it.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def distributed_job(section, *, what: str = "anlr train"):
  """Joins the ``jax.distributed`` job that ``section`` (a ``DistributedSection``) or the
  environment describes, before any JAX computation, and watches the peers while the body runs;
  a no-op yielding None for one process. An error in the body is reported to the peers (they
  stop with one line naming this process and the error) and re-raised; at the end every process
  waits for the others, then the job shuts down."""
  import jax

  from anlr_jax.settings import ConfigError
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

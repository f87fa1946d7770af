r"""Multi-process start-up and per-process batch feeding.

Process ``p`` of ``P`` holds rows ``[p b, (p+1) b)`` of every global batch of ``B = P b`` rows (the
batch contract); :func:`global_batch_array` stitches those local rows into one global ``jax.Array``
sharded over ``data x fsdp`` with ``jax.make_array_from_process_local_data``.
"""

from __future__ import annotations

import os
from typing import Mapping

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
) -> bool:
  """Calls ``jax.distributed.initialize`` from arguments or ``JAX_COORDINATOR_ADDRESS``,
  ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``. Must run before any JAX computation.

  Returns False (and does nothing) for a single process with no coordinator configured.
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
  jax.distributed.initialize(
      coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
  )
  return True


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

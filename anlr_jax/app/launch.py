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

Several processes (:func:`anlr_jax.app.distributed_job.distributed_job`): a process of a job that
fails exits at once, without JAX's shutdown barrier (which would wait for the others).
"""

from __future__ import annotations

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

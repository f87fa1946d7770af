"""Runs one of the ``tests.helpers`` modules in a fresh interpreter on one CPU device (the test
process has 8 fake devices, over which every train step would be sharded and compiled 8 ways)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_helper(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
  """``python -m tests.helpers.<module> ARGS`` from the repository root; fails the test with the
  end of its stderr unless it exits 0."""
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", f"tests.helpers.{module}", *args],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc

"""The tree is formatted with pyink (settings in ``pyproject.toml``: 2-space indents, 100 columns).

Format with ``pyink anlr_jax tests benchmarks examples scripts``.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ["anlr_jax", "tests", "benchmarks", "examples", "scripts"]


def test_sources_are_pyink_formatted():
  proc = subprocess.run(
      [sys.executable, "-m", "pyink", "--check", "--diff", *SOURCES],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert proc.returncode == 0, f"{proc.stderr[-2000:]}\n{proc.stdout[-4000:]}"

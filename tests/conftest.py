"""Test session setup: 8 fake CPU devices, set before any JAX computation runs; a fresh
compilation-cache directory for the CLI, removed when the session ends.

Every test sees the same 8-device CPU backend; unsharded tests simply run on device 0.
"""

import atexit
import functools
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CLI's persistent compilation cache: one fresh directory per test session (and its
# subprocesses), so the suite neither reads nor fills the user's ~/.cache; removed at exit.
os.environ["ANLR_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="anlr-xla-")
atexit.register(functools.partial(shutil.rmtree, os.environ["ANLR_COMPILE_CACHE"], True))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

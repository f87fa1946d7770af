"""Test session setup: 8 fake CPU devices, set before any JAX computation runs.

Every test sees the same 8-device CPU backend; unsharded tests simply run on device 0.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

"""``python -m anlr_jax`` = the ``anlr`` command (see :mod:`anlr_jax.app.launch`)."""

from anlr_jax.app.launch import run

run()

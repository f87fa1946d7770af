"""``python -m anlr_jax`` = the ``anlr`` command (see :mod:`anlr_jax.cli`)."""

import sys

from anlr_jax.cli import main

sys.exit(main())

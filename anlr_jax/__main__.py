"""``python -m anlr_jax`` = the ``anlr`` command (see :mod:`anlr_jax.app.cli`)."""

import sys

from anlr_jax.app.cli import main

sys.exit(main())

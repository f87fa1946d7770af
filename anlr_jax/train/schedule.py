r"""The paper's learning-rate schedule: linear warmup, then linear decay to 0 (App. B, "Linear").

.. math::
   \eta_t = \eta \, t / w \quad (t < w), \qquad
   \eta_t = \eta \, (T - t) / (T - w) \quad (w \le t \le T),

with ``t`` the optax update count (0 for the first update), ``w`` = ``warmup_steps`` and
``T`` = ``total_steps``. This matches ``transformers.get_linear_schedule_with_warmup``.
"""

from __future__ import annotations

import optax


def linear_warmup_decay(
    peak_value: float, total_steps: int, warmup_steps: int = 0
) -> optax.Schedule:
  """Linear 0 -> ``peak_value`` over ``warmup_steps``, then linear -> 0 at ``total_steps``."""
  if total_steps < 1:
    raise ValueError(f'total_steps={total_steps} must be >= 1')
  if not 0 <= warmup_steps <= total_steps:
    raise ValueError(f'warmup_steps={warmup_steps} must be in [0, total_steps={total_steps}]')
  decay = optax.linear_schedule(peak_value, 0.0, max(total_steps - warmup_steps, 1))
  if warmup_steps == 0:
    return decay
  warmup = optax.linear_schedule(0.0, peak_value, warmup_steps)
  return optax.join_schedules([warmup, decay], [warmup_steps])

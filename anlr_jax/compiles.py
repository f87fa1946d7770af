"""Counting the programs JAX compiles, from its own monitoring events.

Every program JAX hands to XLA — a jitted function at a new shape, or one eager operation at a new
shape — records one ``/jax/core/compile/backend_compile_duration`` event (:mod:`jax.monitoring`),
whether XLA compiles it or the persistent compilation cache (``compile_cache``,
:func:`anlr_jax.app.cli.use_compile_cache`) supplies it; a cache hit also records
``/jax/compilation_cache/cache_hits``. :func:`compile_log` collects both while it is open::

    with compile_log() as log:
      generate_answers(...)
    print(log.compiled, log.cache_hits, log.seconds)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass
class CompileLog:
  """The programs of one stretch of work: ``programs`` ``[(name, seconds, loaded)]``, compiled
  by XLA or (``loaded``) read from the persistent cache."""

  programs: list[tuple[str, float, bool]] = dataclasses.field(default_factory=list)

  @property
  def cache_hits(self) -> int:
    """Programs read from the persistent compilation cache."""
    return sum(1 for *_, loaded in self.programs if loaded)

  @property
  def compiled(self) -> int:
    """Programs XLA compiled (not read from the persistent cache)."""
    return len(self.programs) - self.cache_hits

  @property
  def seconds(self) -> float:
    """Wall time spent compiling or loading programs."""
    return sum(seconds for _, seconds, _ in self.programs)

  def compiled_longer_than(self, seconds: float) -> int:
    """Programs XLA compiled in at least ``seconds`` (what the persistent cache keeps)."""
    return sum(1 for _, s, loaded in self.programs if s >= seconds and not loaded)


_OPEN: list[CompileLog] = []
_LISTENING = False
_HIT = [False]  # a cache hit is recorded just before its program's duration


def _on_duration(event: str, duration: float, **kwargs) -> None:
  if event == BACKEND_COMPILE_EVENT:
    loaded, _HIT[0] = _HIT[0], False
    for log in _OPEN:
      log.programs.append((str(kwargs.get("fun_name", "?")), float(duration), loaded))


def _on_event(event: str, **kwargs) -> None:
  del kwargs
  if event == CACHE_HIT_EVENT:
    _HIT[0] = True


@contextlib.contextmanager
def compile_log() -> Iterator[CompileLog]:
  """A :class:`CompileLog` of what JAX compiles while the block runs (logs may nest)."""
  global _LISTENING
  if not _LISTENING:  # jax.monitoring has no public way to remove a listener: register once
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)
    _LISTENING = True
  log = CompileLog()
  _OPEN.append(log)
  try:
    yield log
  finally:
    _OPEN.remove(log)


__all__ = ["BACKEND_COMPILE_EVENT", "CACHE_HIT_EVENT", "CompileLog", "compile_log"]

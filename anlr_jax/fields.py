"""Settings dataclasses whose fields carry their own help text and allowed values.

A settings class (:class:`anlr_jax.train.TrainerConfig`, the sections of the run config in
:mod:`anlr_jax.app.config`) declares each field with :func:`setting`::

    @dataclasses.dataclass
    class LoraSection:
      rank: int = setting(32, "LoRA rank r", Range(1))
      dropout: float = setting(0.05, "dropout on the adapter input", Range(0, 1, hi_open=True))

      def __post_init__(self):
        check_fields(self)

:func:`check_fields` is the one validation path: it checks every field against its rule and raises
:class:`ConfigError` naming the field (``LoraSection.rank: 0 is not allowed; must be >= 1``, or with
the run config's dotted prefix ``lora.rank: 0 is not allowed; must be >= 1``); the command line
reports the same rule and help text (:func:`field_help`, :func:`rule_of`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax.numpy as jnp

HELP = "help"
RULE = "rule"


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
"""The dtype names a setting may use, and their JAX dtypes."""


RENAMED_KEYS = {
    "trainer.warmup_steps": "trainer.lr_warmup_steps",
    "anlr.alpha": "anlr.velocity_weight",
    "anlr.beta": "anlr.snr_weight",
}
"""Run-config keys that were renamed (old dotted key -> new): still read, with a warning, and a
run identity stored under an old key matches the new one."""


class ConfigError(ValueError):
  """A setting is malformed; the message names the key (and file) and what is allowed."""


@dataclasses.dataclass(frozen=True)
class Range:
  """A number in ``[lo, hi]`` (``lo_open``/``hi_open``: the bound excluded), finite; None allowed."""

  lo: float | None = None
  hi: float | None = None
  lo_open: bool = False
  hi_open: bool = False

  def allows(self, value: Any) -> bool:
    if value is None:
      return True
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
      return False
    if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
      return False
    return not (self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi))

  def __str__(self) -> str:
    lower = "" if self.lo is None else (f"> {self.lo}" if self.lo_open else f">= {self.lo}")
    upper = "" if self.hi is None else (f"< {self.hi}" if self.hi_open else f"<= {self.hi}")
    return " and ".join(s for s in (lower, upper) if s) or "finite"


@dataclasses.dataclass(frozen=True)
class OneOf:
  """A value from ``choices`` (a sequence, or a function returning one, for tables filled later)."""

  choices: Sequence[Any] | Callable[[], Sequence[Any]]

  def values(self) -> tuple[Any, ...]:
    choices = self.choices() if callable(self.choices) else self.choices
    return tuple(choices)

  def allows(self, value: Any) -> bool:
    return value in self.values()

  def __str__(self) -> str:
    return f"one of {list(self.values())}"


@dataclasses.dataclass(frozen=True)
class Each:
  """Every item of a list (or every key of a mapping) follows ``rule``."""

  rule: Range | OneOf

  def allows(self, value: Any) -> bool:
    return all(self.rule.allows(item) for item in (value or ()))

  def __str__(self) -> str:
    return str(self.rule)


Rule = Range | OneOf | Each


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    rule: Rule | None = None,
    *,
    factory: Callable[[], Any] | None = None,
) -> Any:
  """A dataclass field with its one-line ``help`` and its allowed values ``rule``.

  ``factory`` builds mutable defaults (lists, dicts), as ``dataclasses.field(default_factory=)``.
  """
  metadata = {HELP: help, RULE: rule}
  if factory is not None:
    return dataclasses.field(default_factory=factory, metadata=metadata)
  return dataclasses.field(default=default, metadata=metadata)


def field_help(field: dataclasses.Field) -> str:
  """The field's one-line help text ('' if it has none)."""
  return field.metadata.get(HELP, "")


def rule_of(field: dataclasses.Field) -> Rule | None:
  """The field's allowed-values rule, or None."""
  return field.metadata.get(RULE)


def check_fields(obj: Any, prefix: str | None = None) -> None:
  """Checks every field of the dataclass instance ``obj`` against its rule.

  Raises:
    ConfigError: ``<prefix><field>: <value> is not allowed; must be <rule>``; ``prefix`` defaults to
      the class name and a dot.
  """
  prefix = f"{type(obj).__name__}." if prefix is None else prefix
  for field in dataclasses.fields(obj):
    rule = rule_of(field)
    value = getattr(obj, field.name)
    if rule is None or rule.allows(value):
      continue
    one = rule.rule if isinstance(rule, Each) else rule
    bad = next(
        item for item in (value if isinstance(rule, Each) else [value]) if not one.allows(item)
    )
    raise ConfigError(f"{prefix}{field.name}: {bad!r} is not allowed; must be {rule}")


__all__ = [
    "ConfigError",
    "DTYPES",
    "Each",
    "OneOf",
    "RENAMED_KEYS",
    "Range",
    "check_fields",
    "field_help",
    "rule_of",
    "setting",
]

"""Settings dataclasses whose fields carry their own help text and allowed values.

A settings class (:class:`anlr_jax.train.TrainerConfig`, the sections of the run config in
:mod:`anlr_jax.app.sections`) declares each field with :func:`setting`::

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

A field declared with ``identity=True`` determines a run's trajectory (:func:`identity_of` lists
them); ``identity="unless-default"`` marks a key added after runs existed: it counts only when it
differs from its default, so runs that never stored it keep their identity.

:func:`coerce` reads a value given as text (a command-line override) or as parsed YAML into a
field's type; :func:`build_settings` builds a settings class from a mapping with it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Callable, Literal, Mapping, Sequence

import jax.numpy as jnp
import yaml

HELP = "help"
RULE = "rule"
IDENTITY = "identity"


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
"""The dtype names a setting may use, and their JAX dtypes."""


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
    identity: bool | Literal["unless-default"] = False,
) -> Any:
  """A dataclass field with its one-line ``help`` and its allowed values ``rule``.

  ``factory`` builds mutable defaults (lists, dicts), as ``dataclasses.field(default_factory=)``.
  ``identity``: the field determines a run's trajectory (see the module docstring).
  """
  if identity not in (False, True, "unless-default"):
    raise ValueError(f"identity={identity!r}: expected True, False or 'unless-default'")
  metadata = {HELP: help, RULE: rule, IDENTITY: identity}
  if factory is not None:
    return dataclasses.field(default_factory=factory, metadata=metadata)
  return dataclasses.field(default=default, metadata=metadata)


def field_help(field: dataclasses.Field) -> str:
  """The field's one-line help text ('' if it has none)."""
  return field.metadata.get(HELP, "")


def rule_of(field: dataclasses.Field) -> Rule | None:
  """The field's allowed-values rule, or None."""
  return field.metadata.get(RULE)


def identity_fields(cls: type) -> list[dataclasses.Field]:
  """The fields of the settings class ``cls`` declared with ``identity``."""
  return [f for f in dataclasses.fields(cls) if f.metadata.get(IDENTITY)]


def identity_of(obj: Any, prefix: str) -> dict[str, Any]:
  """``{<prefix><field>: value}`` of ``obj``'s identity fields (lists copied; a field marked
  ``"unless-default"`` only when it differs from its default)."""
  out = {}
  for f in identity_fields(type(obj)):
    value = getattr(obj, f.name)
    if f.metadata[IDENTITY] == "unless-default" and value == _default(f):
      continue
    out[f"{prefix}{f.name}"] = list(value) if isinstance(value, (list, tuple)) else value
  return out


def _default(field: dataclasses.Field) -> Any:
  if field.default_factory is not dataclasses.MISSING:
    return field.default_factory()
  return field.default


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


# ------------------------------------------------------------------------------------- coercion
_NULLS = ("null", "none", "~", "")
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def type_name(tp: Any) -> str:
  """``tp`` as the help text and errors write it (``int``, ``str | None``, ``list[str]``)."""
  if tp is type(None):
    return "null"
  if isinstance(tp, type) and not typing.get_args(tp):
    return tp.__name__
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin in (typing.Union, types.UnionType):  # a settings class by its name, None as None
    return " | ".join("None" if a is type(None) else type_name(a) for a in args)
  if origin in (list, dict, tuple):
    return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
  return str(tp).replace("typing.", "")


def coerce(value: Any, tp: Any, key: str) -> Any:
  """``value`` as type ``tp`` (strings from the command line are parsed); ConfigError if impossible."""
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  bad = ConfigError(f"{key}: expected {type_name(tp)}, got {value!r} ({type(value).__name__})")
  if origin in (typing.Union, types.UnionType):
    if value is None or (isinstance(value, str) and value.strip().lower() in _NULLS):
      if type(None) in args:
        return None
      raise bad
    for a in args:
      if a is type(None):
        continue
      try:
        return coerce(value, a, key)
      except ConfigError:
        pass
    raise bad
  if origin is list or origin is tuple:
    if isinstance(value, str):
      value = _parse_text(value)
      if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
      raise bad
    return [coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
  if origin is dict:
    if isinstance(value, str):
      value = _parse_text(value)
    if value is None:
      return {}
    if not isinstance(value, Mapping):
      raise bad
    return {
        coerce(k, args[0], f"{key} key"): coerce(v, args[1], f"{key}.{k}") for k, v in value.items()
    }
  if dataclasses.is_dataclass(tp):  # a nested settings section, e.g. eval.judge
    if isinstance(value, tp):
      return value
    if isinstance(value, str):
      value = _parse_text(value)
    if value is None:
      return tp()
    if not isinstance(value, Mapping):
      raise bad
    return build_settings(tp, value, f"{key}.")
  if tp is bool:
    if isinstance(value, bool):
      return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
      return value.strip().lower() in _TRUE
    raise bad
  if tp is int:
    if isinstance(value, bool):
      raise bad
    if isinstance(value, int):
      return value
    if isinstance(value, float) and value.is_integer():
      return int(value)
    if isinstance(value, str):
      try:
        number = float(value)
      except ValueError:
        raise bad from None
      if number.is_integer():
        return int(number)
    raise bad
  if tp is float:
    if isinstance(value, bool):
      raise bad
    if isinstance(value, (int, float)):
      return float(value)
    if isinstance(value, str):
      try:
        return float(value)
      except ValueError:
        raise bad from None
    raise bad
  if tp is str:
    if isinstance(value, str):
      return value
    raise bad
  raise bad


def _parse_text(text: str) -> Any:
  try:
    return yaml.safe_load(text)
  except yaml.YAMLError:
    return text


def build_settings(
    cls: type, raw: Mapping[str, Any], prefix: str, *, names: Sequence[str] | None = None
) -> Any:
  """An instance of the settings class ``cls`` from ``raw``, every key coerced and checked.

  ``names``: the keys ``raw`` may hold (default: every field of ``cls``); an unknown key raises
  :class:`ConfigError` listing them, as does a value of the wrong type or one its rule rejects,
  each error naming ``<prefix><key>``.
  """
  types_ = typing.get_type_hints(cls)
  allowed = [f.name for f in dataclasses.fields(cls)] if names is None else list(names)
  kwargs = {}
  for name, value in raw.items():
    if name not in allowed:
      raise ConfigError(
          f"unknown key {prefix + name!r}; allowed keys in "
          f"{prefix[:-1] or 'the top level'!r}: {', '.join(allowed)}"
      )
    kwargs[name] = coerce(value, types_[name], f"{prefix}{name}")
  try:
    obj = cls(**kwargs)
  except ConfigError as err:  # a class that checks itself names its fields by its class name
    message = str(err)
    for klass in cls.__mro__:
      message = message.replace(f"{klass.__name__}.", prefix)
    raise ConfigError(message) from None
  check_fields(obj, prefix)
  return obj


__all__ = [
    "ConfigError",
    "DTYPES",
    "Each",
    "OneOf",
    "Range",
    "build_settings",
    "check_fields",
    "coerce",
    "field_help",
    "identity_fields",
    "identity_of",
    "rule_of",
    "setting",
    "type_name",
]

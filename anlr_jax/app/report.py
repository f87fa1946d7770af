"""What a run shows and writes besides the adapter: log lines, loss plots, tables, JSON files.

Every process of a multi-process run trains and evaluates; only process 0 writes files
(:func:`is_writer`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping

import jax
import numpy as np

from anlr_jax import fileio
from anlr_jax.analysis.results import RunResult

BASE_ROW = "base"
"""The row of the base model (no adapters) in accuracy tables."""

Log = Callable[[str], None]


def say(message: str) -> None:
  """The default :data:`Log`: one line on stdout, flushed."""
  print(message, flush=True)


def plot_losses(curves: Mapping[str, tuple[list[float], list[float]]], path: str) -> None:
  """Training loss against update step, one line per label (Agg backend: no display needed); labels
  without a loss value are left out, and with none at all no file is written."""
  curves = {label: curve for label, curve in curves.items() if len(curve[1])}
  if not is_writer() or not curves:
    return
  import matplotlib  # here, not at the top: a command that draws nothing starts faster

  matplotlib.use("Agg")  # files only: no display needed
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  for label, (steps, losses) in curves.items():
    steps, losses = np.asarray(steps), np.asarray(losses)
    (line,) = ax.plot(steps, losses, alpha=0.3, linewidth=0.8)
    window = max(1, len(losses) // 20)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    ax.plot(steps[window - 1 :], smooth, color=line.get_color(), label=label)
  ax.set_xlabel("update step")
  ax.set_ylabel("training loss (response tokens)")
  ax.set_yscale("log")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def loss_curve(rows) -> tuple[list[float], list[float]]:
  rows = [r for r in rows if "loss" in r]
  return [r["step"] for r in rows], [r["loss"] for r in rows]


def is_writer() -> bool:
  """Only process 0 writes run files (every process trains and evaluates)."""
  return jax.process_index() == 0


def write_json(path: str, payload: Any) -> None:
  """Writes ``payload`` as JSON to ``path`` atomically, on process 0 only."""
  if is_writer():
    fileio.write_json_atomic(path, payload)


def final_loss(curve) -> float | None:
  losses = curve[1]
  return float(np.mean(losses[-max(1, len(losses) // 10) :])) if losses else None


def table_text(base: Mapping[str, float] | None, runs: list[RunResult]) -> str:
  """A small fixed-width table: method, accuracy per task (percent), avg, final loss, seconds."""
  tasks = list(base or (runs[0].accuracy if runs else {}))
  header = ["method", *tasks, "avg", "final loss", "train s"]
  rows = []
  if base:
    rows.append(
        [
            BASE_ROW,
            *(f"{100 * base[t]:.1f}" for t in tasks),
            f"{100 * float(np.mean(list(base.values()))):.1f}",
            "",
            "",
        ]
    )
  for r in runs:
    rows.append(
        [
            r.method,
            *(f"{100 * r.accuracy[t]:.1f}" if t in r.accuracy else "" for t in tasks),
            "" if r.avg is None else f"{100 * r.avg:.1f}",
            "" if r.final_loss is None else f"{r.final_loss:.4f}",
            "" if r.train_seconds is None else f"{r.train_seconds:.0f}",
        ]
    )
  widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
  fmt = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
  return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def no_lock():
  """A stand-in for :class:`anlr_jax.train.lock.DirectoryLock` on processes that write nothing."""
  return contextlib.nullcontext()


__all__ = [
    "BASE_ROW",
    "Log",
    "final_loss",
    "is_writer",
    "loss_curve",
    "no_lock",
    "plot_losses",
    "say",
    "table_text",
    "write_json",
]

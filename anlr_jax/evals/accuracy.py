r"""Per-task accuracy tables like the paper's Tab. 1: rows = methods, columns = tasks + "Avg.".

Cell values are accuracies in percent, `100 · correct / total`, printed with `digits` decimals. The
"Avg." of a method is the unweighted mean of its task accuracies (each task counts once, as in the
paper), computed before rounding; it is left blank when the method lacks a task of the table, and so
is any missing cell. In Markdown the best value of each column is bold (ties all bold).
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from anlr_jax import fileio
from anlr_jax.evals.generative import EvalResult
from anlr_jax.evals.extract import COMMONSENSE_TASKS, TASKS, get_task

AVG_TITLE = "Avg."


def _task_key(name: str) -> str:
  try:
    return get_task(name).name
  except ValueError:
    return name  # a custom task: its own name


def _title(name: str) -> str:
  return TASKS[name].title if name in TASKS else name


def _percent(value: float | EvalResult, where: str) -> float:
  if isinstance(value, EvalResult):
    return 100.0 * value.accuracy
  value = float(value)
  if not 0.0 <= value <= 1.0 or math.isnan(value):
    raise ValueError(f"{where}: an accuracy must be a fraction in [0, 1], got {value}")
  return 100.0 * value


def accuracy_table(
    results: Mapping[str, Mapping[str, float | EvalResult]],
    *,
    tasks: Sequence[str] | None = None,
) -> tuple[list[str], list[tuple[str, list[float | None]]]]:
  """The table as `(column titles, [(method, [percent or None per task..., avg or None])])`.

  Args:
    results: `{method: {task: accuracy fraction or EvalResult}}`; tasks may be names or aliases.
    tasks: the task columns in order; None: the commonsense tasks in the paper's order, then GSM8K,
      then any other task in order of first appearance.
  """
  if not results:
    raise ValueError("results is empty: no methods to tabulate")
  rows_in = {
      method: {
          _task_key(task): _percent(value, f"results[{method!r}][{task!r}]")
          for task, value in per_task.items()
      }
      for method, per_task in results.items()
  }
  if tasks is None:
    seen: list[str] = []
    for per_task in rows_in.values():
      seen += [t for t in per_task if t not in seen]
    known = [t for t in (*COMMONSENSE_TASKS, "gsm8k") if t in seen]
    columns = known + [t for t in seen if t not in known]
  else:
    columns = [_task_key(t) for t in tasks]
    if len(set(columns)) != len(columns):
      raise ValueError(f"tasks has duplicates: {list(tasks)}")
  rows = []
  for method, per_task in rows_in.items():
    cells: list[float | None] = [per_task.get(task) for task in columns]
    avg = None if any(c is None for c in cells) else sum(cells) / len(cells)
    rows.append((method, cells + [avg]))
  return ["Method", *(_title(t) for t in columns), AVG_TITLE], rows


def _fmt(value: float | None, digits: int) -> str:
  return "" if value is None else f"{value:.{digits}f}"


def write_accuracy_table(
    results: Mapping[str, Mapping[str, float | EvalResult]],
    path: str | os.PathLike[str],
    *,
    tasks: Sequence[str] | None = None,
    digits: int = 1,
) -> tuple[Path, Path]:
  """Writes `path` with suffixes `.csv` and `.md` (see `accuracy_table`); returns both paths."""
  header, rows = accuracy_table(results, tasks=tasks)
  base = Path(path)
  if base.suffix in (".csv", ".md"):
    base = base.with_suffix("")
  csv_path, md_path = base.with_suffix(".csv"), base.with_suffix(".md")
  base.parent.mkdir(parents=True, exist_ok=True)
  with fileio.atomic_write(csv_path, "w", newline="", encoding="utf-8") as f:
    writer = csv.writer(f)
    writer.writerow(header)
    for method, cells in rows:
      writer.writerow([method, *(_fmt(c, digits) for c in cells)])
  best = [
      max((round(cells[j], digits) for _, cells in rows if cells[j] is not None), default=None)
      for j in range(len(header) - 1)
  ]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" + "---:|" * (len(header) - 1)]
  for method, cells in rows:
    shown = []
    for j, value in enumerate(cells):
      text = _fmt(value, digits)
      if value is not None and len(rows) > 1 and round(value, digits) == best[j]:
        text = f"**{text}**"
      shown.append(text)
    lines.append("| " + " | ".join([method.replace("|", "\\|"), *shown]) + " |")
  with fileio.atomic_write(md_path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  return csv_path, md_path

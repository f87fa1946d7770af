"""CSV and Markdown table writers shared by ``anlr analyze`` and ``anlr sweep`` (each file written
whole or not at all)."""

from __future__ import annotations

import csv
import math
from typing import Sequence

from anlr_jax.fileio import atomic_write

__all__ = ['write_csv', 'write_markdown', 'format_number']


def format_number(value, digits: int = 4) -> str:
  """``nan`` -> ``-``, floats to ``digits`` significant digits, anything else ``str``."""
  if isinstance(value, bool):
    return str(value)
  if isinstance(value, float):
    if math.isnan(value):
      return '-'
    return f'{value:.{digits}g}'
  return str(value)


def write_csv(path: str, rows: Sequence[dict], fields: Sequence[str] | None = None) -> str:
  """Writes ``rows`` (dicts) with a header; ``fields`` defaults to the keys in first-seen order."""
  if fields is None:
    fields = list(dict.fromkeys(k for row in rows for k in row))
  with atomic_write(path, 'w', newline='') as f:
    writer = csv.DictWriter(f, list(fields), extrasaction='ignore')
    writer.writeheader()
    writer.writerows(rows)
  return path


def write_markdown(
    path: str, header: Sequence[str], rows: Sequence[Sequence], title: str = ''
) -> str:
  """A GitHub Markdown table; cells go through :func:`format_number`."""
  lines = [f'# {title}', ''] if title else []
  lines.append('| ' + ' | '.join(header) + ' |')
  lines.append('|' + '|'.join(['---'] * len(header)) + '|')
  for row in rows:
    lines.append('| ' + ' | '.join(format_number(c) for c in row) + ' |')
  with atomic_write(path, 'w') as f:
    f.write('\n'.join(lines) + '\n')
  return path

"""Files written whole or not at all, and JSON / YAML files read with their type checked.

:func:`atomic_write` writes to a temporary name in the target's folder and renames it into place
(``os.replace``), so a reader or a crash sees the old file or the new one, never a partial one.
:func:`read_json` and :func:`read_yaml` read a document, check that it is of the expected type, and
name the file (and the line of a syntax error) in every error. :func:`read_jsonl` reads a JSON Lines
file (gzipped when its name ends in ``.gz``) under one rule: a bad line raises naming
``file:line``, except, for a file that a program appends to, an unterminated last line (a write cut
short by a crash), which is dropped. :func:`package_data_folder` finds a
data folder inside an installed package without importing it.
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import json
import os
import tempfile
from typing import Any

import yaml

__all__ = [
    "atomic_write",
    "package_data_folder",
    "parse_json",
    "read_json",
    "read_jsonl",
    "read_jsonl_lines",
    "read_yaml",
    "write_json_atomic",
]


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", **kwargs):
  """A file object on a temporary name in ``path``'s folder, renamed to ``path`` when the block
  ends without an exception (removed otherwise): ``path`` is either the old file or the new one,
  never a partial one."""
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
  try:
    with os.fdopen(fd, mode, **kwargs) as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise


def write_json_atomic(path: str | os.PathLike, payload: Any) -> str:
  """Writes ``payload`` as indented JSON to ``path`` atomically (:func:`atomic_write`); returns
  ``path``. A payload that cannot be serialised raises and leaves ``path`` as it was."""
  text = json.dumps(payload, indent=2) + "\n"  # serialise first: a TypeError writes nothing
  with atomic_write(path, "w", encoding="utf-8") as f:
    f.write(text)
  return os.fspath(path)


def _check_type(value: Any, expect: type | tuple[type, ...], where: str, what: str, error) -> Any:
  if not isinstance(value, expect):
    raise error(f"{where}: expected {what}, got {type(value).__name__}")
  return value


def parse_json(
    text: str,
    where: str,
    expect: type | tuple[type, ...] = dict,
    *,
    what: str = "a JSON object",
    line: int | None = None,
    error: type[ValueError] = ValueError,
) -> Any:
  """The JSON document ``text`` read from the file ``where`` (the whole file, or its line ``line``
  of a JSON Lines file), checked to be an ``expect``.

  Raises:
    error: ``'<where>:<line>: invalid JSON: ...'`` (the line of the syntax error in the file), or
      ``'<where>: expected <what>, got <type>'`` (``<where>:<line>`` for a line).
  """
  try:
    value = json.loads(text)
  except json.JSONDecodeError as err:
    raise error(f"{where}:{(line or 1) + err.lineno - 1}: invalid JSON: {err.msg}") from None
  return _check_type(value, expect, where if line is None else f"{where}:{line}", what, error)


def read_json(
    path: str | os.PathLike,
    expect: type | tuple[type, ...] = dict,
    *,
    what: str = "a JSON object",
    error: type[ValueError] = ValueError,
) -> Any:
  """The JSON document in the file ``path``, checked to be an ``expect`` (:func:`parse_json`).

  Raises:
    FileNotFoundError: no such file. error: not JSON, or another type (the message names the file).
  """
  path = os.fspath(path)
  with open(path, encoding="utf-8") as f:
    text = f.read()
  return parse_json(text, path, expect, what=what, error=error)


def read_jsonl_lines(
    path: str | os.PathLike,
    expect: type | tuple[type, ...] | None = dict,
    *,
    what: str = "a JSON object",
    cut_last: str = "raise",
    error: type[ValueError] = ValueError,
) -> list[tuple[int, Any]]:
  """``(line number, value)`` of each non-blank line of the JSON Lines file ``path`` (gzipped when
  the name ends in ``.gz``), each value checked to be an ``expect`` (None: any JSON value).

  ``cut_last`` says what an unterminated last line that is not valid JSON is: for a file a program
  appends to, a write cut short by a crash; ``"drop"`` leaves it out, ``"remove"`` also removes it
  from the file (so the next append starts on a fresh line), ``"raise"`` (a file read as input)
  treats it as any other bad line.

  Raises:
    FileNotFoundError: no such file. error: ``'<path>:<line>: invalid JSON: ...'`` or
      ``'<path>:<line>: expected <what>, got <type>'``.
  """
  if cut_last not in ("raise", "drop", "remove"):
    raise ValueError(f"cut_last must be 'raise', 'drop' or 'remove', got {cut_last!r}")
  path = os.fspath(path)
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", encoding="utf-8") as f:
    text = f.read()
  lines = text.split("\n")  # the last item is "" when the file ends with a newline
  out = []
  for number, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    try:
      value = json.loads(line)
    except json.JSONDecodeError as err:
      if number == len(lines) and cut_last != "raise":  # unterminated: a write cut short
        if cut_last == "remove":
          with atomic_write(path, "w", encoding="utf-8") as f:
            f.write("\n".join(lines[:-1]) + ("\n" if len(lines) > 1 else ""))
        break
      raise error(f"{path}:{number}: invalid JSON: {err.msg}") from None
    if expect is not None:
      _check_type(value, expect, f"{path}:{number}", what, error)
    out.append((number, value))
  return out


def read_jsonl(
    path: str | os.PathLike,
    expect: type | tuple[type, ...] | None = dict,
    *,
    what: str = "a JSON object",
    cut_last: str = "raise",
    error: type[ValueError] = ValueError,
) -> list[Any]:
  """The values of the JSON Lines file ``path``: :func:`read_jsonl_lines` without the line
  numbers."""
  rows = read_jsonl_lines(path, expect, what=what, cut_last=cut_last, error=error)
  return [value for _, value in rows]


def read_yaml(
    path: str | os.PathLike,
    expect: type | tuple[type, ...] = dict,
    *,
    what: str = "a mapping",
    empty: Any = None,
    error: type[ValueError] = ValueError,
) -> Any:
  """The YAML document in the file ``path`` (``empty`` for an empty file), checked to be an
  ``expect``.

  Raises:
    FileNotFoundError: no such file. error: ``'<path>:<line>: invalid YAML: ...'``, or
      ``'<path>: expected <what>, got <type>'``.
  """
  path = os.fspath(path)
  with open(path, encoding="utf-8") as f:
    try:
      value = yaml.safe_load(f)
    except yaml.YAMLError as err:
      mark = getattr(err, "problem_mark", None)
      where = f"{path}:{mark.line + 1}" if mark is not None else path
      raise error(f"{where}: invalid YAML: {getattr(err, 'problem', err)}") from None
  if value is None:
    return empty
  return _check_type(value, expect, path, what, error)


def package_data_folder(
    package: str, parts: tuple[str, ...], missing: str, install_hint: str
) -> str:
  """The folder ``parts`` inside the installed package ``package`` (found without importing it).

  Raises:
    FileNotFoundError: one line, ``"<missing>: <install_hint>"`` when the package is not installed,
      or naming the folder when the installed package lacks it.
  """
  try:
    spec = importlib.util.find_spec(package)
  except (ImportError, ValueError):
    spec = None
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f"{missing}: {install_hint}")
  root = os.path.join(list(spec.submodule_search_locations)[0], *parts)
  if not os.path.isdir(root):
    raise FileNotFoundError(f"{root} is missing: reinstall with {install_hint}")
  return root

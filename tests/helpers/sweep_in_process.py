"""``anlr sweep`` with its cells trained in this process: each cell's ``anlr train`` command line,
which the sweep would start as a process of its own, goes to ``cli.main`` here instead (one
interpreter start for every cell, on this process's devices).

  python -m tests.helpers.sweep_in_process COMMANDS_JSON [anlr sweep arguments ...]

writes the cells' command lines to ``COMMANDS_JSON`` and exits with the sweep's status.
"""

import json
import subprocess
import sys

from anlr_jax.app import cli


def main(argv: list[str]) -> int:
  commands_file, args = argv[0], argv[1:]
  commands = []

  def call(command, **_):
    commands.append(list(command))
    if command[1:4] != ["-m", "anlr_jax", "train"]:
      raise ValueError(f"not an `anlr train` cell: {command}")
    return cli.main(command[3:])

  subprocess.call = call
  try:
    return cli.main(["sweep", *args])
  finally:
    with open(commands_file, "w", encoding="utf-8") as f:
      json.dump(commands, f)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

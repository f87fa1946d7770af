"""Runs the ``main(argv)`` of scripts (an example, a benchmark) one after the other in this
process, for a test that runs them in a process of their own: one interpreter start for all.

  python -m tests.helpers.run_scripts '[["examples/a.py", ["--x", "1"]], ["b.py", []]]'

Exits with the first non-zero status of a ``main``, else 0.
"""

import importlib.util
import json
import os
import sys


def run_main(path: str, argv: list[str]) -> int:
  name = os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.main(argv)


def main(argv: list[str]) -> int:
  (runs,) = argv
  for path, args in json.loads(runs):
    code = run_main(path, args)
    if code:
      return code
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))

"""Every third-party package the library imports is a declared dependency in ``pyproject.toml``.

A fresh ``pip install -e .`` installs only what is declared; a module imported by ``anlr_jax`` but
installed here for another reason (a test extra, a tool) would work on this machine and fail for a
newcomer (``grain`` once did).
"""

import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imported_top_level_modules(package: pathlib.Path) -> dict[str, str]:
  """``{top-level module: first file importing it}`` over every import statement in ``package``,
  function-local imports included."""
  found = {}
  for path in sorted(package.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
      else:
        continue
      for name in names:
        found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
  return found


def _declared() -> list[Requirement]:
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  return [Requirement(d) for d in project["dependencies"]]


def test_every_imported_third_party_package_is_a_declared_dependency():
  declared = {canonicalize_name(r.name) for r in _declared()}
  # what the declared dependencies themselves require (outside their extras) is installed with them
  required = set(declared)
  for dist in declared:
    for req in map(Requirement, importlib.metadata.requires(dist) or []):
      if req.marker is None or req.marker.evaluate({"extra": ""}):
        required.add(canonicalize_name(req.name))
  providers = importlib.metadata.packages_distributions()
  stdlib = set(sys.stdlib_module_names)
  missing = {}
  for module, where in _imported_top_level_modules(ROOT / "anlr_jax").items():
    if module in stdlib or module == "anlr_jax":
      continue
    dists = {canonicalize_name(d) for d in providers.get(module, [])}
    assert dists, f"{module} (imported in {where}) is not installed here at all"
    if not dists & required:
      missing[module] = (where, sorted(dists))
  assert not missing, f"imported by anlr_jax but not declared in pyproject.toml: {missing}"


def test_the_oldest_python_allowed_is_one_every_dependency_installs_on():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  oldest = re.fullmatch(r">=\s*(3\.\d+)", project["requires-python"]).group(1)
  refuse = {}
  for req in _declared():
    needs = importlib.metadata.metadata(req.name).get("Requires-Python")
    if needs and not SpecifierSet(needs).contains(oldest):
      refuse[req.name] = needs
  assert not refuse, f"requires-python >={oldest}, but these need: {refuse}"

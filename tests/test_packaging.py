"""Every third-party package the library imports is a declared dependency in ``pyproject.toml``.

A fresh ``pip install -e .`` installs only what is declared; a module imported by ``anlr_jax`` but
installed here for another reason (a test extra, a tool) would work on this machine and fail for a
newcomer (``grain`` once did).
"""

import ast
import functools
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


def test_the_wheel_ships_the_configs_the_assets_and_the_anlr_command(tmp_path):
  import subprocess
  import zipfile

  try:  # build with the installed setuptools when it is recent enough (no download)
    isolation = int(importlib.metadata.version("setuptools").split(".")[0]) < 68
  except importlib.metadata.PackageNotFoundError:
    isolation = True
  flags = [] if isolation else ["--no-build-isolation"]
  command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *flags, "-w", str(tmp_path)]
  subprocess.run([*command, str(ROOT)], check=True, capture_output=True)
  (wheel,) = tmp_path.glob("anlr_jax-*.whl")
  names = set(zipfile.ZipFile(wheel).namelist())
  shipped = {f"anlr_jax/configs/{p.name}" for p in (ROOT / "anlr_jax" / "configs").iterdir()}
  assert "anlr_jax/configs/quickstart.yaml" in shipped and shipped <= names
  assert "anlr_jax/assets/quickstart/model.safetensors" in names
  entry = next(n for n in names if n.endswith("entry_points.txt"))
  assert "anlr = anlr_jax.app.launch:run" in zipfile.ZipFile(wheel).read(entry).decode()


def test_the_library_never_imports_the_application():
  """``anlr_jax.app`` sits on top: no library module imports it (or the CLI through it)."""
  for path in sorted((ROOT / "anlr_jax").rglob("*.py")):
    if "app" in path.relative_to(ROOT / "anlr_jax").parts or path.name == "__main__.py":
      continue
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
      if isinstance(node, ast.ImportFrom) and node.module:
        modules = [node.module]
      elif isinstance(node, ast.Import):
        modules = [alias.name for alias in node.names]
      else:
        continue
      assert not any(m.startswith("anlr_jax.app") for m in modules), (path, modules)


def test_no_module_imports_a_private_name_of_another():
  """A helper that two modules share is public in the module that owns it (``from anlr_jax.x
  import _helper`` reaches into another module's internals)."""
  private = []
  for path in sorted((ROOT / "anlr_jax").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
      if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("anlr_jax"):
        names = [a.name for a in node.names if a.name.startswith("_") and a.name != "__version__"]
        private += [f"{path.relative_to(ROOT)}: {node.module}.{name}" for name in names]
  assert not private, private


@functools.cache
def _module_imports() -> dict[str, set[str]]:
  """``{module: the anlr_jax modules it imports}`` over every import statement, function-local
  ones included and ``if TYPE_CHECKING:`` ones left out; a name imported from a package resolves
  to its submodule when there is one."""
  files = {}
  for path in (ROOT / "anlr_jax").rglob("*.py"):
    parts = path.relative_to(ROOT).with_suffix("").parts
    files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

  def known(name: str) -> str:
    while name not in files:
      name = name.rpartition(".")[0]
    return name

  graph = {}
  for module, path in files.items():
    targets = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only = {  # imports under `if TYPE_CHECKING:` run only for type checkers
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for n in ast.walk(block)
    }
    for node in ast.walk(tree):
      if id(node) in typing_only:
        continue
      if isinstance(node, ast.Import):
        targets.update(a.name for a in node.names)
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        targets.update(
            f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
            for a in node.names
        )
    graph[module] = {known(t) for t in targets if t.startswith("anlr_jax")} - {module}
  return graph


def _first_cycle(edges: dict[str, set[str]]) -> str | None:
  """``"a -> b -> a"`` for a cycle of the directed graph ``edges``, or None."""
  state = dict.fromkeys(edges, 0)  # 0 unvisited, 1 on the current path, 2 done

  def visit(node: str, path: list[str]) -> str | None:
    state[node] = 1
    for target in sorted(edges[node]):
      if state[target] == 1:
        return " -> ".join(
            path[path.index(target) :] + [node, target] if target in path else [node, target]
        )
      if state[target] == 0 and (found := visit(target, path + [node])):
        return found
    state[node] = 2
    return None

  for node in sorted(edges):
    if state[node] == 0 and (found := visit(node, [])):
      return found
  return None


def test_no_import_cycle_between_modules():
  """Module A imports B and B (perhaps through others) imports A: a cycle hidden in function-level
  imports is still a cycle. Packages' ``__init__`` files only re-export and are left out."""
  graph = _module_imports()
  packages = {m for m in graph if (ROOT / m.replace(".", "/") / "__init__.py").is_file()}
  library = {m for m in graph if m not in packages}
  assert _first_cycle({m: graph[m] & library for m in library}) is None


def test_no_import_cycle_between_packages():
  """The subpackages (``data``, ``evals``, ``optim``, ...) and top-level modules of ``anlr_jax``
  form layers: if a module of ``data`` imports one of ``evals`` (even inside a function), no module
  of ``evals`` imports ``data``."""
  graph = _module_imports()

  def layer(module: str) -> str:
    return ".".join(module.split(".")[:2])

  edges = {}
  for module, targets in graph.items():
    if module in ("anlr_jax", "anlr_jax.__main__"):  # the re-exports and the entry point
      continue
    edges.setdefault(layer(module), set()).update(layer(t) for t in targets)
  edges = {
      node: {t for t in targets if t != node and t in edges} for node, targets in edges.items()
  }
  assert _first_cycle(edges) is None


def test_the_app_modules_import_in_the_order_their_package_docstring_lists_them():
  """``anlr_jax/app/__init__.py`` lists every module of the application, each importing only the
  modules listed before it."""
  doc = ast.get_docstring(ast.parse((ROOT / "anlr_jax" / "app" / "__init__.py").read_text()))
  listed = re.findall(r":mod:`~(anlr_jax\.app\.\w+)`", doc)
  modules = {f"anlr_jax.app.{p.stem}" for p in (ROOT / "anlr_jax" / "app").glob("*.py")}
  assert sorted(listed) == sorted(modules - {"anlr_jax.app.__init__"}), "each listed once"
  graph = _module_imports()
  for i, module in enumerate(listed):
    later = {m for m in graph[module] if m in listed[i + 1 :]}
    assert not later, f"{module} imports {sorted(later)}, listed after it"

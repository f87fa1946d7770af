"""The README and the docs: every relative link names a file of the repository, and the README's
optimizer example runs as printed."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "configs" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_an_existing_file(page):
  broken = []
  for target in LINK.findall(page.read_text()):
    if re.match(r"[a-z]+:", target) or target.startswith("#"):
      continue  # a web address or an anchor of the same page
    if not (page.parent / target.split("#")[0]).exists():
      broken.append(target)
  assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_the_readme_optimizer_example_runs(capsys):
  text = (ROOT / "README.md").read_text()
  blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
  assert blocks, "README.md has no python example"
  exec(compile(blocks[0], "README.md", "exec"), {})
  printed = capsys.readouterr().out
  assert all(key in printed for key in ("velocity_cv", "velocity_max_min", "multiplier_max_min"))


def _has_docstring(dotted: str) -> bool:
  """Whether ``anlr_jax.x.NAME`` has a docstring: its ``__doc__`` for a module, class or function;
  for a value, the string literal after its assignment in the module that assigns it."""
  import ast
  import importlib
  import inspect

  module_name, _, name = dotted.rpartition(".")
  obj = getattr(importlib.import_module(module_name), name)
  if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj):
    return bool(inspect.getdoc(obj))
  for path in sorted((ROOT / "anlr_jax").rglob("*.py")):
    body = ast.parse(path.read_text()).body
    for node, after in zip(body, body[1:]):
      targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
      if any(isinstance(t, ast.Name) and t.id == name for t in targets):
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
          return isinstance(after.value.value, str)
  return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_docstring_a_page_points_to_exists(page):
  """``see `anlr_jax.X`' docstring`` in a page names something whose docstring says it."""
  named = re.findall(r"`(anlr_jax(?:\.\w+)+)`'s? docstring", page.read_text())
  missing = [name for name in named if not _has_docstring(name)]
  assert not missing, f"{page.relative_to(ROOT)} points to missing docstrings: {missing}"


def test_the_identity_keys_in_docs_reliability_are_the_codes():
  from anlr_jax.app.identity import identity_keys

  text = (ROOT / "docs" / "reliability.md").read_text()
  start = text.index("A run's *identity*")
  bullets = text[start : text.index("\n\n", text.index("\n- ", start))]
  documented = set(re.findall(r"`([a-z_0-9]+(?:\.[a-z_0-9]+)?)`", bullets))
  documented.discard("identity")  # the word, as the code names the metadata
  assert documented == identity_keys()


def _sources():
  for folder in ("anlr_jax", "configs", "examples", "benchmarks", "scripts", "tests"):
    for path in sorted((ROOT / folder).rglob("*")):
      if path.suffix in (".py", ".yaml", ".md") and path.is_file():
        yield path


def test_every_docs_page_the_code_and_the_configs_name_exists():
  missing = sorted(
      f"{path.relative_to(ROOT)}: {page}"
      for path in _sources()
      for page in re.findall(r"\bdocs/[\w.-]+\.md\b", path.read_text())
      if not (ROOT / page).is_file()
  )
  assert not missing, missing


def test_every_python_m_command_names_an_existing_module():
  """Each ``python -m`` command of a module of this package in the README, the docs, the configs
  and the code runs a module that exists (a renamed module leaves no stale command behind)."""
  missing = set()
  for path in [*PAGES, *_sources()]:
    for module in re.findall(r"python -m (anlr_jax(?:\.\w+)*)", path.read_text()):
      file = ROOT / module.replace(".", "/")
      if not (file.with_suffix(".py").is_file() or (file / "__main__.py").is_file()):
        missing.add(f"{path.relative_to(ROOT)}: {module}")
  assert not missing, sorted(missing)

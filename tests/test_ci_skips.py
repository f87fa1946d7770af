"""Under ``CI=true`` a skip fails the run (tests/helpers/ci_skips.py, which tests/conftest.py
registers): a test's own ``pytest.skip``, a ``skipif`` mark, a fixture that skips and a file's
module-level ``importorskip`` each become a failure naming the reason; an ``xfail`` stays one.
Outside CI they stay skips."""

import os
import subprocess
import sys

import tests.conftest
from tests.helpers import ci_skips

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TESTS = """
import pytest

def test_passes():
  pass

def test_skips_itself():
  pytest.skip("needs the moon")

@pytest.mark.skipif(True, reason="marked away")
def test_marked():
  pass

@pytest.fixture
def thing():
  pytest.skip("no thing here")

def test_with_a_fixture_that_skips(thing):
  pass

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_to_fail():
  assert False
"""

MISSING = """
import pytest

pytest.importorskip("anlr_no_such_module")

def test_never_collected():
  pass
"""


def _pytest(folder, ci):
  env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
  env["PYTHONPATH"] = REPO
  if ci is not None:
    env["CI"] = ci
  return subprocess.run(
      [sys.executable, "-m", "pytest", "-p", "tests.helpers.ci_skips", "-p", "no:cacheprovider"]
      + ["-p", "no:xdist", "-q", "-rA", "."],
      cwd=folder,
      env=env,
      capture_output=True,
      text=True,
      timeout=120,
  )


def test_a_skip_fails_under_ci_and_stays_a_skip_elsewhere(tmp_path):
  (tmp_path / "some").mkdir()
  (tmp_path / "some" / "test_some.py").write_text(TESTS)
  (tmp_path / "needs").mkdir()
  (tmp_path / "needs" / "test_needs.py").write_text(MISSING)
  out = _pytest(tmp_path / "some", "true")
  assert out.returncode == 1, out.stdout[-3000:]
  for line in (
      "PASSED test_some.py::test_passes",
      "FAILED test_some.py::test_skips_itself - skipped under CI=true",
      "ERROR test_some.py::test_marked - skipped under CI=true",
      "ERROR test_some.py::test_with_a_fixture_that_skips - skipped under CI=true",
      "XFAIL test_some.py::test_expected_to_fail",
  ):
    assert line in out.stdout, out.stdout[-3000:]
  for reason in ("needs the moon", "marked away", "no thing here"):
    assert f"install what it needs in .ci/run): {reason}" in out.stdout
  assert "1 failed, 1 passed, 1 xfailed, 2 errors" in out.stdout
  out = _pytest(tmp_path / "needs", "1")  # a file that skips at import: a collection error
  assert out.returncode == 2, out.stdout[-3000:]
  assert "ERROR test_needs.py - skipped under CI=true" in out.stdout
  assert "could not import 'anlr_no_such_module'" in out.stdout
  out = _pytest(tmp_path, "false")
  assert out.returncode == 0, out.stdout[-3000:]
  assert "1 passed, 4 skipped, 1 xfailed" in out.stdout


def test_the_suite_registers_the_hooks():
  assert tests.conftest.pytest_runtest_makereport is ci_skips.pytest_runtest_makereport
  assert tests.conftest.pytest_make_collect_report is ci_skips.pytest_make_collect_report
  assert ci_skips.in_ci({"CI": "true"}) and ci_skips.in_ci({"CI": "1"})
  assert not ci_skips.in_ci({}) and not ci_skips.in_ci({"CI": "false"})

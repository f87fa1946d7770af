"""Under ``CI=true`` (as ``.ci/run`` is run) a skipped test is a failed one.

A test skips when something it needs is missing: a package (``pytest.importorskip``), a data
file, a capability of the machine. On a developer's machine that is a convenience; in CI it would
leave the run green while a test the docs rely on never ran. So when the environment variable
``CI`` is ``true`` (or ``1``), every skip -- of a test, of its setup (a ``skipif`` mark, a fixture
that calls ``pytest.skip``) or of a whole file at import -- is reported as a failure that gives the
skip's reason; an expected failure (``xfail``) is left as it is. No skip is exempt: CI installs
everything the tests need.

``tests/conftest.py`` imports the two hooks below, which registers them; a pytest run elsewhere
loads them with ``-p tests.helpers.ci_skips``.
"""

import os

import pytest

MESSAGE = "skipped under CI=true, where every test must run (install what it needs in .ci/run): "


def in_ci(environ=os.environ) -> bool:
  """True when ``CI`` is set to ``true`` or ``1`` (any case), as CI services set it."""
  return environ.get("CI", "").strip().lower() in ("true", "1")


def _skip_as_failure(report) -> None:
  if not (report.skipped and in_ci()) or hasattr(report, "wasxfail"):
    return
  longrepr = report.longrepr
  reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
  report.outcome = "failed"
  report.longrepr = MESSAGE + reason.removeprefix("Skipped: ")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  """A test's skip (in its setup or its body) becomes a failure under CI."""
  report = yield
  _skip_as_failure(report)
  return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
  """A file's skip at import (a module-level ``importorskip``) becomes a collection error under
  CI."""
  report = yield
  _skip_as_failure(report)
  return report

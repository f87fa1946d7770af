"""The ``anlr`` process entry re-executes once with huge-page-backed malloc (anlr_jax.app.launch)."""

import os
import platform
import subprocess
import sys

import pytest

from anlr_jax.app import launch


@pytest.fixture
def linux_glibc_madvise(monkeypatch):
  monkeypatch.setattr(launch.sys, "platform", "linux")
  monkeypatch.setattr(launch.platform, "libc_ver", lambda: ("glibc", "2.36"))
  monkeypatch.setattr(launch, "_thp_mode", lambda: "madvise")


def test_sets_the_tunable_once_and_keeps_other_tunables(linux_glibc_madvise):
  env = launch.huge_pages_env({"PATH": "/bin"})
  assert env == {"PATH": "/bin", "GLIBC_TUNABLES": launch.TUNABLE}
  env = launch.huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
  assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:" + launch.TUNABLE
  assert launch.huge_pages_env(env) is None  # the re-executed process does not loop


@pytest.mark.parametrize(
    "environ",
    [{"ANLR_HUGE_PAGES": "0"}, {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}],
)
def test_opt_out_and_explicit_choice_are_respected(linux_glibc_madvise, environ):
  assert launch.huge_pages_env(environ) is None


@pytest.mark.parametrize("mode", ["always", "never", None])
def test_nothing_to_do_unless_huge_pages_are_on_request(linux_glibc_madvise, monkeypatch, mode):
  monkeypatch.setattr(launch, "_thp_mode", lambda: mode)
  assert launch.huge_pages_env({}) is None


def test_not_on_other_platforms(linux_glibc_madvise, monkeypatch):
  monkeypatch.setattr(launch.sys, "platform", "darwin")
  assert launch.huge_pages_env({}) is None
  monkeypatch.setattr(launch.sys, "platform", "linux")
  monkeypatch.setattr(launch.platform, "libc_ver", lambda: ("", ""))  # musl
  assert launch.huge_pages_env({}) is None


def test_thp_mode_reads_the_bracketed_choice(tmp_path, monkeypatch):
  path = tmp_path / "enabled"
  path.write_text("always [madvise] never\n")
  monkeypatch.setattr(launch, "THP_MODE_FILE", str(path))
  assert launch._thp_mode() == "madvise"
  monkeypatch.setattr(launch, "THP_MODE_FILE", str(tmp_path / "missing"))
  assert launch._thp_mode() is None


def test_the_command_reexecutes_with_the_tunable_and_runs_once(tmp_path):
  """A real process: the entry runs twice (before and after re-executing) and the command once,
  with the tunable set; with ANLR_HUGE_PAGES=0 it runs once, unchanged. The kernel's huge-page mode
  is read from a file that says madvise, so the test runs whatever this machine's mode is."""
  if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
    pytest.skip(f"needs Linux and glibc: platform {sys.platform}, libc {platform.libc_ver()}")
  mode = tmp_path / "enabled"
  mode.write_text("always [madvise] never\n")
  code = (
      "import os, sys; print('entry', os.environ.get('GLIBC_TUNABLES'), flush=True); "
      "sys.argv = ['anlr', 'configs']; from anlr_jax.app import launch; "
      f"launch.THP_MODE_FILE = {str(mode)!r}; launch.run()"
  )
  env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-2000:]
  entries = [line for line in out.stdout.splitlines() if line.startswith("entry")]
  assert entries == ["entry None", f"entry {launch.TUNABLE}"]
  assert out.stdout.count("quickstart") >= 1  # `anlr configs` ran (once: after the re-exec)
  env["ANLR_HUGE_PAGES"] = "0"
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-2000:]
  assert [l for l in out.stdout.splitlines() if l.startswith("entry")] == ["entry None"]

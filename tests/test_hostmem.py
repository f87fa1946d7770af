"""release_free_heap hands freed heap pages back to the OS (glibc's malloc_trim)."""

import sys

import pytest

from anlr_jax import hostmem


def resident_mib() -> float:
  with open("/proc/self/status", encoding="utf-8") as f:
    return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc: Linux only")
def test_freed_heap_in_the_middle_of_the_heap_goes_back_to_the_os():
  hostmem.release_free_heap()
  blocks = [bytearray(b"x" * 65536) for _ in range(3200)]  # 200 MiB of malloc'd heap
  keep = bytearray(b"y" * 65536)  # above them: glibc cannot trim the top by itself
  full = resident_mib()
  del blocks
  freed = resident_mib()
  assert isinstance(hostmem.release_free_heap(), bool)
  trimmed = resident_mib()
  assert full - freed < 50, (full, freed)  # free() alone kept the pages
  assert freed - trimmed > 150, (freed, trimmed)
  del keep

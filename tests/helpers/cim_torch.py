"""One intra-op thread for PyTorch while a module's references run.

PyTorch's CPU pool takes every core by default; next to another test worker and XLA's own threads,
its workers spin waiting for each other and burn several times the CPU a forward needs (on two
cores, a SmolLM2-135M forward of 180 tokens takes 4.5 s of CPU with two threads, 0.7 s with one).
The results are the same up to float rounding order. Use it in a test module as

    from tests.helpers.cim_torch import torch_one_thread  # noqa: F401  (autouse, module-scoped)
"""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def torch_one_thread():
  """``torch.set_num_threads(1)`` for the module's tests; the previous count restored after."""
  before = torch.get_num_threads()
  torch.set_num_threads(1)
  yield
  torch.set_num_threads(before)

"""The kernel test files again, with the block sizes a GPU would get (KFUSED_GPU_CONFIGS=1,
see tests/conftest.py): in the interpreter the host functions otherwise pick small tiles
(32-column output tiles and the low-rank packing that goes with them, 32-token steps, few
splits), so the GPU's tile shapes — 128-column tiles and their packing, 64-token rank-pass
steps, the SM-count grids and splits — were only ever compiled by CI, never run (the opcheck
and torch.compile tests left out: they check how the ops are registered and traced, which the
main run covers; tests/_background.py). Each file runs in its own pytest process (the switch
must be set before the kernels are first used), with this run's seed; a failure shows the
child's report. They start in the background as soon as they are collected
(tests/_background.py)."""

import pytest
import torch

from tests import _background

FILES = ["test_headwise_ops.py", "test_headwise_section.py", "test_krona.py",
         "test_inducer.py", "test_inducer_decode.py", "test_inducer_varlen.py"]


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="on a GPU the kernel tests run with the GPU's block sizes anyway")
@pytest.mark.parametrize("name", FILES)
def test_kernel_tests_pass_with_gpu_block_sizes(name, seed):
    # run in the background from collection on (conftest.py, tests/_background.py)
    rc, out = _background.result(name, seed)
    # the child really ran with the GPU's block sizes (its pytest header says so)
    assert "GPU block sizes (KFUSED_GPU_CONFIGS=1)" in out, out[-3000:]
    assert rc == 0, out[-6000:]

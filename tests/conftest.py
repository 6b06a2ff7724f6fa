"""Shared test setup: Triton runs in the CPU interpreter when there is no GPU, every test is
seeded, and kernel outputs are NaN-poisoned before each launch."""

import os
import random
import zlib

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit function is created (i.e. before kfused kernels load).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kfused import _alloc  # noqa: E402

# Shapes and data are drawn afresh each run; KFUSED_TEST_SEED=<n> replays a run (the seed is
# printed in the pytest header).
BASE_SEED = int(os.environ.get("KFUSED_TEST_SEED", random.SystemRandom().randrange(2**31)))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.fixture(autouse=True)
def _seed_and_poison(request):
    seed = (BASE_SEED + zlib.crc32(request.node.nodeid.encode())) % (2**31)
    random.seed(seed)
    torch.manual_seed(seed)
    old = _alloc.set_poisoning(True)
    yield
    _alloc.set_poisoning(old)


@pytest.fixture
def device():
    return DEVICE


def pytest_report_header(config):
    return (f"kfused tests on {DEVICE}; TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}; "
            f"torch {torch.__version__}; KFUSED_TEST_SEED={BASE_SEED}")

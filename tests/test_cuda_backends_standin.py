"""The ops' ``backend="cuda"`` tests that need a GPU (tests/test_krona.py, test_headwise_ops.py),
run on the CPU with the extension replaced by the float64 stand-ins of tests/_cuda_standin.py:
backend choice, the custom ops with their fake implementations (opcheck), the autograd glue and
the tests' own references — everything but the kernels, so that a GPU session spends its time
on those. (inducer_attention's: tests/test_inducer_cuda_host.py; krona_linear's folded path:
tests/test_krona_cuda_host.py.)"""

import types

import pytest
import torch

import _cuda_standin
import test_headwise_ops
import test_krona
from kfused import backends, cuda as kcuda

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="on a GPU these tests run against the extension itself")


@pytest.fixture
def standin(monkeypatch):
    """The stand-in extension, counting its calls per function."""
    calls = []

    def counted(name):
        fn = getattr(_cuda_standin, name)

        def wrapper(*a, **kw):
            calls.append(name)
            return fn(*a, **kw)
        return wrapper

    ext = types.SimpleNamespace(**{n: counted(n) for n in (
        "kron_matvec_fwd", "kron_matvec_bwd", "krona_fold_fwd", "headwise_lowrank_fwd",
        "headwise_lowrank_bwd", "inducer_attention_fwd")})
    monkeypatch.setattr(kcuda, "require", lambda name: ext)
    monkeypatch.setattr(backends, "cuda_unfit", lambda device, dtype, op: None)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("per_head", [False, True])
def test_headwise_lowrank_cuda_backend(standin, dtype, per_head):
    test_headwise_ops.test_lowrank_cuda_extension(dtype, per_head)
    assert {"headwise_lowrank_fwd", "headwise_lowrank_bwd"} <= set(standin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shape", test_krona.SHAPES, ids=str)
def test_kron_matvec_cuda_backend(standin, shape, dtype):
    test_krona.test_kron_matvec_cuda(shape, dtype)
    assert {"kron_matvec_fwd", "kron_matvec_bwd"} <= set(standin)

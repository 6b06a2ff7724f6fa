"""The interpreter's bounds check (kfused/triton_kernels/_bounds.py), which tests/conftest.py
turns on for every test: it must catch a stray load, store or atomic and name where it went,
and let every in-bounds access through. Each stray access here stays inside a larger buffer,
so a check that failed to catch it would not corrupt this process."""

import pytest
import torch

import triton
import triton.language as tl

from kfused.triton_kernels import _bounds

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not _bounds.supported(),
                                reason="checks Triton's CPU interpreter")


@triton.jit
def _copy(X, Y, n, shift, EXTRA, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    # EXTRA: an argument the kernel never touches (its span counts as the launch's)
    o = tl.arange(0, BLOCK)
    if MASKED:
        x = tl.load(X + o + shift, mask=o < n)
        tl.store(Y + o, x, mask=o < n)
    else:
        x = tl.load(X + o + shift)
        tl.store(Y + o, x)


@triton.jit
def _bump(C, idx):
    tl.atomic_add(C + idx, 1)


def _cause(excinfo) -> _bounds.BoundsError:
    e = excinfo.value
    while e is not None and not isinstance(e, _bounds.BoundsError):
        e = e.__cause__
    assert e is not None, f"no BoundsError behind {excinfo.value!r}"
    return e


@pytest.fixture
def checked():
    with _bounds.bounds_checked() as ok:
        assert ok
        yield


def test_the_test_session_runs_checked():
    import os

    if os.environ.get("KFUSED_BOUNDS_CHECK", "1") == "0":
        pytest.skip("KFUSED_BOUNDS_CHECK=0")
    assert _bounds.installed()


def test_in_bounds_and_masked_accesses_pass(checked):
    x, y = torch.randn(10), torch.zeros(10)
    _copy[(1,)](x, y, 10, 0, y, BLOCK=16, MASKED=True)      # lanes 10..15 masked off
    assert torch.equal(x, y)
    _copy[(1,)](x, y, 10, 0, y, BLOCK=8, MASKED=False)
    assert torch.equal(x[:8], y[:8])


def test_a_read_past_the_end_is_caught(checked):
    buf = torch.randn(64)
    x, y = buf[8:18], torch.zeros(16)
    with pytest.raises(Exception) as ei:
        _copy[(1,)](x, y, 10, 0, y, BLOCK=16, MASKED=False)
    msg = str(_cause(ei))
    assert "kernel _copy" in msg and "6 of 16 load addresses" in msg, msg
    assert "4 bytes past the end of argument 'X' (shape (10,), stride (1,), torch.float32)" in msg


def test_a_read_before_the_start_is_caught(checked):
    buf = torch.randn(64)
    x, y = buf[8:24], torch.zeros(16)
    with pytest.raises(Exception) as ei:
        _copy[(1,)](x, y, 16, -3, y, BLOCK=16, MASKED=True)
    msg = str(_cause(ei))
    assert "3 of 16 load addresses" in msg and "12 bytes before the start of argument 'X'" in msg


def test_a_write_past_a_view_is_caught_before_it_lands(checked):
    # the output is a view into a larger buffer: a write past it would hit a neighbour
    buf = torch.zeros(40, dtype=torch.float16)
    x = torch.randn(16).half()
    with pytest.raises(Exception) as ei:
        _copy[(1,)](x, buf[4:14], 16, 0, buf[4:14], BLOCK=16, MASKED=False)
    msg = str(_cause(ei))
    assert "6 of 16 store addresses (2-byte elements)" in msg and "argument 'Y'" in msg, msg
    assert not buf[14:].any(), "the stray store landed"


def test_views_of_one_buffer_count_together(checked):
    # q and k as views of one qkv buffer, both arguments: a load spanning both is inside them
    qkv = torch.randn(2, 8)
    y = torch.zeros(16)
    _copy[(1,)](qkv[0], y, 16, 0, qkv[1], BLOCK=16, MASKED=False)
    assert torch.equal(y, qkv.reshape(-1))
    # the same load with only qkv[0] among the arguments is not
    with pytest.raises(Exception) as ei:
        _copy[(1,)](qkv[0], y, 16, 0, y, BLOCK=16, MASKED=False)
    assert "8 of 16 load addresses" in str(_cause(ei))


def test_atomics_are_checked(checked):
    buf = torch.zeros(8, dtype=torch.int32)
    _bump[(1,)](buf[:4], 3)
    assert buf[3] == 1
    with pytest.raises(Exception) as ei:
        _bump[(1,)](buf[:4], 4)
    assert "atomic addresses" in str(_cause(ei))
    assert buf[4] == 0


def test_uninstall_restores_the_interpreter():
    from triton.runtime import interpreter as itp

    was = _bounds.installed()
    if was:
        _bounds.uninstall()
    try:
        before = itp.InterpreterBuilder.create_masked_load
        with _bounds.bounds_checked():
            assert itp.InterpreterBuilder.create_masked_load is not before
        assert itp.InterpreterBuilder.create_masked_load is before
        buf, y = torch.randn(32), torch.zeros(16)
        _copy[(1,)](buf[:8], y, 16, 0, y, BLOCK=16, MASKED=False)   # unchecked: no error
    finally:
        if was:
            _bounds.install()

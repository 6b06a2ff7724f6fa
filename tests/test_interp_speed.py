"""The interpreter caches (kfused/triton_kernels/_interp_speed.py), which tests/conftest.py turns
on for every test: a kernel must compute the same bits with them as without, leave
triton.language patched exactly as the interpreter alone leaves it, and patch the language
less often (the point of the cache)."""

import pytest
import torch

import triton
import triton.language as tl
from triton.runtime import interpreter as itp

from kfused.triton_kernels import _interp_speed

pytestmark = pytest.mark.skipif(torch.cuda.is_available() or not _interp_speed.supported(),
                                reason="caches of Triton's CPU interpreter")


@triton.jit
def _scaled(x, s):
    return x * s


@triton.jit
def _row_sums(X, Y, S, n_cols, BLOCK: tl.constexpr):
    # per program: one row; two nested jit calls per program (ours and tl.sum, whose module
    # sees triton.language.core rather than triton.language), plus tl.cdiv
    r = tl.program_id(0)
    o = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, tl.cdiv(n_cols, BLOCK)):
        c = k * BLOCK + o
        x = tl.load(X + r * n_cols + c, mask=c < n_cols, other=0.0).to(tl.float32)
        acc += _scaled(x, tl.load(S))
    tl.store(Y + r, tl.sum(acc, axis=0))


@pytest.fixture
def caches_off():
    """The test switches the caches itself; the session's state comes back afterwards."""
    was = _interp_speed.installed()
    _interp_speed.uninstall()
    try:
        yield
    finally:
        _interp_speed.uninstall()
        if was:
            _interp_speed.install()


class _Counting:
    """Counts the interpreter's own _patch_lang calls (installed under the caches)."""

    def __init__(self):
        self.orig, self.n = itp._patch_lang, 0

    def __enter__(self):
        def counted(fn):
            self.n += 1
            return self.orig(fn)
        itp._patch_lang = counted
        return self

    def __exit__(self, *exc):
        itp._patch_lang = self.orig


def _launch(x, s):
    y = torch.empty(x.shape[0])
    _row_sums[(x.shape[0],)](x, y, s, x.shape[1], BLOCK=16)
    return y


def test_the_test_session_runs_with_the_caches():
    import os

    if os.environ.get("KFUSED_INTERP_SPEED", "1") == "0":
        pytest.skip("KFUSED_INTERP_SPEED=0")
    assert _interp_speed.installed()


def test_same_bits_and_fewer_language_patches(caches_off):
    x, s = torch.randn(7, 37), torch.tensor([0.37])
    with _Counting() as plain:
        y0 = _launch(x, s)
    with _Counting() as cached:
        assert _interp_speed.install()
        y1 = _launch(x, s)
        _interp_speed.uninstall()
    assert torch.equal(y0, y1)
    torch.testing.assert_close(y0, (x * 0.37).sum(1), rtol=1e-5, atol=1e-5)
    # plain: the launch, then every nested call of every program (7 programs, 3 row blocks:
    # _scaled three times, tl.cdiv and tl.sum (and tl.zeros) once or more each) patches again
    assert plain.n >= 1 + 7 * 5, plain.n
    # cached: the launch, then the first nested call whose module sees another language
    # module (triton.language.core)
    assert cached.n <= 3, cached.n


_LANG = {"tl": tl, "tl.core": tl.core, "tl.math": tl.math, "tensor": tl.tensor,
         "tensor_descriptor_base": tl.core.tensor_descriptor_base}


def _language_state():
    # each object's own namespace (where the interpreter's setattr lands)
    return {(k, n): v for k, o in _LANG.items() for n, v in list(vars(o).items())}


def _restore(state):
    now = _language_state()
    for (k, n) in now.keys() - state.keys():
        delattr(_LANG[k], n)
    for (k, n), v in state.items():
        if now.get((k, n)) is not v:
            setattr(_LANG[k], n, v)


def _changed(before):
    now = _language_state()
    return {key for key in now.keys() | before.keys() if now.get(key) is not before.get(key)}


def test_the_language_is_left_as_the_interpreter_alone_leaves_it(caches_off):
    x, s = torch.randn(3, 20), torch.tensor([1.5])
    before = _language_state()
    try:
        _launch(x, s)
        plain = _changed(before)
        _restore(before)
        assert _interp_speed.install()
        _launch(x, s)
        cached = _changed(before)
    finally:
        _interp_speed.uninstall()
        _restore(before)
    # (the interpreter leaves the nested calls' patches of triton.language.core in place)
    assert cached == plain
    assert _changed(before) == set()


def test_a_failing_launch_ends_its_record(caches_off):
    assert _interp_speed.install()
    x, s = torch.randn(2, 5), torch.tensor([1.0])
    y = torch.empty(2)

    def bad_grid(meta):
        raise ZeroDivisionError("grid")

    with pytest.raises(Exception):
        _row_sums[bad_grid](x, y, s, 5, BLOCK=16)
    assert not getattr(_interp_speed._state, "stack", [])
    torch.testing.assert_close(_launch(x, s), x.sum(1))   # the next launch is unaffected


def test_numpy_dtype_table_matches_the_interpreters(caches_off):
    orig = itp._get_np_dtype
    assert _interp_speed.install()
    fast = itp._get_np_dtype
    assert fast is not orig
    names = ["int1", "float16", "float32", "float64", "int8", "uint8", "int16", "uint16",
             "int32", "uint32", "int64", "uint64", "bfloat16", "float8e5", "float8e5b16",
             "float8e4nv", "float8e4b8", "float8e4b15"]
    dts = [getattr(tl, n) for n in names if hasattr(tl, n)]
    cases = dts + [tl.pointer_type(tl.float16), tl.block_type(tl.float32, [4]),
                   tl.block_type(tl.pointer_type(tl.int8), [2, 2])]
    for t in cases:
        assert fast(t) == orig(t), t
    with pytest.raises(KeyError):
        orig(tl.void)
    with pytest.raises(KeyError):
        fast(tl.void)


def test_install_is_idempotent_and_uninstall_restores(caches_off):
    p, d = itp._patch_lang, itp._get_np_dtype
    assert _interp_speed.install() and _interp_speed.install()
    assert itp._patch_lang is not p and itp._get_np_dtype is not d
    _interp_speed.uninstall()
    assert itp._patch_lang is p and itp._get_np_dtype is d
    assert not _interp_speed.installed()


@pytest.mark.parametrize("cmd", ["check", "bench", "demo"])
def test_the_cli_turns_the_caches_on_in_the_interpreter(caches_off, monkeypatch, cmd):
    # `kfused check` on a CPU runs every kernel in the interpreter (minutes): the commands
    # that launch kernels install the caches in their own process; KFUSED_INTERP_SPEED=0 not
    from kfused.cli import bench, check, demo, main

    monkeypatch.setattr(check, "run", lambda rest: 0)
    monkeypatch.setattr(bench, "run", lambda rest: 0)
    monkeypatch.setattr(demo, "run_demo", lambda rest: 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KFUSED_INTERP_SPEED", "0")
    assert main.main([cmd]) == 0
    assert not _interp_speed.installed()
    monkeypatch.delenv("KFUSED_INTERP_SPEED")
    assert main.main([cmd]) == 0
    assert _interp_speed.installed()

"""``backend="auto"`` from measurement: ``kfused bench --write-prefs`` records which fused
backend was faster per op and regime on a GPU model, and the ops' ``auto`` follows that file
(``KFUSED_BACKEND_PREFS`` or the package's kfused/data/backend_prefs.json), not the backends'
names. Everything here runs on the CPU with stand-in devices and rows."""

import json
import types

import pytest
import torch

from kfused import backends
from kfused.backends import (BackendError, PREFS_ENV, PREFS_WRITER, load_prefs, measured_order,
                             ordered, select_backend)
from kfused.bench import backend_prefs
from kfused.cases import regime_of
from kfused.cli.bench import write_prefs
from kfused.ops.inducer_attention import regime

GPU = "NVIDIA H100 80GB HBM3"
CUDA = torch.device("cuda", 0)      # a device object only: nothing is allocated on it


@pytest.fixture
def prefs(tmp_path, monkeypatch):
    """Write a preferences file, point KFUSED_BACKEND_PREFS at it, pretend to be on GPU."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: GPU)
    backends._device_name.cache_clear()      # asked once per device index
    backends._PREFS.clear()

    def make(devices):
        path = tmp_path / "prefs.json"
        path.write_text(json.dumps({"written_by": PREFS_WRITER, "devices": devices}))
        monkeypatch.setenv(PREFS_ENV, str(path))
        backends._PREFS.clear()
        return path
    return make


def test_ordered():
    assert ordered(("triton", "cuda"), None) == ("triton", "cuda")
    assert ordered(("triton", "cuda"), ["cuda", "triton"]) == ("cuda", "triton")
    assert ordered(("triton", "cuda"), ["cuda"]) == ("cuda", "triton")
    assert ordered(("triton",), ["cuda", "triton"]) == ("triton",)    # not an impl: ignored


def test_measured_order_reads_this_gpu_models_entry(prefs):
    prefs({GPU: {"inducer_attention": {"decode": ["cuda", "triton"]}},
           "other GPU": {"inducer_attention": {"prefill": ["cuda", "triton"]}}})
    assert measured_order("inducer_attention", CUDA, "decode") == ("cuda", "triton")
    assert measured_order("inducer_attention", CUDA, "prefill") is None
    assert measured_order("krona_linear", CUDA, "decode") is None
    assert measured_order("inducer_attention", torch.device("cpu"), "decode") is None


def test_malformed_prefs_name_the_file(prefs, tmp_path):
    path = prefs({GPU: {"inducer_attention": {"decode": ["fastest"]}}})
    with pytest.raises(BackendError, match="prefs.json"):
        measured_order("inducer_attention", CUDA, "decode")
    path.write_text("{not json")
    backends._PREFS.clear()
    with pytest.raises(BackendError, match="cannot be read"):
        load_prefs(str(path))


def test_auto_follows_the_measured_order(prefs, monkeypatch):
    """auto on CUDA tensors walks the op's backends in the measured order for the call's
    regime; without a regime or a measurement it keeps the op's order (Triton first); an
    explicit backend is never reordered."""
    monkeypatch.setattr(backends, "cuda_unfit", lambda device, dtype, op: None)
    monkeypatch.setattr(backends, "triton_unfit", lambda device, dtype: None)
    t = [types.SimpleNamespace(device=CUDA, dtype=torch.float16)]
    prefs({GPU: {"inducer_attention": {"decode": ["cuda", "triton"],
                                       "prefill": ["triton", "cuda"]}}})
    pick = lambda **kw: select_backend("inducer_attention", "auto", t, **kw)  # noqa: E731
    assert pick(regime="decode") == "cuda"
    assert pick(regime="prefill") == "triton"
    assert pick() == "triton"
    assert select_backend("inducer_attention", "triton", t, regime="decode") == "triton"
    # the measured backend cannot run these inputs: the next one, not an error
    assert pick(regime="decode", extra_unfit=lambda n: "no" if n == "cuda" else None) == "triton"
    monkeypatch.delenv(PREFS_ENV)
    monkeypatch.setattr(backends, "prefs_path", lambda: None)
    assert pick(regime="decode") == "triton"


def _row(provider, shape, ms, mode="fwd", op="inducer_attention"):
    return {"op": op, "shape": shape, "provider": provider, "mode": mode, "ms_p50": ms}


def test_backend_prefs_from_rows():
    dec = {"B": 8, "H": 32, "n_q": 1, "n_k": 4096, "p": 128}
    dec2 = {**dec, "B": 1}
    pre = {"B": 8, "H": 16, "n": 2048, "p": 128, "causal": True}
    rows = [_row("kfused-triton", dec, 0.20), _row("kfused-cuda", dec, 0.18),
            _row("kfused-triton", dec2, 0.03), _row("kfused-cuda", dec2, 0.04),
            _row("sdpa", dec, 0.10),                                   # not a kfused backend
            _row("kfused-triton", pre, 0.40), _row("kfused-cuda", pre, 0.50),
            _row("kfused-triton", pre, 9.0, mode="fwd+bwd"),   # no CUDA backward: not compared
            {"op": "inducer_attention", "shape": pre, "provider": "kfused-cuda", "mode": "all",
             "skipped": "forward-only"},
            _row("kfused-triton", {"T": 16}, 0.1, op="krona_linear"),
            _row("kfused-cuda", {"T": 16}, 0.05, op="krona_linear"),
            _row("kfused-triton", {"T": 16384}, 1.4, op="krona_linear"),
            _row("kfused-cuda", {"T": 16384}, 3.8, op="krona_linear"),
            _row("kfused-triton", {"T": 65536}, 1.1, op="krona_linear"),
            _row("kfused-cuda", {"T": 65536}, 0.8, op="krona_linear"),
            _row("kfused-triton", {"d": 768}, 0.1, op="headwise_qkv"),    # no regimes: left
            _row("kfused-cuda", {"d": 768}, 0.05, op="headwise_qkv")]    # out
    got = backend_prefs(rows, regime_of)
    # decode: 0.18 + 0.04 = 0.22 against 0.23; prefill 0.50 against 0.40; KronA folded
    # 1.4 + 1.1 = 2.5 against 3.8 + 0.8 = 4.6 (the sum over the cases, not the cases won)
    assert got == {"inducer_attention": {"decode": ["cuda", "triton"],
                                         "prefill": ["triton", "cuda"]},
                   "krona_linear": {"exact": ["cuda", "triton"],
                                    "folded": ["triton", "cuda"]}}
    tie = [_row("kfused-cuda", dec, 0.2), _row("kfused-triton", dec, 0.2)]
    assert backend_prefs(tie, regime_of)["inducer_attention"]["decode"] == ["triton", "cuda"]
    assert backend_prefs([_row("kfused-cuda", dec, 0.2)], regime_of) == {}


def test_regimes():
    assert regime(1) == regime(16) == "decode" and regime(17) == "prefill"
    assert regime_of("inducer_attention", {"n_q": 1, "n_k": 4096}) == "decode"
    assert regime_of("inducer_attention", {"n": 2048}) == "prefill"
    # KronA: the benchmark's bfloat16 calls fold from FOLD_MIN_TOKENS tokens
    from kfused.ops._fold import FOLD_MIN_TOKENS
    from kfused.ops.krona_linear import regime as krona_regime

    assert regime_of("krona_linear", {"T": 16384}) == "folded"
    assert regime_of("krona_linear", {"T": FOLD_MIN_TOKENS - 1}) == "exact"
    assert krona_regime(16384, torch.float32, None) == "exact"          # float32 never folds
    assert krona_regime(16384, torch.bfloat16, True) == "exact"
    assert krona_regime(16384, torch.bfloat16, None, on_cuda=False) == "exact"
    # the benchmark's factor shapes: the CUDA factor kernel's tensor-core path or not
    assert regime_of("krona_linear", {"T": 16384, "A": [24, 24], "B": [32, 32]}) == "folded"
    assert regime_of("krona_linear", {"T": 16384, "A": [2, 384], "B": [384, 2]}) == \
        "folded-narrow"
    assert regime_of("krona_linear", {"T": 16384, "A": [8, 384], "B": [384, 2]}) == \
        "folded-narrow"
    assert regime_of("krona_linear", {"T": 64, "A": [384, 2], "B": [2, 384]}) == "exact-narrow"
    assert regime_of("headwise_qkv", {"tokens": 16384}) is None


def test_write_prefs_merges_and_never_overwrites_a_foreign_file(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "backend_prefs.json"
    dec = {"n_q": 1, "n_k": 64}
    pre = {"n": 2048}
    e = write_prefs(path, GPU, [_row("kfused-triton", dec, 2.0), _row("kfused-cuda", dec, 1.0)],
                    "abc")
    assert e == {"inducer_attention": {"decode": ["cuda", "triton"]}}
    e = write_prefs(path, GPU, [_row("kfused-triton", pre, 1.0), _row("kfused-cuda", pre, 2.0)])
    assert e == {"inducer_attention": {"decode": ["cuda", "triton"],
                                       "prefill": ["triton", "cuda"]}}
    write_prefs(path, "other GPU", [])
    data = load_prefs(str(path))
    assert data["written_by"] == PREFS_WRITER and set(data["devices"]) == {GPU, "other GPU"}
    assert [p.name for p in path.parent.iterdir()] == ["backend_prefs.json"]   # no temp left
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: GPU)
    backends._device_name.cache_clear()
    monkeypatch.setenv(PREFS_ENV, str(path))
    backends._PREFS.clear()
    assert measured_order("inducer_attention", CUDA, "prefill") == ("triton", "cuda")
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"mine": true}')
    with pytest.raises(SystemExit, match="not written by"):
        write_prefs(foreign, GPU, [])
    assert foreign.read_text() == '{"mine": true}'
    # a symlink to a file kfused wrote: the rename replaced the link with a regular file
    link = tmp_path / "link.json"
    link.symlink_to(path)
    before = path.read_text()
    with pytest.raises(SystemExit, match="symbolic link"):
        write_prefs(link, "third GPU", [])
    assert link.is_symlink() and path.read_text() == before


def test_available_backends_checks_its_arguments():
    """A dtype given by name ("float16") was answered "dtype float16 is not one of float32,
    float16, bfloat16" for every fused backend; a bad device raised torch's RuntimeError."""
    with pytest.raises(TypeError, match="dtype must be a torch.dtype.*'float16'"):
        backends.available_backends("kron_matvec", "cpu", "float16")
    with pytest.raises(ValueError, match="device='gpu'"):
        backends.available_backends("kron_matvec", "gpu")
    assert backends.available_backends("kron_matvec", "cpu", torch.float16)["reference"] is None


@pytest.mark.parametrize("capability,runs", [((9, 0), True), ((8, 0), True), ((8, 9), True),
                                             ((7, 5), False), ((10, 0), False),
                                             ((12, 0), False)])
def test_cuda_is_unfit_for_a_gpu_the_extension_was_not_built_for(monkeypatch, capability, runs):
    """The extension embeds sm_80 and sm_90 cubins only (no PTX): on a GPU none of them runs on
    (a T4, a Blackwell) "auto" picked cuda and the first launch failed with "no kernel image is
    available". The build's arch list (kfused._C.CUDA_ARCHS) is compared with the GPU's compute
    capability, and the reason names both and how to rebuild."""
    from kfused import cuda as kcuda

    ext = types.SimpleNamespace(CUDA_ARCHS=(80, 90), kron_matvec_fwd=None,
                                kron_matvec_bwd=None)
    monkeypatch.setattr(kcuda, "_LOADED", [(ext, None)])
    monkeypatch.setattr(backends, "_ARCH_UNFIT", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    reason = backends.cuda_unfit(CUDA, torch.float16, "kron_matvec")
    if runs:
        assert reason is None
    else:
        major, minor = capability
        assert f"compute capability {major}.{minor}" in reason and "sm_80, sm_90" in reason
        assert f"KFUSED_CUDA_ARCHS={major}{minor}" in reason
    # a build that does not record its archs (older bindings) is not refused for this
    monkeypatch.setattr(kcuda, "_LOADED", [(types.SimpleNamespace(
        kron_matvec_fwd=None, kron_matvec_bwd=None), None)])
    monkeypatch.setattr(backends, "_ARCH_UNFIT", {})
    assert backends.cuda_unfit(CUDA, torch.float16, "kron_matvec") is None


def test_krona_auto_follows_the_measured_order_of_its_regime(prefs, monkeypatch):
    """krona_linear's auto takes the backend measured faster for the call's regime on this
    GPU model: folded (16-bit, FOLD_MIN_TOKENS tokens and more) or exact, each "-narrow" for
    factors the CUDA extension's factor kernel cannot put on the tensor cores."""
    import importlib

    kl = importlib.import_module("kfused.ops.krona_linear")      # the module, not the op
    seen = []

    def pick(op, requested, tensors, **kw):
        seen.append(kw.get("regime"))
        return "reference"
    monkeypatch.setattr(kl, "select_backend", pick)
    x = torch.randn(3, 5, 32 * 16)
    A, B, W = torch.randn(24, 32), torch.randn(32, 16), torch.randn(24 * 32, 32 * 16)
    kl.krona_linear(x, W, None, A, B)
    assert seen == ["exact"]                                # CPU, float32: never folds
    monkeypatch.setattr(kl, "fold_decision", lambda dtype, tokens, exact, on_cuda: tokens >= 15)
    kl.krona_linear(x, W, None, A, B)
    assert seen[-1] == "folded"                             # 15 token rows
    # factors whose 16-padding the CUDA factor kernel refuses (its CUDA-core kernel runs):
    # a regime of their own, so balanced factors' measurements do not decide for them
    x6, A2, B2, W2 = torch.randn(3, 5, 6), torch.randn(2, 2), torch.randn(4, 3), torch.randn(8, 6)
    kl.krona_linear(x6, W2, None, A2, B2)
    assert seen[-1] == "folded-narrow"
    x768 = torch.randn(15, 768)
    kl.krona_linear(x768, torch.randn(768, 768), None, torch.randn(2, 384), torch.randn(384, 2))
    assert seen[-1] == "folded-narrow"                      # the paper's GLUE factors
    # and select_backend itself walks the measured order for that regime
    monkeypatch.setattr(backends, "cuda_unfit", lambda device, dtype, op: None)
    monkeypatch.setattr(backends, "triton_unfit", lambda device, dtype: None)
    t = [types.SimpleNamespace(device=CUDA, dtype=torch.bfloat16)]
    prefs({GPU: {"krona_linear": {"folded": ["cuda", "triton"]}}})
    assert select_backend("krona_linear", "auto", t, regime="folded") == "cuda"
    assert select_backend("krona_linear", "auto", t, regime="exact") == "triton"

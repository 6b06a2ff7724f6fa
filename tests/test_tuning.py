"""Measured launch configurations (kfused.tuning, benchmarks/tune_kernels.py): the table's
lookup and checks, and every candidate configuration of KronA's factor-gradient pass computes
the same exact sums on the CPU (a GPU run then picks among them by time only)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from kfused import tuning
from kfused.triton_kernels import krona_linear as kl

from conftest import DEVICE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = "Test GPU 80GB"


def _entry(key, T, **cfg):
    return {"key": key, "T": T, "config": cfg, "us": {}}


@pytest.fixture
def table(tmp_path, monkeypatch):
    """A table at a temporary path the library reads, for a device that reports GPU."""
    path = tmp_path / "tuning.json"
    monkeypatch.setenv(tuning.TUNING_ENV, str(path))
    monkeypatch.setattr(tuning, "device_name", lambda dev: GPU if dev.type == "cuda" else None)
    kl._grad_config.cache_clear()
    yield path
    kl._grad_config.cache_clear()
    tuning.forget()


def test_measured_config_applies_to_its_gpu_shape_and_tokens(table):
    cuda = torch.device("cuda")
    key = kl.grad_tuning_key(24, 24, 32, 32, 2)
    tuning.merge(str(table), GPU, "_kron_grad_kernel",
                 [_entry(key, 16384, BT=8, num_warps=8, num_stages=3),
                  _entry(key, 65536, BT=16, num_warps=8, num_stages=2)])
    rule = kl._grad_rule(16384, 24, 24, 32, 32, cuda, 2)
    assert (rule["BT"], rule["num_warps"]) == (2, 4)
    cfg = kl._grad_config(16384, 24, 24, 32, 32, cuda, 2)
    assert (cfg["BT"], cfg["num_warps"], cfg["num_stages"]) == (8, 8, 3)
    assert all(cfg[k] for k in ("DOT_W1", "DOT_DA", "DOT_V", "DOT_DB"))
    # the entry timed at the nearest token count (log scale)
    assert kl._grad_config(4096, 24, 24, 32, 32, cuda, 2)["BT"] == 8
    assert kl._grad_config(50000, 24, 24, 32, 32, cuda, 2)["BT"] == 16
    # not below _TUNE_MIN_T, not for float32, not for another shape, not off CUDA
    assert kl._grad_config(kl._TUNE_MIN_T - 1, 24, 24, 32, 32, cuda, 2)["BT"] == 2
    assert kl._grad_config(16384, 24, 24, 32, 32, cuda, 4) == kl._grad_rule(
        16384, 24, 24, 32, 32, cuda, 4)
    assert kl._grad_config(16384, 32, 24, 24, 32, cuda, 2) == kl._grad_rule(
        16384, 32, 24, 24, 32, cuda, 2)
    cpu = torch.device("cpu")
    assert kl._grad_config(16384, 24, 24, 32, 32, cpu, 2) == kl._grad_rule(
        16384, 24, 24, 32, 32, cpu, 2)


def test_another_gpu_model_keeps_the_rule(table, monkeypatch):
    key = kl.grad_tuning_key(24, 24, 32, 32, 2)
    tuning.merge(str(table), "Other GPU", "_kron_grad_kernel",
                 [_entry(key, 16384, BT=8, num_warps=8, num_stages=3)])
    cuda = torch.device("cuda")
    assert kl._grad_config(16384, 24, 24, 32, 32, cuda, 2) == kl._grad_rule(
        16384, 24, 24, 32, 32, cuda, 2)


def test_merge_replaces_same_shape_and_keeps_others(table):
    key = kl.grad_tuning_key(24, 24, 32, 32, 2)
    other = kl.grad_tuning_key(48, 24, 64, 32, 2)
    tuning.merge(str(table), GPU, "_kron_grad_kernel",
                 [_entry(key, 16384, BT=4, num_warps=8, num_stages=3),
                  _entry(other, 16384, BT=1, num_warps=8, num_stages=3)])
    data = tuning.merge(str(table), GPU, "_kron_grad_kernel",
                        [_entry(key, 16384, BT=8, num_warps=8, num_stages=3)])
    got = data["devices"][GPU]["_kron_grad_kernel"]
    assert len(got) == 2
    assert [e["config"]["BT"] for e in got if e["key"] == key] == [8]
    assert json.loads(table.read_text()) == data


def test_malformed_table_is_an_error_naming_the_file(table):
    table.write_text(json.dumps({"devices": {GPU: {"_kron_grad_kernel": [{"key": {},
                                                                          "T": "many"}]}}}))
    with pytest.raises(tuning.TuningError, match="tuning.json"):
        tuning.lookup("_kron_grad_kernel", torch.device("cuda"), {}, 16)
    # and merge never overwrites a file that is not a table
    before = table.read_text()
    with pytest.raises(tuning.TuningError):
        tuning.merge(str(table), GPU, "_kron_grad_kernel", [])
    assert table.read_text() == before


def test_an_entry_that_is_no_candidate_is_refused(table):
    """A table chooses among the tested candidates: an invented config (2 tokens per step for
    the rank pass, whose split rule divides BT by 4; 3 for the factor-gradient kernel, whose
    step must be a power of two) was handed to the launch and failed inside it
    (ZeroDivisionError, "arange's range must be a power of 2")."""
    from kfused.triton_kernels import _headwise_common as hc

    cuda = torch.device("cuda")
    key = kl.grad_tuning_key(24, 24, 32, 32, 2)
    tuning.merge(str(table), GPU, "_kron_grad_kernel",
                 [_entry(key, 16384, BT=3, num_warps=8, num_stages=3)])
    with pytest.raises(tuning.TuningError, match=r"tuning\.json.*_kron_grad_kernel.*'BT': 3"):
        kl._grad_config(16384, 24, 24, 32, 32, cuda, 2)
    rkey = {"sections": [[12, 24, 8, False]], "BN": 128, "elem_bytes": 2}
    tuning.merge(str(table), GPU, "_lr_rank_bwd_kernel",
                 [_entry(rkey, 16384, BT=2, num_warps=8, num_stages=3)])
    with pytest.raises(tuning.TuningError, match="_lr_rank_bwd_kernel"):
        hc.rank_config(cuda, torch.bfloat16, 16384, lambda: rkey)
    nkey = kl.narrow_tuning_key(2, 2, 384, 384, 2)
    tuning.merge(str(table), GPU, "_kron_narrow_grad_kernel",
                 [_entry(nkey, 16384, NARROW=1, TILE=3000, num_warps=3)])
    with pytest.raises(tuning.TuningError, match="_kron_narrow_grad_kernel"):
        kl.narrow_config(16384, (None, False, 2, 2, 384, 384), cuda, 2)
    # a candidate is taken
    c = hc.rank_candidates()[2]
    tuning.merge(str(table), GPU, "_lr_rank_bwd_kernel", [_entry(rkey, 16384, **c)])
    tuning.forget()
    assert hc.rank_config(cuda, torch.bfloat16, 16384, lambda: rkey) == c


def test_another_table_or_forget_reaches_the_cached_config(table, tmp_path, monkeypatch):
    """_grad_config caches its choice per shape; switching KFUSED_KERNEL_TUNING to another
    table, or rewriting the table and calling tuning.forget(), must reach the next call (the
    cache kept the first table's choice)."""
    cuda = torch.device("cuda")
    key = kl.grad_tuning_key(24, 24, 32, 32, 2)
    tuning.merge(str(table), GPU, "_kron_grad_kernel",
                 [_entry(key, 16384, BT=8, num_warps=8, num_stages=3)])
    assert kl._grad_config(16384, 24, 24, 32, 32, cuda, 2)["BT"] == 8
    other = tmp_path / "other.json"
    tuning.merge(str(other), GPU, "_kron_grad_kernel",
                 [_entry(key, 16384, BT=16, num_warps=8, num_stages=2)])
    monkeypatch.setenv(tuning.TUNING_ENV, str(other))
    assert kl._grad_config(16384, 24, 24, 32, 32, cuda, 2)["BT"] == 16
    monkeypatch.setenv(tuning.TUNING_ENV, str(table))
    assert kl._grad_config(16384, 24, 24, 32, 32, cuda, 2)["BT"] == 8
    tuning.merge(str(table), GPU, "_kron_grad_kernel",
                 [_entry(key, 16384, BT=4, num_warps=8, num_stages=3)])
    tuning.forget()
    assert kl._grad_config(16384, 24, 24, 32, 32, cuda, 2)["BT"] == 4


def test_candidates_start_with_the_rule_and_cover_larger_steps():
    c = kl.grad_candidates(16384, 24, 24, 32, 32)
    assert c[0] == {"BT": 2, "num_warps": 4, "num_stages": 3}
    # the tensor-core narrow kernel's step among them (4 tokens at 24×24 / 32×32)
    assert {x["BT"] for x in c if x.get("TC")} == {4}
    assert len([x for x in c if x.get("TC")]) == len(kl._GRAD_TC_CANDIDATES)
    assert {x["BT"] for x in c} == {2, 4, 8, 16} and len(c) == len({json.dumps(x) for x in c})
    assert kl.grad_candidates(16384, 2, 384, 384, 2) == []      # CUDA-core products: no tuning
    assert max(x["BT"] for x in kl.grad_candidates(5, 24, 24, 32, 32)) <= 8


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_every_candidate_computes_the_exact_sums(dtype):
    """Small integers: every product and partial sum is exact, so dA and dB equal the float64
    result rounded once to the factor dtype, whatever the tokens per step (a ragged last
    step at T = 37), warps or stages."""
    a_out, a_in, b_out, b_in = 16, 24, 32, 16
    T = 37 if dtype == torch.float32 else 5          # float16: the sums stay below 2^11
    gen = torch.Generator().manual_seed(7)
    ints = lambda *s: torch.randint(-1, 2, s, generator=gen).double()  # noqa: E731
    x, g = ints(T, a_in * b_in), ints(T, a_out * b_out)
    A, B = ints(a_out, a_in), ints(b_out, b_in)
    G, X = g.view(T, a_out, b_out), x.view(T, a_in, b_in)
    dA = 0.5 * torch.einsum("tij,jl,tkl->ik", G, B, X)
    dB = 0.5 * torch.einsum("tij,ik,tkl->jl", G, A, X)
    cands = kl.grad_candidates(16384, a_out, a_in, b_out, b_in)
    assert len(cands) >= 4
    cast = lambda t: t.to(dtype).to(DEVICE)  # noqa: E731
    for c in cands:
        _, gA, gB = kl.kron_factor_grads(cast(g), cast(x), cast(A), cast(B), 0.5,
                                         compute_dx=False, config=c)
        assert torch.equal(gA.cpu(), dA.to(dtype)), c
        assert torch.equal(gB.cpu(), dB.to(dtype)), c


@pytest.mark.skipif(DEVICE != "cpu", reason="the sm_90 compile check runs on the CPU in CI")
def test_candidates_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tune_kernels.py"),
                        "--compile-only", "--limit", "1"], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    from kfused.triton_kernels import _headwise_common as hc

    lines = [ln for ln in r.stdout.splitlines() if "regs" in ln]
    # (the tensor-core narrow kernel is a candidate of both factor-gradient passes)
    tc = [ln for ln in lines if ln.startswith("_kron_narrow_tc_kernel")]
    grad = [ln for ln in lines if ln.startswith("_kron_grad")] + [
        ln for ln in tc if " A24x24 B32x32 " in ln]
    narrow = [ln for ln in lines if ln.startswith("_kron_narrow_grad_kernel")]
    narrow_tc = [ln for ln in tc if " A2x384 B384x2 " in ln]
    assert len(tc) == len(narrow_tc) + len(grad) - len(
        [ln for ln in lines if ln.startswith("_kron_grad")])
    rank = [ln for ln in lines if ln.startswith("_lr_rank_bwd_kernel")]
    assert len(grad) == len(kl.grad_candidates(16384, 24, 24, 32, 32))
    assert len(narrow) == len(kl.NARROW_CANDIDATES)
    assert len(narrow_tc) == len(kl.NARROW_TC_CANDIDATES)
    assert len(rank) == len(hc.rank_candidates())
    from kfused.triton_kernels import inducer_attention as ia

    for p in (64, 128):    # one inducer case a head width: every kernel's every candidate
        attn = [ln for ln in lines if ln.startswith("_inducer_attn") and f" p={p} " in ln
                and " decode " not in ln]
        assert len(attn) == sum(len(ia.attn_candidates(k, p)) for k in ia.ATTN_KERNELS)
    decode = [ln for ln in lines if " decode " in ln]
    assert len(decode) == len(ia.decode_candidates())
    # the decode candidates may spill what the rule's launch spills (rc 0 says so: 16 B
    # outside the key loop under Triton 3.9), every other candidate nothing
    assert all("spill 0 B" in ln for ln in lines if ln not in decode)


def test_tune_script_records_the_fastest_candidate(tmp_path, monkeypatch):
    """benchmarks/tune_kernels.py's timing loop on the CPU with a stand-in timer (the GPU's is
    a CUDA-graph replay): every candidate runs (and agrees), the fastest goes into the table
    under the kernel-side factor key, every time into the JSON."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import tune_kernels
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(tune_kernels, "shapes", lambda which: [(37, 16, 24, 32, 16)])
    fast = {"BT": 8, "num_warps": 8, "num_stages": 3}

    def timer(fn, dev, reps_ms):
        fn()
        c = fn.__defaults__[0]            # the candidate the lambda was bound to
        ms = 0.01 if c == fast else 0.02 + 0.001 * c["BT"]
        return ms, ms, ms

    table, out = tmp_path / "t.json", tmp_path / "tune.json"
    assert tune_kernels.tune("targets", str(table), str(out), 1.0, 60.0,
                             dev=torch.device(DEVICE), timer=timer, name=GPU,
                             kernels=("krona",)) == 0
    data = json.loads(table.read_text())
    (e,) = data["devices"][GPU]["_kron_grad_kernel"]
    assert e["key"] == kl.grad_tuning_key(16, 24, 32, 16, 2) and e["T"] == 37
    assert e["config"] == fast and e["us"]["BT8-w8-s3"] == 10.0
    rows = json.loads(out.read_text())["rows"]
    rule = kl.grad_candidates(37, 16, 24, 32, 16)[0]
    assert rows[0]["best"] == "BT8-w8-s3" and rows[0]["rule"] == tune_kernels.label(rule)
    assert None not in rows[0]["us"].values()


def test_rank_pass_config_from_the_table(table):
    from kfused.triton_kernels import _headwise_common as hc

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    key = {"sections": [[6, 34, 2, True], [6, 34, 2, True]], "BN": 128, "elem_bytes": 2}
    tuning.merge(str(table), GPU, "_lr_rank_bwd_kernel",
                 [_entry(key, 16384, BT=128, num_warps=8, num_stages=2)])
    rule = {"BT": 64, "num_warps": 8}
    assert hc.rank_config(cuda, torch.bfloat16, 16384, lambda: key) == {
        "BT": 128, "num_warps": 8, "num_stages": 2}
    other = dict(key, BN=64)
    assert hc.rank_config(cuda, torch.bfloat16, 16384, lambda: other) == rule
    assert hc.rank_config(cuda, torch.bfloat16, 1000, lambda: key) == rule
    assert hc.rank_config(cuda, torch.float32, 16384, lambda: key) == {"BT": 32,
                                                                        "num_warps": 8}
    assert hc.rank_config(cpu, torch.float16, 16384, lambda: key) == {"BT": 32,
                                                                       "num_warps": 4}
    # a given config wins, and no table is asked
    asked = []
    assert hc.rank_config(cuda, torch.bfloat16, 16384, lambda: asked.append(1) or key,
                          {"BT": 32, "num_stages": 4}) == {"BT": 32, "num_warps": 8,
                                                           "num_stages": 4}
    assert asked == []
    assert hc.rank_candidates()[0] == {"BT": 64, "num_warps": 8, "num_stages": 3}


def test_every_rank_candidate_computes_the_same_sums():
    """The rank pass on the sections a real (CPU-sized) q|k|v backward hands it: every
    candidate writes the same dZ (to an ulp) and the same token sums (float32, another
    order)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import tune_kernels
    finally:
        sys.path.pop(0)
    jobs = list(tune_kernels.rank_jobs("quick", torch.device(DEVICE)))
    assert jobs and all(j.kernel == "_lr_rank_bwd_kernel" for j in jobs)
    for job in jobs[:2]:
        ref = None
        for c in job.candidates:
            got = [t.sum(0) for t in job.run(c)]
            dz = [it[2].clone() for it in job.items]
            if ref is None:
                ref = (got, dz)
                continue
            for r, v in zip(ref[0], got):
                torch.testing.assert_close(v, r, rtol=1e-5, atol=1e-5)
            for r, v in zip(ref[1], dz):   # dZ in 16 bits: the same float32 sums, within
                # an ulp (the interpreter's dot may block the M rows differently)
                torch.testing.assert_close(v.float(), r.float(), rtol=2e-3, atol=1e-3)


def test_info_names_the_tuning_table(table, capsys):
    """`kfused info` says which measured choices apply: the tuning table in use (or none) and
    a broken one as an error line, not a crash."""
    from kfused.cli.main import _info

    tuning.merge(str(table), GPU, "_kron_grad_kernel",
                 [_entry(kl.grad_tuning_key(24, 24, 32, 32, 2), 16384, BT=8, num_warps=8,
                         num_stages=3)])
    assert _info() == 0
    out = capsys.readouterr().out
    assert f"kernel tuning table: {table}" in out and "backend preferences:" in out
    table.write_text("{not json")
    tuning.forget()
    assert _info() == 0
    assert "cannot be read" in capsys.readouterr().out


def test_persistent_grid_takes_the_resident_ctas(monkeypatch):
    """_kron_grad_kernel's persistent grid: as many programs per SM as the compiled kernel
    lets reside (remembered after its first launch on a GPU), 4 before that."""
    from kfused.triton_kernels import _common as cm

    # the rule kfused.perf's occupancy uses too (sm_90): the 32×32-factor step (90 registers,
    # 36 KB shared, 4 warps) fits 5 CTAs; the rank pass's (172 registers, 8 warps) 1
    assert cm.ctas_per_sm(90, 36864, 4) == 5 and cm.ctas_per_sm(172, 73728, 8) == 1
    assert cm.ctas_per_sm(64, 240000, 4) == 0                    # over a block's shared memory

    class Compiled:
        n_regs = 90

        class metadata:
            shared, num_warps = 36864, 4
    assert cm.resident_ctas(torch.device("cpu"), Compiled()) is None
    assert cm.resident_ctas(torch.device("cuda"), object()) is None

    asked = []
    real = kl.grid_programs
    monkeypatch.setattr(kl, "grid_programs",
                        lambda dev, blocks, per_sm=4: asked.append(per_sm) or real(dev, blocks))
    dt = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    args = [torch.randn(40, n, dtype=dt).to(DEVICE) for n in (24 * 32, 24 * 32)]
    A, B = (torch.randn(24, 24, dtype=dt).to(DEVICE), torch.randn(32, 32, dtype=dt).to(DEVICE))
    kl.kron_factor_grads(args[0], args[1], A, B, compute_dx=False)
    dev = args[0].device
    cfg = kl._grad_config(40, 24, 24, 32, 32, dev, 2)
    key = (dev, dt, False, True, tuple(sorted(cfg.items())))
    monkeypatch.setitem(kl._GRAD_RESIDENT, key, 7)
    kl.kron_factor_grads(args[0], args[1], A, B, compute_dx=False)
    assert asked[-1] == 7 and (DEVICE == "cuda" or asked[0] == 4)


def test_every_narrow_candidate_computes_the_same_sums():
    """The narrow factor-gradient kernels' candidates on the paper's pairs (their CPU
    stand-ins, both orientations, the 8-row side too): float32, the CUDA-core kernel's
    (tile, warps), the same dA and dB to float32 rounding (other token blocks, other
    summation orders); float16, also the tensor-core kernel's (warps, stages), first, each
    within float16's eps of the largest entry of the float32 sums of the same operands."""
    assert kl.NARROW_CANDIDATES[0]["TILE"] == kl._NARROW_GPU_TILE
    gen = torch.Generator().manual_seed(5)
    for a_out, a_in, b_out, b_in in ((2, 128, 128, 2), (128, 2, 2, 128), (8, 40, 30, 2)):
        plan = kl.narrow_grad_plan(a_out, a_in, b_out, b_in)
        assert plan is not None and kl.narrow_tc_tiles(plan) is not None
        T = 45
        x = torch.randn(T, a_in * b_in, generator=gen).to(DEVICE)
        g = torch.randn(T, a_out * b_out, generator=gen).to(DEVICE)
        A = torch.randn(a_out, a_in, generator=gen).to(DEVICE)
        B = torch.randn(b_out, b_in, generator=gen).to(DEVICE)
        assert kl.narrow_candidates(plan, 4) == list(kl.NARROW_CANDIDATES)
        ref = None
        for c in kl.NARROW_CANDIDATES:
            got = kl.kron_factor_grads(g, x, A, B, 0.5, compute_dx=False, config=c)[1:]
            if ref is None:
                ref = got
            for r, v in zip(ref, got):
                torch.testing.assert_close(v, r, rtol=1e-5, atol=1e-5)
        h = [t.half() for t in (g, x, A, B)]
        # the float32 sums of the float16 operands, rounded once
        exact = kl.kron_factor_grads(*[t.float() for t in h], 0.5, compute_dx=False)[1:]
        cands = kl.narrow_candidates(plan, 2)
        assert cands[:len(kl.NARROW_TC_CANDIDATES)] == list(kl.NARROW_TC_CANDIDATES)
        assert kl.narrow_candidates(plan, 2, dx=True) == list(kl.NARROW_CANDIDATES)
        for c in cands:
            got = kl.kron_factor_grads(*h, 0.5, compute_dx=False, config=c)[1:]
            for e, v in zip(exact, got):
                # the CUDA-core kernel's W and V are float32, the tensor-core kernel's rounded
                # once to float16 for its token sums (errors ~2^-12 of the terms, whose sums
                # cancel): both within float16's eps of the largest entry, §4's atol
                tol = torch.finfo(torch.float16).eps * e.abs().max()
                assert (v.float() - e.float()).abs().max() <= tol, c


def test_narrow_config_from_the_table(table):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    plan = kl.narrow_grad_plan(2, 384, 384, 2)
    key = kl.narrow_tuning_key(2, 2, 384, 384, 2)
    assert key["tc"] == 1
    tuning.merge(str(table), GPU, "_kron_narrow_grad_kernel",
                 [_entry(key, 16384, NARROW=1, TILE=2048, num_warps=4)])
    rule = dict(kl.NARROW_CANDIDATES[0])
    tc = dict(kl.NARROW_TC_CANDIDATES[0])
    assert kl.narrow_config(16384, plan, cuda, 2) == dict(rule, TILE=2048, num_warps=4)
    assert kl.narrow_config(1000, plan, cuda, 2) == tc                   # below _TUNE_MIN_T
    assert kl.narrow_config(16384, plan, cuda, 4) == rule                 # float32
    assert kl.narrow_config(16384, plan, cuda, 2, dx=True) == rule        # with dx: not timed
    other = kl.narrow_grad_plan(8, 384, 384, 2)
    assert kl.narrow_config(16384, other, cuda, 2) == tc                  # another shape
    assert kl.narrow_config(16384, plan, cpu, 2) == tc
    assert kl.narrow_config(16384, plan, cpu, 2, dx=True)["TILE"] == 16 * kl._NARROW_GPU_TILE
    # an entry timed before the tensor-core kernel existed (its key without "tc") is not
    # used where that kernel applies: the rule, not the old measurement, decides
    old = {k: v for k, v in key.items() if k != "tc"}
    tuning.merge(str(table), GPU, "_kron_narrow_grad_kernel",
                 [_entry(old, 16384, NARROW=1, TILE=1024, num_warps=2)])
    tuning.forget()
    assert kl.narrow_config(16384, other, cuda, 2) == tc
    tuning.merge(str(table), GPU, "_kron_narrow_grad_kernel", [_entry(key, 16384, **tc)])
    tuning.forget()
    assert kl.narrow_config(16384, plan, cuda, 2) == tc


def test_merge_never_writes_through_a_link_and_leaves_no_temporary(tmp_path):
    # merge wrote its temporary at the predictable <table>.tmp<pid> (through any link placed
    # there), replaced a symlinked table by a plain file (the file it named never updated),
    # and an interrupted write left the temporary behind
    key = kl.grad_tuning_key(24, 24, 32, 32, 2)
    real = tmp_path / "real.json"
    tuning.merge(str(real), GPU, "_kron_grad_kernel",
                 [_entry(key, 16384, BT=8, num_warps=8, num_stages=3)])
    link = tmp_path / "link.json"
    link.symlink_to(real)
    with pytest.raises(tuning.TuningError, match="symbolic link"):
        tuning.merge(str(link), GPU, "_kron_grad_kernel", [])
    assert link.is_symlink()
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (tmp_path / f"real.json.tmp{os.getpid()}").symlink_to(victim)
    tuning.merge(str(real), "GPU 2", "_kron_grad_kernel",
                 [_entry(key, 16384, BT=4, num_warps=8, num_stages=3)])
    assert victim.read_text() == "mine"
    assert set(json.loads(real.read_text())["devices"]) == {GPU, "GPU 2"}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["real.json", "link.json", "victim.txt", f"real.json.tmp{os.getpid()}"])


def test_tune_kernels_out_is_never_a_file_it_did_not_write(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import tune_kernels

    mine = tmp_path / "t.json"
    assert tune_kernels.out_refusal(str(mine)) is None
    mine.write_text(json.dumps({"written_by": tune_kernels.OUT_WRITER, "rows": []}))
    assert tune_kernels.out_refusal(str(mine)) is None
    (tmp_path / "notes.json").write_text("USER")
    (tmp_path / "ln.json").symlink_to(mine)
    for name in ("notes.json", "ln.json"):
        assert "not replacing it" in tune_kernels.out_refusal(str(tmp_path / name))
        with pytest.raises(SystemExit) as exc:
            tune_kernels.main(["--out", str(tmp_path / name)])
        assert exc.value.code == 2
    assert (tmp_path / "notes.json").read_text() == "USER"


def test_attention_configs_from_the_table(table):
    """The inducer attention's three kernels each take their own measured entry (16-bit, on
    the GPU model and head width timed, causal or not — a causal launch without one takes the
    non-causal entry —, from _ATTN_TUNE_MIN_N keys), else the rule: the first candidate."""
    from kfused.triton_kernels import inducer_attention as ia

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    fwd, dq, dkdv = ia.ATTN_KERNELS
    tup = lambda c: tuple(c[k] for k in ia._CFG_KEYS)  # noqa: E731
    rule = {k: tup(ia.attn_candidates(k, 128)[0]) for k in ia.ATTN_KERNELS}
    assert rule[fwd] == (128, 64, 8, 3) and rule[dq] == (128, 64, 8, 2)
    assert rule[dkdv] == (32, 128, 8, 2)
    key = ia.attn_tuning_key(128, False, 2)
    tuning.merge(str(table), GPU, fwd, [_entry(key, 2048, **ia.attn_candidates(fwd, 128)[1])])
    tuning.merge(str(table), GPU, dkdv, [_entry(key, 16384,
                                                **ia.attn_candidates(dkdv, 128)[1])])
    bf = torch.bfloat16
    want = tup(ia.attn_candidates(fwd, 128)[1])
    assert ia._fwd_config(bf, 128, cuda, False, 2048) == want
    assert ia._fwd_config(torch.float16, 128, cuda, False, 8192) == want   # nearest count
    assert ia._fwd_config(bf, 128, cuda, True, 2048) == want    # causal: the non-causal's
    assert ia._fwd_config(bf, 128, cuda, False, ia._ATTN_TUNE_MIN_N - 1) == rule[fwd]
    assert ia._fwd_config(bf, 64, cuda, False, 2048) == tup(ia.attn_candidates(fwd, 64)[0])
    assert ia._fwd_config(torch.float32, 128, cuda, False, 2048) == (64, 32, 4, 1)
    assert ia._fwd_config(bf, 128, cpu, False, 2048) == (64, 64, 4, 1)      # interpreter
    assert ia._bwd_config(bf, 128, cuda, False, 2048) == (
        rule[dq], tup(ia.attn_candidates(dkdv, 128)[1]))
    own = ia.attn_candidates(fwd, 128)[2]       # a causal entry of its own wins for causal
    tuning.merge(str(table), GPU, fwd, [_entry(ia.attn_tuning_key(128, True, 2), 2048, **own)])
    assert ia._fwd_config(bf, 128, cuda, True, 2048) == tup(own)
    assert ia._fwd_config(bf, 128, cuda, False, 2048) == want
    # a given configuration wins over the table and the rule, for its kernel only
    c = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    assert ia._fwd_config(bf, 128, cuda, False, 2048, c) == (64, 32, 8, 2)
    assert ia._bwd_config(bf, 128, cuda, False, 2048, {dq: c}) == (
        (64, 32, 8, 2), tup(ia.attn_candidates(dkdv, 128)[1]))
    # another GPU model keeps the rule
    tuning.forget()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tuning, "device_name", lambda dev: "Another GPU")
        assert ia._fwd_config(bf, 128, cuda, False, 2048) == rule[fwd]


def test_attention_candidates_start_with_the_rule_and_differ():
    from kfused.triton_kernels import inducer_attention as ia

    for d_pad in (16, 32, 64, 128):
        for kernel in ia.ATTN_KERNELS:
            c = ia.attn_candidates(kernel, d_pad)
            assert len(c) >= 2 and len({json.dumps(x, sort_keys=True) for x in c}) == len(c)
            assert all(set(x) == set(ia._CFG_KEYS) for x in c)


def test_tune_script_times_the_attention_kernels(tmp_path, monkeypatch, capsys):
    """tune_kernels' attn jobs on the CPU (a tiny shape, a stand-in timer): each kernel's
    candidates run within their pass and agree, the fastest goes into the table under the
    kernel's own name, the head-width key and the sequence length."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import tune_kernels
    finally:
        sys.path.pop(0)
    from kfused.triton_kernels import inducer_attention as ia

    monkeypatch.setattr(tune_kernels, "attn_shapes", lambda which: [(1, 2, 70, 64, False)])
    monkeypatch.setattr(tune_kernels, "decode_shapes", lambda which: [(2, 4, 2, 300, 64)])
    ran = []

    def timer(fn, dev, reps_ms):
        fn()
        c = fn.__defaults__[0]
        ran.append(c)
        # dK/dV's second candidate; the decode's widest step
        fast = (c.get("BLOCK_M") == 64 and c["BLOCK_N"] == 128
                or "BLOCK_M" not in c and c["BLOCK_N"] == 256)
        ms = 0.01 if fast else 0.02
        return ms, ms, ms

    table, out = tmp_path / "t.json", tmp_path / "tune.json"
    assert tune_kernels.tune("targets", str(table), str(out), 1.0, 600.0,
                             dev=torch.device(DEVICE), timer=timer, name=GPU,
                             kernels=("attn",)) == 0
    assert len(ran) == (sum(len(ia.attn_candidates(k, 64)) for k in ia.ATTN_KERNELS)
                        + len(ia.decode_candidates()))
    data = json.loads(table.read_text())["devices"][GPU]
    assert sorted(data) == sorted(ia.ATTN_KERNELS + (ia.DECODE_TUNING,))
    (e,) = data[ia.DECODE_TUNING]
    assert e["key"] == ia.decode_tuning_key(64, 16, 4, 2) and e["T"] == 300
    assert e["config"] == {"BLOCK_N": 256, "num_warps": 4, "num_stages": 2}
    key = ia.attn_tuning_key(64, False, 2)
    for kernel in ia.ATTN_KERNELS:
        (e,) = data[kernel]
        assert e["key"] == key and e["T"] == 70
        assert e["config"] in ia.attn_candidates(kernel, 64)
    assert data[ia.ATTN_KERNELS[2]][0]["config"]["BLOCK_N"] == 128
    printed = capsys.readouterr().out
    assert "differs" not in printed and "Error" not in printed, printed


def test_decode_config_from_the_table(table):
    """The split-KV decode takes a measured entry for its GPU model and shape (16-bit), else
    the rule; a given configuration wins; the CPU interpreter keeps the rule's keys."""
    from kfused.triton_kernels import inducer_attention as ia

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    lay = ia._Layout(torch.empty(1, 32, 1, 128), torch.empty(1, 8, 16384, 128), None)
    key = ia.decode_tuning_key(128, 16, 8, 2)
    tuning.merge(str(table), GPU, ia.DECODE_TUNING,
                 [_entry(key, 16384, BLOCK_N=256, num_warps=4, num_stages=2)])
    rule = ia.DECODE_CANDIDATES[0]
    got = lambda plan: (plan.block_n, plan.num_warps, plan.num_stages)  # noqa: E731
    plan = ia._DecodePlan(lay, cuda, None, None, torch.bfloat16)
    assert got(plan) == (256, 4, 2) and plan.chunk % 256 == 0 and plan.splits > 1
    assert got(ia._DecodePlan(lay, cuda, None, None, torch.float32)) == rule
    other = ia._Layout(torch.empty(2, 32, 1, 128), torch.empty(2, 8, 16384, 128), None)
    assert got(ia._DecodePlan(other, cuda, None, None, torch.bfloat16)) == rule   # kv heads
    c = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}
    assert got(ia._DecodePlan(lay, cuda, None, c, torch.bfloat16)) == (128, 4, 2)
    assert ia._DecodePlan(lay, cpu, None, None, torch.bfloat16).block_n == rule[0]

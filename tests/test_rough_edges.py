"""Issue 18, item 4: the rough edges a new user met — every method honours
AdapterConfig(backend=...), add_inducers freezes the base, the merge error names every
mergeable method, `kfused info` says each reason once, `kfused bench --quick` is CPU-sized
and every provider runs (the torch.compile baseline included), the README says how to replay a
failing randomised test."""

import os
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")

import kfused  # noqa: E402
from kfused.integration import AdapterConfig, count_parameters, inject, merge, set_backend  # noqa: E402,E501
from kfused.integration.models import tiny_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpt2():
    torch.manual_seed(0)
    return tiny_model("gpt2", d_model=32, n_layers=1, n_heads=2, vocab=50)


@pytest.mark.parametrize("method", ["kernel_mix", "kernel_wise_lite", "inducer", "inducer_lora",
                                    "prefix", "krona", "lora"])
def test_every_method_honours_config_backend(method, monkeypatch):
    # The environment says "reference"; the config asks for "cuda", which cannot run CPU
    # tensors: honouring the config means a BackendError, ignoring it runs the reference.
    monkeypatch.setenv("KFUSED_BACKEND", "reference")
    model = _gpt2()
    inject(model, AdapterConfig(method=method, r=2, backend="cuda"))
    ids = torch.randint(0, 50, (2, 8))
    if method == "lora":  # LoRA has no fused kernel (cuBLAS): nothing to dispatch
        model(input_ids=ids)
        return
    with pytest.raises(kfused.BackendError):
        model(input_ids=ids)
    set_backend(model, "reference")  # and set_backend reaches the same modules
    assert model(input_ids=ids).logits.shape == (2, 8, 50)


def test_add_inducers_freezes_the_base_by_default():
    from kfused.integration.hf_attention import add_inducers

    model = _gpt2()
    adapters = add_inducers(model, key_bottleneck=2, value_bottleneck=3)
    own = sum(p.numel() for a in adapters for p in a.parameters())
    trainable, total = count_parameters(model)
    assert trainable == own and 0 < trainable < total
    model = _gpt2()
    add_inducers(model, key_bottleneck=2, value_bottleneck=3, freeze_base=False)
    assert count_parameters(model)[0] == count_parameters(model)[1]


@pytest.mark.parametrize("kwargs, error", [
    (dict(key_bottleneck=0), ValueError), (dict(composition="mul"), ValueError),
    (dict(prefix_len=-1), ValueError), (dict(value_bottleneck=2.5), TypeError)])
def test_add_inducers_refusal_leaves_the_model_as_it_was(kwargs, error):
    # add_inducers documents that it raises before changing the model: it had frozen the base
    # before the adapter refused the argument (and a float bottleneck failed in torch.empty)
    from kfused.integration.hf_attention import add_inducers

    model = _gpt2()
    flags = [p.requires_grad for p in model.parameters()]
    names = [n for n, _ in model.named_modules()]
    with pytest.raises(error, match=next(iter(kwargs)) if error is TypeError else None):
        add_inducers(model, **kwargs)
    assert [p.requires_grad for p in model.parameters()] == flags
    assert [n for n, _ in model.named_modules()] == names
    assert model.config._attn_implementation == "eager"


def test_a_second_inducer_adapter_is_refused_and_the_first_kept():
    # add_inducers (or inject of inducer/prefix) on a model that already had inducer adapters
    # replaced them silently: the trained adapters were gone
    from kfused.integration.hf_attention import ADAPTER_ATTR, add_inducers

    model = _gpt2()
    first = add_inducers(model, key_bottleneck=2, value_bottleneck=3)
    flags = [p.requires_grad for p in model.parameters()]
    for again in (lambda: add_inducers(model, key_bottleneck=2, value_bottleneck=3),
                  lambda: inject(model, AdapterConfig(method="prefix", r=2))):
        with pytest.raises(ValueError, match="already has an inducer/prefix adapter"):
            again()
        assert getattr(model.transformer.h[0].attn, ADAPTER_ATTR) is first[0]
        assert [p.requires_grad for p in model.parameters()] == flags


def test_the_numerics_rule_compares_every_output():
    # check_against_reference zipped the kernel's outputs with the reference's: a kernel that
    # returned fewer (e.g. dropped u) passed on the ones it had; out_names dropped the rest too
    from kfused.testing import assert_against_reference, check_against_reference

    x = torch.randn(5, 4, dtype=torch.float64)
    both = lambda x: (x * 2, x + 1)  # noqa: E731
    assert len(assert_against_reference(both, both, {"x": x}, torch.float32)) == 3
    for fewer in (lambda x: (x * 2,), lambda x: x * 2):  # outputs only: no gradient differs
        with pytest.raises(AssertionError, match="the kernel returned 1 outputs, the reference 2"):
            assert_against_reference(fewer, both, {"x": x}, torch.float32, grad_names=[])
    with pytest.raises(ValueError, match="out_names"):
        check_against_reference(both, both, {"x": x}, torch.float32, out_names=["y"])


def test_merge_error_lists_every_mergeable_method():
    model = _gpt2()
    inject(model, AdapterConfig(method="inducer", r=2))
    with pytest.raises(ValueError) as exc:
        merge(model)
    msg = str(exc.value)
    for name in ("krona", "lora", "kernel_mix", "kernel_wise_lite"):
        assert name in msg
    assert "inducer," not in msg.split("Mergeable methods:")[1]


def test_info_prints_each_reason_once(capsys):
    from kfused.cli.main import _info

    assert _info() == 0
    lines = capsys.readouterr().out.splitlines()
    reasons = [ln.strip() for ln in lines if ln.strip().startswith("[")]
    assert len(reasons) == len(set(reasons))
    assert not any("ImportError" in ln for ln in lines if "float" in ln)


def test_bench_quick_cpu_cases_are_tiny_float32_and_every_provider_runs(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    import kfused.cases.e2e as be
    from kfused.bench import measure

    cases = be.bench_cases("cpu", torch.bfloat16, quick=True)
    assert all(c.dtype == torch.float32 and c.shape["d_model"] <= 64 for c in cases)
    rows = measure(cases[0], "cpu", rep_ms=5, warmup_ms=1, modes=("fwd",))
    assert not [r for r in rows if "error" in r], [r for r in rows if "error" in r]
    ran = {r["provider"] for r in rows if "ms_p50" in r}
    assert {"frozen-floor", "peft-lora", "kfused-krona-unfused",
            "kfused-kernel-mix-qvo-unfused", "kfused-inducer-lora-unfused"} <= ran
    skipped = {r["provider"]: r["skipped"] for r in rows if "skipped" in r}
    assert all("CUDA" in why or "LoKr" in why for why in skipped.values()), skipped
    del sys.modules["kfused.cases.e2e"]


def test_bench_on_the_cpu_runs_the_dtype_asked_or_says_which(tmp_path, monkeypatch, capsys):
    # --dtype bf16 on the CPU ran krona and headwise in float32 without a word
    import kfused.cases
    from kfused.cli import bench

    for op in ("krona", "headwise", "inducer"):
        cases = kfused.cases.bench_cases(op, "cpu", torch.bfloat16, quick=True)
        assert cases and all(c.dtype == torch.bfloat16 for c in cases), op
    # e2e's CPU cases are float32 by design (bf16 autocast on a CPU is slow): a note says so
    monkeypatch.setattr(kfused.cases, "bench_cases", lambda *a, **k: [_Case(torch.float32)])
    assert bench.run(["e2e", "--device", "cpu", "--dtype", "bf16", "--no-plot",
                      "--out", str(tmp_path)]) == 0
    assert "e2e runs its cpu cases in float32, not --dtype bf16" in capsys.readouterr().err


class _Case:
    op, shape, providers = "e2e", {}, []

    def __init__(self, dtype):
        self.dtype = dtype


@pytest.mark.parametrize("op", ["krona_linear", "inducer_attention"])
def test_torch_func_grad_runs_reference_and_names_why_not_fused(op):
    # under torch.func.grad the fused custom ops failed inside torch ("must override the
    # setup_context staticmethod", pytorch/pytorch#170834), a message naming neither the op
    # nor a way out; now a fused backend asked for is refused by name and auto runs reference
    from kfused.backends import BackendError, triton_unfit

    g = torch.Generator().manual_seed(11)
    if op == "krona_linear":
        x, w = torch.randn(5, 12, generator=g), torch.randn(6, 12, generator=g)
        a0, b = torch.randn(2, 3, generator=g), torch.randn(3, 4, generator=g)

        def f(a, backend):
            return (kfused.krona_linear(x, w, None, a, b, 0.5, backend=backend) ** 2).sum()
    else:
        q, k, v = (torch.randn(1, 2, 6, 32, generator=g) for _ in range(3))
        a0 = q.clone()

        def f(q, backend):
            return (kfused.inducer_attention(q, k, v, causal=True, backend=backend)[0] ** 2).sum()

    leaf = a0.clone().requires_grad_()
    f(leaf, "reference").backward()
    for backend in ("auto", "reference"):
        torch.testing.assert_close(torch.func.grad(f)(a0, backend), leaf.grad, rtol=0, atol=0)
    if triton_unfit(torch.device("cpu"), torch.float32) is None:
        with pytest.raises(BackendError, match=rf"{op}: backend 'triton' .* torch.func transform"):
            torch.func.grad(f)(a0, "triton")
        f(a0.clone().requires_grad_(), "triton").backward()  # outside a transform: unchanged


def test_bench_defaults_to_git_ignored_local_folder():
    import subprocess

    from kfused.cli import bench

    src = open(os.path.join(ROOT, "kfused", "cli", "bench.py")).read()
    assert '"results" / "local"' in src
    probe = os.path.join("benchmarks", "results", "local", "x.json")
    out = subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT)
    if out.returncode not in (0, 1):
        pytest.skip("not a git checkout")
    assert out.returncode == 0  # ignored
    kept = os.path.join("benchmarks", "results", "h100", "x.json")
    assert subprocess.run(["git", "check-ignore", "-q", kept], cwd=ROOT).returncode == 1
    assert bench  # imported without error


def test_bench_out_never_overwrites_a_file(tmp_path, monkeypatch, capsys):
    import datetime
    import json
    import types

    import kfused.cases
    from kfused.cli import bench

    class Fixed(datetime.datetime):  # two runs in the same second
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime(2026, 1, 1, tzinfo=tz)

    monkeypatch.setattr(bench, "_dt", types.SimpleNamespace(datetime=Fixed,
                                                            timezone=datetime.timezone))
    monkeypatch.setattr(kfused.cases, "bench_cases", lambda *a, **k: [])
    argv = ["krona", "--device", "cpu", "--no-plot", "--out", str(tmp_path)]
    assert bench.run(argv) == 0
    (first,) = tmp_path.iterdir()
    first.write_text("the user's notes")  # or the earlier run's results
    assert bench.run(argv) == 0
    assert first.read_text() == "the user's notes"
    second = first.with_name(first.stem + "-2.json")
    assert json.loads(second.read_text())["meta"]["device_type"] == "cpu"
    first.with_name(first.stem + "-3.png").write_text("a plot of the user's")  # its PNG too
    assert bench.run(argv) == 0
    assert {p.name[len(first.stem):] for p in tmp_path.iterdir()} == \
        {".json", "-2.json", "-3.png", "-4.json"}
    # --out naming a file: a usage error (was a FileExistsError traceback)
    with pytest.raises(SystemExit) as exc:
        bench.run(argv[:-1] + [str(first)])
    assert exc.value.code == 2
    assert "--out" in capsys.readouterr().err and first.read_text() == "the user's notes"
    # --out under a file: a usage error before any case (was a NotADirectoryError traceback)
    monkeypatch.setattr(kfused.cases, "bench_cases", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(SystemExit) as exc:
        bench.run(argv[:-1] + [str(first / "sub")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --out" in err and "is not a directory" in err


def test_bench_exits_1_when_a_provider_fails(tmp_path, monkeypatch, capsys):
    # a provider that raised (a crashing kernel) was one row marked "error" and the exit
    # status stayed 0: benchmarks/gpu_suite.sh's `|| status=1` passed the stage
    import json

    import kfused.cases
    from kfused.bench import BenchCase, Provider
    from kfused.cli import bench

    def works():
        x = torch.ones(3, requires_grad=True)
        return (lambda: x * 2), [x]

    def crashes():
        raise RuntimeError("the kernel crashed")

    def cases(providers):
        return lambda *a, **k: [BenchCase("krona_linear", {"T": 3}, torch.float32, providers)]

    argv = ["krona", "--device", "cpu", "--no-plot", "--rep-ms", "1", "--out", str(tmp_path)]
    monkeypatch.setattr(kfused.cases, "bench_cases", cases([Provider("floor", works)]))
    assert bench.run(argv) == 0
    (first,) = tmp_path.glob("*.json")
    monkeypatch.setattr(kfused.cases, "bench_cases", cases([
        Provider("floor", works), Provider("kfused-triton", crashes),
        Provider("kfused-cuda", works, skip_reason="not built")]))  # a skip is no failure
    assert bench.run(argv) == 1
    assert "1 provider(s) failed" in capsys.readouterr().err
    (written,) = set(tmp_path.glob("*.json")) - {first}  # the results are still written
    rows = json.loads(written.read_text())["rows"]
    assert [r["provider"] for r in rows if "error" in r] == ["kfused-triton"]
    assert any(r["provider"] == "floor" and "ms_p50" in r for r in rows)


def test_bench_write_prefs_folder_is_checked_before_the_run(tmp_path):
    # --write-prefs under a file: refused only by mkdir after the whole GPU run (a
    # NotADirectoryError traceback, the measured preferences lost)
    from pathlib import Path

    from kfused.cli import bench

    (tmp_path / "file").write_text("mine")
    for bad in (tmp_path / "file" / "prefs.json", tmp_path / "file" / "sub" / "prefs.json"):
        with pytest.raises(SystemExit, match="--write-prefs .*file (exists and )?is not a directory"):
            bench._check_prefs_target(Path(bad))
    bench._check_prefs_target(tmp_path / "new" / "prefs.json")  # a folder it can make: fine
    assert (tmp_path / "file").read_text() == "mine" and not (tmp_path / "new").exists()


def test_bench_write_prefs_body_is_checked_before_the_run(tmp_path):
    # a file of ours with a body that is not preferences passed the pre-run check and failed
    # in write_prefs after every case (a BackendError traceback, the measurements lost)
    import json
    from pathlib import Path

    from kfused.backends import PREFS_WRITER
    from kfused.cli import bench

    path = Path(tmp_path / "prefs.json")
    body = json.dumps({"written_by": PREFS_WRITER, "devices": {"GPU": {"op": {"r": ["TRITON"]}}}})
    path.write_text(body)
    with pytest.raises(SystemExit, match=r"--write-prefs .*prefs\.json: backend preferences"):
        bench._check_prefs_target(path)
    assert path.read_text() == body
    path.write_text(json.dumps({"written_by": PREFS_WRITER, "devices": {}}))
    bench._check_prefs_target(path)                                  # a good one: fine


def test_a_results_file_is_whole_or_absent(tmp_path):
    # written in place under its final name, a write that failed part way (a full disk, here
    # a file-size limit) left a truncated, unparsable results file there
    import json
    import subprocess

    code = textwrap.dedent(f"""
        import json, os, resource, signal
        from kfused import _files
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            _files.new_results_file({str(tmp_path)!r}, "krona_x",
                                    json.dumps({{"rows": list(range(5000))}}))
        except OSError as exc:
            print("failed:", exc)
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert "failed:" in out.stdout, (out.stdout, out.stderr)
    assert os.listdir(tmp_path) == []
    (tmp_path / "krona_x.json").write_text("mine")
    text = json.dumps({"rows": list(range(5000))})
    from kfused import _files

    path = _files.new_results_file(tmp_path, "krona_x", text)
    assert path.name == "krona_x-2.json" and json.loads(path.read_text()) == json.loads(text)
    assert sorted(os.listdir(tmp_path)) == ["krona_x-2.json", "krona_x.json"]
    assert (tmp_path / "krona_x.json").read_text() == "mine"


def test_bench_e2e_script_never_overwrites_a_file(tmp_path, monkeypatch):
    # benchmarks/bench_e2e.py wrote e2e_<device>.json over whatever was in --out
    import kfused.cases.e2e as be

    monkeypatch.setattr(be, "bench_cases", lambda *a, **k: [])
    (tmp_path / "e2e_cpu.json").write_text("the user's notes")
    be.run("cpu", torch.float32, True, str(tmp_path), 1.0)
    be.run("cpu", torch.float32, True, str(tmp_path), 1.0)
    assert (tmp_path / "e2e_cpu.json").read_text() == "the user's notes"
    assert {p.name for p in tmp_path.glob("*.json")} == {"e2e_cpu.json", "e2e_cpu-2.json",
                                                         "e2e_cpu-3.json"}
    import json

    # the file names the dtype the cases ran: the CPU's quick cases are float32 (it said
    # torch.bfloat16, the script's default, for a float32 run)
    monkeypatch.setattr(be, "bench_cases", lambda *a, **k: [_Case(torch.float32)])
    monkeypatch.setattr(be, "measure", lambda *a, **k: [])
    be.run("cpu", torch.bfloat16, True, str(tmp_path), 1.0)
    meta = json.loads((tmp_path / "e2e_cpu-4.json").read_text())["meta"]
    assert meta["dtype"] == "torch.float32" and meta["requested_dtype"] == "torch.bfloat16"


def test_bench_e2e_script_checks_its_arguments_before_measuring(tmp_path, monkeypatch, capsys):
    # benchmarks/bench_e2e.py took any --rep-ms (-1, nan) and --device string, and found an
    # --out under a file only after every measurement (a NotADirectoryError traceback)
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_e2e_script", os.path.join(ROOT, "benchmarks", "bench_e2e.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "run", lambda *a, **k: pytest.fail("measured"))
    (tmp_path / "file").write_text("mine")
    for argv, option, text in [(["--rep-ms", "-1"], "--rep-ms", "expected a number > 0"),
                               (["--rep-ms", "nan"], "--rep-ms", "expected a finite number"),
                               (["--device", "bogus"], "--device", "invalid device 'bogus'"),
                               (["--out", str(tmp_path / "file" / "sub")], "--out",
                                "is not a directory")]:
        with pytest.raises(SystemExit) as exc:
            script.main(["--quick", "--device", "cpu"] + argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"argument {option}" in err and text in err, err
    assert (tmp_path / "file").read_text() == "mine"
    # a provider that failed: exit status 1 (was 0), as `kfused bench`
    for rows, code in [([{"provider": "a", "ms_p50": 1.0}], 0),
                       ([{"provider": "a", "ms_p50": 1.0}, {"provider": "b", "error": "x"}], 1)]:
        monkeypatch.setattr(script, "run", lambda *a, rows=rows, **k: rows)
        assert script.main(["--quick", "--device", "cpu", "--out", str(tmp_path)]) == code


def test_bench_records_the_commit_of_the_kfused_that_runs(tmp_path, monkeypatch):
    import subprocess

    from kfused.cli import bench

    here = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    if not here:
        pytest.skip("not a git checkout")
    # run from inside another checkout: its commit was recorded as kfused's
    other = tmp_path / "other"
    (other / "benchmarks").mkdir(parents=True)
    (other / "kfused").mkdir()
    subprocess.run(["git", "init", "-q"], cwd=other, check=True)
    subprocess.run(["git", "-c", "user.name=x", "-c", "user.email=x@x", "commit", "-q",
                    "--allow-empty", "-m", "other"], cwd=other, check=True)
    monkeypatch.chdir(other)
    assert bench._git_commit().split("-")[0] == here


@pytest.mark.slow
def test_inducer_bench_compile_baseline_runs_backward():
    # torch.compile's donated buffers refused the harness's replayed backward (retain_graph)
    sys.path.insert(0, ROOT)
    try:
        from kfused.cases.inducer import bench_cases as cases
        from kfused.bench import measure

        case = cases("cpu", torch.float32, quick=True)[0]
        case.providers = [p for p in case.providers if p.name == "compile"]
        rows = measure(case, "cpu", rep_ms=5, warmup_ms=1, modes=("bwd",))
    finally:
        sys.path.remove(ROOT)
    assert len(rows) == 1 and "ms_p50" in rows[0], rows


def test_readme_says_how_to_replay_a_random_test():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "KFUSED_TEST_SEED=" in readme


def test_check_dtypes_named_either_way_and_unknown_refused(capsys):
    """`kfused check --dtypes` takes fp32/fp16/bf16 or torch's names; anything else is a
    usage error naming it, not a KeyError."""
    from kfused.cli import check

    with pytest.raises(SystemExit) as e:
        check.run(["--dtypes", "float64", "inducer_attention"])
    assert e.value.code == 2 and "unknown dtype(s) float64" in capsys.readouterr().err


def test_check_with_every_case_skipped_fails(monkeypatch, capsys):
    """`kfused check` where no backend can run a case (Triton unusable, extension not built)
    printed "0 passed, 0 failed" and exited 0: a gate (benchmarks/gpu_suite.sh) passed having
    compared nothing."""
    from kfused import backends
    from kfused.cli import check

    monkeypatch.setattr(backends, "triton_unfit", lambda device, dtype: "no triton here")
    monkeypatch.setattr(backends, "cuda_unfit", lambda device, dtype, op: "no extension here")
    assert check.run(["krona", "--device", "cpu", "--dtypes", "fp32"]) == 1
    out = capsys.readouterr().out
    assert "skipped: no triton here" in out and "nothing was checked" in out


def test_bench_ratios_against_each_family_baseline():
    """Ratios go against the case's own baseline: the frozen layer ("floor"), SDPA for
    inducer attention, the padded batch for the packed case; a case with none gets none."""
    from kfused.cli.bench import add_ratios

    rows = [dict(shape={"n": 1}, mode="fwd", provider="sdpa", ms_p50=2.0),
            dict(shape={"n": 1}, mode="fwd", provider="kfused-triton", ms_p50=3.0),
            dict(shape={"k": 1}, mode="fwd", provider="floor", ms_p50=1.0),
            dict(shape={"k": 1}, mode="fwd", provider="sdpa", ms_p50=9.0),
            dict(shape={"k": 1}, mode="fwd", provider="kfused-triton", ms_p50=1.5),
            dict(shape={"p": 1}, mode="fwd+bwd", provider="kfused-varlen", ms_p50=1.0),
            dict(shape={"p": 1}, mode="fwd+bwd", provider="kfused-padded", ms_p50=4.0),
            dict(shape={"z": 1}, mode="fwd", provider="eager", ms_p50=1.0)]
    add_ratios(rows)
    got = [(r["provider"], r.get("ratio_to_floor"), r.get("ratio_baseline")) for r in rows]
    assert got == [("sdpa", 1.0, "sdpa"), ("kfused-triton", 1.5, "sdpa"),
                   ("floor", 1.0, "floor"), ("sdpa", 9.0, "floor"),
                   ("kfused-triton", 1.5, "floor"), ("kfused-varlen", 0.25, "kfused-padded"),
                   ("kfused-padded", 1.0, "kfused-padded"), ("eager", None, None)]


def test_bench_e2e_ratios_against_the_frozen_model():
    # the e2e family's baseline (its cost floor, "frozen-floor") was not one of the ratio
    # baselines: every e2e row had no ratio and the table's "x base" column read nan
    from kfused.cli.bench import add_ratios

    rows = [dict(shape={"t": 1}, mode="fwd", provider="frozen-floor", ms_p50=2.0),
            dict(shape={"t": 1}, mode="fwd", provider="peft-lora", ms_p50=3.0)]
    add_ratios(rows)
    assert [(r["ratio_to_floor"], r["ratio_baseline"]) for r in rows] == \
        [(1.0, "frozen-floor"), (1.5, "frozen-floor")]


def test_old_triton_interpreter_with_new_numpy_is_refused_by_name(monkeypatch):
    # Triton < 3.7's CPU interpreter calls int() on a one-element array for every runtime
    # loop bound, an error from numpy 2.4 on (seen with triton 3.6.0 + numpy 2.4.6: every
    # kernel with a loop failed inside the interpreter). The backend check says so instead.
    import numpy
    import triton

    from kfused import backends

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = torch.device("cpu")
    for tv, nv, refused in [("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False),
                            ("3.7.0", "2.4.6", False), ("3.5.1", "2.5.0", True)]:
        monkeypatch.setattr(triton, "__version__", tv)
        monkeypatch.setattr(numpy, "__version__", nv)
        monkeypatch.setattr(backends, "_INTERPRETER_CHECK", [])
        reason = backends.triton_unfit(cpu, torch.float32)
        assert (reason is not None) == refused, (tv, nv, reason)
        if refused:
            assert tv in reason and nv in reason and "numpy<2.4" in reason
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.6")
    monkeypatch.setattr(backends, "_INTERPRETER_CHECK", [])
    x, A, B = torch.randn(4, 6), torch.randn(2, 3), torch.randn(2, 2)
    with pytest.raises(kfused.BackendError, match="numpy<2.4"):
        kfused.kron_matvec(x, A, B, backend="triton")
    # the reference backend is not affected
    kfused.kron_matvec(x, A, B, backend="reference")


@pytest.mark.parametrize("value", ["false", "off", "no", "2", "0", ""])
def test_triton_interpret_off_as_triton_reads_it(monkeypatch, value):
    """TRITON_INTERPRET=false leaves Triton's interpreter off, but kfused read every value
    other than "" and "0" as on: backend="triton" took CPU tensors and failed inside Triton
    ("0 active drivers"), not with a BackendError saying why."""
    from kfused import backends

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert backends.triton_interpret() is False
    x, A, B = torch.randn(4, 6), torch.randn(2, 3), torch.randn(2, 2)
    with pytest.raises(kfused.BackendError, match="TRITON_INTERPRET=1"):
        kfused.kron_matvec(x, A, B, backend="triton")


def test_triton_interpret_on_as_triton_reads_it(monkeypatch):
    import triton

    from kfused import backends

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backends.triton_interpret() is True
    if hasattr(triton, "knobs"):    # Triton >= 3.4 also takes true / yes / on
        for value in ("true", "ON", "yes"):
            monkeypatch.setenv("TRITON_INTERPRET", value)
            assert backends.triton_interpret() is bool(triton.knobs.runtime.interpret) is True


def test_kfused_poison_reads_its_flag_as_triton_reads_its_own():
    # KFUSED_POISON=false turned poisoning on (every value but "" and "0" did)
    import subprocess

    code = ("import importlib, os, kfused._alloc as a\n"
            "for v in ['1', 'true', 'ON', '0', 'false', 'off', '']:\n"
            "    os.environ['KFUSED_POISON'] = v\n"
            "    print(importlib.reload(a).poisoning())\n")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=ROOT),
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True"] * 3 + ["False"] * 4


@pytest.mark.parametrize("method", ["kernel_mix", "kernel_wise_lite", "krona"])
def test_set_exact_reaches_every_folding_op(method, monkeypatch):
    """kfused.integration.set_exact: the injected modules pass it to every op that can fold
    its update into the frozen weight (q|k|v / single projection, output projection, KronA);
    None again restores each op's own rule; anything else is refused."""
    import importlib

    from kfused.integration import set_exact

    seen = []
    for mod, fn in (("kfused.ops.headwise_qkv", "headwise_qkv"),
                    ("kfused.ops.headwise_projection", "headwise_projection"),
                    ("kfused.ops.headwise_oproj", "headwise_oproj"),
                    ("kfused.ops.krona_linear", "krona_linear")):
        real = getattr(importlib.import_module(mod), fn)

        def spy(*a, _real=real, _fn=fn, **kw):
            seen.append((_fn, kw.get("exact")))
            return _real(*a, **kw)

        for where in ("kfused.modules.headwise", "kfused.modules.krona"):
            m = importlib.import_module(where)
            if hasattr(m, fn):
                monkeypatch.setattr(m, fn, spy)
    model = _gpt2()
    inject(model, AdapterConfig(method=method, r=2, backend="reference"))
    ids = torch.randint(0, 50, (2, 8))
    for exact in (True, False, None):
        seen.clear()
        set_exact(model, exact)
        model(input_ids=ids)
        assert seen and all(e is exact for _, e in seen), seen
    with pytest.raises(TypeError, match="exact must be True, False or None"):
        set_exact(model, "yes")


@pytest.mark.slow
def test_harness_replays_the_backward_of_any_compiled_baseline(monkeypatch):
    """measure() turns buffer donation off itself: the KronA and headwise torch.compile
    baselines (GPU-only providers) would otherwise lose their rows to the replayed backward
    exactly as the inducer's did (torch from 2.6 refused retain_graph on a donating
    backward; the torch 2.13 here no longer raises, the GPU machine's 2.11 may: so the switch
    itself is checked); a fresh compiled function on the CPU stands in for the baselines."""
    from kfused.bench import BenchCase, Provider, measure

    import torch._functorch.config as cfg

    if not hasattr(cfg, "donated_buffer"):
        pytest.skip("this torch never donates buffers")
    monkeypatch.setattr(cfg, "donated_buffer", True)

    def ref(x, w):   # a fresh function: no graph of it is cached yet
        return torch.tanh(x @ w).square() * 0.5

    def make():
        x = torch.randn(64, 32, requires_grad=True)
        w = torch.randn(32, 16, requires_grad=True)
        fn = torch.compile(ref)
        return (lambda: fn(x, w)), [x, w]

    case = BenchCase("stand_in", {"T": 64}, torch.float32, [Provider("compile", make)])
    rows = measure(case, "cpu", rep_ms=5, warmup_ms=1, modes=("bwd", "fwd+bwd"))
    assert [r.get("mode") for r in rows] == ["bwd", "fwd+bwd"], rows
    assert all("ms_p50" in r for r in rows), rows
    assert cfg.donated_buffer is False


def test_files_that_appear_during_a_run_are_never_replaced(tmp_path, capsys):
    # the output names were checked before a long run (demo: the training; bench: every
    # case) and written after it whatever stood there by then: a demo.json made meanwhile was
    # replaced, a link at the plot's name written through
    import json

    from kfused import _files
    from kfused.cli import bench, demo

    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (tmp_path / "link.png").symlink_to(victim)
    (tmp_path / "taken.png").write_text("mine")
    assert not _files.write_new(tmp_path / "link.png", lambda tmp: open(tmp, "w").write("x"))
    assert not _files.write_new(tmp_path / "taken.png", lambda tmp: open(tmp, "w").write("x"))
    assert _files.write_new(tmp_path / "free.png", lambda tmp: open(tmp, "w").write("x"))
    assert victim.read_text() == "mine" and (tmp_path / "taken.png").read_text() == "mine"
    assert (tmp_path / "free.png").read_text() == "x"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]   # no temporary left

    out = tmp_path / "demo_out"
    out.mkdir()
    assert demo._report_paths(str(out)) == (str(out / "demo.json"), str(out / "demo.png"))
    (out / "demo.json").write_text("USER")             # appeared during the training
    assert demo._report_paths(str(out)) == (str(out / "demo-2.json"), str(out / "demo-2.png"))
    assert "not overwriting it" in capsys.readouterr().out

    pytest.importorskip("matplotlib")                 # (the plot part: bench's [bench] extra)
    rows = [{"op": "krona_linear", "shape": {"T": 1}, "dtype": "float32", "provider": "floor",
             "mode": "fwd", "ms_p50": 1.0, "ms_p20": 0.9, "ms_p80": 1.1}]
    js = tmp_path / "krona.json"
    js.write_text(json.dumps({"meta": {"device": "cpu"}, "rows": rows}))
    (tmp_path / "krona.png").symlink_to(victim)
    assert bench.plot_results(js) is None and victim.read_text() == "mine"
    (tmp_path / "krona.png").unlink()
    assert bench.plot_results(js) == tmp_path / "krona.png"


def test_available_backends_names_a_cuda_device_this_machine_lacks(monkeypatch):
    """``available_backends`` asked for a CUDA device by name (its default) on a machine
    without one: with the CUDA extension built (a CUDA build of torch, no GPU or driver: found
    rehearsing the GPU machine's torch 2.11 here) the extension's architecture check raised
    torch's "Found no NVIDIA driver" — at import of tests/test_krona.py, whose skip condition
    asks — and Triton was reported usable. Now both fused backends give the reason."""
    import types

    from kfused import available_backends, backends, cuda as kcuda

    fn = lambda *a, **k: None  # noqa: E731
    ext = types.SimpleNamespace(CUDA_ARCHS=(90,), **{
        f"{op}_{d}": fn for op in ("kron_matvec", "headwise_lowrank") for d in ("fwd", "bwd")},
        krona_fold_fwd=fn, inducer_attention_fwd=fn)
    monkeypatch.setattr(kcuda, "_LOADED", [(ext, None)])
    monkeypatch.setattr(backends, "_ARCH_UNFIT", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    got = available_backends("kron_matvec")
    assert "no CUDA device is available" in got["cuda"]
    assert got["triton"] is not None and got["reference"] is None
    if backends._triton_import_error() is None:
        assert "no CUDA device is available" in got["triton"]
    # a device index past the machine's devices
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    got = available_backends("krona_linear", "cuda:3")
    assert "cuda:3 does not exist: this machine has 1 CUDA device(s)" in got["cuda"]
    assert "cuda:3 does not exist" in (got["triton"] or "") or \
        backends._triton_import_error() is not None

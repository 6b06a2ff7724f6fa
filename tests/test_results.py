"""`kfused results`: measured bench rows against the issues' targets (RESULTS.md)."""

import json
import math
import os

import pytest
import torch

from kfused import results
from kfused.cli import results as cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PERF_LATEST = os.path.join(ROOT, "benchmarks", "results", "predicted", "perf-latest.json")

QKV = {"width": "gpt2-small", "preset": "kernel-mix-qvo-intermediate", "tokens": 16384, "d": 768,
       "heads": 12, "kv_heads": 12, "head_dim": 64, "adapter_params": 74496,
       "peft_lora_rank": 24}
KRONA = {"T": 16384, "d_in": 768, "d_out": 768, "factors": "sqrt", "A": [24, 24],
         "B": [32, 32]}
DECODE = {"B": 8, "H": 32, "H_kv": 32, "n_q": 1, "n_k": 4096, "p": 128, "decode": True,
          "L": 4, "r": 8, "composition": "add"}


def _prefill(n):
    return {"B": max(1, 16384 // n), "H": 32, "n": n, "p": 64, "causal": True, "L": 4, "r": 8,
            "composition": "add"}


def _row(op, shape, provider, mode, ms):
    return {"op": op, "shape": shape, "dtype": "bfloat16", "provider": provider, "mode": mode,
            "ms_p20": ms * 0.99, "ms_p50": ms, "ms_p80": ms * 1.01}


META = {"device": "NVIDIA H100 80GB HBM3", "driver": "550.54", "cuda": "12.8", "torch": "2.11.0",
        "triton": "3.6.0", "git_commit": "0123456789abcdef",
        "ceilings": {"d2d_copy_GBps": 2950.0, "bf16_matmul_8192_TFLOPs": 770.0}}


def _rows():
    return [
        _row("headwise_qkv", QKV, "floor", "fwd+bwd", 0.160),
        _row("headwise_qkv", QKV, "kfused-triton", "fwd+bwd", 0.240),     # 1.5x: not met
        _row("headwise_qkv", QKV, "peft-lora", "fwd+bwd", 0.480),         # 0.5x: met
        _row("headwise_qkv", QKV, "floor", "fwd", 0.05),                  # fwd: no qkv target
        _row("headwise_qkv", QKV, "kfused-triton", "fwd", 0.5),
        _row("krona_linear", KRONA, "floor", "fwd+bwd", 0.060),
        _row("krona_linear", KRONA, "kfused-triton", "fwd+bwd", 0.0688),  # 1.147x: met
        _row("krona_linear", KRONA, "kron-dense", "fwd+bwd", 0.100),      # 0.69x: not met
        _row("krona_linear", {**KRONA, "T": 4096}, "floor", "fwd+bwd", 0.02),
        _row("krona_linear", {**KRONA, "T": 4096}, "kfused-triton", "fwd+bwd", 0.02),
        {"op": "krona_linear", "shape": KRONA, "dtype": "bfloat16", "provider": "compile",
         "mode": "all", "skipped": "torch.compile timed on CUDA only"},
        {"op": "krona_linear", "shape": KRONA, "dtype": "bfloat16", "provider": "kfused-cuda",
         "mode": "all", "error": "RuntimeError: boom"},
        _row("inducer_attention", DECODE, "kfused-triton", "fwd", 0.180),
        _row("inducer_attention", DECODE, "sdpa", "fwd", 0.180),          # tie: met (≤ 1)
        _row("inducer_attention", DECODE, "kfused-cuda", "fwd", 0.200),   # 0.9x: not faster
        _row("inducer_attention", _prefill(512), "kfused-triton", "fwd+bwd", 0.9),
        _row("inducer_attention", _prefill(512), "sdpa", "fwd+bwd", 0.3),     # n < 2048: none
        _row("inducer_attention", _prefill(512), "flex", "fwd+bwd", 1.0),     # 0.9x: not met
        _row("inducer_attention", _prefill(2048), "kfused-triton", "fwd+bwd", 2.2),
        _row("inducer_attention", _prefill(2048), "sdpa", "fwd+bwd", 2.0),    # 1.1x ≤ 1/0.85
    ]


def _by(entries, op, baseline, n=None):
    out = [e for e in entries if e["op"] == op and e["baseline"] == baseline
           and (n is None or e["shape"].get("n") == n)]
    assert len(out) == 1, (op, baseline, n, out)
    return out[0]


def test_evaluate_ratios_limits_and_what_was_not_measured():
    ev = results.evaluate(_rows())
    e = _by(ev, "headwise_qkv", "floor")
    assert e["ratio"] == pytest.approx(1.5) and e["met"] is False
    assert _by(ev, "headwise_qkv", "peft-lora")["met"] is True
    assert all(e["mode"] == "fwd+bwd" for e in ev if e["op"] == "headwise_qkv")
    big = [e for e in ev if e["op"] == "krona_linear" and e["shape"]["T"] == 16384]
    assert _by(big, "krona_linear", "floor")["met"] is True          # 1.147 ≤ 1.15
    assert _by(big, "krona_linear", "kron-dense")["met"] is False    # 0.69 > 0.5
    assert "skipped: torch.compile" in _by(big, "krona_linear", "compile")["missing"]
    assert "failed: RuntimeError: boom" in _by(big, "krona_linear", "kfused-cuda")["missing"]
    assert "met" not in _by(big, "krona_linear", "compile")
    dec = [e for e in ev if e["op"] == "inducer_attention" and e["shape"].get("decode")]
    assert {(e["baseline"], e["met"]) for e in dec} == {("sdpa", True), ("kfused-cuda", False)}
    assert all(e["mode"] == "fwd" for e in dec)
    # the SDPA target covers n ≥ 2048 only; FlexAttention every prefill length
    assert [e["shape"]["n"] for e in ev if e["baseline"] == "sdpa" and not
            e["shape"].get("decode")] == [2048]
    assert _by(ev, "inducer_attention", "flex", 512)["met"] is False
    assert _by(ev, "inducer_attention", "sdpa", 2048)["met"] is True


def test_rules_hold_the_limits_the_performance_model_predicts_against():
    """RESULTS.md and `kfused perf` judge the same targets: every (issue, baseline, limits) a
    model case carries is a rule of its op here (flash-varlen and sdpa-padded are model-only
    baselines: the GPU run has no flash-attn package, and pads with kfused)."""
    from kfused.perf.cases import all_cases

    rules = {(r.op, r.issue, r.baseline, round(r.max_ratio, 6),
              None if r.min_ratio is None else round(r.min_ratio, 6)) for r in results.RULES}
    n = 0
    for case in all_cases():
        for t in case.targets:
            if t.baseline in ("flash-varlen", "sdpa-padded"):
                continue
            key = (case.op, t.issue, t.baseline, round(t.max_ratio, 6),
                   None if t.min_ratio is None else round(t.min_ratio, 6))
            assert key in rules, key
            n += 1
    assert n > 30


def test_render_puts_predicted_beside_measured_from_the_model_json():
    pred = results.load_predicted(PERF_LATEST)
    text = results.render([{"path": "/x/headwise.json", "meta": META, "rows": _rows()}], pred,
                          "perf-latest.json")
    assert text.splitlines()[0] == results.MARKER
    assert "| headwise.json | NVIDIA H100 80GB HBM3 | 550.54 | 12.8 | 2.11.0 | 3.6.0 | " \
           "0123456789ab | 2950 | 770 | False | True |" in text
    ev = results.evaluate(_rows())
    n_met = sum(e.get("met") is True for e in ev)
    n_not = sum(e.get("met") is False for e in ev)
    n_missing = sum("missing" in e for e in ev)
    assert f"**{n_met} met, {n_not} not met, {n_missing} not measured.**" in text
    with open(PERF_LATEST) as f:
        model = json.load(f)
    assert "Not a GPU run" not in text
    assert f"(`perf-latest.json`, predicted at commit {model['versions']['commit'][:12]})" in text
    case = next(c for c in model["cases"] if c["op"] == "headwise_qkv"
                and c["shape"]["width"] == "gpt2-small"
                and c["shape"]["preset"] == "kernel-mix-qvo-intermediate")
    ratio = next(t["predicted_ratio"] for t in case["targets"] if t["baseline"] == "floor")
    line = next(ln for ln in text.splitlines() if ln.startswith("| #12 | headwise_qkv")
                and "kfused-triton vs floor" in ln)
    assert line.endswith(f"| 1.50x | ≤ 1.25 | **NO** | — | {ratio:.2f}x |")  # no graph timing
    p_us = case["predicted_t_s"] * 1e6
    timing = next(ln for ln in text.splitlines() if ln.startswith("| headwise_qkv |")
                  and "| fwd+bwd | kfused-triton |" in ln)
    assert f"| {p_us:.1f} µs | 240.0 µs | {240.0 / p_us:.2f} | " in timing
    # a case the model has no counterpart of gets no predicted ratio
    line = next(ln for ln in text.splitlines() if "flex" in ln and "n=512" in ln)
    assert line.endswith("| **NO** | — |") or "| **NO** | " in line


def test_a_run_on_another_device_than_the_model_says_so():
    """The committed prediction models an H100; a run measured on an H200 gets a line saying
    predicted against measured compares different devices; an H100 run does not."""
    pred = results.load_predicted(PERF_LATEST)
    assert pred.device == "h100"
    h200 = dict(META, device="NVIDIA H200")
    text = results.render([{"path": "/x/k.json", "meta": h200, "rows": _rows()}], pred, "p.json")
    assert "**The prediction models an H100 SXM5; measured on NVIDIA H200:**" in text
    assert "kfused perf --device" in text
    text = results.render([{"path": "/x/k.json", "meta": META, "rows": _rows()}], pred, "p.json")
    assert "The prediction models" not in text
    pred.device = "h200"
    text = results.render([{"path": "/x/k.json", "meta": h200, "rows": _rows()}], pred, "p.json")
    assert "The prediction models" not in text


def test_the_model_predicts_memory_bound_work_faster_on_an_h200():
    from kfused.perf import roofline as R

    assert R.device_key("NVIDIA H200") == "h200" and R.device_key("NVIDIA H100 80GB HBM3") \
        == "h100" and R.device_key("NVIDIA A100-SXM4-80GB") is None
    work = {"hbm_bytes": 3e9}
    try:
        t100 = R.predict(work, {}, 1000, 2)["t"]
        R.use_device("h200")
        assert R.CONSTANTS["DEVICE"] == "h200" and R.HBM_BW == 4.3e12
        t200 = R.predict(work, {}, 1000, 2)["t"]
        assert t200 < t100 and abs((t100 - R.KERNEL_OVERHEAD_S) / (t200 - R.KERNEL_OVERHEAD_S)
                                   - 4.3 / 3.0) < 1e-9
        with pytest.raises(ValueError, match="h100, h200"):
            R.use_device("a100")
    finally:
        R.use_device("h100")
    assert R.HBM_BW == 3.0e12 and R.CONSTANTS["DEVICE"] == "h100"


def test_cli_writes_refuses_foreign_files_and_replaces_its_own(tmp_path, capsys):
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "headwise_x.json").write_text(json.dumps({"meta": META, "rows": _rows()}))
    (bench / "backend_prefs.json").write_text(json.dumps({"written_by": "x", "devices": {}}))
    out = tmp_path / "RESULTS.md"
    assert cli.run([str(bench), "--predicted", PERF_LATEST, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"wrote {out}: ") and err.rstrip().endswith("not measured.")
    first = out.read_text()
    assert first.startswith(results.MARKER) and "headwise_x.json" in first
    assert "backend_prefs" not in first
    assert cli.run([str(bench), "--out", str(out)]) == 0            # its own file: replaced
    assert "predicted" in out.read_text() and out.read_text() != first
    foreign = tmp_path / "notes.md"
    foreign.write_text("mine\n")
    with pytest.raises(SystemExit):
        cli.run([str(bench), "--out", str(foreign)])
    assert foreign.read_text() == "mine\n"
    assert "was not written by `kfused results`" in capsys.readouterr().err
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"meta": {}, "rows": [{"op": "krona_linear", "ms_p50": 1.0}]}))
    cases = tmp_path / "cases.json"
    cases.write_text(json.dumps({"cases": [{"label": "x"}]}))
    for argv, msg in (([str(odd)], "row 0 is not a `kfused bench` row"),
                      ([str(bench), "--predicted", str(cases)], "case 0 has no op and shape"),
                      ([str(bench), "--out", str(tmp_path)], "is a directory"),
                      ([str(tmp_path / "missing")], "does not exist"),
                      ([str(bench / "backend_prefs.json")], "no `kfused bench` JSON"),
                      ([str(tmp_path / "RESULTS.md")], "RESULTS.md is not readable JSON"),
                      ([str(bench), "--predicted", str(bench / "headwise_x.json")],
                       "not a `kfused perf --json` file")):
        with pytest.raises(SystemExit):
            cli.run(argv)
        assert msg in capsys.readouterr().err


def test_results_of_a_real_cpu_bench_run(tmp_path, monkeypatch, capsys):
    """The JSON `kfused bench` writes is what `kfused results` reads (CPU-sized headwise
    cases: the ratios mean nothing on a CPU, the pipeline is what is checked)."""
    import kfused.cases
    from kfused.cli import bench

    cases = [c for c in kfused.cases.bench_cases("headwise", "cpu", torch.float32, quick=True)
             if c.op == "headwise_oproj"]
    assert cases
    for c in cases:
        c.providers = [p for p in c.providers if p.name in ("floor", "kfused-triton", "eager")]
    monkeypatch.setattr(kfused.cases, "bench_cases", lambda *a, **k: cases)
    assert bench.run(["headwise", "--device", "cpu", "--no-plot", "--rep-ms", "1",
                      "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    text = results.render(results.load_runs([tmp_path]))
    line = next(ln for ln in text.splitlines() if ln.startswith("| #12 | headwise_oproj")
                and "kfused-triton vs floor" in ln)
    ratio = float(line.split("|")[7].strip().rstrip("x"))
    assert math.isfinite(ratio) and ratio > 0
    assert "kfused-triton vs peft-lora | no fwd+bwd measurement of peft-lora" in text
    assert "**Not a GPU run (headwise_" in text


def test_per_kernel_device_times_against_the_model():
    """kernel_events keeps device-side events only (per call); kernel_rows matches them to
    the model's launches by name (a compiled name may carry a suffix) and sets the rest
    against the model's torch glue; render prints the table for a profiled row."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval

    from kfused.bench import kernel_events

    def ev(name, dev, us):
        return SimpleNamespace(name=name, device_type=dev, time_range=Interval(5, 5 + us))

    events = [ev("_gemm_kernel", DeviceType.CUDA, 30), ev("_gemm_kernel", DeviceType.CUDA, 36),
              ev("_gemm_kernel", DeviceType.CUDA, 28), ev("_gemm_kernel", DeviceType.CUDA, 34),
              ev("aten::mm", DeviceType.CPU, 100), ev("cudaLaunchKernel", DeviceType.CPU, 3),
              ev("sm90_xmma_gemm_bf16bf16", DeviceType.CUDA, 60),
              ev("_oproj_fold_kernel_0d1d2d", DeviceType.CUDA, 12)]
    k = kernel_events(events, calls=2)
    assert set(k) == {"_gemm_kernel", "sm90_xmma_gemm_bf16bf16", "_oproj_fold_kernel_0d1d2d"}
    assert k["_gemm_kernel"] == {"us": pytest.approx(64.0), "launches": pytest.approx(2.0)}
    # one record in two calls: a dropped first record, read as one launch per call
    assert k["sm90_xmma_gemm_bf16bf16"] == {"us": pytest.approx(60.0),
                                            "launches": pytest.approx(1.0)}
    assert kernel_events(events[:3], calls=2)["_gemm_kernel"] == {
        "us": pytest.approx(2 * 94 / 3), "launches": pytest.approx(2.0)}

    with open(PERF_LATEST) as f:
        model = json.load(f)
    case = next(c for c in model["cases"] if c["op"] == "headwise_oproj"
                and c["shape"]["width"] == "gpt2-small")
    rows = {r[0]: r for r in results.kernel_rows(case, k)}
    # the folded output projection's GEMMs are cuBLAS's since the H200 run (2026-11-30): a
    # measured kfused kernel the model no longer has keeps its own row, predicted 0
    assert not any(x["kernel"] == "_gemm_kernel" for x in case["kernels"])
    assert rows["_gemm_kernel"][1:] == (0, pytest.approx(2.0), 0.0, pytest.approx(64.0))
    folds = [x for x in case["kernels"] if x["kernel"] == "_oproj_fold_kernel"]
    fold_pred = sum(x["predicted"]["t"] for x in folds) * 1e6
    assert folds   # (one: the forward keeps its folded operands at 16k tokens)
    assert rows["_oproj_fold_kernel"][1:] == (len(folds), pytest.approx(1.0),
                                              pytest.approx(fold_pred), pytest.approx(12.0))
    glue = rows["other (torch glue, cuBLAS)"]
    assert glue[4] == pytest.approx(60.0)
    assert glue[3] == pytest.approx(case["glue"]["t_s"] * 1e6)
    assert rows["_oproj_pack_kernel"][2] == 0 and rows["_oproj_pack_kernel"][4] == 0.0

    shape = {"width": "gpt2-small", "preset": "kernel-mix-qvo-intermediate", "tokens": 16384,
             "d": 768, "heads": 12, "head_dim": 64, "adapter_params": 92928,
             "peft_lora_rank": 60}
    row = _row("headwise_oproj", shape, "kfused-triton", "fwd+bwd", 0.11)
    row["kernels"] = k
    text = results.render([{"path": "o.json", "meta": META, "rows": [
        row, _row("headwise_oproj", shape, "floor", "fwd+bwd", 0.055)]}],
        results.load_predicted(PERF_LATEST))
    sec = text.split("## Predicted against measured per kernel", 1)[1]
    assert "**headwise_oproj " in sec and "fwd+bwd, kfused-triton**" in sec
    line = next(ln for ln in sec.splitlines() if ln.startswith("| _gemm_kernel |"))
    assert line == "| _gemm_kernel | 0 | 2 | 0.0 µs | 64.0 µs | — |"
    # predicted but never launched in the measured run (the pack kernel is not in k): "not
    # run", not a 0 µs kernel with a 0.00 ratio
    pack_pred = sum(x["predicted"]["t"] for x in case["kernels"]
                    if x["kernel"] == "_oproj_pack_kernel") * 1e6
    line = next(ln for ln in sec.splitlines() if ln.startswith("| _oproj_pack_kernel |"))
    assert line.endswith(f"| 0 | {pack_pred:.1f} µs | not run | — |"), line


def test_bench_time_limit_keeps_every_measured_case_and_says_which_did_not_run(
        tmp_path, monkeypatch, capsys):
    """--time-limit: no case starts after it; the JSON is rewritten after every case (a run
    killed from outside keeps what it measured) and ends "complete"; cases not run are rows
    that say so, and `kfused results` reports their targets as not measured."""
    import kfused.bench
    import kfused.cases
    from kfused.bench import BenchCase, Provider
    from kfused.cli import bench

    clock = {"t": 0.0}
    monkeypatch.setattr(bench.time, "monotonic", lambda: clock["t"])
    seen = []

    def fake_measure(case, device, **kw):
        clock["t"] += 40.0                       # each case "takes" 40 s
        files = sorted(tmp_path.glob("headwise_*.json"))
        seen.append([json.loads(f.read_text())["meta"]["complete"] for f in files])
        return [_row(case.op, case.shape, p.name, "fwd+bwd", 0.1 + 0.1 * i)
                for i, p in enumerate(case.providers)]

    shapes = [dict(QKV, tokens=t) for t in (1024, 2048, 4096)]
    cases = [BenchCase("headwise_qkv", sh, torch.float32,
                       [Provider("floor", None), Provider("kfused-triton", None)])
             for sh in shapes]
    monkeypatch.setattr(kfused.cases, "bench_cases", lambda *a, **k: cases)
    monkeypatch.setattr(kfused.bench, "measure", fake_measure)
    assert bench.run(["headwise", "--device", "cpu", "--no-plot", "--time-limit", "50",
                      "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    assert seen == [[], [False]]                 # written after case 1; case 3 never started
    (f,) = tmp_path.glob("headwise_*.json")
    data = json.loads(f.read_text())
    assert data["meta"]["complete"] is True
    measured = [r for r in data["rows"] if "ms_p50" in r]
    assert len(measured) == 4
    assert all(r["ratio_to_floor"] == pytest.approx(2.0) for r in measured
               if r["provider"] == "kfused-triton")
    left = [r for r in data["rows"] if "skipped" in r]
    assert [r["shape"]["tokens"] for r in left] == [4096, 4096]
    assert all(r["skipped"] == "not run: --time-limit 50 s reached" for r in left)
    ev = [e for e in results.evaluate(data["rows"]) if e["shape"]["tokens"] == 4096]
    assert {e["baseline"] for e in ev} == {"floor", "peft-lora"}
    assert all(e["missing"].startswith("skipped: not run: --time-limit") for e in ev
               if e["baseline"] == "floor")


def test_bench_runs_the_shapes_the_model_predicts_first():
    """Under --time-limit the target shapes are measured first (the model's cases), the rest
    keep their order after them."""
    from types import SimpleNamespace

    from kfused.cli.bench import targets_first

    small = dict(KRONA, T=4096)
    odd = dict(KRONA, T=16384, A=[32, 24], B=[24, 32], factors="glue")
    cases = [SimpleNamespace(op="krona_linear", shape=s) for s in (small, odd, KRONA)]
    cases.append(SimpleNamespace(op="headwise_qkv", shape=QKV))
    order = targets_first(cases)
    assert [c.shape for c in order] == [KRONA, QKV, small, odd]


def test_krona_exact_path_is_timed_against_its_own_prediction():
    """No target holds KronA's exact path, but the model predicts it (its own kernels): the
    measured row gets a time row and, profiled, a per-kernel table against the exact case,
    not the folded one."""
    with open(PERF_LATEST) as f:
        model = json.load(f)
    exact = next(c for c in model["cases"] if c["op"] == "krona_linear"
                 and c["shape"]["path"] == "exact" and c["shape"]["A"] == [24, 24]
                 and c["shape"]["d_out"] == 768)
    row = _row("krona_linear", KRONA, "kfused-triton-exact", "fwd+bwd", 0.125)
    name = exact["kernels"][0]["kernel"]
    row["kernels"] = {name: {"us": 50.0, "launches": 1.0}}
    text = results.render([{"path": "k.json", "meta": META, "rows": [row]}],
                          results.load_predicted(PERF_LATEST))
    p_us = exact["predicted_t_s"] * 1e6
    line = next(ln for ln in text.splitlines() if "| kfused-triton-exact |" in ln)
    # the device column: the kernel sum (no graph timing in this row)
    assert line.endswith(f"| {p_us:.1f} µs | 125.0 µs | {125.0 / p_us:.2f} | 50.0 µs (kernels) "
                         f"| {50.0 / p_us:.2f} |")
    assert "fwd+bwd, kfused-triton-exact**" in text
    assert f"| {name} |" in text.split("per kernel", 1)[1]


def test_every_rule_names_providers_the_benchmarks_have():
    """A rule whose subject or baseline no benchmark case provides would read "not measured"
    on every GPU run: each names a provider of its op's cases (flash-varlen is the model's
    baseline only: the GPU machine has no flash-attn package)."""
    import kfused.cases

    provided = {}
    for fam in kfused.cases.BENCH_FAMILIES:
        for case in kfused.cases.bench_cases(fam, "cpu", torch.float32, quick=True):
            provided.setdefault(case.op, set()).update(p.name for p in case.providers)
    for r in results.RULES:
        assert r.subject in provided[r.op], (r.op, r.subject)
        assert r.baseline in provided[r.op] or r.baseline == "flash-varlen", (r.op, r.baseline)


def test_cuda_graph_ratio_sits_beside_the_eager_one():
    """A row pair with CUDA-graph times (kfused.bench.graph_timer) gets the device-bound ratio
    and its own verdict beside the eager one; a pair where either lacks it shows a dash."""
    rows = _rows()
    for r in rows:
        if r.get("mode") == "fwd+bwd" and "ms_p50" in r:
            r["graph_ms_p50"] = r["ms_p50"] * (0.5 if r["provider"] == "kfused-triton" else 1.0)
    ev = [e for e in results.evaluate(rows) if "ratio" in e and e["mode"] == "fwd+bwd"]
    assert ev and all(abs(e["graph_ratio"] - e["ratio"] * (0.5 if e["subject"] ==
                      "kfused-triton" else 1.0)) < 1e-12 for e in ev)
    assert all(e["graph_met"] == e["rule"].met(e["graph_ratio"]) for e in ev)
    text = results.render([{"path": "/x/headwise.json", "meta": META, "rows": rows}])
    line = next(ln for ln in text.splitlines() if ln.startswith("| #12 | headwise_qkv")
                and "kfused-triton vs floor" in ln)
    assert "| 1.50x | ≤ 1.25 | **NO** | 0.75x yes |" in line


def test_bench_skip_records_the_providers_not_run(tmp_path, monkeypatch, capsys):
    """`kfused bench --skip eager`: the named providers are not run, their rows say so, the
    others are measured."""
    import kfused.cases
    from kfused.cli import bench

    cases = [c for c in kfused.cases.bench_cases("headwise", "cpu", torch.float32, quick=True)
             if c.op == "headwise_oproj"][:1]
    for c in cases:
        c.providers = [p for p in c.providers if p.name in ("floor", "eager")]
    monkeypatch.setattr(kfused.cases, "bench_cases", lambda *a, **k: cases)
    assert bench.run(["headwise", "--device", "cpu", "--no-plot", "--rep-ms", "1",
                      "--skip", "eager", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    (path,) = tmp_path.glob("*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["skipped"] for r in rows if r["provider"] == "eager"] == ["not run: --skip"]
    assert any("ms_p50" in r for r in rows if r["provider"] == "floor")


def test_bench_skip_refuses_a_name_no_selected_family_provides(tmp_path, monkeypatch, capsys):
    """`kfused bench --skip <misspelt>` was silently ignored and every provider ran: a usage
    error (exit 2) naming the known providers, before anything runs; a provider of any
    selected family is accepted."""
    import kfused.cases
    from kfused.cli import bench

    real = kfused.cases.bench_cases
    cases = {op: real(op, "cpu", torch.float32, quick=True) for op in ("krona", "headwise")}
    monkeypatch.setattr(kfused.cases, "bench_cases", lambda op, *a, **k: cases[op][:1])

    def no_run(*a, **k):
        raise AssertionError("reached the measurements")

    monkeypatch.setattr(bench, "device_ceilings", no_run)
    with pytest.raises(SystemExit) as exc:
        bench.run(["krona", "--device", "cpu", "--no-plot", "--skip", "eagr",
                   "--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --skip: no provider named eagr in krona; expected any of" in err
    assert "eager" in err and "kfused-triton" in err
    assert os.listdir(tmp_path) == []
    # a provider of either selected family is accepted (the run then reaches the device
    # ceilings, stopped there)
    krona, headwise = ({p.name for c in cases[op] for p in c.providers}
                       for op in ("krona", "headwise"))
    names = sorted(krona - headwise)[:1] + sorted(headwise - krona)[:1]
    assert len(names) == 2
    with pytest.raises(AssertionError, match="reached the measurements"):
        bench.run(["krona", "headwise", "--device", "cpu", "--no-plot", "--out",
                   str(tmp_path), "--skip", ",".join(names)])


def _bench_file(path, rows, meta=META):
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    return str(path)


def _usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.run(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_a_time_that_is_not_finite_and_positive_is_refused(tmp_path, capsys):
    """ms_p50 / graph_ms_p50 of 0, < 0, inf or NaN were taken as measurements (a
    ZeroDivisionError, or a target 'met' at -0.05x): the file and row are named, exit 2."""
    for i, (field, ms) in enumerate([("ms_p50", 0.0), ("ms_p50", -1.0),
                                     ("ms_p50", math.inf), ("ms_p50", math.nan),
                                     ("graph_ms_p50", 0.0)]):
        floor = _row("krona_linear", KRONA, "floor", "fwd+bwd", 0.06)
        floor[field] = ms
        f = _bench_file(tmp_path / f"t{i}.json", [
            _row("krona_linear", KRONA, "kfused-triton", "fwd+bwd", 0.05), floor])
        err = _usage_error([f], capsys)
        assert f"{f}: row 1 (krona_linear, floor, fwd+bwd) {field} is " in err, err
        assert "expected a finite positive time (ms)" in err


def test_malformed_bench_and_perf_fields_are_usage_errors(tmp_path, capsys):
    """A missing or mistyped field of a bench or perf JSON gave a traceback: each is a usage
    error naming the file and the field."""
    good = _bench_file(tmp_path / "good.json", [
        _row("krona_linear", KRONA, "floor", "fwd+bwd", 1.0),
        _row("krona_linear", KRONA, "kfused-triton", "fwd+bwd", 0.5)])
    no_ms = _row("krona_linear", KRONA, "kfused-triton", "fwd+bwd", 0.5)
    del no_ms["ms_p50"]
    ind = {"n": "big"}
    bench = {
        "row 0 (krona_linear, kfused-triton, fwd+bwd) has no ms_p50": ([no_ms], META),
        "meta.ceilings is [1, 2]": ([], {**META, "ceilings": [1, 2]}),
        "meta.ceilings.d2d_copy_GBps is \"fast\"": ([], {"ceilings": {"d2d_copy_GBps": "fast"}}),
        "graph_ms_p50 is \"x\"": ([{**no_ms, "ms_p50": 1.0, "graph_ms_p50": "x"}], META),
        "shape.n is \"big\", expected a number": (
            [_row("inducer_attention", ind, "sdpa", "fwd+bwd", 1.0)], META),
    }
    for i, (msg, (rows, meta)) in enumerate(bench.items()):
        f = _bench_file(tmp_path / f"b{i}.json", rows, meta)
        assert f"{f}: " in (err := _usage_error([f], capsys)) and msg in err, err
    case = {"op": "krona_linear", "shape": KRONA}
    perf = {"versions is [\"x\"]": {"cases": [], "versions": ["x"]},
            "versions.commit is 12345": {"cases": [], "versions": {"commit": 12345}},
            "case 0 (krona_linear) targets[0] is {\"issue\": 11}": {
                "cases": [{**case, "targets": [{"issue": 11}]}]}}
    for i, (msg, obj) in enumerate(perf.items()):
        f = tmp_path / f"p{i}.json"
        f.write_text(json.dumps(obj))
        err = _usage_error([good, "--predicted", str(f)], capsys)
        assert f"argument --predicted: {f}: {msg}" in err, err


def test_a_named_input_that_is_not_json_is_an_error_one_in_a_folder_is_said(tmp_path,
                                                                             capsys):
    """A bench JSON named on the command line that cannot be parsed was dropped without a
    word: a usage error naming it; one found in a folder is passed over, and the report and
    stderr say so."""
    text = json.dumps({"meta": META, "rows": _rows()})
    good = _bench_file(tmp_path / "a.json", _rows())
    (tmp_path / "b.json").write_text(text[: len(text) // 2])
    err = _usage_error([good, str(tmp_path / "b.json")], capsys)
    assert f"argument inputs: {tmp_path / 'b.json'} is not readable JSON" in err
    assert cli.run([str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert f"**Passed over: {tmp_path / 'b.json'} is not readable JSON" in out
    assert f"passed over {tmp_path / 'b.json'} is not readable JSON" in err


def test_a_file_named_twice_is_read_once(tmp_path, capsys):
    """DIR and DIR/run.json (or one file twice) read the file twice, every target counted
    twice: each file is read once (by its resolved path)."""
    f = _bench_file(tmp_path / "run.json", _rows())
    assert [r["path"] for r in results.load_runs([tmp_path, f, str(tmp_path / ".." /
                                                   tmp_path.name / "run.json")])] == [f]
    cli.run([str(tmp_path)])
    once = capsys.readouterr().out
    cli.run([str(tmp_path), f, f])
    assert capsys.readouterr().out == once


def test_a_run_whose_sdpa_was_not_pinned_to_flash_says_so():
    """The H100 run of 2026-11-27 timed "sdpa" on torch's own backend choice (cuDNN attention
    first on Hopper with torch 2.11 / cuDNN 9.19), not the flash backend the inducer targets
    name: a run without the bench's sdpa_pinned meta gets that said beside its verdicts; a
    run that has it, or has no sdpa rows, does not."""
    text = results.render([{"path": "/x/ind.json", "meta": META, "rows": _rows()}])
    assert "**ind.json: its `sdpa` rows timed SDPA on the backend torch chose" in text
    pinned = dict(META, sdpa_pinned="flash")
    text = results.render([{"path": "/x/ind.json", "meta": pinned, "rows": _rows()}])
    assert "backend torch chose" not in text
    no_sdpa = [r for r in _rows() if r["provider"] != "sdpa"]
    text = results.render([{"path": "/x/ind.json", "meta": META, "rows": no_sdpa}])
    assert "backend torch chose" not in text


def test_the_bench_pins_sdpa_to_the_flash_backend_and_records_it(monkeypatch):
    """Every inducer case's "sdpa" provider runs SDPA's flash backend (the baseline the
    targets and the performance model name) whatever torch would pick, "sdpa-default" runs
    torch's choice, and the bench JSON's meta says which backend "sdpa" was."""
    import kfused.cases
    from kfused.bench import SDPA_PINNED
    from kfused.cli.bench import environment

    from kfused.bench import COMPILE_CACHE

    meta = environment(torch.device("cpu"))
    assert meta["sdpa_pinned"] == SDPA_PINNED == "flash"
    assert meta["compile_cache"] == COMPILE_CACHE
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*a, **k):        # the backends SDPA may choose from at the call
        seen.append((torch.backends.cuda.flash_sdp_enabled(),
                     torch.backends.cuda.cudnn_sdp_enabled(),
                     torch.backends.cuda.mem_efficient_sdp_enabled(),
                     torch.backends.cuda.math_sdp_enabled()))
        return real(*a, **k)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    cases = [c for c in kfused.cases.bench_cases("inducer", "cpu", torch.float32, quick=True)
             if any(p.name == "sdpa" for p in c.providers)]
    assert len(cases) >= 5                                  # prefill (causal or not) + decode
    for case in cases:
        provs = {p.name: p for p in case.providers}
        assert "sdpa-default" in provs
        for name, want in (("sdpa", (True, False, False, False)), ("sdpa-default", None)):
            fn, _ = provs[name].make()
            seen.clear()
            fn()
            assert len(seen) == 1
            if want is not None:
                assert seen[0] == want, (case.shape, name, seen)
            else:
                assert seen[0] != (True, False, False, False), (case.shape, name)


def _compiled_cases(f, n):
    from kfused.bench import BenchCase, Provider

    def case(i):
        def mk(i=i):
            x = torch.randn(i + 1, 3)
            return (lambda: f(x)), []
        return BenchCase(op="t", shape={"i": i}, dtype=torch.float32,
                         providers=[Provider("compile", mk)])
    return [case(i) for i in range(n)]


def test_compiled_baselines_compile_for_every_case_not_past_dynamos_limit():
    """The 2026-11-27 H100 run's flex rows after its third inducer case timed the unfused eager
    fallback (flex_attention had hit Dynamo's recompile limit of 8 across cases: 36-99 ms for
    a ~3-5 ms kernel). Each measured case now starts from empty Dynamo caches: a function
    compiled once (static shapes) and timed over twelve shapes is compiled for every one."""
    import torch._dynamo.testing

    from kfused.bench import measure

    cnt = torch._dynamo.testing.CompileCounter()
    f = torch.compile(lambda x: x * 2 + 1, backend=cnt, dynamic=False)
    rows = [r for c in _compiled_cases(f, 12)
            for r in measure(c, "cpu", rep_ms=1, warmup_ms=1, modes=("fwd",))]
    assert [r.get("error") for r in rows] == [None] * 12
    assert cnt.frame_count >= 12          # stopped at 8 before: the rest ran uncompiled


def test_a_case_that_reaches_the_recompile_limit_is_an_error_not_an_eager_timing():
    """Within one case, a compiled baseline that Dynamo would stop compiling (the limit hit)
    fails its row, where it used to be timed running uncompiled."""
    from kfused.bench import BenchCase, Provider, measure

    f = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)

    def mk():
        xs = [torch.randn(i + 1, 3) for i in range(12)]
        return (lambda: [f(x) for x in xs][-1]), []

    rows = measure(BenchCase(op="t", shape={}, dtype=torch.float32,
                             providers=[Provider("compile", mk)]),
                   "cpu", rep_ms=1, warmup_ms=1, modes=("fwd",))
    assert len(rows) == 1 and "error" in rows[0], rows
    assert "limit" in rows[0]["error"].lower(), rows[0]["error"]


def test_a_run_whose_compiled_baselines_shared_a_cache_says_so():
    """A run without the bench's compile_cache meta that timed flex or compile rows gets the
    warning that later rows may be the uncompiled fallback; with the meta, or with no such
    rows, it does not."""
    rows = _rows()
    text = results.render([{"path": "/x/ind.json", "meta": META, "rows": rows}])
    assert "**ind.json: torch.compile baselines (`flex`, `compile`) shared" in text
    meta = dict(META, compile_cache="fresh per case; the recompile limit hit is an error")
    assert "shared one Dynamo cache" not in results.render(
        [{"path": "/x/ind.json", "meta": meta, "rows": rows}])
    plain = [r for r in rows if r["provider"] not in ("flex", "compile")]
    assert "shared one Dynamo cache" not in results.render(
        [{"path": "/x/ind.json", "meta": META, "rows": plain}])


def test_device_time_is_the_graph_replay_else_the_kernel_sum():
    # the model predicts device time: RESULTS.md sets it beside the graph replay or the
    # profiled kernels, not only beside the eager call (host-bound on the GPU machines)
    row = {"ms_p50": 2.0, "kernels": {"a": {"us": 300.0, "launches": 1.0},
                                      "b": {"us": 20.0, "launches": 2.0}}}
    assert results.device_ms(row) == (0.32, "kernels")
    assert results.device_ms(dict(row, graph_ms_p50=0.4)) == (0.4, "graph")
    assert results.device_ms({"ms_p50": 2.0}) == (None, "")

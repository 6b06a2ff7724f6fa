"""`kfused bench`: run the benchmark cases of each op family (``bench_cases(device, dtype,
quick)`` in :mod:`kfused.cases`) through the shared harness (exit status 1 when a provider
failed: its row holds the error, the others are still measured). Results go to
``<out>/<op>_<device>_<utc>.json`` (``-2``, ``-3``, ... before ``.json`` when that name or
its PNG is taken: an existing file is never overwritten; default
``benchmarks/results/local/`` of the source checkout, git-ignored;
``./kfused_bench_results/`` elsewhere) with the device, driver,
versions, git commit and the two device ceilings measured in the same run (a large
device-to-device copy and an 8192³ matmul), plus a PNG drawn from the JSON by
:func:`plot_results`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from kfused._files import (folder_refusal, new_results_file, replace_atomically,
                           write_new)
from kfused.bench import COMPILE_CACHE, SDPA_PINNED

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def repo_root() -> Optional[Path]:
    """The source checkout (editable install or a run from the repo), if any."""
    for cand in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (cand / "benchmarks").is_dir() and (cand / "kfused").is_dir():
            return cand
    return None


def default_out_dir() -> Path:
    root = repo_root()
    if root is None:
        return Path.cwd() / "kfused_bench_results"
    return root / "benchmarks" / "results" / "local"


def available_ops() -> List[str]:
    from kfused.cases import BENCH_FAMILIES

    return list(BENCH_FAMILIES)


def _git_commit() -> str:
    """The commit of the kfused that runs: the checkout this package was imported from (not
    the working directory's, which may be another checkout or none)."""
    named = os.environ.get("KFUSED_GIT_COMMIT")
    if named:
        # the caller names it: a copy of the tree whose .git is absent or not the tree's own
        # (the lent GPU machine's copy recorded the session's first commit, b378980, for a
        # tree at 488dbee)
        return named
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return "unknown"
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root,
                             capture_output=True, text=True, timeout=10)
        sha = out.stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) if sha else "unknown"
    except Exception:
        return "unknown"


def _driver() -> Optional[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 else None
    except Exception:
        return None


def _tuning_meta(device: torch.device) -> Dict[str, object]:
    """The kernel tuning table a run used (kfused.tuning): its path and its entries for this
    GPU model per kernel (the measured launch configurations the numbers depend on)."""
    from kfused import tuning

    path = tuning.table_path()
    out: Dict[str, object] = {"path": path}
    if path is None or device.type != "cuda":
        return out
    try:
        mine = tuning.load(path)["devices"].get(torch.cuda.get_device_name(device), {})
    except tuning.TuningError as exc:
        out["error"] = str(exc)
        return out
    out["entries"] = {k: [dict(key=e["key"], T=e["T"], config=e["config"]) for e in v]
                      for k, v in mine.items()}
    return out


def environment(device: torch.device) -> Dict[str, object]:
    meta: Dict[str, object] = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device_type": device.type,
        # the kfused settings a run's numbers depend on (unset: the defaults)
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KFUSED_")
                and k not in ("KFUSED_GIT_COMMIT",)},
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception:
        meta["triton"] = None
    meta["kernel_tuning"] = _tuning_meta(device)
    meta["sdpa_pinned"] = SDPA_PINNED      # the inducer cases' "sdpa" provider's backend
    meta["compile_cache"] = COMPILE_CACHE  # torch.compile baselines: see kfused.bench
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        meta.update(device=props.name, sm_count=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                    driver=_driver(), capability=f"{props.major}.{props.minor}")
    else:
        meta.update(device=platform.processor() or platform.machine(), cuda=None)
    return meta


def device_ceilings(device: torch.device) -> Dict[str, float]:
    """The two ceilings every kernel is judged against, measured now on this device."""
    if device.type != "cuda":
        return {}
    import triton.testing

    n = 1 << 30  # 1 GiB copy: far beyond L2
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
    copy_gbps = 2 * n / (ms * 1e-3) / 1e9
    del src, dst
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200)
    mm_tflops = 2 * 8192**3 / (ms * 1e-3) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return {"d2d_copy_GBps": copy_gbps, "bf16_matmul_8192_TFLOPs": mm_tflops}


# the baseline of a case's ratios: the first of these providers it has (krona and headwise:
# the frozen layer; inducer: SDPA; the packed-batch case: the same kernels on the padded batch;
# e2e: the frozen model's training step, its cost floor)
RATIO_BASELINES = ("floor", "sdpa", "kfused-padded", "frozen-floor")


def add_ratios(rows: List[dict], baselines=RATIO_BASELINES) -> None:
    """ratio_to_floor = ms_p50 / (the baseline provider's ms_p50 for the same shape and mode);
    ratio_baseline names that provider (the first of ``baselines`` measured for the case)."""
    base = {}
    for r in rows:
        if r.get("provider") in baselines and "ms_p50" in r:
            base.setdefault((json.dumps(r["shape"], sort_keys=True), r["mode"]), {})[
                r["provider"]] = r["ms_p50"]
    for r in rows:
        found = base.get((json.dumps(r.get("shape"), sort_keys=True), r.get("mode")), {})
        name = next((b for b in baselines if b in found), None)
        if "ms_p50" in r and name is not None:
            r["ratio_to_floor"] = r["ms_p50"] / found[name]
            r["ratio_baseline"] = name


def plot_results(json_path: Path, png_path: Optional[Path] = None) -> Optional[Path]:
    """Draw ms (p50, with p20–p80 bars) per provider for every shape and mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    data = json.loads(Path(json_path).read_text())
    rows = [r for r in data["rows"] if "ms_p50" in r]
    if not rows:
        return None
    modes = [m for m in ("fwd", "bwd", "fwd+bwd") if any(r["mode"] == m for r in rows)]
    shapes = sorted({json.dumps(r["shape"], sort_keys=True) for r in rows})
    providers = sorted({r["provider"] for r in rows})
    fig, axes = plt.subplots(len(modes), 1, figsize=(max(8, 1.6 * len(shapes)), 3.2 * len(modes)),
                             squeeze=False)
    width = 0.8 / max(1, len(providers))
    for ax, mode in zip(axes[:, 0], modes):
        for pi, prov in enumerate(providers):
            xs, ys, lo, hi = [], [], [], []
            for si, sh in enumerate(shapes):
                for r in rows:
                    if r["mode"] == mode and r["provider"] == prov and \
                            json.dumps(r["shape"], sort_keys=True) == sh:
                        xs.append(si + pi * width)
                        ys.append(r["ms_p50"])
                        lo.append(r["ms_p50"] - r["ms_p20"])
                        hi.append(r["ms_p80"] - r["ms_p50"])
            if xs:
                ax.bar(xs, ys, width, yerr=[lo, hi], label=prov)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))])
        ax.set_xticklabels([_short(json.loads(s)) for s in shapes], fontsize=7, rotation=15)
        ax.set_ylabel("ms (p50)")
        ax.set_title(f"{data['rows'][0]['op']} {mode} — {data['meta'].get('device')} "
                     f"({data['rows'][0]['dtype']})", fontsize=9)
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    png_path = Path(png_path) if png_path else Path(json_path).with_suffix(".png")
    # a new file only: one that appeared at that name during the run is not replaced
    made = write_new(png_path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    if not made:
        print(f"kfused bench: {png_path} appeared during the run; not replacing it (no plot)",
              file=sys.stderr)
        return None
    return png_path


def _short(shape: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items() if not isinstance(v, (list, dict)))


def _print_table(rows: List[dict]) -> None:
    print(f"{'op':<16} {'shape':<38} {'mode':<8} {'provider':<15} {'p50 ms':>9} "
          f"{'x base':>8} {'TFLOP/s':>8} {'peak MiB':>9}")
    for r in rows:
        if "ms_p50" not in r:
            why = r.get("skipped") or r.get("error")
            print(f"{r['op']:<16} {_short(r['shape']):<38} {'-':<8} {r['provider']:<15} {why}")
            continue
        mem = r.get("peak_mem_bytes")
        print(f"{r['op']:<16} {_short(r['shape']):<38} {r['mode']:<8} {r['provider']:<15} "
              f"{r['ms_p50']:9.3f} {r.get('ratio_to_floor', float('nan')):8.2f} "
              f"{r.get('tflops', float('nan')):8.1f} "
              f"{(mem / 2**20) if mem is not None else float('nan'):9.1f}")


def build_parser() -> argparse.ArgumentParser:
    from kfused.cli.args import device, positive_float

    p = argparse.ArgumentParser(prog="kfused bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ops", nargs="*",
                   help=f"ops to benchmark (default: all of {', '.join(available_ops())})")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="compute dtype (default: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--quick", action="store_true",
                   help="fewer, smaller shapes (on a CPU: tiny float32 cases, 20-30 s on 2 cores)")
    p.add_argument("--device", type=device,
                   default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--rep-ms", type=positive_float, default=None,
                   help="measuring time per point in ms, > 0 (default 200 on GPU, 50 on CPU; "
                        "warm-up is a quarter of it)")
    p.add_argument("--out", default=None,
                   help="results folder (default benchmarks/results/local of the checkout, "
                        "git-ignored, or ./kfused_bench_results; committed results live in "
                        "benchmarks/results/<device>/)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-kernels", action="store_true",
                   help="on CUDA, skip the per-kernel device times of the kfused providers "
                        "(torch.profiler, a few calls each; `kfused results` sets them beside "
                        "the performance model's per-kernel prediction)")
    p.add_argument("--write-prefs", default=None, metavar="PATH",
                   help="also record which fused backend was faster per op and regime on this "
                        "GPU model into PATH (JSON, merged with what kfused wrote there "
                        "before); backend='auto' reads it through KFUSED_BACKEND_PREFS or as "
                        "kfused/data/backend_prefs.json")
    p.add_argument("--time-limit", type=positive_float, default=None, metavar="SECONDS",
                   help="start no new case after this many seconds (the cases left are "
                        "recorded as not run); each op's JSON is rewritten after every case, "
                        "so a run stopped from outside keeps what it measured")
    p.add_argument("--skip", default="", metavar="PROVIDERS",
                   help="comma list of providers not to run (recorded as skipped), e.g. "
                        "'eager' (no target compares with it) when device time is short")
    p.add_argument("--list", action="store_true", help="list the ops and exit")
    return p


def run(argv: Optional[List[str]] = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.list:
        if args.ops:       # (it listed every op and ignored them)
            p.error(f"argument --list: lists every op and runs nothing; not with ops "
                    f"({' '.join(args.ops)})")
        print("\n".join(available_ops()))
        return 0
    ops = args.ops or available_ops()
    unknown = [op for op in ops if op not in available_ops()]
    if unknown:
        p.error(f"argument ops: no benchmark cases for {', '.join(unknown)}; expected any of "
                f"{', '.join(available_ops())}")
    from kfused.bench import measure
    from kfused.cases import bench_cases

    device = torch.device(args.device)
    if args.write_prefs and device.type != "cuda":
        p.error("argument --write-prefs: records GPU measurements; needs a CUDA --device")
    if args.dtype is None:
        args.dtype = "bf16" if device.type == "cuda" else "fp32"
    out_dir = Path(args.out) if args.out else default_out_dir()
    unusable = folder_refusal(out_dir)  # a file, under one, not writable: before any case runs
    if unusable:
        p.error(f"argument --out: {unusable}")
    # every op's cases (providers are built lazily: no tensor yet), so that --skip is checked
    # against the providers of the selected families before anything runs
    case_lists = {op: targets_first(bench_cases(op, device, DTYPES[args.dtype],
                                                quick=args.quick)) for op in ops}
    skip = {n.strip() for n in args.skip.split(",") if n.strip()}
    known = sorted({prov.name for cases in case_lists.values() for case in cases
                    for prov in case.providers})
    unknown = sorted(skip - set(known))
    if unknown:
        p.error(f"argument --skip: no provider named {', '.join(unknown)} in "
                f"{', '.join(ops)}; expected any of {', '.join(known)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    rep = args.rep_ms if args.rep_ms is not None else (200 if device.type == "cuda" else 50)
    if device.type != "cuda":
        print("kfused bench: no CUDA device — running the CPU-sized cases of the baselines only "
              "(Triton/CUDA kernels and every speed claim need a GPU).", file=sys.stderr)
    meta = environment(device)
    meta["ceilings"] = device_ceilings(device)
    if meta["ceilings"]:
        print("device ceilings: " + ", ".join(f"{k}={v:.1f}" for k, v in meta["ceilings"].items()))
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    slug = str(meta.get("device", device.type)).replace(" ", "-").replace("/", "-")
    try:
        from tqdm import tqdm
    except Exception:  # pragma: no cover
        tqdm = lambda it, **k: it  # noqa: E731
    if args.write_prefs:
        _check_prefs_target(Path(args.write_prefs))
    all_rows: List[dict] = []
    t_end = None if args.time_limit is None else time.monotonic() + args.time_limit
    for op in ops:
        rows: List[dict] = []
        case_list = case_lists[op]
        for case in case_list:
            for prov in case.providers:
                if prov.name in skip and not prov.skip_reason:
                    prov.skip_reason = "not run: --skip"
        other = sorted({str(c.dtype).replace("torch.", "") for c in case_list
                        if c.dtype != DTYPES[args.dtype]})
        if other:  # a family that runs another dtype here says so (the rows name it too)
            print(f"kfused bench: {op} runs its {device.type} cases in {', '.join(other)}, not "
                  f"--dtype {args.dtype}", file=sys.stderr)
        path = None

        def save(complete: bool) -> Path:
            """This op's JSON so far: a new file the first time, then replaced whole (a run
            stopped from outside keeps every case measured before it)."""
            text = json.dumps({"meta": {**meta, "quick": args.quick, "complete": complete},
                               "rows": rows}, indent=1, default=str)
            if path is None:
                return new_results_file(out_dir, f"{op}_{slug}_{stamp}", text)
            replace_atomically(str(path), lambda tmp: Path(tmp).write_text(text))
            return path

        for case in tqdm(case_list, desc=f"bench {op}", file=sys.stderr):
            if t_end is not None and time.monotonic() > t_end:
                rows.extend({"op": case.op, "shape": dict(case.shape),
                             "dtype": str(case.dtype).replace("torch.", ""),
                             "provider": prov.name, "mode": "all",
                             "skipped": f"not run: --time-limit {args.time_limit:g} s reached"}
                            for prov in case.providers)
                continue
            rows.extend(measure(case, device, rep_ms=rep, warmup_ms=rep / 4,
                                kernels=device.type == "cuda" and not args.no_kernels))
            add_ratios(rows)
            path = save(False)
        add_ratios(rows)
        all_rows.extend(rows)
        path = save(True)
        _print_table(rows)
        print(f"wrote {path}")
        if not args.no_plot:
            png = plot_results(path)
            if png:
                print(f"wrote {png}")
    if args.write_prefs:
        prefs = write_prefs(Path(args.write_prefs), str(meta.get("device")), all_rows,
                            meta.get("git_commit"))
        print(f"wrote {args.write_prefs}: {json.dumps(prefs)}")
    failed = [r for r in all_rows if "error" in r]  # the others are measured and written
    if failed:
        print(f"kfused bench: {len(failed)} provider(s) failed: " + "; ".join(
            f"{r['op']} {_short(r['shape'])} {r['provider']}: {r['error'][:200]}"
            for r in failed), file=sys.stderr)
        return 1
    return 0


def targets_first(cases: list) -> list:
    """The cases the performance model predicts (the issues' target shapes) first, the rest
    after, each group in its own order: under --time-limit the shapes that decide a target
    are measured before the others."""
    try:
        from kfused.perf.cases import all_cases
        from kfused.results import case_key

        keys = {case_key(c.op, c.shape, "kfused-triton") for c in all_cases()}
    except Exception:  # pragma: no cover - the model is optional to a benchmark run
        return list(cases)
    return sorted(cases, key=lambda c: case_key(c.op, c.shape, "kfused-triton") not in keys)


def _check_prefs_target(path: Path) -> None:
    """kfused never overwrites a file it did not write: an existing PATH must be a
    preferences file written by ``kfused bench --write-prefs``, with a body this run can merge
    into."""
    from kfused.backends import PREFS_WRITER, BackendError, load_prefs

    unusable = folder_refusal(path.parent)  # else found by mkdir after the whole GPU run
    if unusable:
        raise SystemExit(f"kfused bench: --write-prefs {path}: {unusable}")
    if path.is_symlink():  # the rename would replace the link itself, not what it names
        raise SystemExit(f"kfused bench: {path} is a symbolic link; not replacing it (give "
                         f"the file it points to, {os.path.realpath(path)})")
    if path.exists():
        try:
            mine = json.loads(path.read_text()).get("written_by") == PREFS_WRITER
        except (OSError, ValueError, AttributeError):
            mine = False
        if not mine:
            raise SystemExit(f"kfused bench: {path} exists and was not written by "
                             f"'{PREFS_WRITER}'; not overwriting it")
        # the run merges into it: a body that does not parse as preferences is refused now,
        # not after the whole GPU run (its measured preferences lost to a traceback)
        try:
            load_prefs(str(path))
        except BackendError as exc:
            raise SystemExit(f"kfused bench: --write-prefs {path}: {exc}; not merging into it "
                             "(move it aside to start a new file)") from None


def write_prefs(path: Path, device_name: str, rows: List[dict],
                commit: Optional[str] = None) -> dict:
    """Merge this run's measured backend order (:func:`kfused.bench.backend_prefs`) for
    ``device_name`` into the preferences file at ``path`` (created if absent; replaced
    atomically, so it always holds one complete version). Returns this device's entry."""
    from kfused.backends import PREFS_WRITER, load_prefs
    from kfused.bench import backend_prefs
    from kfused.cases import regime_of

    _check_prefs_target(path)
    data = load_prefs(str(path)) if path.exists() else {
        "written_by": PREFS_WRITER, "devices": {}}
    entry = data["devices"].setdefault(device_name, {})
    for op, regimes in backend_prefs(rows, regime_of).items():
        entry.setdefault(op, {}).update(regimes)
    data.setdefault("commits", {})[device_name] = commit
    path.parent.mkdir(parents=True, exist_ok=True)
    def dump(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)

    replace_atomically(str(path), dump)
    return entry

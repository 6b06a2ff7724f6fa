"""`kfused perf`: compile every benchmark launch, model it, predict, check the structure.

    python -m kfused.cli.main perf                  # table + JSON (benchmarks/results/predicted)
    python -m kfused.cli.main perf --ops krona      # one op family
    python -m kfused.cli.main perf --update-known   # rewrite kfused/perf/known_violations.json
    python -m kfused.cli.main perf --structure-only --arch 90 --json out.json   # what CI runs

Every time and ratio it prints is PREDICTED by kfused.perf.roofline (no GPU involved).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional

from kfused._files import replace_atomically

HERE = os.path.dirname(os.path.abspath(__file__))
KNOWN = os.path.join(HERE, "known_violations.json")
ROOT = os.path.dirname(os.path.dirname(HERE))
OUT_DIR = os.path.join(ROOT, "benchmarks", "results", "predicted")
LABEL = "PREDICTED (static model, no GPU): kfused.perf"   # the first field of every report

# CUDA C++ kernels that are matrix products (must issue HMMA/HGMMA): every 16-bit (Half /
# BFloat16 template) instantiation in csrc/ except those whose name contains one of these
# fragments (pure reductions, the split-KV merge, the element-wise KronA weight fold, and
# KronA's narrow-factor backward, whose products have two sides of at most 8 — the host runs it
# only where padding them to 16 for mma.sync would multiply the MACs by more than kTcMaxWaste;
# it is memory-bound on the CUDA cores). float32 instantiations compute in IEEE float32
# (docs/math.md §4) and are not required to use tensor cores.
CSRC_NOT_GEMM = ("reduce", "merge", "krona_fold", "kron_narrow")
CSRC_16BIT = ("Half", "BFloat16")


def _versions() -> Dict[str, str]:
    import torch
    import triton

    try:
        commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", ROOT, "status", "--porcelain"],
                                    capture_output=True, text=True).stdout.strip())
    except Exception:
        commit, dirty = "", False
    return dict(commit=commit + ("-dirty" if dirty else ""), triton=triton.__version__,
                torch=torch.__version__, python=sys.version.split()[0])


# ------------------------------------------------------------------------------------------
# collecting launches


def collect(ops: Optional[List[str]] = None):
    """Trace every case; returns [(case, launches, glue)]."""
    from kfused.perf import cases as C
    from kfused.perf.trace import trace

    out = []
    for case in C.all_cases():
        if ops and not any(case.op.startswith(o) for o in ops):
            continue
        launches, glue = trace(case.run)
        out.append((case, launches, glue))
    return out


def representative_launches(ops: Optional[List[str]] = None):
    """Each op family's representative launches (``aot_launches`` in kfused.cases: odd head
    widths, masks, prefix, float32) — compile coverage beyond the benchmark shapes."""
    from kfused.perf.compile import recording
    from kfused.cases import aot_drivers

    out = []
    for op, drv in aot_drivers().items():
        if ops and not any(op.startswith(o) for o in ops):
            continue
        with recording() as launches:
            drv()
        out.append((op, launches))
    return out


def _spec_items(launches, archs):
    from kfused.perf.compile import jit_spec, spec_key

    items, index = [], {}
    keys = []
    for L in launches:
        row = {}
        for arch in archs:
            spec = jit_spec(L.fn, L.args, L.kwargs, arch)
            k = (L.name, spec_key(L.fn, spec, arch))
            if k not in index:
                index[k] = len(items)
                items.append((L.fn, spec, arch))
            row[arch] = index[k]
        keys.append(row)
    return items, keys


# ------------------------------------------------------------------------------------------
# violations (the structural checks)


def launch_violations(stats: dict, dtypes: List[str]) -> List[dict]:
    v = []
    if stats.get("spill_bytes", 0) > 0:
        v.append(dict(what="spill_bytes", value=int(stats["spill_bytes"])))
    sixteen = any(d in ("bf16", "fp16") for d in dtypes)
    dots = stats.get("dots", {})
    n_dots = sum(dots.values()) if dots else 0
    sass = stats.get("sass", {})
    # a float32 dot on TF32 tensor cores: kfused never asks for one (docs/math.md §4 wants
    # IEEE float32), so the compiler made it (Triton <= 3.6 rewrote broadcast-and-sum
    # products into TF32 dots: kfused.triton_kernels._common._bcast_mm) — any dtype
    if dots.get("dot_tf32", 0):
        v.append(dict(what="tf32_dot", value=int(dots["dot_tf32"])))
    if sixteen and n_dots:
        if not (sass.get("hgmma", 0) or sass.get("hmma", 0)):
            v.append(dict(what="no_tensor_core", value=1))
        # float32/float64 operand dots run on CUDA cores
        cc = dots.get("dot_f32_ieee", 0) + dots.get("dot_tf32", 0) + dots.get("dot_f64", 0)
        if cc:
            v.append(dict(what="cuda_core_dots", value=int(cc)))
    return v


def csrc_kernel_name(mangled: str) -> str:
    """The mangled name without nvcc's anonymous-namespace tag, which hashes the file's path
    and so differs between checkouts."""
    import re

    return re.sub(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_\w*?_cu_[0-9a-f]{8}", "(anon)", mangled)


def csrc_violations(csrc: dict) -> List[dict]:
    out = []
    for rel, per_arch in sorted(csrc.get("files", {}).items()):
        for arch, kernels in per_arch.items():
            for name, st in sorted(kernels.items()):
                base = dict(kernel=csrc_kernel_name(name), where=f"csrc/{rel}",
                            arch=f"sm_{arch}")
                if st.get("spill_bytes", 0) > 0:
                    out.append(dict(base, what="spill_bytes", value=int(st["spill_bytes"])))
                sass = st.get("sass", {})
                gemm = (any(f in name for f in CSRC_16BIT)
                        and not any(f in name for f in CSRC_NOT_GEMM))
                if gemm and not (
                        sass.get("hgmma", 0) or sass.get("hmma", 0)):
                    out.append(dict(base, what="no_tensor_core", value=1))
    return out


def _vkey(v: dict) -> str:
    return f"{v['arch']} | {v['where']} | {v['kernel']} | {v['what']}"


def compare_known(found: List[dict], known: List[dict], scope: Optional[set] = None):
    """(new-or-worse, disappeared) lists. ``scope``: only judge known entries whose 'where'
    starts with one of these prefixes (so a partial run does not call others disappeared)."""
    kmap = {_vkey(k): k for k in known}
    fmap = {_vkey(f): f for f in found}
    bad = []
    for key, f in sorted(fmap.items()):
        k = kmap.get(key)
        if k is None:
            bad.append(f"NEW   {key} = {f['value']}  (not in known_violations.json)")
        elif f["value"] > k["value"]:
            bad.append(f"WORSE {key} = {f['value']} (known: {k['value']})")
    gone = []
    for key, k in sorted(kmap.items()):
        if scope is not None and not any(k["where"].startswith(s) for s in scope):
            continue
        if key not in fmap:
            gone.append(f"FIXED {key}: delete this entry from kfused/perf/known_violations.json "
                        "(or run `kfused perf --update-known`)")
        elif fmap[key]["value"] < k["value"]:
            gone.append(f"IMPROVED {key} = {fmap[key]['value']} (known: {k['value']}): lower "
                        "the entry (`kfused perf --update-known`)")
    return bad, gone


def _cases_for(ops):
    from kfused.perf import cases as C

    return [c for c in C.all_cases() if not ops or any(c.op.startswith(o) for o in ops)]


def load_known() -> List[dict]:
    if not os.path.exists(KNOWN):
        return []
    with open(KNOWN) as f:
        return json.load(f)["violations"]


# ------------------------------------------------------------------------------------------
# main analysis


def analyse(ops=None, archs=(90, 80), jobs=2, with_csrc=True, with_grounding=True,
            with_representative=True, structure_only=False, device="h100") -> dict:
    from kfused.perf import cases as C
    from kfused.perf import roofline as R
    from kfused.perf.compile import (compile_many, constexpr_summary, csrc_stats, jit_spec,
                                     spec_dtypes)

    t0 = time.time()
    # traced first, on the H100 profile: the ops' own roofline choices at run time (the
    # per-head fold plans) read the H100 constants on every GPU, so the launches predicted for
    # another device are the ones that run there
    R.use_device("h100")
    traced = collect(ops)
    rep = representative_launches(ops) if with_representative else []
    R.use_device(device)
    all_launches = [L for _, ls, _ in traced for L in ls] + [L for _, ls in rep for L in ls]
    items, _ = _spec_items(all_launches, archs)
    results = compile_many(items, jobs=jobs)
    by_key = {}
    from kfused.perf.compile import spec_key
    for (fn, spec, arch), res in zip(items, results):
        by_key[(fn.__name__, spec_key(fn, spec, arch), arch)] = (spec, res)

    def stats_of(L, arch):
        spec = jit_spec(L.fn, L.args, L.kwargs, arch)
        return spec, by_key[(L.name, spec_key(L.fn, spec, arch), arch)][1]

    report = dict(label=LABEL, versions=_versions(),
                  date=datetime.datetime.utcnow().isoformat(timespec="seconds") + "Z",
                  constants=dict(R.CONSTANTS), archs=list(archs), cases=[], launches=[],
                  failures=[], violations=[])
    seen_launch = set()
    for case, launches, glue in traced:
        counts: Dict[str, int] = {}
        rows = []
        for L in launches:
            counts[L.name] = counts.get(L.name, 0) + 1
            where = f"{case.compile_group} #{counts[L.name]}"
            per_arch = {}
            for arch in archs:
                spec, (st, err) = stats_of(L, arch)
                if err:
                    report["failures"].append(dict(kernel=L.name, where=where, arch=arch,
                                                   error=err))
                    continue
                per_arch[arch] = st
                for v in launch_violations(st, spec_dtypes(spec)):
                    v.update(kernel=L.name, where=where, arch=f"sm_{arch}")
                    k = _vkey(v)
                    if k not in seen_launch:
                        seen_launch.add(k)
                        report["violations"].append(v)
            if structure_only:
                continue
            work, modelled = C.model_launch(L)
            st90 = per_arch.get(90, {})
            pred = R.predict(work, st90.get("sass", {}), L.programs(),
                             st90.get("ctas_per_sm", 1))
            # sensitivity: the same launch if its wgmma products ran at the mma.sync rate
            sass_ms = dict(st90.get("sass", {}))
            if sass_ms.get("hgmma"):
                sass_ms.update(hgmma=0, hmma=1)
            pred["t_if_wgmma_at_mma_sync"] = R.predict(work, sass_ms, L.programs(),
                                                       st90.get("ctas_per_sm", 1))["t"]
            spec90 = jit_spec(L.fn, L.args, L.kwargs, 90)
            rows.append(dict(kernel=L.name, where=where, grid=list(L.grid), alt=L.alt,
                             config=constexpr_summary(L.fn, spec90), modelled=modelled,
                             work=work, predicted=pred,
                             compiled={f"sm_{a}": {k: s.get(k) for k in (
                                 "regs", "spill_bytes", "shared_bytes", "ctas_per_sm",
                                 "num_warps", "num_stages", "sass", "dots")}
                                 for a, s in per_arch.items()}))
        if structure_only:
            continue
        rows = _fastest_alternatives(rows)
        glue_rows = []
        for g in glue:
            t = R.torch_op_time(g.flops, g.bytes)
            glue_rows.append(dict(op=g.name, bytes=g.bytes, flops=g.flops, t=t))
        t_k = sum(r["predicted"]["t"] for r in rows) + sum(g["t"] for g in glue_rows)
        issued = sum(r["work"]["dot16_flops"] + r["work"]["fma32_flops"] + r["work"]["fma64_flops"]
                     for r in rows) + sum(g["flops"] for g in glue_rows)
        moved = sum(r["work"]["hbm_bytes"] for r in rows) + sum(g["bytes"] for g in glue_rows)
        base = {}
        for name, fn in case.baselines.items():
            parts = fn()
            base[name] = dict(t=sum(p["t"] for p in parts), parts=parts)
        t_ms = (sum(r["predicted"]["t_if_wgmma_at_mma_sync"] for r in rows)
                + sum(g["t"] for g in glue_rows))
        targets = []
        for tg in case.targets:
            ratio = t_k / base[tg.baseline]["t"]
            targets.append(dict(issue=tg.issue, baseline=tg.baseline, text=tg.text,
                                max_ratio=None if math.isinf(tg.max_ratio) else tg.max_ratio,
                                min_ratio=tg.min_ratio,
                                predicted_ratio=ratio, met=_within(ratio, tg.max_ratio,
                                                                   tg.min_ratio),
                                ratio_if_wgmma_at_mma_sync=t_ms / base[tg.baseline]["t"]))
        report["cases"].append(dict(
            op=case.op, label=case.label, shape=case.shape,
            useful_flops=case.useful_flops, min_bytes=case.min_bytes,
            issued_flops=issued, hbm_bytes=moved,
            predicted_t_s=t_k, predicted_t_s_if_wgmma_at_mma_sync=t_ms,
            predicted_min_t_s=max(case.useful_flops / R.WGMMA_RATE, case.min_bytes / R.HBM_BW),
            kernels=rows, glue=dict(n_ops=len(glue_rows), t_s=sum(g["t"] for g in glue_rows),
                                    bytes=sum(g["bytes"] for g in glue_rows),
                                    by_op=_glue_by_op(glue_rows)),
            baselines=base, targets=targets))
    # representative launches: compile failures and violations (compile coverage)
    for op, launches in rep:
        for L in launches:
            for arch in archs:
                spec, (st, err) = stats_of(L, arch)
                if err:
                    report["failures"].append(dict(kernel=L.name, where=f"representative {op}",
                                                   arch=arch, error=err))
    if with_csrc:
        cs = csrc_stats(archs=tuple(a for a in archs), jobs=jobs)
        report["csrc"] = cs
        report["violations"] += csrc_violations(cs)
        for e in cs.get("errors", []):
            report["failures"].append(dict(kernel="csrc", where="csrc", arch="", error=e))
    # back to the H100 profile: the grounding holds the model to public H100 figures, and the
    # ops' own choices in this process read the profile too
    R.use_device("h100")
    if with_grounding and not structure_only:
        from kfused.perf import grounding

        report["grounding"] = grounding.run(jobs=jobs)
        for row in report["grounding"]["rows"]:     # a grounding kernel is compiled too
            if "error" in row:
                report["failures"].append(dict(kernel=row["name"], where="grounding", arch=90,
                                               error=row["error"]))
    report["elapsed_s"] = time.time() - t0
    return report


# ------------------------------------------------------------------------------------------
# output


def _fastest_alternatives(rows: List[dict]) -> List[dict]:
    """Of the launches recorded for one autotuned call (same ``alt`` >= 0, one per config),
    keep the one with the lowest predicted time: the config the autotuner would pick."""
    best: Dict[int, dict] = {}
    for r in rows:
        if r["alt"] >= 0 and (r["alt"] not in best
                              or r["predicted"]["t"] < best[r["alt"]]["predicted"]["t"]):
            best[r["alt"]] = r
    return [r for r in rows if r["alt"] < 0 or best[r["alt"]] is r]


def _glue_by_op(rows: List[dict]) -> Dict[str, dict]:
    out: Dict[str, dict] = {}
    for g in rows:
        d = out.setdefault(g["op"], dict(n=0, bytes=0.0, flops=0.0, t_s=0.0))
        d["n"] += 1
        d["bytes"] += g["bytes"]
        d["flops"] += g["flops"]
        d["t_s"] += g["t"]
    return out


def _within(ratio: float, max_ratio=None, min_ratio=None) -> bool:
    """Met: at most ``max_ratio`` and at least ``min_ratio`` (None / inf: no such limit)."""
    return ((max_ratio is None or ratio <= max_ratio)
            and (min_ratio is None or ratio >= min_ratio))


def _limit(t: dict) -> str:
    """A target's limit: "1.25" (kfused / baseline at most) or ">=0.91" (at least: a
    baseline that must keep up with kfused's Triton path)."""
    if t.get("min_ratio") is not None and t.get("max_ratio") is None:
        return f">={t['min_ratio']:.2f}"
    return f"{t['max_ratio']:.2f}"


def _fmt_t(t: float) -> str:
    return f"{t * 1e3:.3f} ms" if t >= 1e-3 else f"{t * 1e6:.1f} us"


def table(report: dict) -> str:
    dev = (report.get("constants") or {}).get("DEVICE", "h100")
    from kfused.perf import roofline as R
    name = R.DEVICES.get(dev, {}).get("NAME", dev)
    out = [f"PREDICTED (static roofline model of an {name}; nothing here was measured)", ""]
    out.append(f"{'case':<80} {'kfused':>11} {'min':>10} | target (issue)"
               f"{'':<38} {'pred. ratio':>11} {'limit':>6}  met")
    for c in report["cases"]:
        first = True
        tg = c["targets"] or [None]
        for t in tg:
            head = (f"{c['op'] + ' ' + c['label']:<80.80} {_fmt_t(c['predicted_t_s']):>11} "
                    f"{_fmt_t(c['predicted_min_t_s']):>10}" if first else " " * 103)
            first = False
            if t is None:
                out.append(head + " | (no target at this shape)")
            else:
                out.append(head + f" | #{t['issue']} {t['text'][:40]:<40} vs {t['baseline']:<10}"
                           f" {t['predicted_ratio']:>7.2f}x {_limit(t):>6}  "
                           f"{'yes' if t['met'] else 'NO'}")
    out.append("")
    out.append("Sensitivity (PREDICTED): the ratio if every Triton wgmma (HGMMA) product ran at "
               "the mma.sync rate (MMA_SYNC_FRACTION of the GEMM ceiling) instead of the GEMM "
               "ceiling. GEMM-shaped kernels are grounded by the Triton-tutorial matmul, flash "
               "loops only by the Triton-tutorial attention forward (grounding section); no "
               "attention backward kernel is grounded.")
    for c in report["cases"]:
        for t in c["targets"]:
            alt = t.get("ratio_if_wgmma_at_mma_sync")
            if alt is None or abs(alt - t["predicted_ratio"]) < 0.005:
                continue
            out.append(f"  {c['op'] + ' ' + c['label']:<80.80} #{t['issue']} vs "
                       f"{t['baseline']:<10} {t['predicted_ratio']:>6.2f}x -> {alt:>6.2f}x "
                       f"(limit {_limit(t)}: "
                       f"{'yes' if _within(alt, t['max_ratio'], t.get('min_ratio')) else 'NO'})")
    out.append("")
    out.append("Per kernel (sm_90; predicted time, bound, registers, spill, CTAs/SM, "
               "instruction for 16-bit dots):")
    seen = set()
    for c in report["cases"]:
        for r in c["kernels"]:
            key = (r["kernel"], r["where"])
            if key in seen:
                continue
            seen.add(key)
            s = r["compiled"].get("sm_90", {})
            sass = s.get("sass") or {}
            mma = "wgmma" if sass.get("hgmma") else "mma.sync" if sass.get("hmma") else "none"
            p = r["predicted"]
            out.append(f"  {r['kernel']:<32} {r['where']:<52.52} {_fmt_t(p['t']):>10} "
                       f"{p['bound']:<7} regs={s.get('regs')} spill={s.get('spill_bytes')} "
                       f"ctas/SM={s.get('ctas_per_sm')} tc={mma} "
                       f"ldg128={sass.get('ldg128', 0) + sass.get('ldgsts128', 0)} "
                       f"ldg<128={sass.get('ldg_narrow', 0) + sass.get('ldg64', 0) + sass.get('ldgsts_narrow', 0)}"
                       + ("" if r["modelled"] else "  [UNMODELLED]"))
    g = report.get("grounding")
    if g:
        out.append("")
        out.append("Grounding (predicted vs published/measured H100 figures):")
        for row in g["rows"]:
            out.append(f"  {row['name']:<54} predicted {row['predicted_tflops']:7.1f} TFLOP/s "
                       f"| reference {row['reference_tflops']:7.1f} ({row['source'][:60]}) "
                       f"| error {row['error_pct']:+.1f} %  {'OK' if abs(row['error_pct']) <= 25 else 'OUTSIDE 25 %'}")
    if report["violations"]:
        out.append("")
        out.append("Structural violations (see kfused/perf/known_violations.json):")
        for v in sorted(report["violations"], key=_vkey):
            out.append(f"  {_vkey(v)} = {v['value']}")
    if report["failures"]:
        out.append("")
        out.append("COMPILE FAILURES:")
        for f in report["failures"]:
            out.append(f"  {f['arch']} {f['where']} {f['kernel']}: {f['error'][:300]}")
    return "\n".join(out)


def write_known(report: dict) -> None:
    v = sorted(report["violations"], key=_vkey)

    def dump(tmp: str) -> None:  # the committed list is replaced whole or not at all
        with open(tmp, "w") as f:
            json.dump(dict(
                about="Structural violations known today (ratchet). tests/test_perf_structure.py "
                      "fails on a violation not listed here, on one worse than listed, and on a "
                      "listed one that has disappeared or improved: then regenerate with "
                      "`python -m kfused.cli.main perf --update-known` and commit the smaller "
                      "file.",
                versions=report["versions"], violations=v), f, indent=1, ensure_ascii=False)
            f.write("\n")

    replace_atomically(KNOWN, dump)


def _our_table(path: str) -> bool:
    """True when ``path`` is a table an earlier ``kfused perf`` wrote (its first line; a
    symbolic link never)."""
    if os.path.islink(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().startswith(LABEL)
    except (OSError, UnicodeDecodeError):
        return False


def _not_ours(path: str) -> Optional[str]:
    """Why ``kfused perf`` may not write its report to ``path`` and its table beside it (None
    if it may): either exists and is not one an earlier ``kfused perf`` wrote."""
    text_path = os.path.splitext(path)[0] + ".txt"
    if os.path.lexists(path) and not _our_report(path):
        return f"{path} exists and was not written by kfused perf; not overwriting it"
    if os.path.lexists(text_path) and not _our_table(text_path):
        return (f"the table goes to {text_path}, which exists and was not written by kfused "
                "perf; not overwriting it")
    return None


def _free_name(path: str) -> str:
    """``<stem>-<n>.json`` beside ``path``, free for the report and its table."""
    from kfused._files import free_stem

    folder, stem = os.path.split(os.path.splitext(path)[0])
    cand = os.path.join(folder, free_stem(folder or ".", stem, (".json", ".txt"), start=2)
                        + ".json")
    print(f"kfused perf: {path} or its table is no longer kfused's; writing {cand}")
    return cand


def _our_report(path: str) -> bool:
    """True when ``path`` is empty or a JSON report an earlier ``kfused perf`` wrote (a
    symbolic link never: replacing it would replace the link, not what it names)."""
    try:
        if os.path.islink(path):
            return False
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            return True
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("label") == LABEL


def default_json() -> str:
    """Where a run without --json writes its report: benchmarks/results/predicted/ of the
    source checkout kfused runs from; ./kfused_perf_results/ for an installed package (never
    into site-packages, like kfused bench's default folder)."""
    if os.path.isdir(os.path.join(ROOT, "benchmarks")) and os.path.isdir(os.path.join(ROOT,
                                                                                   "kfused")):
        return os.path.join(OUT_DIR, "perf-latest.json")
    return os.path.join(os.getcwd(), "kfused_perf_results", "perf-latest.json")


def _archs(text: str) -> tuple:
    """--arch: a comma list of SM versions (e.g. 90,80), as integers; only those whose limits
    the model knows (kfused.perf.compile.SM_LIMITS: every launch of another arch failed with
    KeyError after the compile run)."""
    from kfused.perf.compile import SM_LIMITS

    try:
        archs = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        archs = ()
    known = ",".join(str(a) for a in sorted(SM_LIMITS, reverse=True))
    if not archs or any(a not in SM_LIMITS for a in archs):
        raise argparse.ArgumentTypeError(f"expected a comma list of the SM versions {known}, "
                                         f"got {text!r}")
    return archs


def _devices():
    from kfused.perf import roofline as R
    return R.DEVICES


def run(argv=None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.call([sys.executable, "-m", "kfused.perf.report", *(argv or [])],
                               env=env)
    from kfused.cli.args import positive_int

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    p = argparse.ArgumentParser(prog="kfused perf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=None, help="comma-separated op prefixes (krona,headwise,"
                   "inducer); default all")
    p.add_argument("--arch", type=_archs, default=(90, 80),
                   help="comma-separated SM versions (default 90,80)")
    p.add_argument("--jobs", type=positive_int, default=min(2, os.cpu_count() or 1),
                   help="parallel compile jobs (>= 1)")
    p.add_argument("--no-csrc", action="store_true")
    p.add_argument("--no-grounding", action="store_true")
    p.add_argument("--no-representative", action="store_true",
                   help="skip the kernel modules' own representative launches")
    p.add_argument("--structure-only", action="store_true",
                   help="compile and check structure only (no model, no grounding)")
    p.add_argument("--json", default=None, help="write the JSON here, and the table beside it "
                   "as <name>.txt (default benchmarks/results/predicted/perf-latest.json "
                   "of the checkout, ./kfused_perf_results/perf-latest.json for an installed "
                   "package; none with --structure-only)")
    p.add_argument("--update-known", action="store_true",
                   help="rewrite kfused/perf/known_violations.json from this run (sm_90)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 on compile failures or violations beyond the known list")
    p.add_argument("--device", choices=sorted(_devices()), default="h100",
                   help="the GPU the model predicts for (default h100; h200: the same "
                   "compute with HBM3e bandwidth)")
    a = p.parse_args(argv)
    ops = [o for o in a.ops.split(",") if o] if a.ops is not None else None
    # every refusal before the compile run (up to half an hour cold), none after it
    if ops == []:       # "--ops ," or "--ops ''": no op named (it ran every op)
        p.error(f"argument --ops: no op named in {a.ops!r}; give comma-separated op "
                "prefixes (krona,headwise,inducer), or leave --ops out for every op")
    if ops:
        known_ops = sorted({c.op for c in _cases_for(None)})
        unknown = [o for o in ops if not any(k.startswith(o) for k in known_ops)]
        if unknown:
            p.error(f"argument --ops: {', '.join(unknown)} is no prefix of an op; expected "
                    f"prefixes of {', '.join(known_ops)}")
    if a.update_known and (ops or 90 not in a.arch or a.no_csrc):
        p.error("argument --update-known: needs a full run (all ops, sm_90, csrc)")
    if a.check and 90 not in a.arch:
        # the known list is sm_90's: without it every entry would be reported fixed
        p.error("argument --check: compares the sm_90 violations with the known list; "
                "--arch must include 90")
    if not a.structure_only and 90 not in a.arch:
        # without sm_90 statistics every launch was predicted with no tensor-core instruction
        # and one CTA per SM (--arch 80: the Triton headwise_lowrank case 240 us -> 589 us)
        p.error("argument --arch: the model predicts H100 times from the sm_90 compile; "
                "include 90, or pass --structure-only")
    if a.json is not None:
        if not os.path.basename(a.json):  # '' or 'dir/': after the run, nothing was written
            p.error(f"argument --json: {a.json!r} names no file; give a .json file name")
        folder = os.path.dirname(os.path.abspath(a.json))
        text_path = os.path.splitext(a.json)[0] + ".txt"
        if os.path.isdir(a.json) or not os.path.isdir(folder):
            p.error(f"argument --json: {a.json} is a folder or its folder does not exist")
        if os.path.lexists(a.json) and not _our_report(a.json):
            p.error(f"argument --json: {a.json} exists and was not written by kfused perf; "
                    "not overwriting it")
        if not a.structure_only and os.path.abspath(text_path) == os.path.abspath(a.json):
            p.error(f"argument --json: {a.json} would be overwritten by the table (written "
                    "beside the JSON as <name>.txt); give a .json name")
        if not a.structure_only and os.path.lexists(text_path) and not _our_table(text_path):
            p.error(f"argument --json: the table goes to {text_path}, which exists and was "
                    "not written by kfused perf; not overwriting it")
    path = a.json
    if path is None and not a.structure_only:
        path = default_json()
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        except OSError as exc:
            p.error(f"argument --json: the default report folder {os.path.dirname(path)} "
                    f"cannot be made ({exc}); give --json")
        # the default names are checked as --json's are (they were replaced whatever held them)
        refusal = _not_ours(path)
        if refusal:
            p.error(f"argument --json: the default report {refusal}; give --json")
    report = analyse(ops, a.arch, a.jobs, with_csrc=not a.no_csrc,
                     with_grounding=not a.no_grounding,
                     with_representative=not a.no_representative,
                     structure_only=a.structure_only, device=a.device)
    if path and _not_ours(path):
        # a file of someone else's appeared there during the run: never replaced; the report
        # goes to a new name beside it
        path = _free_name(path)
    if path:  # replaced whole or not at all (kfused._files), like the other commands' reports
        def dump(tmp: str) -> None:
            with open(tmp, "w") as f:
                json.dump(report, f, indent=1, default=str)

        replace_atomically(path, dump)
    if not a.structure_only:
        text = table(report)
        print(text)
        if path:
            def write_table(tmp: str) -> None:
                with open(tmp, "w") as f:
                    f.write(f"{report['label']}\n{json.dumps(report['versions'])}\n\n{text}\n")

            replace_atomically(os.path.splitext(path)[0] + ".txt", write_table)
    print(f"\n{len(report['failures'])} compile failures, {len(report['violations'])} "
          f"violations; {report['elapsed_s']:.0f} s" + (f"; JSON: {path}" if path else ""))
    rc = 1 if report["failures"] else 0
    skipped = (report.get("csrc") or {}).get("skipped")
    if a.update_known and (report["failures"] or skipped):
        # a kernel that did not compile (or CUDA C++ objects not built) shows no violation:
        # writing the list now would silently drop its entries from the ratchet
        why = (f"{len(report['failures'])} compile failures" if report["failures"]
               else f"the CUDA C++ objects were not compiled ({skipped})")
        print(f"not updating {KNOWN}: {why}; the list is unchanged")
        rc = 1
    elif a.update_known:
        report["violations"] = [v for v in report["violations"] if v["arch"] == "sm_90"]
        write_known(report)
        print(f"wrote {KNOWN}")
    elif a.check:
        found = [v for v in report["violations"] if v["arch"] == "sm_90"]
        scope = None
        if ops or a.no_csrc:
            scope = {c.compile_group for c in _cases_for(ops)}
            if not a.no_csrc:
                scope.add("csrc/")
        bad, gone = compare_known(found, load_known(), scope)
        for line in bad + gone:
            print(line)
        if bad or gone:
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))

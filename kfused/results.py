"""Measured results against the issues' targets: ``kfused results`` reads the JSON that
``kfused bench`` wrote on a GPU (and, optionally, the performance model's prediction for the
same commit, ``kfused perf --json``) and writes ``RESULTS.md``: for every op, case and target
the measured ratio, its limit and whether it is met, the predicted ratio beside it, the two
device ceilings measured in the same run, predicted against measured time per case and,
where ``kfused bench`` profiled the run (on CUDA, by default), per kernel.

Ratios are the subject provider's median time over the baseline's, measured in the same run
(the same JSON file, shape and mode): ``≤ limit`` for "no slower than" targets, ``≥ min`` for
the CUDA C++ path against the Triton one (Triton time / CUDA time). A target whose subject or
baseline was not measured (skipped, failed, not a provider of that case) is listed as such,
never as met.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple

MARKER = "<!-- written by `kfused results`; it replaces only a file that starts with this line -->"


@dataclass(frozen=True)
class Rule:
    """One target of an issue, as it applies to measured benchmark rows."""

    issue: int
    op: str
    subject: str                    # the provider held to the target
    baseline: str                   # the provider it is compared with
    text: str
    max_ratio: float = math.inf     # subject time / baseline time must be <= this
    min_ratio: Optional[float] = None   # ... and >= this
    mode: str = "fwd+bwd"
    when: Optional[Callable[[dict], bool]] = None   # which shapes the target covers

    def applies(self, op: str, shape: dict, mode: str) -> bool:
        return op == self.op and mode == self.mode and (self.when is None or self.when(shape))

    def limit(self) -> str:
        parts = []
        if self.max_ratio != math.inf:
            parts.append(f"≤ {self.max_ratio:.2f}")
        if self.min_ratio is not None:
            parts.append(f"≥ {self.min_ratio:.2f}")
        return " and ".join(parts)

    def met(self, ratio: float) -> bool:
        return ratio <= self.max_ratio and (self.min_ratio is None or ratio >= self.min_ratio)


def _prefill(s: dict) -> bool:
    return "n" in s and not s.get("decode")


def _decode(s: dict) -> bool:
    return bool(s.get("decode"))


def _packed(s: dict) -> bool:
    return "lens" in s


_CUDA = "CUDA C++ within 10 % of the Triton path"
_KRONA = "krona_linear"
_QKV, _OPROJ, _LOWRANK = "headwise_qkv", "headwise_oproj", "headwise_lowrank"
_IND, _E2E = "inducer_attention", "e2e_train_step"

# issue 9's list of targets (issues 11, 12, 14, 15 state them per op)
RULES: Tuple[Rule, ...] = (
    Rule(11, _KRONA, "kfused-triton", "floor", "≤ 1.15× the frozen linear", 1.15),
    Rule(11, _KRONA, "kfused-triton", "kron-dense", "≥ 2× faster than materialised kron", 0.5),
    Rule(11, _KRONA, "kfused-triton", "compile", "≥ 1.3× faster than torch.compile", 1 / 1.3),
    Rule(15, _KRONA, "kfused-triton", "kfused-cuda", _CUDA, min_ratio=1 / 1.1),
    *(r for op in (_QKV, _OPROJ) for r in (
        Rule(12, op, "kfused-triton", "floor", "≤ 1.25× the frozen projections", 1.25),
        Rule(12, op, "kfused-triton", "peft-lora", "no slower than unfused LoRA (same budget)",
             1.0))),
    Rule(15, _LOWRANK, "kfused-triton", "kfused-cuda", _CUDA, min_ratio=1 / 1.1),
    Rule(14, _IND, "kfused-triton", "sdpa", "≥ 0.85× SDPA flash speed (n ≥ 2048)", 1 / 0.85,
         when=lambda s: _prefill(s) and s["n"] >= 2048),
    Rule(14, _IND, "kfused-triton", "flex", "≥ 1.2× FlexAttention computing the same λ",
         1 / 1.2, when=_prefill),
    Rule(15, _IND, "kfused-triton", "kfused-cuda", _CUDA + " (prefill, inference)",
         min_ratio=1 / 1.1, mode="fwd", when=_prefill),
    Rule(14, _IND, "kfused-triton", "sdpa", "decode at least as fast per token as SDPA", 1.0,
         mode="fwd", when=_decode),
    Rule(15, _IND, "kfused-triton", "kfused-cuda", "CUDA C++ faster than Triton on decode",
         min_ratio=1.0, mode="fwd", when=_decode),
    Rule(14, _IND, "kfused-varlen", "flash-varlen", "≥ 0.85× flash-attention varlen speed",
         1 / 0.85, when=_packed),
    Rule(14, _IND, "kfused-varlen", "kfused-padded", "packed: faster than padding", 1.0,
         when=_packed),
    *(Rule(9, _E2E, f"kfused-{m}-fused", "peft-lora",
           "GPT-2-small training step ≥ PEFT LoRA tokens/s", 1.0, mode="fwd",
           when=lambda s: s.get("model") == "gpt2-small")
      for m in ("krona", "kernel-mix-qvo", "inducer-lora", "mam-inducer")),
)

# (op, provider) pairs the model predicts that no target holds: timed against the model only
TIMED_ONLY = {(_KRONA, "kfused-triton-exact")}


# ------------------------------------------------------------------------------------------
# reading


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _need(ok: bool, where: str, v, want: str) -> None:
    """Raise ValueError naming ``where``, what it holds and what was expected, unless ``ok``."""
    if not ok:
        raise ValueError(f"{where} is {json.dumps(v)[:80]}, expected {want}")


_TIME = "a finite positive time (ms)"


def _check_shape(where: str, op: str, shape: dict) -> None:
    """The fields of a case's shape this module reads: JSON scalars or lists of them; the
    inducer's n a number and lens a list, KronA's factor shapes A and B lists."""
    def scalar(x) -> bool:
        return x is None or isinstance(x, (str, int, float, bool))

    for k, v in shape.items():
        _need(scalar(v) or isinstance(v, list) and all(map(scalar, v)), f"{where}.{k}", v,
              "a number, string or list of them")
    lists = {_IND: ("lens",), _KRONA: ("A", "B")}.get(op, ())
    for k in lists:
        _need(shape.get(k) is None or isinstance(shape[k], list), f"{where}.{k}", shape.get(k),
              "a list")
    if op == _IND and "n" in shape:
        _need(_number(shape["n"]), f"{where}.n", shape["n"], "a number")


def _check_row(where: str, r: dict) -> None:
    """A `kfused bench` row's times (a measured row, any mode but "all", has its median
    ``ms_p50``), its shape and its per-kernel times."""
    _check_shape(f"{where} shape", r["op"], r["shape"])
    if r["mode"] != "all" and "ms_p50" not in r:
        raise ValueError(f"{where} has no ms_p50: a measured row holds {_TIME}")
    if "ms_p50" in r:
        _need(_number(r.get("ms_p50")) and r["ms_p50"] > 0, f"{where} ms_p50",
              r.get("ms_p50"), _TIME)
    if "graph_ms_p50" in r:
        _need(_number(r["graph_ms_p50"]) and r["graph_ms_p50"] > 0, f"{where} graph_ms_p50",
              r["graph_ms_p50"], _TIME)
    kernels = r.get("kernels")
    _need(kernels is None or isinstance(kernels, dict), f"{where} kernels", kernels,
          "an object (kernel name -> launches, us)")
    for name, m in (kernels or {}).items():
        _need(isinstance(m, dict) and all(_number(m.get(k)) and m[k] >= 0
                                          for k in ("launches", "us")),
              f"{where} kernels.{name}", m, "an object with numbers launches and us")


def load_runs(paths: Iterable, skipped: Optional[List[str]] = None) -> List[dict]:
    """The ``kfused bench`` JSON files among ``paths`` (files, or folders searched for
    ``*.json``); each {"path", "meta", "rows"}, each file once however often it is named.
    Other JSON (a performance-model file, backend preferences) is passed over, as is a file
    found in a folder that is not readable JSON (said in ``skipped``, where given); a named
    file that is not readable JSON, a malformed bench row or meta field raises ValueError
    naming the file and field; a path that does not exist raises FileNotFoundError."""
    runs = []
    seen = set()
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise FileNotFoundError(f"{p} does not exist")
        for f in (sorted(p.rglob("*.json")) if p.is_dir() else [p]):
            if f.resolve() in seen:
                continue
            try:
                data = json.loads(f.read_text())
            except (OSError, ValueError) as exc:
                why = f"{f} is not readable JSON ({type(exc).__name__}: {exc})"
                if not p.is_dir():
                    raise ValueError(why) from None
                if skipped is not None:
                    skipped.append(why)
                continue
            seen.add(f.resolve())
            if isinstance(data, dict) and isinstance(data.get("rows"), list) and \
                    isinstance(data.get("meta"), dict):
                for i, r in enumerate(data["rows"]):
                    bad = not isinstance(r, dict) or not isinstance(r.get("shape"), dict) or \
                        any(not isinstance(r.get(k), str) for k in ("op", "provider", "mode"))
                    if bad:
                        raise ValueError(f"{f}: row {i} is not a `kfused bench` row (op, "
                                         f"shape, provider, mode, ms_p50): {str(r)[:200]}")
                    _check_row(f"{f}: row {i} ({r['op']}, {r['provider']}, {r['mode']})", r)
                c = data["meta"].get("ceilings")
                _need(c is None or isinstance(c, dict), f"{f}: meta.ceilings", c,
                      "an object (ceiling -> number)")
                for k, v in (c or {}).items():
                    _need(v is None or _number(v), f"{f}: meta.ceilings.{k}", v, "a number")
                runs.append({"path": str(f), "meta": data["meta"], "rows": data["rows"]})
    return runs


def _key(shape: dict) -> str:
    return json.dumps(shape, sort_keys=True)


def _table(rows: List[dict]) -> Dict[Tuple[str, str, str], Dict[str, dict]]:
    """(op, shape, mode) -> provider -> row (measured rows; a skipped or failed provider is
    kept under mode "all")."""
    out: Dict[Tuple[str, str, str], Dict[str, dict]] = {}
    for r in rows:
        out.setdefault((r["op"], _key(r["shape"]), r["mode"]), {})[r["provider"]] = r
    return out


def _why_missing(table, op: str, shape: str, mode: str, provider: str) -> str:
    r = table.get((op, shape, "all"), {}).get(provider)
    if r is not None:
        return ("skipped: " + str(r["skipped"])) if "skipped" in r else \
            ("failed: " + str(r.get("error", ""))[:120])
    return f"no {mode} measurement of {provider}"


def evaluate(rows: List[dict], rules: Iterable[Rule] = RULES) -> List[dict]:
    """One entry per (case, mode, rule) that applies to a measured case: the measured ratio
    and whether it meets the rule, or why it could not be measured."""
    table = _table(rows)
    rules = list(rules)
    out = []
    cases = list(dict.fromkeys((op, shape) for op, shape, _ in table))
    for op, shape in cases:
        sh = json.loads(shape)
        for rule in rules:
            mode = rule.mode
            if not rule.applies(op, sh, mode):
                continue
            provs = table.get((op, shape, mode), {})
            e = {"issue": rule.issue, "op": op, "shape": sh, "mode": mode, "rule": rule,
                 "subject": rule.subject, "baseline": rule.baseline}
            s, b = provs.get(rule.subject), provs.get(rule.baseline)
            if s is None or b is None:
                e["missing"] = _why_missing(table, op, shape, mode,
                                            rule.subject if s is None else rule.baseline)
            else:
                e["ms"], e["ms_baseline"] = s["ms_p50"], b["ms_p50"]
                e["device"], e["device_baseline"] = device_ms(s), device_ms(b)
                if s.get("kernels"):
                    e["kernels"] = s["kernels"]
                e["ratio"] = s["ms_p50"] / b["ms_p50"]
                e["met"] = rule.met(e["ratio"])
                if s.get("graph_ms_p50") and b.get("graph_ms_p50"):
                    # both captured in a CUDA graph: the device-bound ratio, host cost apart
                    e["graph_ratio"] = s["graph_ms_p50"] / b["graph_ms_p50"]
                    e["graph_met"] = rule.met(e["graph_ratio"])
            out.append(e)
    return out


# ------------------------------------------------------------------------------------------
# the performance model's prediction for the same case


def case_key(op: str, shape: dict, subject: str) -> Optional[tuple]:
    """A key that a bench case and the performance-model case of the same shape share (None
    for cases the model does not cover). krona: the model's fold+cuBLAS path is the
    ``kfused-triton`` provider on a GPU, its exact path ``kfused-triton-exact``."""
    def g(k, default=None):
        v = shape.get(k, default)
        return tuple(v) if isinstance(v, list) else v    # a key: hashable
    if op == _KRONA:
        path = g("path")
        if path is not None:      # a model case
            subject = "kfused-triton-exact" if path == "exact" else "kfused-triton"
        return (op, g("T"), g("d_in"), g("d_out"), tuple(g("A") or ()), tuple(g("B") or ()),
                subject)
    if op in (_QKV, _OPROJ):
        return (op, g("width"), g("preset"), g("T", g("tokens")))
    if op == _LOWRANK:
        return (op, g("T"), g("H"), g("d_b"), g("p"), g("r"))
    if op == _IND:
        if "lens" in shape:
            return (op, "packed", tuple(g("lens")), g("H"), g("p"))
        if g("decode"):
            return (op, "decode", g("B"), g("H"), g("H_kv"), g("n_k"), g("p"))
        return (op, "prefill", g("B"), g("H"), g("n"), g("p"), bool(g("causal")))
    return None


@dataclass
class Prediction:
    """A ``kfused perf --json`` file: its cases by :func:`case_key` (a key may hold a
    fwd+bwd and a forward-only case) and the commit it predicted."""

    cases: Dict[tuple, List[dict]]
    commit: Optional[str] = None
    device: str = "h100"      # the GPU the model predicted for (kfused perf --device)


def load_predicted(path) -> Prediction:
    """Read a ``kfused perf --json`` file (:class:`Prediction`)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("cases"), list):
        raise ValueError(f"{path} is not a `kfused perf --json` file (no 'cases' list)")
    out: Dict[tuple, List[dict]] = {}
    for i, c in enumerate(data["cases"]):
        if not isinstance(c, dict) or not isinstance(c.get("op"), str) or \
                not isinstance(c.get("shape"), dict):
            raise ValueError(f"{path}: case {i} has no op and shape: not a `kfused perf "
                             "--json` file")
        _check_case(f"{path}: case {i} ({c['op']})", c)
        k = case_key(c["op"], c["shape"], "kfused-triton")
        if k is not None:
            out.setdefault(k, []).append(c)
    for k in ("versions", "constants"):
        _need(data.get(k) is None or isinstance(data[k], dict), f"{path}: {k}", data.get(k),
              "an object")
    commit = (data.get("versions") or {}).get("commit")
    _need(commit is None or isinstance(commit, str), f"{path}: versions.commit", commit,
          "a string")
    return Prediction(out, commit, str((data.get("constants") or {}).get("DEVICE", "h100")))


def _check_case(where: str, c: dict) -> None:
    """The fields of a ``kfused perf --json`` case this module reads."""
    _check_shape(f"{where} shape", c["op"], c["shape"])
    t = c.get("predicted_t_s")
    _need(t is None or _number(t) and t >= 0, f"{where} predicted_t_s", t,
          "a finite time (s)")
    _need(isinstance(c.get("targets", []), list), f"{where} targets", c.get("targets"),
          "a list")
    for j, tg in enumerate(c.get("targets", [])):
        _need(isinstance(tg, dict) and isinstance(tg.get("issue"), int)
              and isinstance(tg.get("baseline"), str) and _number(tg.get("predicted_ratio")),
              f"{where} targets[{j}]", tg, "an object with issue, baseline, predicted_ratio")
    base = c.get("baselines")
    _need(base is None or isinstance(base, dict), f"{where} baselines", base, "an object")
    for k, b in (base or {}).items():
        _need(isinstance(b, dict) and (b.get("t") is None or _number(b["t"]) and b["t"] >= 0),
              f"{where} baselines.{k}", b, "an object with a finite time t (s)")
    _need(isinstance(c.get("kernels", []), list), f"{where} kernels", c.get("kernels"),
          "a list")
    for j, k in enumerate(c.get("kernels", [])):
        _need(isinstance(k, dict) and isinstance(k.get("kernel"), str)
              and isinstance(k.get("predicted"), dict) and _number(k["predicted"].get("t")),
              f"{where} kernels[{j}]", k, "an object with kernel and predicted.t")
    glue = c.get("glue")
    _need(glue is None or isinstance(glue, dict) and all(
        _number(glue.get(k, 0)) for k in ("n_ops", "t_s")), f"{where} glue", glue,
        "an object with numbers n_ops and t_s")


def _pred_case(pred: Optional[Prediction], op: str, shape: dict, subject: str,
               mode: str) -> Optional[dict]:
    for c in (pred.cases.get(case_key(op, shape, subject), []) if pred else []):
        forward_only = bool(c["shape"].get("forward_only") or c["shape"].get("decode"))
        if forward_only == (mode == "fwd"):
            return c
    return None


def _pred_ratio(case: Optional[dict], rule: Rule) -> Optional[float]:
    if case is None:
        return None
    for t in case.get("targets", []):
        if t["issue"] == rule.issue and t["baseline"] == rule.baseline:
            return t["predicted_ratio"]
    return None


def kernel_rows(case: dict, measured: Dict[str, Dict[str, float]]) -> List[tuple]:
    """Predicted against measured per kernel of one case: (kernel, predicted launches,
    measured launches per call, predicted µs, measured µs). Measured names are matched to the
    model's Triton kernel names (exactly, else by the longest model name they start with); a
    kfused kernel (its name starts with "_") the model has none of keeps a row of its own
    (0 predicted: a kernel the predicted commit no longer launches); the rest (cuBLAS, torch
    element-wise, copies) is set against the model's torch glue."""
    names = sorted({k["kernel"] for k in case.get("kernels", [])}, key=len, reverse=True)
    pred: Dict[str, List[float]] = {}
    for k in case.get("kernels", []):
        v = pred.setdefault(k["kernel"], [0, 0.0])
        v[0] += 1
        v[1] += k["predicted"]["t"] * 1e6
    glue = "other (torch glue, cuBLAS)"
    g = case.get("glue") or {}
    pred[glue] = [g.get("n_ops", 0), g.get("t_s", 0.0) * 1e6]
    meas: Dict[str, List[float]] = {}
    for name, m in measured.items():
        to = name if name in pred else next((n for n in names if name.startswith(n)),
                                            name if name.startswith("_") else glue)
        v = meas.setdefault(to, [0.0, 0.0])
        v[0] += m["launches"]
        v[1] += m["us"]
        if to not in pred:
            pred[to] = [0, 0.0]
    order = [n for n in pred if n != glue] + [glue]
    return [(n, pred[n][0], meas.get(n, [0, 0.0])[0], pred[n][1], meas.get(n, [0, 0.0])[1])
            for n in order if pred[n][1] or n in meas]


# ------------------------------------------------------------------------------------------
# writing


def _case_label(op: str, shape: dict) -> str:
    skip = {"L", "r", "composition", "adapter_params", "padded_tokens"}
    parts = []
    for k, v in shape.items():
        if k in skip:
            continue
        if isinstance(v, list):
            v = f"{len(v)} seqs" if k == "lens" else "x".join(map(str, v))
        parts.append(f"{k}={v}")
    return ", ".join(parts)


def device_ms(row: dict) -> Tuple[Optional[float], str]:
    """(ms, source) of a bench row's device-bound time: the call captured in a CUDA graph and
    replayed ("graph"), else the sum of its kernels' times under torch.profiler ("kernels":
    no launch gaps), else (None, "")."""
    if row.get("graph_ms_p50"):
        return float(row["graph_ms_p50"]), "graph"
    k = row.get("kernels")
    if k:
        return sum(float(v["us"]) for v in k.values()) / 1e3, "kernels"
    return None, ""


def _fmt_ms(ms: Optional[float]) -> str:
    if ms is None:
        return "—"
    return f"{ms * 1e3:.1f} µs" if ms < 1 else f"{ms:.3f} ms"


def render(runs: List[dict], pred: Optional[Prediction] = None,
           pred_source: Optional[str] = None, skipped: Iterable[str] = ()) -> str:
    """RESULTS.md text for ``runs`` (:func:`load_runs`) and the optional prediction;
    ``skipped``: the files :func:`load_runs` passed over, said in the report."""
    lines = [MARKER, "", "# Measured results", ""]
    if not runs:
        lines.append("No `kfused bench` JSON was given: nothing measured.")
        return "\n".join(lines) + "\n"
    lines += ["Every ratio is measured: the median time of the provider held to the target "
              "over the baseline's, in the same run (same JSON file, shape and mode). "
              "\"predicted\" is `kfused perf`'s static model for the same case, where it has "
              "one" + (f" (`{pred_source}`" + (f", predicted at commit {pred.commit[:12]}"
                                                if pred and pred.commit else "") + ")"
                       if pred_source else "")
              + ".", ""]
    lines += ["## Runs", "", "| file | device | driver | CUDA | torch | triton | commit | "
              "d2d copy GB/s | bf16 matmul TFLOP/s | quick | complete |", "|---" * 11 + "|"]
    for run in runs:
        m = run["meta"]
        c = m.get("ceilings") or {}
        cp, mm = c.get("d2d_copy_GBps"), c.get("bf16_matmul_8192_TFLOPs")
        lines.append(f"| {Path(run['path']).name} | {m.get('device')} | {m.get('driver')} | "
                     f"{m.get('cuda')} | {m.get('torch')} | {m.get('triton')} | "
                     f"{str(m.get('git_commit'))[:12]} | "
                     f"{f'{cp:.0f}' if cp else '—'} | {f'{mm:.0f}' if mm else '—'} | "
                     f"{m.get('quick', False)} | {m.get('complete', True)} |")
    lines.append("")
    for why in skipped:
        lines += [f"**Passed over: {why}.**", ""]
    if pred is not None:
        from kfused.perf.roofline import DEVICES, device_key
        other = sorted({str(r["meta"].get("device")) for r in runs
                        if r["meta"].get("device_type", "cuda") == "cuda"
                        and device_key(str(r["meta"].get("device"))) != pred.device})
        if other:
            modelled = DEVICES.get(pred.device, {}).get("NAME", pred.device)
            lines += [f"**The prediction models an {modelled}; measured on "
                      f"{', '.join(other)}:** predicted against measured compares different "
                      "devices (regenerate it with `kfused perf --device "
                      "<key>` where the model knows the device: "
                      f"{', '.join(sorted(DEVICES))}).", ""]
    unpinned = [Path(r["path"]).name for r in runs if "sdpa_pinned" not in r["meta"]
                and any(x["op"] == _IND and x["provider"] == "sdpa" for x in r["rows"])]
    if unpinned:
        lines += [f"**{', '.join(unpinned)}: its `sdpa` rows timed SDPA on the backend torch "
                  "chose, not pinned to the flash backend the inducer targets name** (the run "
                  "predates the bench's `sdpa_pinned` meta). With torch ≥ 2.11 and cuDNN > "
                  "9.15 on an H100/H200, torch tries cuDNN attention first "
                  "(check_prefer_cudnn_attention), so those verdicts likely compare kfused "
                  "with a faster baseline than the target's, and the performance model "
                  "(FlashAttention-2) does not price it. Runs since time `sdpa` on the flash "
                  "backend and torch's choice as `sdpa-default`.", ""]
    shared = [Path(r["path"]).name for r in runs if "compile_cache" not in r["meta"]
              and any(x["provider"] in ("flex", "compile") and "ms_p50" in x
                      for x in r["rows"])]
    if shared:
        lines += [f"**{', '.join(shared)}: torch.compile baselines (`flex`, `compile`) "
                  "shared one Dynamo cache across cases** (before the bench's "
                  "`compile_cache` meta): once a function reached Dynamo's recompile limit "
                  "(8), later rows timed it uncompiled. The 2026-11-27 inducer run hit it "
                  "after three cases (its log: flex_attention, recompile_limit (8)): every "
                  "`flex` row after them is the unfused eager fallback, and a verdict against "
                  "it says nothing about FlexAttention.", ""]
    cpu = [Path(r["path"]).name for r in runs if r["meta"].get("device_type", "cuda") != "cuda"]
    if cpu:
        lines += [f"**Not a GPU run ({', '.join(cpu)}): the Triton kernels ran in the "
                  "interpreter or not at all; these ratios say nothing about the targets.**",
                  ""]
    met = failed = missing = 0
    target_lines = ["## Targets", "", "\"measured\" is the eager call as a user makes it "
                    "(host Python and launches included); \"CUDA graph\" the same call "
                    "captured once and replayed (device-bound: the host's cost apart), where "
                    "both providers could be captured.", "",
                    "| issue | op | case | mode | target | subject vs "
                    "baseline | measured | limit | met | CUDA graph | predicted |",
                    "|---" * 11 + "|"]
    timing = ["## Predicted against measured time", "",
              "The model predicts device time. \"measured\" is the eager call (host cost "
              "included); \"device\" the same call captured in a CUDA graph and replayed "
              "(graph), else the sum of its kernels' times under torch.profiler (kernels), "
              "the number to hold the prediction to.", "",
              "| op | case | mode | provider | predicted | measured | measured / predicted | "
              "device | device / predicted |",
              "|---" * 9 + "|"]
    per_kernel = ["## Predicted against measured per kernel", "",
                  "Device time per call (torch.profiler) of the provider held to the target, "
                  "kernel by kernel, against the model's prediction for that launch. A kernel "
                  "predicted but \"not run\" was not launched in the measured run (a kernel "
                  "its commit did not have).", ""]
    timed, profiled = set(), set()

    def note(run, op, shape, mode, prov, p_s, ms, kernels=None, case=None, device=(None, "")):
        """One predicted-against-measured time row (once per run, case, mode, provider) and,
        for a profiled row, its per-kernel table. ``device``: (ms, source) of
        :func:`device_ms`."""
        key = (run["path"], op, _key(shape), mode, prov)
        label = _case_label(op, shape)
        if p_s and key not in timed:
            timed.add(key)
            dev_ms, src = device
            dev = (f"{_fmt_ms(dev_ms)} ({src}) | {dev_ms / (p_s * 1e3):.2f}"
                   if dev_ms else "— | —")
            timing.append(f"| {op} | {label} | {mode} | {prov} | {_fmt_ms(p_s * 1e3)} | "
                          f"{_fmt_ms(ms)} | {ms / (p_s * 1e3):.2f} | {dev} |")
        if kernels and case is not None and key not in profiled:
            profiled.add(key)
            per_kernel.extend([f"**{op} {label}, {mode}, {prov}**", "",
                               "| kernel | launches predicted | launches measured | "
                               "predicted | measured | measured / predicted |",
                               "|---" * 6 + "|"])
            for name, lp, lm, tp, tm in kernel_rows(case, kernels):
                if lp and not lm:
                    # predicted, never launched in the measured run: a kernel the measured
                    # commit did not have (or that case did not reach), not a 0 µs kernel
                    per_kernel.append(f"| {name} | {lp:g} | 0 | {tp:.1f} µs | not run | — |")
                    continue
                ratio = f"{tm / tp:.2f}" if tp else "—"
                per_kernel.append(f"| {name} | {lp:g} | {lm:g} | {tp:.1f} µs | "
                                  f"{tm:.1f} µs | {ratio} |")
            per_kernel.append("")

    for run in runs:
        for e in evaluate(run["rows"]):
            rule = e["rule"]
            case = _pred_case(pred, e["op"], e["shape"], e["subject"], e["mode"])
            pr = _pred_ratio(case, rule)
            label = _case_label(e["op"], e["shape"])
            if "ratio" in e:
                verdict = "yes" if e["met"] else "**NO**"
                met += e["met"]
                failed += not e["met"]
                measured = f"{e['ratio']:.2f}x"
            else:
                verdict, measured = "not measured", e["missing"].replace("|", "/")
                missing += 1
            graph = (f"{e['graph_ratio']:.2f}x " + ("yes" if e["graph_met"] else "**NO**")
                     if "graph_ratio" in e else "—")
            target_lines.append(
                f"| #{rule.issue} | {e['op']} | {label} | {e['mode']} | {rule.text} | "
                f"{rule.subject} vs {rule.baseline} | {measured} | {rule.limit()} | "
                f"{verdict} | {graph} | {f'{pr:.2f}x' if pr is not None else '—'} |")
            if case is None or "ms" not in e:
                continue
            base = (case.get("baselines") or {}).get(rule.baseline) or {}
            note(run, e["op"], e["shape"], e["mode"], e["subject"], case.get("predicted_t_s"),
                 e["ms"], e.get("kernels"), case, device=e["device"])
            note(run, e["op"], e["shape"], e["mode"], rule.baseline, base.get("t"),
                 e["ms_baseline"], device=e["device_baseline"])
        # paths the model predicts that no target holds (KronA's exact path): time only
        for r in run["rows"]:
            if (r["op"], r["provider"]) in TIMED_ONLY and "ms_p50" in r:
                case = _pred_case(pred, r["op"], r["shape"], r["provider"], r["mode"])
                if case is not None:
                    note(run, r["op"], r["shape"], r["mode"], r["provider"],
                         case.get("predicted_t_s"), r["ms_p50"], r.get("kernels"), case,
                         device=device_ms(r))
    lines.append(f"**{met} met, {failed} not met, {missing} not measured.**")
    lines += [""] + target_lines + [""]
    if len(timing) > 4:
        lines += timing + [""]
    if profiled:
        lines += per_kernel
    return "\n".join(lines)


def write(path, text: str) -> None:
    """Write RESULTS.md at ``path``: a new file, or one this command wrote before (its first
    line is :data:`MARKER`); anything else is refused (kfused never overwrites a file it did
    not write). Replaced atomically."""
    from kfused._files import replace_atomically

    path = Path(path)
    if path.is_symlink():
        raise FileExistsError(f"{path} is a symbolic link; not replacing it")
    if path.is_dir():
        raise FileExistsError(f"{path} is a directory; give the RESULTS.md file to write")
    if path.exists():
        try:
            first = path.read_text().split("\n", 1)[0]
        except (OSError, UnicodeDecodeError):
            first = ""
        if first != MARKER:
            raise FileExistsError(f"{path} exists and was not written by `kfused results`; "
                                  "not overwriting it")

    def dump(tmp: str) -> None:
        Path(tmp).write_text(text)

    replace_atomically(str(path), dump)

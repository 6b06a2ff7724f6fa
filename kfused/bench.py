"""The shared benchmark harness: cases, providers and measurement.

A benchmark script (benchmarks/bench_<op>.py) exposes ``cases(device, dtype, quick)`` returning
a list of :class:`BenchCase`. Each case holds providers (kfused-triton, kfused-cuda, eager
reference, torch.compile of the reference, materialised baselines, the frozen floor, ...).
A provider's ``make()`` builds fresh inputs and returns ``(fn, grad_leaves)`` where ``fn()`` runs
the forward and returns the output tensor(s); backward is measured as ``autograd.grad`` of the
outputs with a fixed random upstream gradient into ``grad_leaves``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

Tensors = Union[torch.Tensor, Tuple[torch.Tensor, ...]]

# The backend the inducer benchmark's "sdpa" provider is pinned to (its "sdpa-default" runs
# torch's own choice); bench JSON records it as meta["sdpa_pinned"]. Runs without that key
# timed "sdpa" on torch's choice (kfused.results says so beside their verdicts).
SDPA_PINNED = "flash"


@dataclasses.dataclass
class Provider:
    name: str
    make: Callable[[], Tuple[Callable[[], Tensors], List[torch.Tensor]]]
    skip_reason: Optional[str] = None


@dataclasses.dataclass
class BenchCase:
    op: str
    shape: Dict[str, object]
    dtype: torch.dtype
    providers: List[Provider]
    flops_fwd: Optional[float] = None      # useful FLOPs of the forward
    flops_bwd: Optional[float] = None
    bytes_fwd: Optional[float] = None      # minimum bytes the forward must move


def _as_tuple(x: Tensors) -> Tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def _timer(fn: Callable[[], object], device: torch.device, rep_ms: float, warmup_ms: float
           ) -> Tuple[float, float, float]:
    """(p20, median, p80) in milliseconds."""
    if device.type == "cuda":
        import triton.testing

        q = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.2, 0.5, 0.8])
        return tuple(float(v) for v in q)  # type: ignore[return-value]
    times = []
    fn()
    t_end = time.perf_counter() + rep_ms / 1e3
    while True:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() > t_end and len(times) >= 3:
            break
    times.sort()
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]  # noqa: E731
    return pick(0.2), pick(0.5), pick(0.8)


def graph_timer(fn: Callable[[], object], device: torch.device, rep_ms: float
                ) -> Tuple[float, float, float]:
    """(p20, median, p80) ms of ``fn`` captured once in a CUDA graph and replayed: the
    device-bound time, without the host's Python and launch cost (which ``_timer`` includes:
    on the H100 machine of 2026-11-27 the KronA fold path's fwd+bwd spent 1.38 ms on the host
    for 0.17 ms of kernels). Raises where ``fn`` cannot be captured (a host sync, a CPU
    tensor, a first-call compilation inside).

    The capture runs on the current stream when that is not the device's default stream
    (:func:`measure` runs each provider on a stream of its own, so that the autograd nodes
    of its leaves live on the stream captured: a backward whose AccumulateGrad node sits on
    the legacy default stream syncs with it, which invalidates the capture — every fwd+bwd
    capture of the H200 run of 2026-11-30 failed so); else on a side stream. A failed
    capture leaves the default CUDA generator marked as capturing (every later random draw
    in the process raised "Offset increment outside graph capture"): its state is renewed
    before the error is raised on."""
    import triton.testing

    fn()                                   # compiled, cached, allocator warm
    torch.cuda.synchronize(device)
    cur = torch.cuda.current_stream(device)
    own = cur != torch.cuda.default_stream(device)
    side = cur if own else torch.cuda.Stream(device)
    if not own:
        side.wait_stream(cur)
    try:
        with torch.cuda.stream(side):      # a capture must not run on the legacy stream
            for _ in range(2):
                fn()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                fn()
    except BaseException:
        renew_generators(device)
        raise
    if not own:
        cur.wait_stream(side)
    torch.cuda.synchronize(device)
    q = triton.testing.do_bench(graph.replay, warmup=max(1.0, rep_ms / 4), rep=rep_ms,
                                quantiles=[0.2, 0.5, 0.8])
    del graph
    return tuple(float(v) for v in q)  # type: ignore[return-value]


def renew_generators(device: torch.device) -> None:
    """Give the device's default CUDA generator a fresh copy of its own state (same seed and
    offset; not capturing): after a capture that failed the generator still counts itself
    inside the capture and refuses every draw outside it."""
    try:
        torch.cuda.synchronize(device)
    except Exception:  # the capture's error may surface here; the state is what matters
        pass
    idx = device.index if device.index is not None else torch.cuda.current_device()
    gen = torch.cuda.default_generators[idx]
    gen.graphsafe_set_state(gen.clone_state())


@contextlib.contextmanager
def _provider_stream(device: torch.device):
    """Each provider's calls on a CUDA stream of its own (see :func:`graph_timer`)."""
    if device.type != "cuda":
        yield
        return
    cur = torch.cuda.current_stream(device)
    s = torch.cuda.Stream(device)
    s.wait_stream(cur)
    try:
        with torch.cuda.stream(s):
            yield
    finally:            # a provider that failed is recorded and the next one runs after it
        cur.wait_stream(s)


def _peak_mem(fn: Callable[[], object], device: torch.device) -> Optional[int]:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def allow_backward_replay() -> None:
    """Turn AOTAutograd's buffer donation off for this process (torch >= 2.6 has the switch;
    older ones never donate). The harness replays one backward (``bwd`` mode,
    retain_graph=True), which a donating backward refuses ("compiled with non-empty donated
    buffers"): every torch.compile baseline (KronA, q|k|v, output projection, inducer) would
    lose its row. Set before the first compiled call: the backward is compiled lazily at the
    first backward, and Dynamo's cache then hands that donating graph to every later
    ``torch.compile`` of the same function (seen: ``test_bench_cases`` then
    ``test_rough_edges`` in one process)."""
    cfg = getattr(getattr(torch, "_functorch", None), "config", None)
    if cfg is not None and hasattr(cfg, "donated_buffer"):
        cfg.donated_buffer = False


# What measure() does about torch.compile baselines; bench JSON records it as
# meta["compile_cache"]. Before it, a family's compiled baselines shared one Dynamo cache per
# function across cases: flex_attention hit Dynamo's recompile limit (8) after three cases of
# the 2026-11-27 H100 run, and every later flex row timed the unfused eager fallback (36-99 ms
# where the fused kernel takes ~3-5), silently.
COMPILE_CACHE = "fresh per case; the recompile limit hit is an error"


def _fresh_compile_cache():
    """Dynamo's caches emptied (each case's torch.compile baselines compile for its own
    shapes, as a user's one model would) and a context in which reaching the recompile limit
    raises instead of running the function uncompiled."""
    import contextlib

    try:
        import torch._dynamo as dyn
    except ImportError:             # a torch without Dynamo compiles nothing
        return contextlib.nullcontext()
    dyn.reset()
    return dyn.config.patch(fail_on_recompile_limit_hit=True)   # torch 2.11 and 2.13 name it


def fwdbwd_step(provider) -> Callable[[], None]:
    """One forward and backward of a benchmark provider, as a no-argument call: its outputs'
    gradients (random, drawn once) taken with respect to its leaves. A forward-only case
    (decode: no leaves, or no output that needs a gradient) is its forward alone."""
    fn, leaves = provider.make()
    outs = _as_tuple(fn())
    if not leaves or not any(o.requires_grad for o in outs):
        return lambda: fn()
    gouts = [torch.randn_like(o) for o in outs]

    def step():
        o = _as_tuple(fn())
        pairs = [(a, g) for a, g in zip(o, gouts) if a.requires_grad]
        torch.autograd.grad([a for a, _ in pairs], leaves, [g for _, g in pairs],
                            allow_unused=True)
    return step


def kernel_events(events, calls: int) -> Dict[str, Dict[str, float]]:
    """Device time per kernel name from torch.profiler events of ``calls`` identical calls:
    {name: {"us": device µs per call, "launches": per call}} (device-side events only:
    kernels, copies and sets; host events are passed over). The launches per call are the
    events per call rounded (at least 1) and the time their mean duration times that: the
    profiler can drop the first kernel records of a session, which would otherwise read as
    fewer launches or less time."""
    from torch.autograd import DeviceType

    seen: Dict[str, List[float]] = {}
    for e in events:
        if getattr(e, "device_type", None) not in (DeviceType.CUDA,):
            continue
        seen.setdefault(e.name, []).append(e.time_range.elapsed_us())
    out: Dict[str, Dict[str, float]] = {}
    for name, times in seen.items():
        launches = max(1, round(len(times) / calls))
        out[name] = {"us": sum(times) / len(times) * launches, "launches": float(launches)}
    return out


def kernel_times(fn: Callable[[], object], device: torch.device, calls: int = 5
                 ) -> Optional[Dict[str, Dict[str, float]]]:
    """:func:`kernel_events` of ``calls`` runs of ``fn`` under torch.profiler (CUDA only: the
    per-kernel time ``kfused results`` sets beside the performance model's per-kernel
    prediction); None on other devices."""
    if device.type != "cuda":
        return None
    import os

    from torch.profiler import ProfilerActivity, profile

    # CUPTI finalised when the profiler stops (torch's default since 2.7 unless CUDA graphs
    # run): left active it slows every later launch, i.e. the timings of the next providers
    os.environ.setdefault("TEARDOWN_CUPTI", "1")

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
    return kernel_events(prof.events(), calls)


def measure(case: BenchCase, device: Union[str, torch.device], *, rep_ms: float = 100,
            warmup_ms: float = 25, modes: Sequence[str] = ("fwd", "bwd", "fwd+bwd"),
            kernels: bool = False, graphs: bool = True) -> List[dict]:
    """Measure every provider of a case; one row per (provider, mode). ``kernels``: on CUDA,
    every provider's fwd and fwd+bwd rows also get the device time per kernel
    (:func:`kernel_times`; a profiler failure is recorded in ``kernels_error``, the timing
    stands). ``graphs``: on CUDA, those rows also get ``graph_ms_p20/p50/p80``, the call
    captured in a CUDA graph and replayed (:func:`graph_timer`: the device-bound time; a
    capture failure is recorded in ``graph_error``)."""
    device = torch.device(device)
    allow_backward_replay()
    with _fresh_compile_cache():
        return _measure(case, device, rep_ms, warmup_ms, modes, kernels, graphs)


def _measure(case, device, rep_ms, warmup_ms, modes, kernels, graphs) -> List[dict]:
    rows = []
    for prov in case.providers:
        base = {"op": case.op, "shape": dict(case.shape), "dtype": str(case.dtype).replace("torch.", ""),
                "provider": prov.name}
        if prov.skip_reason:
            rows.append({**base, "mode": "all", "skipped": prov.skip_reason})
            continue
        try:
            with _provider_stream(device):
                fn, leaves = prov.make()
                outs = _as_tuple(fn())
                gen = torch.Generator(device=device).manual_seed(0)
                gouts = [torch.randn(o.shape, device=device, dtype=o.dtype, generator=gen) for o in outs]
                grad_ok = bool(leaves) and any(o.requires_grad for o in outs)
                del outs       # its autograd graph is not kept alive across the modes

                def run_fwd():
                    with torch.no_grad():
                        return fn()

                def run_fwdbwd():
                    o = _as_tuple(fn())
                    pairs = [(a, g) for a, g in zip(o, gouts) if a.requires_grad]
                    torch.autograd.grad([a for a, _ in pairs], leaves, [g for _, g in pairs],
                                        allow_unused=True)

                for mode in modes:
                    if mode != "fwd" and not grad_ok:
                        continue
                    if mode == "fwd":
                        q = _timer(run_fwd, device, rep_ms, warmup_ms)
                        mem = _peak_mem(run_fwd, device)
                    elif mode == "fwd+bwd":
                        q = _timer(run_fwdbwd, device, rep_ms, warmup_ms)
                        mem = _peak_mem(run_fwdbwd, device)
                    else:  # bwd alone: one graph, backward replayed
                        o = _as_tuple(fn())
                        pairs = [(a, g) for a, g in zip(o, gouts) if a.requires_grad]

                        def run_bwd():
                            torch.autograd.grad([a for a, _ in pairs], leaves,
                                                [g for _, g in pairs], retain_graph=True,
                                                allow_unused=True)

                        q = _timer(run_bwd, device, rep_ms, warmup_ms)
                        mem = _peak_mem(run_bwd, device)
                        o = pairs = None   # the retained graph freed before the next mode
                    row = {**base, "mode": mode, "ms_p20": q[0], "ms_p50": q[1], "ms_p80": q[2],
                           "peak_mem_bytes": mem}
                    flops = {"fwd": case.flops_fwd, "bwd": case.flops_bwd,
                             "fwd+bwd": (case.flops_fwd or 0) + (case.flops_bwd or 0) or None}[mode]
                    if flops:
                        row["tflops"] = flops / (q[1] * 1e-3) / 1e12
                    if mode == "fwd" and case.bytes_fwd:
                        row["gbps"] = case.bytes_fwd / (q[1] * 1e-3) / 1e9
                    if device.type == "cuda" and mode != "bwd" and graphs:
                        try:
                            gq = graph_timer(run_fwd if mode == "fwd" else run_fwdbwd, device,
                                             rep_ms)
                            row.update(graph_ms_p20=gq[0], graph_ms_p50=gq[1], graph_ms_p80=gq[2])
                        except Exception as exc:  # the eager timing above stands
                            row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
                    if kernels and mode != "bwd":
                        try:
                            kt = kernel_times(run_fwd if mode == "fwd" else run_fwdbwd, device)
                            if kt is not None:
                                row["kernels"] = kt
                        except Exception as exc:  # the timing above stands
                            row["kernels_error"] = f"{type(exc).__name__}: {exc}"[:300]
                    rows.append(row)
        except Exception as exc:  # a provider that fails is reported, not fatal
            rows.append({**base, "mode": "all", "error": f"{type(exc).__name__}: {exc}"})
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


# the fused backends' providers in the benchmark cases, by backend name
FUSED_PROVIDERS = {"kfused-triton": "triton", "kfused-cuda": "cuda"}


def backend_prefs(rows: Sequence[dict], regime_of: Callable[[str, dict], Optional[str]]
                  ) -> Dict[str, Dict[str, List[str]]]:
    """``{op: {regime: [backend, ...] fastest first}}`` from measured rows: for each op and
    regime (``regime_of(op, shape)``; None: the op has none), the fused backends compared on
    the cases and modes where each of them was measured, by the sum of their medians (a tie
    keeps the order of FUSED_PROVIDERS). Needs at least two backends measured together."""
    times: Dict[Tuple[str, str, str, str], Dict[str, float]] = {}
    for r in rows:
        backend = FUSED_PROVIDERS.get(r.get("provider", ""))
        if backend is None or "ms_p50" not in r:
            continue
        reg = regime_of(r["op"], r["shape"])
        if reg is None:
            continue
        key = (r["op"], reg, repr(sorted(r["shape"].items())), r["mode"])
        times.setdefault(key, {})[backend] = float(r["ms_p50"])
    sums: Dict[Tuple[str, str], Dict[str, float]] = {}
    for (op, reg, _, _), by in times.items():
        if len(by) < 2:
            continue
        acc = sums.setdefault((op, reg), {})
        for backend, t in by.items():
            acc[backend] = acc.get(backend, 0.0) + t
    rank = list(FUSED_PROVIDERS.values())
    out: Dict[str, Dict[str, List[str]]] = {}
    for (op, reg), acc in sorted(sums.items()):
        out.setdefault(op, {})[reg] = sorted(acc, key=lambda b: (acc[b], rank.index(b)))
    return out

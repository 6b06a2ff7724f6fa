"""Time the candidate launch configurations of some kernels on a GPU; record the fastest per shape.

    python3 benchmarks/tune_kernels.py [--table kfused/data/kernel_tuning.json]
                                       [--out tune.json] [--shapes targets|all] [--reps-ms 30]
                                       [--kernels attn,krona,rank,narrow]
    python3 benchmarks/tune_kernels.py --compile-only      # any machine: compile for sm_90
    python3 benchmarks/tune_kernels.py --warm-only         # GPU: compile + launch, untimed

Kernels whose measured time the roofline model does not explain (a short dependent chain per
loop step; benchmarks/results/h100/proof-2026-11-27), each with a few candidate launch
configurations (tokens per step, warps, stages), every one tested on the CPU and compiling
for sm_90 without spills (``--compile-only`` checks it; CI runs it on one shape):
- ``krona``: ``_kron_grad_kernel``, the factor-gradient pass of KronA's folded backward (dA,
  dB from one read of x and dy): 43.0 µs on the H100 of 2026-11-27 (T = 16384, 768², 24×24 /
  32×32) against 20.9 predicted, with the rule's 2 tokens per step
  (:func:`kfused.triton_kernels.krona_linear.grad_candidates`, including the block-diagonal
  form of the step, ``_kron_grad_bd_kernel``, label suffix ``-bd``, and the tensor-core
  narrow kernel, ``_kron_narrow_tc_kernel``, ``-tc``: new, not yet timed); shapes: the
  benchmark's factor shapes on the tensor-core path.
- ``narrow``: the factor-gradient pass for factor pairs with two small sides (the paper's
  2×384 / 384×2, 8×384 / 384×2): the CUDA-core ``_kron_narrow_grad_kernel`` measured 56.5
  and 193 µs at T = 16384 on the H200 (2026-11-30; 15.5 and 34 predicted), its step's
  block-wide reductions unpriced; ``_kron_narrow_tc_kernel``, the same sums as tensor-core
  products (16-bit, no dx), is the rule now and not yet measured
  (:func:`kfused.triton_kernels.krona_linear.narrow_candidates`: the tensor-core kernel's
  warps and stages, then the CUDA-core kernel's tile and warps, one table entry for both
  under ``_kron_narrow_grad_kernel``); shapes: the benchmark's "paper2" factor shapes.
- ``rank``: ``_lr_rank_bwd_kernel``, the rank pass of the headwise q|k|v backward: 92.5 µs
  against 30.4 predicted (GPT-2 small, Kernel-mix qvo-intermediate; one 8-warp CTA per SM)
  (:data:`kfused.triton_kernels._headwise_common.RANK_CANDIDATES`); shapes: the sections a
  benchmark case's real forward and backward hand it.
- ``attn``: the inducer attention's forward, dQ and dK/dV kernels (p = 128 ran at 1.3-2.7x
  their prediction on the H200 of 2026-11-30; :data:`kfused.triton_kernels.inducer_attention.
  ATTN_CANDIDATES`: tiles, warps, stages per head width; each timed within its pass, whose
  other launches add the same time to every candidate) on the benchmark's n = 2048 cases,
  and the split-KV decode's key step (``DECODE_CANDIDATES``) on its grouped-query cases.
  Timed first by default, then ``narrow`` (its tensor-core candidates are new): ``krona``
  and ``rank`` were timed on the H200 already.

On a GPU (bf16) each candidate's call (the kernel and what sums its partials) is captured in a
CUDA graph and replayed (device time, no host cost: ``kfused.bench.graph_timer``); the fastest
per shape is merged into ``--table`` (:mod:`kfused.tuning`: ``KFUSED_KERNEL_TUNING`` points the
library at a table; the package's ``kfused/data/kernel_tuning.json`` is the committed one),
every time into ``--out`` with the device, versions and commit. ``benchmarks/gpu_suite.sh
proof`` warms the candidates beside its tests, runs this before its benchmarks and points
them at the table.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch

from kfused import _files

KERNEL = "_kron_grad_kernel"


def shapes(which: str):
    """(T, a_out, a_in, b_out, b_in) as ``kron_factor_grads`` is called, the benchmark's
    factor shapes on the tensor-core path (every padded factor dim >= 16, kernel-side)."""
    from kfused.cases import krona as kc
    from kfused.triton_kernels import krona_linear as kl

    widths = kc.QUICK_WIDTHS if which == "targets" else kc.WIDTHS
    tokens = [16384] if which == "targets" else kc.TOKENS
    out = []
    for d_in, d_out in widths:
        for fac in ("sqrt", "glue"):
            fs = kc.factor_shapes(d_in, d_out, fac)
            if fs is None:
                continue
            (a_out, a_in), (b_out, b_in) = fs
            if kl.grad_candidates(16384, *kernel_side(a_out, a_in, b_out, b_in)):
                for T in tokens:
                    if (T, a_out, a_in, b_out, b_in) not in out:
                        out.append((T, a_out, a_in, b_out, b_in))
    return out


def kernel_side(a_out, a_in, b_out, b_in):
    """The factors as the kernel sees them (kron_factor_grads swaps some pairs)."""
    from kfused.triton_kernels import krona_linear as kl

    if kl._swap_factors(a_out, a_in, b_out, b_in):
        return b_out, b_in, a_out, a_in
    return a_out, a_in, b_out, b_in


def label(c: dict) -> str:
    if "BLOCK_N" in c and "BLOCK_M" not in c:
        return f"keys{c['BLOCK_N']}-w{c['num_warps']}-s{c['num_stages']}"
    if "BLOCK_M" in c:
        return f"{c['BLOCK_M']}x{c['BLOCK_N']}-w{c['num_warps']}-s{c['num_stages']}"
    if c.get("NARROW") == 2:
        return f"tc{c['TILE']}-w{c['num_warps']}-s{c['num_stages']}"
    if c.get("NARROW"):
        return f"tile{c['TILE']}-w{c['num_warps']}"
    return (f"BT{c['BT']}-w{c['num_warps']}-s{c['num_stages']}"
            + ("-bd" if c.get("BD") else "") + ("-tc" if c.get("TC") else ""))


def narrow_shapes(which: str):
    """(T, a_out, a_in, b_out, b_in) of the benchmark's factor pairs that take the narrow
    factor-gradient kernel (the "paper2" factors)."""
    from kfused.cases import krona as kc
    from kfused.triton_kernels import krona_linear as kl

    widths = kc.QUICK_WIDTHS if which == "targets" else kc.WIDTHS
    tokens = [16384] if which == "targets" else kc.TOKENS
    out = []
    for d_in, d_out in widths:
        fs = kc.factor_shapes(d_in, d_out, "paper2")
        if fs is None or kl.narrow_grad_plan(*fs[0], *fs[1]) is None:
            continue
        out += [(T, *fs[0], *fs[1]) for T in tokens]
    return out


class Job:
    """One shape of one kernel to time: its candidates and a call running a given one."""

    def __init__(self, kernel, text, key, T, candidates, run):
        self.kernel, self.text, self.key, self.T = kernel, text, key, T
        self.candidates, self.run = candidates, run


def _factor_inputs(dev: torch.device, T: int, a_out: int, a_in: int, b_out: int, b_in: int):
    """dy, x, A, B of a factor-gradient call (bf16 on a GPU, float16 elsewhere: the
    interpreter mishandles bfloat16), seeded."""
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float16
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, a_in * b_in, device=dev, dtype=dt, generator=gen)
    g = torch.randn(T, a_out * b_out, device=dev, dtype=dt, generator=gen)
    A = torch.randn(a_out, a_in, device=dev, dtype=dt, generator=gen)
    B = torch.randn(b_out, b_in, device=dev, dtype=dt, generator=gen)
    return g, x, A, B


def krona_jobs(which: str, dev: torch.device):
    """_kron_grad_kernel on the benchmark's tensor-core factor shapes (bf16 on a GPU, float16
    elsewhere: the interpreter mishandles bfloat16)."""
    from kfused.triton_kernels import krona_linear as kl

    for T, a_out, a_in, b_out, b_in in shapes(which):
        g, x, A, B = _factor_inputs(dev, T, a_out, a_in, b_out, b_in)
        ks = kernel_side(a_out, a_in, b_out, b_in)

        def run(c, g=g, x=x, A=A, B=B):
            return kl.kron_factor_grads(g, x, A, B, 0.5, compute_dx=False, config=c)[1:]
        yield Job(KERNEL, f"T={T} A{a_out}x{a_in} B{b_out}x{b_in}",
                  kl.grad_tuning_key(*ks, 2), T, kl.grad_candidates(T, *ks), run)


def narrow_jobs(which: str, dev: torch.device):
    """_kron_narrow_grad_kernel on the benchmark's narrow factor pairs (as krona_jobs)."""
    from kfused.triton_kernels import krona_linear as kl

    for T, a_out, a_in, b_out, b_in in narrow_shapes(which):
        g, x, A, B = _factor_inputs(dev, T, a_out, a_in, b_out, b_in)
        _, _, m, n, K, J = kl.narrow_grad_plan(a_out, a_in, b_out, b_in)

        def run(c, g=g, x=x, A=A, B=B):
            return kl.kron_factor_grads(g, x, A, B, 0.5, compute_dx=False, config=c)[1:]
        yield Job("_kron_narrow_grad_kernel", f"T={T} A{a_out}x{a_in} B{b_out}x{b_in}",
                  kl.narrow_tuning_key(m, n, K, J, 2), T,
                  kl.narrow_candidates(kl.narrow_grad_plan(a_out, a_in, b_out, b_in), 2), run)


def rank_jobs(which: str, dev: torch.device):
    """_lr_rank_bwd_kernel, the rank pass of the headwise q|k|v backward, on the sections of
    the benchmark's GPT-2 q|k|v cases (all widths with ``all``): the sections a real
    forward and backward hand it (captured), then the pass alone."""
    from kfused.bench import fwdbwd_step
    from kfused.cases import bench_cases
    from kfused.triton_kernels import _headwise_common as hc
    from kfused.triton_kernels import headwise_qkv as hq

    dt = torch.bfloat16 if dev.type == "cuda" else torch.float16
    for case in bench_cases("headwise", dev, dt, quick=which == "quick" or dev.type != "cuda"):
        if case.op != "headwise_qkv" or (which == "targets"
                                         and case.shape.get("width") != "gpt2-small"):
            continue
        prov = next((p for p in case.providers if p.name == "kfused-triton"), None)
        if prov is None:
            continue
        seen = []
        real = hq.lr_rank_backward_sections

        def spy(items, config=None):
            seen.append(items)
            return real(items, config)
        hq.lr_rank_backward_sections = spy
        try:
            fwdbwd_step(prov)()
        finally:
            hq.lr_rank_backward_sections = real
        if not seen:
            continue
        items = seen[-1]
        T = items[0][0].shape[0]

        def run(c, items=items):
            return tuple(t for sec in hc.lr_rank_backward_sections(items, c) for t in sec)
        job = Job("_lr_rank_bwd_kernel", f"{case.shape.get('width')} {case.shape.get('preset')}"
                  f" T={T}", hc.rank_tuning_key(items, items[0][0].element_size()), T,
                  hc.rank_candidates(), run)
        job.items = items
        yield job


def attn_shapes(which: str):
    """(B, H, n, p, causal) of the inducer attention's benchmark cases whose kernels take the
    tuned configurations (16-bit, p = 128 first: its kernels ran at 1.3-2.7x their prediction
    on the H200 of 2026-11-30); ``all`` adds causal and n = 16384."""
    out = [(8, 16, 2048, 128, False), (8, 32, 2048, 64, False)]
    if which == "all":
        out += [(8, 16, 2048, 128, True), (8, 32, 2048, 64, True),
                (1, 16, 16384, 128, False), (1, 32, 16384, 64, False)]
    return out


def _attn_inputs(dev: torch.device, B: int, H: int, n: int, p: int, L: int = 4, r: int = 8):
    """q, k, v (B, H, n, p) and an inducer MLP (bottlenecks L, r: the benchmark's), seeded,
    bf16 on a GPU (float16 elsewhere)."""
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float16
    gen = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s, sc=1.0: (torch.randn(*s, device=dev, generator=gen) * sc).to(dt)  # noqa: E731
    q, k, v = (rnd(B, H, n, p) for _ in range(3))
    mlp = (rnd(H, p, L, sc=p ** -0.5), rnd(H, L, sc=0.1), rnd(H, L, p, sc=L ** -0.5),
           rnd(H, p, sc=0.1), rnd(H, p, r, sc=p ** -0.5), rnd(H, r, sc=0.1))
    return q, k, v, mlp


def attn_jobs(which: str, dev: torch.device):
    """The inducer attention's forward, dQ and dK/dV kernels (each timed within its pass: the
    forward with its MLP-rows kernel, a backward kernel with the other two backward launches
    at the rule's configuration, which add the same time to every candidate)."""
    from kfused.triton_kernels import inducer_attention as ia

    for B, H, n, p, causal in attn_shapes(which):
        q, k, v, mlp = _attn_inputs(dev, B, H, n, p)
        d_pad = max(16, ia.next_pow2(p))
        key = ia.attn_tuning_key(d_pad, causal, q.element_size())
        text = f"B={B} H={H} n={n} p={p}" + (" causal" if causal else "")
        out, u, lse, lam, stats, out_lo = ia.inducer_attention_forward(
            q, k, v, mlp, causal=causal, save_lo=True)
        dout = torch.randn_like(out)
        du = torch.randn_like(u)
        fwd = "_inducer_attn_fwd_kernel"

        def run_fwd(c, q=q, k=k, v=v, mlp=mlp, causal=causal):
            return ia.inducer_attention_forward(q, k, v, mlp, causal=causal, save_lo=True,
                                                config=c)[:2]
        yield Job(fwd, text, key, n, ia.attn_candidates(fwd, d_pad), run_fwd)
        for kernel in ia.ATTN_KERNELS[1:]:
            def run_bwd(c, kernel=kernel, q=q, k=k, v=v, mlp=mlp, causal=causal, out=out,
                        u=u, lse=lse, lam=lam, stats=stats, out_lo=out_lo, dout=dout, du=du):
                dq, dk, dv, dmlp, _, _ = ia.inducer_attention_backward(
                    dout, du, None, None, q, k, v, out, lse, stats, lam, mlp, causal=causal,
                    out_lo=out_lo, configs={kernel: c})
                return (dq, dk, dv)
            yield Job(kernel, text, key, n, ia.attn_candidates(kernel, d_pad), run_bwd)
    for B, H, H_kv, n_k, p in decode_shapes(which):
        q, k, v, mlp = _attn_inputs(dev, B, H, n_k, p)
        q, k, v = q[:, :, -1:].contiguous(), k[:, :H_kv].contiguous(), v[:, :H_kv].contiguous()
        lay = ia._Layout(q, k, None)
        plan = ia._DecodePlan(lay, dev)
        key = ia.decode_tuning_key(max(16, ia.next_pow2(p)), plan.split_m, B * H_kv,
                                   q.element_size())

        def run_dec(c, q=q, k=k, v=v, mlp=mlp):
            return ia.inducer_attention_forward(q, k, v, mlp, causal=True, decode=True,
                                                config=c)[:2]
        yield Job(ia.DECODE_TUNING, f"decode B={B} H={H}/{H_kv} n_k={n_k} p={p}", key, n_k,
                  ia.decode_candidates(), run_dec)


def decode_shapes(which: str):
    """(B, H, H_kv, n_k, p) of the inducer attention's grouped-query decode benchmark cases
    (one new token against the cache): the split-KV path's launch."""
    return [(1, 32, 8, 16384, 128), (16, 32, 8, 4096, 128)]


JOBS = {"krona": krona_jobs, "narrow": narrow_jobs, "rank": rank_jobs, "attn": attn_jobs}


def compile_only(which: str, arch: int, limit: int = 0,
                 kernels=("attn", "krona", "rank", "narrow")) -> int:
    """Compile every candidate of every shape for sm_<arch> on CPU stand-ins; print registers,
    spills and shared memory; nonzero when one spills or cannot launch."""
    from kfused.perf.compile import compile_launch, jit_spec, launch_error, recording
    from kfused.triton_kernels import krona_linear as kl

    bad = 0

    def report(text, c, L, override, allow_spill=0):
        nonlocal bad
        kw = dict(L.kwargs)
        if override:     # a traced launch of the rule's config, relaunched with c
            kw.update(c)
        st = compile_launch(L.fn, jit_spec(L.fn, L.args, kw, arch), arch)
        err = launch_error(st, arch)
        ok = st["spill_bytes"] <= allow_spill and err is None
        bad += not ok
        print(f"{L.name} {text} {label(c):12s} regs {st['regs']:3d} spill {st['spill_bytes']} B "
              f"shared {st['shared_bytes']} B ctas/SM {st['ctas_per_sm']}"
              + ("" if ok else f"  <- {err or 'spills'}"), flush=True)

    def factor_launches(todo, candidates, names):
        """Each candidate's launch of a factor-gradient kernel, on CPU stand-ins."""
        for T, a_out, a_in, b_out, b_in in (todo[:limit] if limit else todo):
            for c in candidates(T, a_out, a_in, b_out, b_in):
                x = torch.empty(T, a_in * b_in, dtype=torch.bfloat16)
                g = torch.empty(T, a_out * b_out, dtype=torch.bfloat16)
                A = torch.empty(a_out, a_in, dtype=torch.bfloat16)
                B = torch.empty(b_out, b_in, dtype=torch.bfloat16)
                with recording() as launches:
                    kl.kron_factor_grads(g, x, A, B, 0.5, compute_dx=False, config=c)
                (L,) = [L for L in launches if L.name in names]
                report(f"T={T} A{a_out}x{a_in} B{b_out}x{b_in}", c, L, False)

    if "krona" in kernels:
        factor_launches(shapes(which),
                        lambda T, *f: kl.grad_candidates(T, *kernel_side(*f)),
                        (KERNEL, "_kron_grad_bd_kernel", "_kron_narrow_tc_kernel"))
    if "narrow" in kernels:
        factor_launches(narrow_shapes(which),
                        lambda T, *f: kl.narrow_candidates(kl.narrow_grad_plan(*f), 2),
                        ("_kron_narrow_grad_kernel", "_kron_narrow_tc_kernel"))
    if "attn" in kernels:
        from kfused.perf.cases import all_cases
        from kfused.perf.trace import trace
        from kfused.triton_kernels import inducer_attention as ia

        # the perf model's inducer cases (p = 128 first), each kernel's traced launch relaunched
        # with every candidate; one case a head width with --limit
        cases = [c for c in all_cases() if c.op == "inducer_attention"
                 and "decode" not in c.label and "packed" not in c.label
                 and not c.label.startswith("fwd")]
        cases.sort(key=lambda c: "p=128" not in c.label)
        done = []
        for case in cases:
            width = "p=128" if "p=128" in case.label else "p=64"
            if limit and done.count(width) >= limit:
                continue
            done.append(width)
            launches, _ = trace(case.run)
            for L in launches:
                if L.name in ia.ATTN_KERNELS and not L.kwargs.get("SPLIT_KV"):
                    for c in ia.attn_candidates(L.name, L.kwargs["D_PAD"]):
                        report(case.label, c, L, True)
        # the split-KV decode: its candidates may spill no more than the rule's own launch
        # (Triton 3.9 spills 16 B outside its key loop at p = 128, a known violation)
        dec = [c for c in all_cases() if c.op == "inducer_attention" and "decode" in c.label]
        for case in dec[:limit] if limit else dec:
            launches, _ = trace(case.run)
            for L in launches:
                if L.kwargs.get("SPLIT_KV"):
                    rule = compile_launch(L.fn, jit_spec(L.fn, L.args, L.kwargs, arch), arch)
                    for c in ia.decode_candidates():
                        report(case.label, c, L, True, allow_spill=rule["spill_bytes"])
    if "rank" in kernels:
        from kfused.perf.cases import all_cases
        from kfused.perf.trace import trace
        from kfused.triton_kernels import _headwise_common as hc

        cases = [c for c in all_cases() if c.op == "headwise_qkv"
                 and (which == "all" or "gpt2-small" in c.label)]
        for case in (cases[:limit] if limit else cases):
            launches, _ = trace(case.run)
            for L in [L for L in launches if L.name == "_lr_rank_bwd_kernel"]:
                for c in hc.rank_candidates():
                    report(case.label, c, L, True)
    return 1 if bad else 0


def warm(which: str, kernels=("attn", "krona", "rank", "narrow")) -> int:
    """Compile and launch every candidate once on the GPU, untimed (the Triton cache on disk
    then holds them: the proof runs this beside its tests, and the timed run later loads)."""
    dev = torch.device("cuda")
    for kind in kernels:
        for job in JOBS[kind](which, dev):
            for c in job.candidates:
                t0 = time.monotonic()
                try:
                    job.run(c)
                    torch.cuda.synchronize()
                    msg = "ok"
                except Exception as exc:
                    msg = f"{type(exc).__name__}: {str(exc)[:120]}"
                print(f"{job.kernel} {job.text} {label(c)}: {msg} "
                      f"({time.monotonic() - t0:.1f} s)", flush=True)
    return 0


def tune(which: str, table: str, out: str, reps_ms: float, time_limit: float,
         dev: torch.device = torch.device("cuda"), timer=None, name: str = "",
         kernels=("attn", "krona", "rank", "narrow")) -> int:
    """Time every candidate per shape (``timer(fn, dev, reps_ms)`` -> (p20, p50, p80) ms,
    default ``kfused.bench.graph_timer``), merge the fastest into ``table``, write ``out``."""
    from kfused import tuning
    from kfused.bench import graph_timer
    from kfused.cli.bench import environment

    timer = timer or graph_timer
    name = name or torch.cuda.get_device_name(dev)
    t_end = time.monotonic() + time_limit
    rows, entries = [], {}
    for kind in kernels:
        for job in JOBS[kind](which, dev):
            if time.monotonic() > t_end:
                print(f"time limit: {job.kernel} {job.text} and later not tuned")
                break
            us, ref = {}, None
            for c in job.candidates:
                run = lambda c=c: job.run(c)  # noqa: E731
                try:
                    got = run()
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    if ref is None:
                        ref = got
                    else:   # every candidate computes the same sums (in another order):
                        # report a difference
                        for r, v in zip(ref, got):
                            if r.shape != v.shape:   # token-split partials: their sums
                                r, v = r.sum(0), v.sum(0)
                            d = (r.float() - v.float()).abs().max().item()
                            sc = r.float().abs().max().item()
                            if d > 1e-2 * max(sc, 1e-6):
                                print(f"  {label(c)}: differs from {label(job.candidates[0])}"
                                      f" by {d:.3g} (max {sc:.3g})")
                    us[label(c)] = timer(run, dev, reps_ms)[1] * 1e3
                except Exception as exc:   # a config this GPU cannot launch: not a candidate
                    us[label(c)] = None
                    print(f"  {label(c)}: {type(exc).__name__}: {str(exc)[:120]}")
            timed = [(us[label(c)], c) for c in job.candidates if us.get(label(c))]
            if not timed:
                continue
            best_us, best = min(timed, key=lambda vc: vc[0])
            rule_us = us.get(label(job.candidates[0]))
            print(f"{job.kernel} {job.text}: " + ", ".join(
                f"{k} {v:.1f}" if v else f"{k} -" for k, v in us.items())
                + f" us -> {label(best)}" + (f" ({rule_us / best_us:.2f}x the rule's)"
                                             if rule_us else ""), flush=True)
            entries.setdefault(job.kernel, []).append(
                {"key": job.key, "T": job.T, "config": dict(best),
                 "us": {k: (round(v, 2) if v else None) for k, v in us.items()}})
            rows.append({"kernel": job.kernel, "case": job.text, "T": job.T, "key": job.key,
                         "us": us, "best": label(best), "rule": label(job.candidates[0])})
    meta = environment(dev)
    for kernel, es in entries.items():
        commits = tuning.load(table).get("commits", {}) if os.path.exists(table) else {}
        tuning.merge(table, name, kernel, es,
                     extra={"commits": {**commits, name: meta["git_commit"]}})
    if out:
        text = json.dumps({"written_by": OUT_WRITER, "meta": meta, "rows": rows}, indent=1)
        refusal = out_refusal(out)      # again: a file may have appeared during the run
        if refusal:
            out = _files.new_results_file(os.path.dirname(os.path.abspath(out)),
                                          os.path.splitext(os.path.basename(out))[0], text)
            print(f"tune_kernels: {refusal}; the timings went to {out}")
        else:
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            _files.replace_atomically(out, lambda tmp: pathlib.Path(tmp).write_text(text))
    print(f"{sum(len(v) for v in entries.values())} shapes tuned; table {table}")
    return 0


OUT_WRITER = "benchmarks/tune_kernels.py --out"


def out_refusal(out: str):
    """Why the timings may not go to ``out`` (None if they may): it exists and is not an
    earlier run's (a symbolic link never is: replacing it would replace the link)."""
    if not os.path.lexists(out):
        return None
    if os.path.islink(out) or not os.path.isfile(out):
        return f"{out} exists and is not a file tune_kernels wrote; not replacing it"
    try:
        with open(out) as f:
            mine = json.load(f).get("written_by") == OUT_WRITER
    except (OSError, ValueError, AttributeError):
        mine = False
    return None if mine else (f"{out} exists and was not written by tune_kernels; not "
                              "replacing it")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", default=os.path.join("kfused", "data", "kernel_tuning.json"))
    p.add_argument("--out", default="")
    p.add_argument("--shapes", choices=("targets", "all"), default="targets")
    p.add_argument("--reps-ms", type=float, default=30.0)
    p.add_argument("--time-limit", type=float, default=1e9, help="seconds; shapes after it "
                   "are not tuned")
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--warm-only", action="store_true", help="GPU: compile and launch every "
                   "candidate once, untimed")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--limit", type=int, default=0, help="--compile-only: the first N shapes")
    p.add_argument("--kernels", default="attn,narrow,krona,rank", help="comma list, in the "
                   "order timed (the H200 of 2026-11-30 timed krona, rank and narrow's CUDA-core "
                   "candidates; attn and narrow's tensor-core ones are new): krona "
                   "(KronA's factor-gradient pass), narrow (its narrow-factor form), rank (the "
                   "headwise rank pass), attn (the inducer attention's forward, dQ and dK/dV "
                   "kernels)")
    a = p.parse_args(argv)
    kernels = tuple(k for k in a.kernels.split(",") if k)
    bad = [k for k in kernels if k not in JOBS]
    if bad:
        p.error(f"--kernels: unknown {bad}; expected some of {sorted(JOBS)}")
    refusal = out_refusal(a.out) if a.out else None
    if refusal:                                  # before the GPU time, not after it
        p.error(f"--out: {refusal}")
    if a.compile_only:
        if os.environ.get("TRITON_INTERPRET"):
            raise SystemExit("unset TRITON_INTERPRET: the kernels are compiled, not interpreted")
        return compile_only(a.shapes, a.arch, a.limit, kernels)
    if not torch.cuda.is_available():
        print("tune_kernels: no CUDA device (use --compile-only on a CPU)", file=sys.stderr)
        return 2
    if a.warm_only:
        return warm(a.shapes, kernels)
    return tune(a.shapes, a.table, a.out, a.reps_ms, a.time_limit, kernels=kernels)


if __name__ == "__main__":
    sys.exit(main())

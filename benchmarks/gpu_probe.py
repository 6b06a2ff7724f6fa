"""Short GPU probes for defects a proof run found (one device call; prints a line per probe).

    python3 benchmarks/gpu_probe.py [rng] [lowrank] [inducer]

rng      a CUDA-graph capture that fails (a host sync inside), then a random draw outside any
         capture: raised "Offset increment outside graph capture" in every later provider of
         the H200 proof of 2026-11-30; ``kfused.bench.renew_generators`` must clear it
lowrank  headwise_lowrank's Triton backward against float64 on the GPU over the shape family
         of tests/test_headwise_ops.py::test_lowrank_kernel (the H200 proof of 2026-11-30
         failed [False-float16] at T=2x45, H=1, r=2, d_b=33: dbasis and dA off by up to 70 %,
         dB right), each draw run three times (a race shows as runs that differ)
inducer  the inducer MLP-rows kernels as redesigned on 2026-11-30 (not yet run on a GPU then:
         16-bit forward on tensor cores, the rest one MLP unit at a time): inducer attention
         forward and backward against float64 over a few shapes and every dtype, each draw in
         a process of its own; then the device time of each kernel at the benchmark's
         B=8, H=32, n=2048, p=64 (the old kernels: 0.81 ms forward, 1.86 ms backward there)
"""

from __future__ import annotations

import sys

import torch


def probe_rng() -> None:
    from kfused.bench import renew_generators

    dev = torch.device("cuda", torch.cuda.current_device())
    s = torch.cuda.Stream(dev)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(s):
            with torch.cuda.graph(g, stream=s):
                torch.randn(8, device=dev)
                torch.cuda.synchronize()
        print("rng: the capture did not fail (probe void)")
    except Exception as exc:
        print(f"rng: capture failed as meant: {type(exc).__name__}: {str(exc)[:120]}")
    try:
        torch.randn(8, device=dev)
        print("rng: a draw after the failed capture works without renewing")
    except Exception as exc:
        print(f"rng: a draw after the failed capture raised: {str(exc)[:100]}")
        renew_generators(dev)
        try:
            torch.randn(8, device=dev)
            print("rng: after renew_generators the draw works")
        except Exception as exc2:
            print(f"rng: after renew_generators it still raised: {str(exc2)[:100]}")


# (per_head, dtype, T, H, p, r, d_b): the two failing draws of 2026-11-30 first, then one
# argument changed at a time (H = 1 and r = 1 are specialised as constants by Triton; d_b = 33
# is an odd row length), then the test's other shapes
LOWRANK_CONFIGS = [
    (False, "float16", 45, 1, 24, 2, 33), (False, "float16", 3, 1, 24, 1, 33),
    (False, "float16", 45, 2, 24, 2, 33), (False, "float16", 45, 1, 24, 2, 32),
    (False, "float16", 45, 1, 24, 3, 33), (False, "float16", 45, 1, 40, 2, 33),
    (False, "float16", 45, 1, 80, 2, 33), (True, "float16", 45, 1, 24, 2, 33),
    (False, "bfloat16", 45, 1, 24, 2, 33), (False, "float32", 45, 1, 24, 2, 33),
    (False, "float16", 17, 3, 40, 5, 20), (True, "float16", 17, 3, 40, 5, 48),
    (False, "float16", 3, 4, 80, 1, 48), (True, "bfloat16", 3, 4, 80, 1, 20),
]


def probe_lowrank_one(per_head: bool, dtype: str, T: int, H: int, p: int, r: int,
                      db: int) -> str:
    """One draw: the Triton forward and backward against float64, three runs; a line."""
    from kfused.ops.headwise_lowrank import headwise_lowrank

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    basis = torch.randn(2, T, H, db) if per_head else torch.randn(2, T, db)
    A, B, c = torch.randn(H, r, db), torch.randn(H, p, r), torch.randn(H, p)
    g = torch.randn(2, T, H, p)
    leaves64 = [t.to(dt).double().requires_grad_() for t in (basis, A, B, c)]
    out64 = headwise_lowrank(*leaves64, per_head=per_head, backend="reference")
    ref = (out64.detach(),) + torch.autograd.grad(out64, leaves64, g.to(dt).double())
    runs = []
    for _ in range(3):
        leaves = [t.to(dev, dt).requires_grad_() for t in (basis, A, B, c)]
        out = headwise_lowrank(*leaves, per_head=per_head, backend="triton")
        if dev == "cuda":
            torch.cuda.synchronize()
        grads = torch.autograd.grad(out, leaves, g.to(dev, dt))
        if dev == "cuda":
            torch.cuda.synchronize()
        runs.append((out.detach(),) + grads)
    names = ["out", "dbasis", "dA", "dB", "dc"]
    per = [float((x.double().cpu() - y).abs().max() / (y.abs().max() + 1e-9))
           for x, y in zip(runs[0], ref)]
    same = all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}[dt]
    verdict = "ok" if max(per) <= tol and same else "BAD"
    return (f"{verdict}: " + ", ".join(f"{n} {e:.1e}" for n, e in zip(names, per))
            + f"; three runs identical: {same}")


def _run_draws(kind: str, configs, label) -> None:
    """Each draw in a process of its own with CUDA_LAUNCH_BLOCKING=1: a fault names the
    launch that made it (its traceback's last kfused frame) and leaves the next draws a
    fresh CUDA context."""
    import os
    import subprocess

    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for cfg in configs:
        args = [str(v) for v in cfg]
        try:
            r = subprocess.run([sys.executable, __file__, kind, *args], env=env,
                               capture_output=True, text=True, timeout=120)
            lines = (r.stdout + r.stderr).strip().splitlines()
        except subprocess.TimeoutExpired:
            lines, r = ["timeout"], None
        res = [ln for ln in lines if ln.startswith(("ok:", "BAD:"))]
        if res:
            line = res[-1]
        else:
            frames = [ln.strip() for ln in lines if "kfused/" in ln and "File" in ln]
            err = [ln for ln in lines if "Error" in ln][-1:] or lines[-1:]
            line = f"FAULT rc={getattr(r, 'returncode', None)}: {err[0][:160] if err else ''}" \
                   f" | last kfused frame: {frames[-1][:160] if frames else '-'}"
        print(f"{label(cfg)}: {line}", flush=True)


def probe_lowrank() -> None:
    _run_draws("lowrank-one", LOWRANK_CONFIGS,
               lambda c: f"lowrank per_head={c[0]} {c[1]} T=2x{c[2]} H={c[3]} p={c[4]} "
                         f"r={c[5]} db={c[6]}")


# (dtype, B, H, n, p, L, r, causal): odd lengths, L and r other than 4 / 8, both head widths
INDUCER_CONFIGS = [
    ("bfloat16", 2, 4, 97, 64, 4, 8, True), ("float16", 2, 4, 97, 64, 4, 8, False),
    ("bfloat16", 1, 2, 301, 128, 17, 5, True), ("float16", 1, 3, 65, 128, 3, 17, False),
    ("float32", 2, 2, 97, 64, 4, 8, True), ("bfloat16", 1, 2, 1025, 64, 1, 1, True),
]


def probe_inducer_one(dtype: str, B: int, H: int, n: int, p: int, L: int, r: int,
                      causal: bool) -> str:
    """One draw: inducer attention forward and backward (Triton) against float64; a line."""
    from kfused.ops import inducer_attention

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    shapes = dict(q=(B, H, n, p), k=(B, H, n, p), v=(B, H, n, p), Ak=(H, p, L), ak=(H, L),
                  Bk=(H, L, p), ck=(H, p), W1=(H, p, r), b1=(H, r))
    base = {k: (torch.randn(*s) * 0.5).to(dt) for k, s in shapes.items()}
    df, du = torch.randn(B, H, n, p).to(dt), torch.randn(B, H, n, r).to(dt)
    outs = []
    for d, backend in ((dev, "triton"), ("cpu", "reference")):
        up = None if backend == "triton" else torch.float64
        leaves = {k: t.to(d, up or dt).requires_grad_() for k, t in base.items()}
        f, u = inducer_attention(**leaves, causal=causal, backend=backend)
        grads = torch.autograd.grad([f, u], list(leaves.values()),
                                    [df.to(d, up or dt), du.to(d, up or dt)])
        if d == "cuda":
            torch.cuda.synchronize()
        outs.append([f.detach(), u.detach(), *grads])
    names = ["f", "u", *("d" + k for k in shapes)]
    per = [float((x.double().cpu() - y).abs().max() / (y.abs().max() + 1e-9))
           for x, y in zip(*outs)]
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}[dt]
    worst = max(range(len(per)), key=per.__getitem__)
    return (("ok" if max(per) <= tol else "BAD")
            + f": worst {names[worst]} {per[worst]:.1e} (relative to its max; "
            + ", ".join(f"{k} {e:.1e}" for k, e in zip(names, per)) + ")")


def probe_inducer() -> None:
    _run_draws("inducer-one", INDUCER_CONFIGS,
               lambda c: f"inducer {c[0]} B={c[1]} H={c[2]} n={c[3]} p={c[4]} L={c[5]} "
                         f"r={c[6]} causal={c[7]}")
    from torch.profiler import ProfilerActivity, profile

    from kfused.ops import inducer_attention

    for H, p in ((32, 64), (16, 128)):     # the benchmark's n = 2048 cases (p = 128: the
        B, n, L, r = 8, 2048, 4, 8         # MLP backward in two launches, new tiles)
        shapes = dict(q=(B, H, n, p), k=(B, H, n, p), v=(B, H, n, p), Ak=(H, p, L),
                      ak=(H, L), Bk=(H, L, p), ck=(H, p), W1=(H, p, r), b1=(H, r))
        t = {k: torch.randn(*s, device="cuda", dtype=torch.bfloat16).requires_grad_()
             for k, s in shapes.items()}

        def step():
            f, u = inducer_attention(**t, backend="triton")
            torch.autograd.backward([f, u], [torch.ones_like(f), torch.ones_like(u)])

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            if "inducer" in ev.key:
                us = getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0.0)
                print(f"inducer p={p} H={H} kernel {ev.key}: {us:.1f} us a launch "
                      f"({ev.count} launches)", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["lowrank-one"]:
        a = sys.argv[2:]
        print(probe_lowrank_one(a[0] == "True", a[1], *map(int, a[2:7])), flush=True)
        sys.exit(0)
    if sys.argv[1:2] == ["inducer-one"]:
        a = sys.argv[2:]
        print(probe_inducer_one(a[0], *map(int, a[1:7]), a[7] == "True"), flush=True)
        sys.exit(0)
    for w in sys.argv[1:] or ["rng", "lowrank", "inducer"]:
        {"rng": probe_rng, "lowrank": probe_lowrank, "inducer": probe_inducer}[w]()

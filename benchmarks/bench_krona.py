"""KronA benchmark cases: the fused Kronecker linear against its baselines.

Providers (one frozen layer of width d_in -> d_out plus a KronA adapter, x requires grad as it
does inside a network, A and B trainable):
    floor           the frozen linear alone (F.linear; cuBLAS): what the adapter rides on
    kfused-triton   krona_linear, one Triton kernel per direction (+ the factor-gradient pass)
    kfused-cuda     F.linear + kron_matvec from the CUDA C++ extension (unfused add)
    eager           the reference: F.linear + reshape/matmul Kronecker term
    compile         torch.compile of the reference
    kron-dense      F.linear + F.linear(x, s·torch.kron(A, B)): what PEFT's LoKr does
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kfused
from kfused.bench import BenchCase, Provider
from kfused.modules.krona import factorize
from kfused.reference.krona import krona_linear_ref

WIDTHS = [(768, 768), (768, 3072), (3072, 768), (1024, 1024), (1024, 4096), (4096, 1024)]
TOKENS = [4096, 16384, 65536]
QUICK_WIDTHS = [(768, 768), (768, 3072)]
QUICK_TOKENS = [16384]
CPU_WIDTHS = [(96, 96)]
CPU_TOKENS = [256]


def _make_inputs(T, d_in, d_out, dtype, device):
    (a_out, b_out), (a_in, b_in) = factorize(d_out), factorize(d_in)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(T, d_in, device=device, dtype=dtype, generator=g).requires_grad_()
    W = torch.randn(d_out, d_in, device=device, dtype=dtype, generator=g) / d_in ** 0.5
    b = torch.randn(d_out, device=device, dtype=dtype, generator=g)
    A = torch.randn(a_out, a_in, device=device, dtype=dtype, generator=g).requires_grad_()
    B = torch.randn(b_out, b_in, device=device, dtype=dtype, generator=g).requires_grad_()
    return x, W, b, A, B


def cases(device, dtype=torch.bfloat16, quick=False):
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    widths = (QUICK_WIDTHS if quick else WIDTHS) if on_gpu else CPU_WIDTHS
    tokens = (QUICK_TOKENS if quick else TOKENS) if on_gpu else CPU_TOKENS
    if not on_gpu and dtype == torch.bfloat16:
        dtype = torch.float32
    backends = kfused.available_backends("kron_matvec", device=str(device), dtype=dtype)
    scale = 0.5
    out = []
    for d_in, d_out in widths:
        for T in tokens:
            def provider(name, fn_of_inputs, leaves_idx=(0, 3, 4), skip=None):
                def make(fn_of_inputs=fn_of_inputs, T=T, d_in=d_in, d_out=d_out):
                    inp = _make_inputs(T, d_in, d_out, dtype, device)
                    return (lambda: fn_of_inputs(*inp)), [inp[i] for i in leaves_idx]
                return Provider(name, make, skip)

            compiled = torch.compile(krona_linear_ref) if on_gpu else None
            provs = [
                provider("floor", lambda x, W, b, A, B: F.linear(x, W, b), leaves_idx=(0,)),
                provider("kfused-triton",
                         lambda x, W, b, A, B: kfused.krona_linear(x, W, b, A, B, scale,
                                                                   backend="triton"),
                         skip=None if on_gpu else "Triton is benchmarked on a GPU only"),
                provider("kfused-cuda",
                         lambda x, W, b, A, B: F.linear(x, W, b) + scale * kfused.kron_matvec(
                             x, A, B, backend="cuda"),
                         skip=backends["cuda"]),
                provider("eager", lambda x, W, b, A, B: krona_linear_ref(x, W, b, A, B, scale)),
                provider("compile",
                         lambda x, W, b, A, B: compiled(x, W, b, A, B, scale),
                         skip=None if on_gpu else "torch.compile is benchmarked on a GPU only"),
                provider("kron-dense",
                         lambda x, W, b, A, B: F.linear(x, W, b) + F.linear(
                             x, scale * torch.kron(A, B))),
            ]
            (a_out, b_out), (a_in, b_in) = factorize(d_out), factorize(d_in)
            kron_flops = 2 * T * (a_out * a_in * b_in + a_out * b_in * b_out)
            gemm = 2 * T * d_in * d_out
            el = torch.finfo(dtype).bits // 8
            out.append(BenchCase(
                op="krona_linear",
                shape={"T": T, "d_in": d_in, "d_out": d_out, "A": [a_out, a_in],
                       "B": [b_out, b_in]},
                dtype=dtype, providers=provs,
                flops_fwd=gemm + kron_flops,
                flops_bwd=gemm + 3 * kron_flops,           # dx (GEMM + Kronecker) + dA + dB
                bytes_fwd=el * (T * (d_in + d_out) + d_in * d_out),
            ))
    return out

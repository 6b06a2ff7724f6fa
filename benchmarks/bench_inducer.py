"""Benchmark cases for inducer attention (SPEC §3), for the shared harness (kfused.bench).

Providers per case (forward, and forward+backward through the harness):
    kfused-triton  the flash-style kernel with the inducer ("add": f and u)
    sdpa           torch scaled_dot_product_attention without an inducer (the ceiling)
    flex           FlexAttention with return_lse plus the λ / u epilogue in PyTorch (CUDA only)
    eager          the materialised reference (O(n²) memory)
    compile        torch.compile of the reference
Shapes: n = 512 … 16k, head width 64 and 128, heads·p = 2048, batch·n = 16k tokens.
FLOPs count the attention matmuls only (4·B·H·n²·p forward, halved when causal; backward
2.5× forward), the convention of the flash-attention benchmarks.
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

from kfused.backends import available_backends
from kfused.bench import BenchCase, Provider
from kfused.ops.inducer import inducer_attention
from kfused.reference.inducer import (inducer_attention_ref, inducer_key_logit,
                                      inducer_value_hidden)

OP = "inducer_attention"
L_KEY, R_VALUE = 4, 8
_MATERIALISED_LIMIT = 8 * 2**30       # skip eager/compile when the score matrix exceeds 8 GiB


def _no_donated_buffers():
    """AOTAutograd's buffer donation off (torch >= 2.6 has the switch; older ones never donate)."""
    import contextlib

    cfg = getattr(getattr(torch, "_functorch", None), "config", None)
    if cfg is None or not hasattr(cfg, "donated_buffer"):
        return contextlib.nullcontext()
    return cfg.patch(donated_buffer=False)


def _make_inputs(B, H, n, p, device, dtype, grad=True):
    def t(*shape, s=1.0):
        x = torch.randn(*shape, device=device, dtype=dtype) * s
        return x.requires_grad_(grad)

    q, k, v = t(B, H, n, p), t(B, H, n, p), t(B, H, n, p)
    params = dict(Ak=t(H, p, L_KEY, s=0.01), ak=t(H, L_KEY, s=0.01), Bk=t(H, L_KEY, p, s=0.01),
                  ck=t(H, p, s=0.01), W1=t(H, p, R_VALUE, s=0.01), b1=t(H, R_VALUE, s=0.01))
    return q, k, v, params


def _leaves(q, k, v, params):
    return [q, k, v] + list(params.values())


def _flex_fn(causal: bool, n: int, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if causal:
        block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, n, n,
                                       device=device)

    def run(q, k, v, params):
        out, lse = flex(q, k, v, block_mask=block_mask, return_lse=True)
        p = q.shape[-1]
        s0 = inducer_key_logit(q.float(), params["Ak"].float(), params["ak"].float(),
                               params["Bk"].float(), params["ck"].float(), p ** -0.5)
        lam = torch.sigmoid(s0 - lse.float()).unsqueeze(-1)
        u = lam * inducer_value_hidden(q.float(), params["W1"].float(), params["b1"].float())
        return out, u.to(q.dtype)

    return run


def cases(device, dtype=torch.bfloat16, quick: bool = False) -> List[BenchCase]:
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    if on_gpu:
        ns = [512, 2048] if quick else [512, 1024, 2048, 4096, 8192, 16384]
        widths = [64] if quick else [64, 128]
    else:                                  # CPU: interpreter-sized smoke shapes
        ns, widths = [64, 128], [64]
    triton_reason = available_backends(OP, device=str(device), dtype=dtype)["triton"]
    out: List[BenchCase] = []
    for p in widths:
        for causal in (False, True):
            for n in ns:
                if on_gpu and not quick:
                    B, H_ = max(1, 16384 // n), 2048 // p
                else:
                    B, H_ = 1, (4 if on_gpu else 2)
                flops = 4.0 * B * H_ * n * n * p * (0.5 if causal else 1.0)
                score_bytes = B * H_ * n * n * 4 * 3          # S, P and the concat in float32
                provs = []

                def mk_kfused(B=B, H=H_, n=n, p=p, causal=causal):
                    q, k, v, params = _make_inputs(B, H, n, p, device, dtype)
                    def fn():
                        return inducer_attention(q, k, v, **params, causal=causal,
                                                 backend="triton")
                    return fn, _leaves(q, k, v, params)

                def mk_sdpa(B=B, H=H_, n=n, p=p, causal=causal):
                    q, k, v, _ = _make_inputs(B, H, n, p, device, dtype)
                    def fn():
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    return fn, [q, k, v]

                def mk_flex(B=B, H=H_, n=n, p=p, causal=causal):
                    q, k, v, params = _make_inputs(B, H, n, p, device, dtype)
                    run = _flex_fn(causal, n, device)
                    return (lambda: run(q, k, v, params)), _leaves(q, k, v, params)

                def mk_eager(B=B, H=H_, n=n, p=p, causal=causal):
                    q, k, v, params = _make_inputs(B, H, n, p, device, dtype)
                    def fn():
                        return inducer_attention_ref(q, k, v, **params, causal=causal)
                    return fn, _leaves(q, k, v, params)

                def mk_compile(B=B, H=H_, n=n, p=p, causal=causal):
                    q, k, v, params = _make_inputs(B, H, n, p, device, dtype)
                    ref = torch.compile(inducer_attention_ref)
                    def fn():
                        # the harness replays one backward (retain_graph=True): compiled
                        # graphs that donate their saved buffers refuse that, so no donation
                        with _no_donated_buffers():
                            return ref(q, k, v, **params, causal=causal)
                    return fn, _leaves(q, k, v, params)

                too_big = (f"materialised scores need {score_bytes / 2**30:.1f} GiB"
                           if score_bytes > _MATERIALISED_LIMIT else None)
                no_cuda = None if device.type == "cuda" else "FlexAttention needs CUDA"
                provs = [Provider("kfused-triton", mk_kfused, skip_reason=triton_reason),
                         Provider("sdpa", mk_sdpa),
                         Provider("flex", mk_flex, skip_reason=no_cuda),
                         Provider("eager", mk_eager, skip_reason=too_big),
                         Provider("compile", mk_compile, skip_reason=too_big)]
                out.append(BenchCase(
                    op=OP,
                    shape={"B": B, "H": H_, "n": n, "p": p, "causal": causal, "L": L_KEY,
                           "r": R_VALUE, "composition": "add"},
                    dtype=dtype, providers=provs, flops_fwd=flops, flops_bwd=2.5 * flops,
                    bytes_fwd=float(4 * B * H_ * n * p * torch.finfo(dtype).bits // 8)))
    return out


if __name__ == "__main__":  # pragma: no cover - manual run
    import json
    import sys

    from kfused.bench import measure

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    for case in cases(dev, dt, quick="--quick" in sys.argv):
        for row in measure(case, dev):
            print(json.dumps(row))

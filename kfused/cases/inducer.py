"""Inducer attention (docs/math.md §3) cases: `kfused check` cases, the sm_90 compile-check launches
and the benchmark cases for the shared harness (kfused.bench).

Benchmark providers per case (forward, and forward+backward through the harness):
    kfused-triton  the flash-style kernel with the inducer ("add": f and u)
    kfused-cuda    the CUDA C++ inference kernel with the same inducer (forward only: timed in
                   "fwd" mode, beside kfused-triton's "fwd"; grouped-query k/v too)
    sdpa           torch scaled_dot_product_attention without an inducer, pinned to its flash
                   backend (FlashAttention-2): the baseline issue 14's targets name and the
                   performance model prices (kfused.perf.cases._fa2)
    sdpa-default   the same call on the backend torch picks itself: what a user gets (torch
                   >= 2.11 with cuDNN > 9.15 prefers cuDNN attention on H100/H200, its
                   check_prefer_cudnn_attention); the kernels profiled name it. Shown, no
                   target holds it
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
from kfused.bench import SDPA_PINNED, BenchCase, Provider, allow_backward_replay
from kfused.cases import CheckCase
from kfused.ops import inducer_attention, inducer_attention_varlen
from kfused.reference.inducer import (inducer_attention_ref, inducer_key_logit,
                                      inducer_value_hidden)

OP = "inducer_attention"
L_KEY, R_VALUE = 4, 8
_MATERIALISED_LIMIT = 8 * 2**30       # skip eager/compile when the score matrix exceeds 8 GiB


def _make_inputs(B, H, n, p, device, dtype, grad=True):
    def t(*shape, s=1.0):
        x = torch.randn(*shape, device=device, dtype=dtype) * s
        return x.requires_grad_(grad)

    q, k, v = t(B, H, n, p), t(B, H, n, p), t(B, H, n, p)
    params = dict(Ak=t(H, p, L_KEY, s=0.01), ak=t(H, L_KEY, s=0.01), Bk=t(H, L_KEY, p, s=0.01),
                  ck=t(H, p, s=0.01), W1=t(H, p, R_VALUE, s=0.01), b1=t(H, R_VALUE, s=0.01))
    return q, k, v, params


def _sdpa_fn(q, k, v, pinned: bool, **kw):
    """SDPA without an inducer: on the backend SDPA_PINNED names (``pinned``), else on
    torch's choice. The backward runs the backend the forward chose."""
    if not pinned:
        return lambda: F.scaled_dot_product_attention(q, k, v, **kw)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION}[SDPA_PINNED]

    def fn():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, **kw)
    return fn


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
        return out, flex_epilogue(q, lse, params)

    return run


def flex_epilogue(q: torch.Tensor, lse: torch.Tensor, params) -> torch.Tensor:
    """The inducer's ``u = λ · tanh(q W1 + b1)`` in PyTorch from FlexAttention's row
    log-sum-exp (λ = σ(s0 − LSE), s0 the key MLP's logit): what the "flex" provider adds to
    the attention. The performance model (kfused.perf.cases) traces this same function."""
    p = q.shape[-1]
    s0 = inducer_key_logit(q.float(), params["Ak"].float(), params["ak"].float(),
                           params["Bk"].float(), params["ck"].float(), p ** -0.5)
    lam = torch.sigmoid(s0 - lse.float()).unsqueeze(-1)
    u = lam * inducer_value_hidden(q.float(), params["W1"].float(), params["b1"].float())
    return u.to(q.dtype)


def bench_cases(device, dtype=torch.bfloat16, quick: bool = False) -> List[BenchCase]:
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    if on_gpu:
        ns = [512, 2048] if quick else [512, 1024, 2048, 4096, 8192, 16384]
        widths = [64] if quick else [64, 128]
    else:                                  # CPU: interpreter-sized smoke shapes
        ns, widths = [64, 128], [64]
    avail = available_backends(OP, device=str(device), dtype=dtype)
    triton_reason, cuda_reason = avail["triton"], avail["cuda"]
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

                def mk_cuda(B=B, H=H_, n=n, p=p, causal=causal):
                    # inference inputs (no grad): the harness then times "fwd" only
                    q, k, v, params = _make_inputs(B, H, n, p, device, dtype, grad=False)
                    def fn():
                        return inducer_attention(q, k, v, **params, causal=causal,
                                                 backend="cuda")
                    return fn, []

                def mk_sdpa(pinned, B=B, H=H_, n=n, p=p, causal=causal):
                    q, k, v, _ = _make_inputs(B, H, n, p, device, dtype)
                    return _sdpa_fn(q, k, v, pinned, is_causal=causal), [q, k, v]

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
                    allow_backward_replay()
                    ref = torch.compile(inducer_attention_ref)
                    def fn():
                        return ref(q, k, v, **params, causal=causal)
                    return fn, _leaves(q, k, v, params)

                too_big = (f"materialised scores need {score_bytes / 2**30:.1f} GiB"
                           if score_bytes > _MATERIALISED_LIMIT else None)
                no_cuda = None if device.type == "cuda" else "FlexAttention needs CUDA"
                provs = [Provider("kfused-triton", mk_kfused, skip_reason=triton_reason),
                         Provider("kfused-cuda", mk_cuda, skip_reason=cuda_reason),
                         Provider("sdpa", lambda mk=mk_sdpa: mk(True)),
                         Provider("sdpa-default", lambda mk=mk_sdpa: mk(False)),
                         Provider("flex", mk_flex, skip_reason=no_cuda),
                         Provider("eager", mk_eager, skip_reason=too_big),
                         Provider("compile", mk_compile, skip_reason=too_big)]
                out.append(BenchCase(
                    op=OP,
                    shape={"B": B, "H": H_, "n": n, "p": p, "causal": causal, "L": L_KEY,
                           "r": R_VALUE, "composition": "add"},
                    dtype=dtype, providers=provs, flops_fwd=flops, flops_bwd=2.5 * flops,
                    bytes_fwd=float(4 * B * H_ * n * p * torch.finfo(dtype).bits // 8)))
    return out + _decode_cases(device, dtype, quick, triton_reason, cuda_reason) + \
        _varlen_cases(device, dtype, quick, triton_reason)


def _decode_cases(device, dtype, quick, triton_reason, cuda_reason=None) -> List[BenchCase]:
    """One new token per sequence against a KV cache (forward only: inference). kfused's
    decode path (split-KV, GQA-packed) with and without the inducer against SDPA (GQA
    natively when the kv heads are fewer), and the CUDA C++ kernel (which packs a kv head's
    query heads into one block as kfused's Triton decode does)."""
    el = torch.finfo(dtype).bits // 8
    if device.type == "cuda":
        shapes = [(1, 32, 8, 16384, 128), (16, 32, 8, 4096, 128), (8, 32, 32, 4096, 128)]
        shapes = shapes[:1] if quick else shapes
    else:
        shapes = [(2, 4, 2, 256, 64)]
    out = []
    for B, H, Hkv, n_k, p in shapes:
        def inputs(B=B, H=H, Hkv=Hkv, n_k=n_k, p=p):
            q = torch.randn(B, H, 1, p, device=device, dtype=dtype)
            k = torch.randn(B, Hkv, n_k, p, device=device, dtype=dtype)
            v = torch.randn(B, Hkv, n_k, p, device=device, dtype=dtype)
            return q, k, v, _make_inputs(1, H, 1, p, device, dtype, grad=False)[3]

        def mk_kfused(inducer, inputs=inputs):
            q, k, v, params = inputs()
            if inducer:
                return (lambda: inducer_attention(q, k, v, **params, backend="triton")), []
            return (lambda: inducer_attention(q, k, v, backend="triton")[0]), []

        def mk_cuda(inputs=inputs):
            q, k, v, params = inputs()
            return (lambda: inducer_attention(q, k, v, **params, backend="cuda")), []

        def mk_sdpa(pinned, inputs=inputs, gqa=Hkv != H):
            q, k, v, _ = inputs()
            kw = {"enable_gqa": True} if gqa else {}
            return _sdpa_fn(q, k, v, pinned, **kw), []

        out.append(BenchCase(
            op=OP, shape={"B": B, "H": H, "H_kv": Hkv, "n_q": 1, "n_k": n_k, "p": p,
                          "decode": True, "L": L_KEY, "r": R_VALUE, "composition": "add"},
            dtype=dtype,
            providers=[Provider("kfused-triton", lambda mk=mk_kfused: mk(True),
                                skip_reason=triton_reason),
                       Provider("kfused-triton-plain", lambda mk=mk_kfused: mk(False),
                                skip_reason=triton_reason),
                       Provider("kfused-cuda", mk_cuda, skip_reason=cuda_reason),
                       Provider("sdpa", lambda mk=mk_sdpa: mk(True)),
                       Provider("sdpa-default", lambda mk=mk_sdpa: mk(False))],
            flops_fwd=4.0 * B * H * n_k * p, bytes_fwd=float(2 * B * Hkv * n_k * p * el)))
    return out


def _varlen_cases(device, dtype, quick, triton_reason) -> List[BenchCase]:
    """A packed batch of mixed-length sequences (padding-free training, fwd+bwd):
    inducer_attention_varlen against the same sequences padded to the longest one."""
    if device.type == "cuda":
        lens, H, p = [2048, 128, 1024, 512, 4096, 256, 3072, 640, 1536, 3072], 16, 128
        if quick:
            lens = lens[:4]
    else:
        lens, H, p = [40, 7, 64, 1], 2, 64
    n, T = max(lens), sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                      device=device)
    seq_lens = torch.tensor(lens, device=device)

    def mk_varlen():
        q, k, v, params = _make_inputs(1, H, T, p, device, dtype)
        q, k, v = (t.detach()[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v))
        def fn():
            return inducer_attention_varlen(q, k, v, cu, **params, causal=True,
                                            backend="triton")
        return fn, _leaves(q, k, v, params)

    def mk_padded():
        q, k, v, params = _make_inputs(len(lens), H, n, p, device, dtype)
        def fn():
            return inducer_attention(q, k, v, **params, causal=True, seq_lens=seq_lens,
                                     backend="triton")
        return fn, _leaves(q, k, v, params)

    flops = sum(2.0 * H * m * m * p for m in lens)           # causal: half of 4·H·m²·p
    return [BenchCase(
        op=OP, shape={"lens": lens, "H": H, "p": p, "causal": True, "packed_tokens": T,
                      "padded_tokens": n * len(lens), "L": L_KEY, "r": R_VALUE,
                      "composition": "add"},
        dtype=dtype,
        providers=[Provider("kfused-varlen", mk_varlen, skip_reason=triton_reason),
                   Provider("kfused-padded", mk_padded, skip_reason=triton_reason)],
        flops_fwd=flops, flops_bwd=2.5 * flops,
        bytes_fwd=float(4 * H * T * p * torch.finfo(dtype).bits // 8))]

# ------------------------------------------------------------------------------------------
# `kfused check`


def _runner(backend: str, comp: str, causal: bool):
    """inducer_attention on ``backend`` returning out, or (out, u) for "add"."""
    def fn(**kw):
        out, u = inducer_attention(**kw, composition=comp, causal=causal, backend=backend)
        return out if u is None else (out, u)
    return fn


def check_cases(device: torch.device) -> list:
    """`kfused check` cases (docs/math.md §4 against the float64 reference): inducer "add" and
    "gate", prefix, causal and padding masks, odd n, every supported head width."""
    g = torch.Generator().manual_seed(0)
    on_gpu = torch.device(device).type == "cuda"
    f64 = torch.float64
    cases = []
    specs = [(2, 4, 1025 if on_gpu else 97, 64, 16, True, "add"),
             (2, 4, 97, 80, 1, False, "gate"),
             (1, 2, 513 if on_gpu else 33, 128, 0, True, "add"),
             (2, 2, 97, 32, 0, False, "gate"),
             (1, 2, 1, 96, 1, True, "add")]
    for B, H, n, p, l, causal, comp in specs:
        rnd = lambda *shape, s=1.0: torch.randn(*shape, generator=g, dtype=f64) * s  # noqa: E731
        inputs = {"q": rnd(B, H, n, p), "k": rnd(B, H, n, p), "v": rnd(B, H, n, p),
                  "Ak": rnd(H, p, 3, s=0.5), "ak": rnd(H, 3, s=0.5), "Bk": rnd(H, 3, p, s=0.5),
                  "ck": rnd(H, p, s=0.5), "W1": rnd(H, p, 5, s=0.5), "b1": rnd(H, 5, s=0.5)}
        if comp == "gate":
            inputs.update(W2=rnd(H, 5, p), b2=rnd(H, p))
        if l:
            inputs.update(prefix_k=rnd(H, l, p), prefix_v=rnd(H, l, p))
        mask = torch.rand(B, n, generator=g) > 0.25
        mask[:, 0] = True
        inputs["key_padding_mask"] = mask

        label = f"B={B} H={H} n={n} p={p} l={l} {'causal ' if causal else ''}{comp}"
        cases.append(CheckCase(OP, label, "triton", _runner("triton", comp, causal),
                               _runner("reference", comp, causal), inputs))
    cases += _decode_and_packed_checks(g, on_gpu)
    cases += _cuda_checks(g, on_gpu)
    return cases


def _cuda_checks(g: torch.Generator, on_gpu: bool) -> list:
    """The CUDA C++ inference kernel (forward only, seq_lens masks; 16-bit: the inducer MLP
    inside the kernel): prefill with a prefix, "gate", a few-block prefill that splits the keys
    over blocks, single-token decode against a long cache."""
    f64 = torch.float64

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=g, dtype=f64) * s

    cases = []
    for B, H, n_q, n_k, p, l, causal, comp in [
            (2, 4, 1025 if on_gpu else 65, 1025 if on_gpu else 65, 64, 2, True, "add"),
            (2, 3, 40, 57, 80, 1, False, "gate"),
            (1, 1, 130, 130, 128, 0, True, "add"),          # 3 row tiles: keys split
            (2, 2, 1, 4099 if on_gpu else 300, 128, 0, True, "add")]:
        inputs = {"q": rnd(B, H, n_q, p), "k": rnd(B, H, n_k, p), "v": rnd(B, H, n_k, p),
                  "Ak": rnd(H, p, 4, s=0.5), "ak": rnd(H, 4, s=0.5),
                  "Bk": rnd(H, 4, p, s=0.5), "ck": rnd(H, p, s=0.5),
                  "W1": rnd(H, p, 8, s=0.5), "b1": rnd(H, 8, s=0.5),
                  "seq_lens": torch.tensor([n_k, max(1, n_k // 2)][:B])}
        if comp == "gate":
            inputs.update(W2=rnd(H, 8, p), b2=rnd(H, p))
        if l:
            inputs.update(prefix_k=rnd(H, l, p), prefix_v=rnd(H, l, p))

        label = (f"B={B} H={H} n_q={n_q} n_k={n_k} p={p} l={l} "
                 f"{'causal ' if causal else ''}{comp} inference")
        cases.append(CheckCase(OP, label, "cuda", _runner("cuda", comp, causal),
                               _runner("reference", comp, causal), inputs, grad_names=[]))
    return cases


def _decode_and_packed_checks(g: torch.Generator, on_gpu: bool) -> list:
    """The decode path (one new token against a padded KV cache, GQA: taken for 16-bit
    inputs) and a packed batch of mixed-length sequences."""
    f64 = torch.float64

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=g, dtype=f64) * s

    def mlp(H, p):
        return {"Ak": rnd(H, p, 3, s=0.5), "ak": rnd(H, 3, s=0.5), "Bk": rnd(H, 3, p, s=0.5),
                "ck": rnd(H, p, s=0.5), "W1": rnd(H, p, 5, s=0.5), "b1": rnd(H, 5, s=0.5)}

    B, H, Hkv, n_k, p = 3, 8, 2, (4099 if on_gpu else 300), 128
    dec = {"q": rnd(B, H, 1, p), "k": rnd(B, Hkv, n_k, p), "v": rnd(B, Hkv, n_k, p),
           **mlp(H, p), "prefix_k": rnd(H, 2, p), "prefix_v": rnd(H, 2, p),
           "seq_lens": torch.tensor([n_k, n_k // 3, 0])}

    def run_dec(backend):
        def fn(**kw):
            return inducer_attention(**kw, causal=True, backend=backend)
        return fn

    lens = [513, 7, 1, 2048, 0, 300] if on_gpu else [37, 7, 1, 70, 0]
    T = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    packed = {"q": rnd(T, 4, 64), "k": rnd(T, 2, 64), "v": rnd(T, 2, 64), **mlp(4, 64),
              "W2": rnd(4, 5, 64), "b2": rnd(4, 64), "cu_seqlens_q": cu}

    def run_packed(backend):
        def fn(**kw):
            return inducer_attention_varlen(**kw, composition="gate", causal=True,
                                            backend=backend)[0]
        return fn

    return [CheckCase(OP, f"decode B={B} H={H}/{Hkv} n_k={n_k} p={p} l=2", "triton",
                      run_dec("triton"), run_dec("reference"), dec),
            CheckCase(OP, f"packed {len(lens)} seqs T={T} H=4/2 p=64 causal gate", "triton",
                      run_packed("triton"), run_packed("reference"), packed)]


# ------------------------------------------------------------------------------------------
# sm_90 compile check


def aot_launches() -> None:
    """Representative launches for the sm_90 compile check (kfused.triton_kernels._aot):
    bfloat16 on every head width with the mask / prefix / causal variants, float32 (IEEE dots)
    on one."""
    from kfused.triton_kernels.inducer_attention import (inducer_attention_backward,
                                                         inducer_attention_forward)

    B, H, n, L, r = 2, 2, 256, 4, 8
    runs = [(torch.bfloat16, p) for p in (32, 64, 80, 96, 128)] + [(torch.float32, 64)]
    for dtype, p in runs:
        for causal, masked, prefix in ((False, False, False), (True, True, True)):
            q = torch.empty(B, H, n, p, dtype=dtype)
            k = torch.empty(B, H, n, p, dtype=dtype)
            v = torch.empty(B, H, n, p, dtype=dtype)
            mlp = (torch.empty(H, p, L, dtype=dtype), torch.empty(H, L, dtype=dtype),
                   torch.empty(H, L, p, dtype=dtype), torch.empty(H, p, dtype=dtype),
                   torch.empty(H, p, r, dtype=dtype), torch.empty(H, r, dtype=dtype))
            km = torch.ones(B, n, dtype=torch.bool) if masked else None
            pk = torch.empty(H, 16, p, dtype=dtype) if prefix else None
            pv = torch.empty(H, 16, p, dtype=dtype) if prefix else None
            if not causal:                     # plain attention (no inducer) too
                inducer_attention_forward(q, k, v, None, pk, pv, km, causal)
            out, u, lse, lam, stats, out_lo = inducer_attention_forward(
                q, k, v, mlp, pk, pv, km, causal, save_lo=True)
            lam = torch.full((2, B, H, n), 0.5)
            inducer_attention_backward(torch.zeros_like(out), torch.zeros(B, H, n, r, dtype=dtype),
                                       None, None, q, k, v, torch.zeros_like(out),
                                       torch.zeros(B, H, n), stats, lam, mlp, pk, pv, km, causal,
                                       out_lo=out_lo)
    # MLP widths other than 4 / 8: L = 17, r = 5 (the MLP-rows kernels' unit loops and their
    # padded gradient accumulators: 32 and 8 rows)
    dtype, p, Lw, rw = torch.bfloat16, 64, 17, 5
    q = torch.empty(B, H, n, p, dtype=dtype)
    mlp = (torch.empty(H, p, Lw, dtype=dtype), torch.empty(H, Lw, dtype=dtype),
           torch.empty(H, Lw, p, dtype=dtype), torch.empty(H, p, dtype=dtype),
           torch.empty(H, p, rw, dtype=dtype), torch.empty(H, rw, dtype=dtype))
    out, u, lse, lam, stats, out_lo = inducer_attention_forward(q, q, q, mlp, None, None, None,
                                                                True, save_lo=True)
    inducer_attention_backward(torch.zeros_like(out), torch.zeros(B, H, n, rw, dtype=dtype), None,
                               None, q, q, q, torch.zeros_like(out), torch.zeros(B, H, n), stats,
                               torch.full((2, B, H, n), 0.5), mlp, None, None, None, True,
                               out_lo=out_lo)
    # the decode path: split-KV chunks merged in the same launch (GQA, padded cache, prefix)
    for dtype, p, n_q in ((torch.bfloat16, 64, 1), (torch.bfloat16, 128, 4),
                          (torch.float32, 64, 1)):
        H4, H_kv, n_k = 8, 2, 4096
        q = torch.empty(B, H4, n_q, p, dtype=dtype)
        k = torch.empty(B, H_kv, n_k, p, dtype=dtype)
        mlp = (torch.empty(H4, p, L, dtype=dtype), torch.empty(H4, L, dtype=dtype),
               torch.empty(H4, L, p, dtype=dtype), torch.empty(H4, p, dtype=dtype),
               torch.empty(H4, p, r, dtype=dtype), torch.empty(H4, r, dtype=dtype))
        pk = torch.empty(H4, 16, p, dtype=dtype)
        inducer_attention_forward(q, k, k, mlp, pk, pk, torch.ones(B, n_k, dtype=torch.bool),
                                  True, decode=True)
    # packed variable-length batches (cumulative lengths, causal, prefix, GQA)
    for p in (64, 128):
        dtype, T, H_kv = torch.bfloat16, 3 * n, 1
        cu = torch.tensor([0, n, 2 * n + 5, T], dtype=torch.int32)
        varlen = (cu, cu, n + 5, n + 5)
        q = torch.empty(T, H, p, dtype=dtype)
        k = torch.empty(T, H_kv, p, dtype=dtype)
        v = torch.empty(T, H_kv, p, dtype=dtype)
        mlp = (torch.empty(H, p, L, dtype=dtype), torch.empty(H, L, dtype=dtype),
               torch.empty(H, L, p, dtype=dtype), torch.empty(H, p, dtype=dtype),
               torch.empty(H, p, r, dtype=dtype), torch.empty(H, r, dtype=dtype))
        pk = torch.empty(H, 16, p, dtype=dtype)
        out, u, lse, lam, stats, out_lo = inducer_attention_forward(
            q, k, v, mlp, pk, pk, None, True, save_lo=True, varlen=varlen)
        inducer_attention_backward(torch.zeros_like(out), torch.zeros_like(u), None, None, q, k,
                                   v, out, lse, stats, torch.full((2, H, T), 0.5), mlp, pk, pk,
                                   None, True, out_lo=out_lo, varlen=varlen)

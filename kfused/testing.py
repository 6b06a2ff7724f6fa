"""The docs/math.md §4 numerics rule as code, shared by the tests and ``kfused check``.

A kernel in dtype ``t`` passes when, for the output and every gradient,

    max|kernel - ref64| <= 2 * max|torch_t - ref64| + atol_t

where ``ref64`` is the reference in float64 and ``torch_t`` the same reference run in ``t``
(TF32 off), and ``atol_t = c_t * finfo(t).eps * max|ref64|`` with ``c_t = 16`` for float32 and
``c_t = 1`` for float16 / bfloat16 (:func:`atol_factor`): in float32 both errors are a few ulp
and the luck of the reduction order in ``torch_t`` alone made a 1x-eps rule flake. float32
kernels must also reach a relative Frobenius error below 1e-4.

The 16-bit rule compares two maxima of rounding errors, so it is a statement about tensors
with enough independent elements (:data:`MIN_16BIT_ELEMENTS`, :func:`min_extent`); see
docs/math.md §4.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from kfused import _alloc

Tensors = Union[torch.Tensor, Tuple[torch.Tensor, ...]]


@contextlib.contextmanager
def poisoned_outputs(flag: bool = True):
    """Within the block, kernel output buffers are NaN-filled before every launch."""
    old = _alloc.set_poisoning(flag)
    try:
        yield
    finally:
        _alloc.set_poisoning(old)


@contextlib.contextmanager
def no_tf32():
    """References must not use TF32."""
    old_mm = torch.backends.cuda.matmul.allow_tf32
    old_cudnn = torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_mm
        torch.backends.cudnn.allow_tf32 = old_cudnn


@dataclasses.dataclass
class Comparison:
    name: str
    dtype: torch.dtype
    kernel_err: float
    torch_err: float
    bound: float
    rel_err: float
    ok: bool
    detail: str = ""

    def row(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        return (f"{self.name:<24} {str(self.dtype).replace('torch.', ''):<9} "
                f"{self.kernel_err:10.3e} {self.torch_err:10.3e} {self.bound:10.3e} {verdict}")


ATOL_FACTORS = {torch.float32: 16.0, torch.float16: 1.0, torch.bfloat16: 1.0}


def atol_factor(dtype: torch.dtype) -> float:
    """docs/math.md §4's ``c_t``: 16 for float32, 1 for float16 / bfloat16 (and any other dtype)."""
    return ATOL_FACTORS.get(dtype, 1.0)


# A 16-bit comparison is statistical: the kernel and torch_t round the same 16-bit
# intermediates (a fused kernel fewer of them) and then differ by independent roundings, so on a
# tensor of one or two independent elements torch_t's error is sometimes far below its usual
# size by cancellation and "2 x torch's + eps" fails a few % of draws although the kernel is the
# exactly rounded result of the same intermediates (measured, stop 24: headwise dx of one
# element fails 1.3 % of draws, of two 0.1 %, of four or more 0 of 3000). Randomised tests
# therefore draw 16-bit cases with at least this many elements in every compared tensor and
# inputs without repeated (stride-0) rows; float32 keeps every tiny shape.
MIN_16BIT_ELEMENTS = 16


def min_extent(dtype: torch.dtype, *others: int) -> int:
    """Smallest extent ``n`` for which a tensor of ``n * prod(others)`` elements is compared in
    ``dtype`` under :data:`MIN_16BIT_ELEMENTS` (1 for float32 and float64)."""
    if dtype in (torch.float32, torch.float64):
        return 1
    rest = 1
    for n in others:
        rest *= int(n)
    return max(1, -(-MIN_16BIT_ELEMENTS // max(rest, 1)))


def compare(name: str, out: torch.Tensor, ref64: torch.Tensor, ref_t: torch.Tensor,
            dtype: torch.dtype) -> Comparison:
    """Apply the docs/math.md §4 rule to one tensor (``out`` in ``ref_t``'s dtype: a kernel
    that answers a ``dtype`` call in another dtype fails)."""
    if tuple(out.shape) != tuple(ref64.shape):
        return Comparison(name, dtype, float("inf"), 0.0, 0.0, float("inf"), False,
                          f"shape {tuple(out.shape)} != reference {tuple(ref64.shape)}")
    if out.dtype != ref_t.dtype:
        # e.g. float32 or float64 out of a float16 call: held to the float16 bound it passed
        return Comparison(name, dtype, float("inf"), 0.0, 0.0, float("inf"), False,
                          f"{name}: dtype {out.dtype} != torch_t's {ref_t.dtype}")
    ref = ref64.detach().double().cpu()
    got = out.detach().double().cpu()
    tor = ref_t.detach().double().cpu()
    if ref.numel() == 0:
        return Comparison(name, dtype, 0.0, 0.0, 0.0, 0.0, True)
    diff = (got - ref).abs()
    diff = torch.where(torch.isnan(got), torch.full_like(diff, float("inf")), diff)
    kernel_err = diff.max().item()
    torch_err = (tor - ref).abs().max().item()
    atol = atol_factor(dtype) * torch.finfo(dtype).eps * ref.abs().max().item()
    bound = 2.0 * torch_err + atol
    norm = ref.norm().item()
    rel = (got - ref).norm().item() / norm if norm > 0 else (got - ref).norm().item()
    ok = kernel_err <= bound
    if (dtype == torch.float32 and not rel < 1e-4
            and ref.abs().max().item() >= torch.finfo(torch.float32).tiny):
        # (a reference below float32's normal range, e.g. ~1e-44 or ~1e-52, has no float32
        # answer with relative precision — subnormals keep a few bits, or round to 0: its
        # relative error is up to 1 whatever the kernel, and the absolute clause above holds
        # the kernel to it)
        ok = False
    if torch_err == float("inf"):
        # torch_t overflowed where ref64 is finite: the bound is infinite and would pass any
        # kernel (an infinite one too); the rule has nothing to compare against
        return Comparison(name, dtype, kernel_err, torch_err, bound, rel, False,
                          f"{name}: torch_{str(dtype).replace('torch.', '')} is not finite "
                          "where ref64 is (it overflowed): no bound to compare the kernel with")
    detail = ""
    if not ok:
        bad = int((diff > bound).sum().item())
        worst = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        detail = (f"{name}: {bad}/{diff.numel()} elements exceed {bound:.3e}; worst at {worst}: "
                  f"kernel {got[worst].item():.6g}, ref64 {ref[worst].item():.6g}, "
                  f"torch_{str(dtype).replace('torch.', '')} {tor[worst].item():.6g}; "
                  f"rel {rel:.3e}")
    return Comparison(name, dtype, kernel_err, torch_err, bound, rel, ok, detail)


def folded_error_bound(x: torch.Tensor, w_eff_t: torch.Tensor, y64: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """Elementwise bound on ``|y - y64|`` for ``y = round(x @ round(W')ᵀ)`` computed by a
    folded 16-bit path: ``W' = W + s·ΔW`` formed in float32 and rounded to ``dtype`` once,
    then one GEMM accumulating in float32 and one rounding of the output.

    ``x`` (T, K): the inputs as the kernel saw them (already ``dtype``-exact, float64);
    ``w_eff_t`` (K, N): the exact effective weight transposed, float64; ``y64`` (T, N) the
    float64 answer for those inputs. With ``u`` the unit roundoff of ``dtype``, each product
    ``x_tk·W'_kn`` is off by at most ``u·|x_tk||W_kn|`` (the fold's one rounding; its float32
    formation adds at most ``2^-22`` relative), the float32 sum over K adds at most
    ``K·2^-24`` of ``Σ|x||W'|`` and the output's rounding ``u·|y|``:

        |y - y64| <= (u + K·2^-24 + 2^-22)·(|x| @ |W|ᵀ) + u·|y64|   (to first order; the
                                                                     2^-22 term covers
                                                                     the products of u's)

    A bound on the error terms, not on the output: an output that cancels to near zero keeps
    the allowance its terms earn, which a fixed rtol/atol pair does not."""
    u = torch.finfo(dtype).eps / 2
    K = x.shape[-1]
    mag = x.abs().double() @ w_eff_t.abs().double()
    return (u + K * 2.0 ** -24 + 2.0 ** -22) * mag + u * y64.abs().double()


def assert_within_bound(name: str, got: torch.Tensor, want64: torch.Tensor,
                        bound: torch.Tensor) -> None:
    """Every element of ``got`` within ``bound`` of the float64 ``want64``; the message names
    the worst element, its error and its bound."""
    err = (got.detach().double().cpu() - want64.double().cpu()).abs()
    excess = err - bound.double().cpu()
    if excess.numel() and float(excess.max()) > 0:
        i = int(excess.flatten().argmax())
        idx = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), err.shape))
        n_bad = int((excess > 0).sum())
        raise AssertionError(
            f"{name}: {n_bad}/{err.numel()} elements outside the error bound; worst at {idx}: "
            f"got {float(got.flatten()[i]):.6g}, float64 {float(want64.flatten()[i]):.6g}, "
            f"error {float(err.flatten()[i]):.3e} > bound {float(bound.flatten()[i]):.3e}")


def _as_tuple(x: Tensors) -> Tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def run_with_grads(fn: Callable[..., Tensors], inputs: Mapping[str, object],
                   grad_outputs: Optional[Sequence[torch.Tensor]], grad_names: Sequence[str]
                   ) -> Tuple[Tuple[torch.Tensor, ...], Dict[str, torch.Tensor]]:
    leaves = {}
    args = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and k in grad_names:
            v = v.detach().requires_grad_(True)
            leaves[k] = v
        args[k] = v
    outs = _as_tuple(fn(**args))
    grads: Dict[str, torch.Tensor] = {}
    if grad_outputs is not None and leaves:
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if o.requires_grad]
        gs = torch.autograd.grad([o for o, _ in pairs], list(leaves.values()),
                                 [g for _, g in pairs], allow_unused=True)
        for k, g in zip(leaves, gs):
            grads[k] = g if g is not None else torch.zeros_like(leaves[k])
    return outs, grads


def check_against_reference(
    kernel_fn: Callable[..., Tensors],
    ref_fn: Callable[..., Tensors],
    inputs: Mapping[str, object],
    dtype: torch.dtype,
    device: Union[str, torch.device] = "cpu",
    *,
    grad_names: Optional[Sequence[str]] = None,
    out_names: Optional[Sequence[str]] = None,
    seed: int = 0,
) -> List[Comparison]:
    """Run kernel (dtype, device), reference in float64 (CPU) and in dtype; compare all.

    inputs: float64 CPU tensors (rounded to ``dtype``, then cast per run) and any other
    arguments (passed unchanged;
    bool/int tensors are moved to the device). grad_names: inputs whose gradients are
    compared (default: every floating tensor input). Returns one Comparison per output and
    per gradient, and a failed one when the kernel returns another number of outputs than
    the reference (``out_names`` must name every reference output).
    """
    device = torch.device(device)
    # Inputs (and upstream gradients) are rounded to dtype first, as flash-attention's tests
    # draw them in the kernel's dtype: ref64 is then the exact answer for the very inputs the
    # kernel sees, and the rule compares computation errors rather than the input rounding
    # that kernel and torch_t share (which on small outputs made the rule depend on luck).
    inputs = {k: (v.to(dtype).to(torch.float64)
                  if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
              for k, v in inputs.items()}
    if grad_names is None:
        grad_names = [k for k, v in inputs.items()
                      if isinstance(v, torch.Tensor) and v.is_floating_point()]
    unknown = [k for k in grad_names
               if not (isinstance(inputs.get(k), torch.Tensor) and inputs[k].is_floating_point())]
    if unknown:     # a misspelt name compared no gradient at all
        raise ValueError(f"grad_names: {unknown} name no floating tensor input; inputs: "
                         f"{list(inputs)}")

    def cast(dt, dev):
        out = {}
        for k, v in inputs.items():
            if isinstance(v, torch.Tensor):
                v = v.to(dev)
                if v.is_floating_point():
                    v = v.to(dt)
            out[k] = v
        return out

    with no_tf32():
        outs64, _ = run_with_grads(ref_fn, cast(torch.float64, "cpu"), None, [])
        gen = torch.Generator().manual_seed(seed)
        gouts = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(dtype).double()
                 for o in outs64]
        outs64, grads64 = run_with_grads(ref_fn, cast(torch.float64, "cpu"), gouts, grad_names)
        ref_dev = device if device.type == "cuda" else torch.device("cpu")
        outs_t, grads_t = run_with_grads(ref_fn, cast(dtype, ref_dev),
                                         [g.to(ref_dev, dtype) for g in gouts], grad_names)
        with poisoned_outputs():
            outs_k, grads_k = run_with_grads(kernel_fn, cast(dtype, device),
                                             [g.to(device, dtype) for g in gouts], grad_names)
    if out_names is None:
        out_names = ["out"] if len(outs64) == 1 else [f"out{i}" for i in range(len(outs64))]
    if len(out_names) != len(outs64):
        raise ValueError(f"out_names: {len(out_names)} names {list(out_names)} for the "
                         f"reference's {len(outs64)} outputs")
    results = []
    if len(outs_k) != len(outs64):
        results.append(Comparison("outputs", dtype, float("inf"), 0.0, 0.0, float("inf"), False,
                                  f"the kernel returned {len(outs_k)} outputs, the reference "
                                  f"{len(outs64)}"))
    for n, a, b, c in zip(out_names, outs_k, outs64, outs_t):
        results.append(compare(n, a, b, c, dtype))
    for k in grads64:
        results.append(compare(f"d{k}", grads_k[k], grads64[k], grads_t[k], dtype))
    return results


def assert_against_reference(*args, **kwargs) -> List[Comparison]:
    """:func:`check_against_reference`, raising AssertionError with a table on failure."""
    results = check_against_reference(*args, **kwargs)
    bad = [r for r in results if not r.ok]
    if bad:
        table = "\n".join(r.row() for r in results)
        details = "\n".join(r.detail for r in bad)
        raise AssertionError(f"docs/math.md §4 rule failed:\n{table}\n{details}")
    return results

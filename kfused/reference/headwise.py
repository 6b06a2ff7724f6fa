"""PyTorch reference for the per-head low-rank updates of docs/math.md §2 (paper 000): Kernel-wise
(basis X), Kernel-wise-lite (basis K), the row-block update of W_o (basis O), the shared
LoRA part, and their mixes.

Everything is a batched einsum over the head axis (never a Python loop over heads), so the
same code is the float64 oracle of the tests and the CPU fallback of the ops.

Layout conventions (docs/math.md §2, PyTorch ``nn.Linear`` layout, row-major reshapes):

* a projection's output ``(..., H·p)`` is split into heads as ``(..., H, p)``;
* ``A`` factors are ``(H, r, d_b)`` (down-projection of each head), ``B`` factors
  ``(H, p, r)`` (up-projection), per-head biases ``c`` are ``(H, p)``;
* the output projection's Kernel-wise factor ``B`` is ``(d_out, H·r)`` and its bias ``c``
  is ``(d_out,)``;
* the shared LoRA part is ``A_s (r_s, d_in)``, ``B_s (d_out, r_s)`` with scale ``s``.

Grouped-query attention: with ``H_kv < H`` key/value heads, query head ``h`` attends with
key head ``h // (H / H_kv)``. Kernel-wise-lite on q therefore uses that key head as the basis
of query head ``h``; lite on v (which has ``H_kv`` heads itself) uses key head ``j`` for
value head ``j``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
import torch.nn.functional as F


@dataclasses.dataclass
class HeadFactors:
    """The adapter factors of one projection (q or v). Any subset may be set.

    shared_A (r_s, d), shared_B (H·p, r_s), scale s      -- shared LoRA part (no bias)
    wise_A (H, r, d), wise_B (H, p, r), wise_c (H, p)    -- Kernel-wise, basis X
    lite_A (H, r, p), lite_B (H, p, r), lite_c (H, p)    -- Kernel-wise-lite, basis K
    """

    shared_A: Optional[torch.Tensor] = None
    shared_B: Optional[torch.Tensor] = None
    scale: float = 1.0
    wise_A: Optional[torch.Tensor] = None
    wise_B: Optional[torch.Tensor] = None
    wise_c: Optional[torch.Tensor] = None
    lite_A: Optional[torch.Tensor] = None
    lite_B: Optional[torch.Tensor] = None
    lite_c: Optional[torch.Tensor] = None

    @property
    def has_shared(self) -> bool:
        return self.shared_A is not None

    @property
    def has_wise(self) -> bool:
        return self.wise_A is not None

    @property
    def has_lite(self) -> bool:
        return self.lite_A is not None

    @property
    def empty(self) -> bool:
        return not (self.has_shared or self.has_wise or self.has_lite)

    def map(self, fn) -> "HeadFactors":
        """A copy with ``fn`` applied to every tensor (e.g. a dtype cast)."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return HeadFactors(**{k: (fn(v) if isinstance(v, torch.Tensor) else v)
                              for k, v in kw.items()})


# ------------------------------------------------------------------------------------------
# The generic per-head low-rank product


def headwise_lowrank_ref(basis: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, *,
                         per_head: Optional[bool] = None) -> torch.Tensor:
    """``out[..., h, :] = basis[..., (h,) :] @ A[h]ᵀ @ B[h]ᵀ + bias[h]``.

    basis: (..., d_b) shared by all heads, or (..., H, d_b) one per head; A: (H, r, d_b);
    B: (H, p, r); bias: (H, p) or None. Returns (..., H, p).
    ``per_head=None`` infers the basis kind like :func:`kfused.ops.headwise_lowrank.headwise_lowrank`.
    """
    if per_head is None:
        per_head = basis.dim() >= 3 and basis.shape[-2] == A.shape[0]
    if per_head:
        z = torch.einsum("...hk,hrk->...hr", basis, A)
    else:
        z = torch.einsum("...k,hrk->...hr", basis, A)
    out = torch.einsum("...hr,hpr->...hp", z, B)
    if bias is not None:
        out = out + bias
    return out


def _heads(t: torch.Tensor, H: int) -> torch.Tensor:
    return t.reshape(*t.shape[:-1], H, t.shape[-1] // H)


def kv_group_index(n_heads: int, n_kv_heads: int, device=None) -> torch.Tensor:
    """Key head used by each of ``n_heads`` query heads (grouped-query attention)."""
    return torch.arange(n_heads, device=device) // (n_heads // n_kv_heads)


def projection_delta_ref(x: torch.Tensor, k_heads: Optional[torch.Tensor],
                         f: HeadFactors, H: int) -> torch.Tensor:
    """The adapter term of one q/v projection, ``(..., H·p)``.

    k_heads: the frozen key projection's output already matched to these ``H`` heads
    (``(..., H, p)``, bias included), needed only for the lite part.
    """
    out = None

    def add(a, b):
        return b if a is None else a + b

    if f.has_shared:
        out = add(out, f.scale * F.linear(F.linear(x, f.shared_A), f.shared_B))
    if f.has_wise:
        y = headwise_lowrank_ref(x, f.wise_A, f.wise_B, f.wise_c, per_head=False)
        out = add(out, y.flatten(-2))
    if f.has_lite:
        y = headwise_lowrank_ref(k_heads, f.lite_A, f.lite_B, f.lite_c, per_head=True)
        out = add(out, y.flatten(-2))
    return out


def headwise_qkv_ref(x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
                     b_q: Optional[torch.Tensor] = None, b_k: Optional[torch.Tensor] = None,
                     b_v: Optional[torch.Tensor] = None, *, n_heads: int,
                     n_kv_heads: Optional[int] = None, q: Optional[HeadFactors] = None,
                     v: Optional[HeadFactors] = None
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Adapted attention-input projection, docs/math.md §2 (unfused reference).

    x (..., d); w_q (H·p, d), w_k and w_v (H_kv·p, d) in nn.Linear layout; biases or None.
    q, v: :class:`HeadFactors` (lite factors use K as the basis, see the module docstring).
    Returns Q (..., H·p), K (..., H_kv·p), V (..., H_kv·p).
    """
    H = n_heads
    Hkv = n_kv_heads or n_heads
    Q = F.linear(x, w_q, b_q)
    K = F.linear(x, w_k, b_k)
    V = F.linear(x, w_v, b_v)
    Kh = _heads(K, Hkv)
    if q is not None and not q.empty:
        kq = Kh.index_select(-2, kv_group_index(H, Hkv, x.device)) if q.has_lite else None
        Q = Q + projection_delta_ref(x, kq, q, H)
    if v is not None and not v.empty:
        V = V + projection_delta_ref(x, Kh if v.has_lite else None, v, Hkv)
    return Q, K, V


def headwise_oproj_ref(o: torch.Tensor, w_o: torch.Tensor, b_o: Optional[torch.Tensor] = None,
                       *, n_heads: int, wise_A: Optional[torch.Tensor] = None,
                       wise_B: Optional[torch.Tensor] = None,
                       wise_c: Optional[torch.Tensor] = None,
                       shared_A: Optional[torch.Tensor] = None,
                       shared_B: Optional[torch.Tensor] = None, scale: float = 1.0
                       ) -> torch.Tensor:
    """Adapted output projection, docs/math.md §2 (basis O).

    ``Y = O W_oᵀ + b_o + concat_h(O^h A_hᵀ) Bᵀ + c + s · O A_sᵀ B_sᵀ``.
    o (..., H·p); w_o (d, H·p); wise_A (H, r, p); wise_B (d, H·r); wise_c (d,);
    shared_A (r_s, H·p); shared_B (d, r_s). Returns (..., d).
    """
    Y = F.linear(o, w_o, b_o)
    if wise_A is not None:
        z = torch.einsum("...hp,hrp->...hr", _heads(o, n_heads), wise_A).flatten(-2)
        Y = Y + F.linear(z, wise_B, wise_c)
    if shared_A is not None:
        Y = Y + scale * F.linear(F.linear(o, shared_A), shared_B)
    return Y


# ------------------------------------------------------------------------------------------
# Dense weight updates, for merge()/unmerge() and for tests


def projection_delta_weight(f: HeadFactors, H: int, w_k: Optional[torch.Tensor] = None,
                            b_k: Optional[torch.Tensor] = None, n_kv_heads: Optional[int] = None,
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Dense ``(ΔW (H·p, d), Δb (H·p,) or None)`` of a q/v update in nn.Linear layout.

    w_k (H_kv·p, d), b_k: the frozen key projection (needed for lite). ``n_kv_heads`` is the
    number of key heads (defaults to ``w_k``'s rows / p, as :class:`HeadwiseProjection`'s
    ``n_key_heads``); lite on a projection with ``H`` heads uses key head ``h // (H / H_kv)``.
    """
    dW = None
    db = None

    def add(a, b):
        return b if a is None else a + b

    if f.has_shared:
        dW = add(dW, f.scale * (f.shared_B @ f.shared_A))
    if f.has_wise:
        dW = add(dW, torch.einsum("hpr,hrd->hpd", f.wise_B, f.wise_A).flatten(0, 1))
        if f.wise_c is not None:
            db = add(db, f.wise_c.flatten())
    if f.has_lite:
        p = f.lite_B.shape[1]
        if w_k is None:
            raise ValueError("projection_delta_weight: w_k (the frozen key projection) is "
                             "required for a lite update")
        # the default was H: a grouped-query w_k then gave a wrongly shaped ΔW (or a reshape
        # error with b_k)
        Hkv = n_kv_heads or w_k.shape[0] // p
        if w_k.shape[0] != Hkv * p or H % Hkv:
            raise ValueError(f"projection_delta_weight: w_k has shape {tuple(w_k.shape)}, "
                             f"expected (H_kv·p, d) with p = {p} and H_kv dividing H = {H}"
                             + (f" (n_kv_heads={n_kv_heads})" if n_kv_heads else ""))
        g = kv_group_index(H, Hkv, f.lite_A.device)
        if hasattr(w_k, "device_mesh"):  # FSDP2's sharded W_k (a DTensor) takes a DTensor index
            from torch.distributed.tensor import DTensor, Replicate

            mesh = w_k.device_mesh
            g = DTensor.from_local(g, mesh, [Replicate()] * mesh.ndim, run_check=False)
        wk = w_k.reshape(Hkv, p, -1).index_select(0, g)           # (H, p, d)
        BA = torch.einsum("hpr,hrk->hpk", f.lite_B, f.lite_A)     # (H, p, p)
        dW = add(dW, torch.einsum("hpk,hkd->hpd", BA, wk).flatten(0, 1))
        if b_k is not None:
            bk = b_k.reshape(Hkv, p).index_select(0, g)
            db = add(db, torch.einsum("hpk,hk->hp", BA, bk).flatten())
        if f.lite_c is not None:
            db = add(db, f.lite_c.flatten())
    return dW, db


def oproj_delta_weight(n_heads: int, wise_A=None, wise_B=None, wise_c=None, shared_A=None,
                       shared_B=None, scale: float = 1.0
                       ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Dense ``(ΔW_o (d, H·p), Δb_o (d,) or None)`` of the output-projection update."""
    dW = None
    db = None
    if wise_A is not None:
        H, r, p = wise_A.shape
        Bh = wise_B.reshape(wise_B.shape[0], H, r)
        dW = torch.einsum("dhr,hrp->dhp", Bh, wise_A).flatten(1)
        db = wise_c
    if shared_A is not None:
        s = scale * (shared_B @ shared_A)
        dW = s if dW is None else dW + s
    return dW, db

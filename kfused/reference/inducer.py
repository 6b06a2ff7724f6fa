"""PyTorch reference for inducer attention and prefix tuning (docs/math.md §3): oracle and CPU fallback.

This is the straightforward form, as in the released inducer-tuning code: the full score matrix
``S`` (batch, heads, n_q, l + n_k) is materialised and the virtual key's logit ``s0`` is
concatenated as an extra, never-masked column in front of it; ``λ`` is that column's softmax
weight. ``f`` is ordinary attention over the real columns (prefix + sequence keys) only.

Shapes (``p`` head width, ``L`` key bottleneck, ``r`` value bottleneck, ``l`` prefix length)::

    q (B, H, n_q, p)   k, v (B, H_kv, n_k, p)   (H_kv divides H: grouped-query attention)
    Ak (H, p, L)  ak (H, L)  Bk (H, L, p)  ck (H, p)          key-side MLP (virtual key)
    W1 (H, p, r)  b1 (H, r)                                   value-side bottleneck
    W2 (H, r, p)  b2 (H, p)                                   "gate" only (head space)
    prefix_k, prefix_v (H, l, p)                              shared across the batch
    key_padding_mask (B, n_k) bool, True = real key; seq_lens (B,) int: keys j < len are real

Causal masking is aligned bottom-right: query ``i`` sees sequence keys ``j <= i + n_k - n_q``
(the usual KV-cache convention; identical to SDPA's ``is_causal`` when ``n_q == n_k``). Prefix
columns and the virtual column are never masked.

Fully masked rows (no prefix, every key masked): ``f = 0``, ``LSE = -inf`` conceptually, so
``λ = 1`` (the virtual column takes all the weight); nothing is NaN, gradients included.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def check_seq_lens(seq_lens: torch.Tensor, n_k: int) -> None:
    """Every key count in [0, n_k] (a negative count would mask the whole row, one above n_k
    would read as "all keys"): ValueError naming the first bad entry. The oracle reads the
    values on any device (a device sync on a GPU); skipped while torch.compile traces."""
    if seq_lens.numel() == 0 or torch.compiler.is_compiling():
        return
    bad = ((seq_lens < 0) | (seq_lens > n_k)).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        vals = seq_lens.tolist()
        raise ValueError(f"seq_lens[{b}] = {vals[b]} is out of range: each entry is a key count "
                         f"in [0, n_k] = [0, {n_k}] (k has {n_k} keys); got seq_lens = "
                         f"{vals if len(vals) <= 16 else vals[:8] + ['...']}")


def key_allowed(n_q: int, n_k: int, *, causal: bool, key_padding_mask: Optional[torch.Tensor],
                seq_lens: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    """Boolean (B or 1, 1, n_q, n_k) mask of visible sequence keys, or None (all visible)."""
    allowed = None
    if causal:
        i = torch.arange(n_q, device=device)[:, None]
        j = torch.arange(n_k, device=device)[None, :]
        allowed = (j <= i + (n_k - n_q))[None, None]
    pad = None
    if key_padding_mask is not None:
        pad = key_padding_mask.to(device=device, dtype=torch.bool)
    if seq_lens is not None:
        lens = seq_lens.to(device=device)
        check_seq_lens(lens, n_k)
        by_len = torch.arange(n_k, device=device)[None, :] < lens[:, None]
        pad = by_len if pad is None else pad & by_len
    if pad is not None:
        pad = pad[:, None, None, :]
        allowed = pad if allowed is None else allowed & pad
    return allowed


def inducer_key_logit(q: torch.Tensor, Ak, ak, Bk, ck, scale: float) -> torch.Tensor:
    """``s0_i = τ ⟨q_i, q_i + tanh(q_i Ak + ak) Bk + ck⟩`` -> (B, H, n)."""
    hidden = torch.tanh(torch.matmul(q, Ak) + ak[:, None, :])
    pk = q + torch.matmul(hidden, Bk) + ck[:, None, :]
    return scale * (q * pk).sum(-1)


def inducer_value_hidden(q: torch.Tensor, W1, b1) -> torch.Tensor:
    """``tanh(q W1 + b1)`` -> (B, H, n, r)."""
    return torch.tanh(torch.matmul(q, W1) + b1[:, None, :])


def inducer_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    Ak: Optional[torch.Tensor] = None, ak: Optional[torch.Tensor] = None,
    Bk: Optional[torch.Tensor] = None, ck: Optional[torch.Tensor] = None,
    W1: Optional[torch.Tensor] = None, b1: Optional[torch.Tensor] = None,
    W2: Optional[torch.Tensor] = None, b2: Optional[torch.Tensor] = None,
    *, composition: str = "add", causal: bool = False,
    key_padding_mask: Optional[torch.Tensor] = None, seq_lens: Optional[torch.Tensor] = None,
    prefix_k: Optional[torch.Tensor] = None, prefix_v: Optional[torch.Tensor] = None,
    scale: Optional[float] = None, upcast: bool = False, return_stats: bool = False,
):
    """Materialised inducer attention. Returns ``(out, u)``:

    * no inducer (``Ak is None``): ``out = f`` (B, H, n_q, p), ``u = None``;
    * ``"add"``: ``out = f`` and ``u = λ · tanh(q W1 + b1)`` (B, H, n_q, r), the term that the
      output projection maps to model space with ``W2`` (H, r, d) and ``b2`` (d) (see
      :func:`inducer_output_projection_ref`);
    * ``"gate"``: ``out = (1 − λ) f + λ (tanh(q W1 + b1) W2 + b2)``, ``u = None``.

    With ``return_stats=True`` also returns ``(lse, lam)`` (B, H, n_q) (``lam`` None without an
    inducer). ``upcast=True`` computes in float32 (float64 stays float64) and casts back.
    """
    dtype = q.dtype
    if upcast and dtype in (torch.float16, torch.bfloat16):
        def cast(t):
            return None if t is None else (t.float() if t.is_floating_point() else t)
        q, k, v, Ak, ak, Bk, ck, W1, b1, W2, b2, prefix_k, prefix_v = map(
            cast, (q, k, v, Ak, ak, Bk, ck, W1, b1, W2, b2, prefix_k, prefix_v))
    B, H, n_q, p = q.shape
    n_k = k.shape[2]
    if scale is None:
        scale = p ** -0.5
    if k.shape[1] != H:                                   # grouped-query attention
        k = k.repeat_interleave(H // k.shape[1], dim=1)
        v = v.repeat_interleave(H // v.shape[1], dim=1)
    S = torch.matmul(q, k.transpose(-1, -2)) * scale
    allowed = key_allowed(n_q, n_k, causal=causal, key_padding_mask=key_padding_mask,
                          seq_lens=seq_lens, device=q.device)
    if allowed is not None:
        allowed = allowed.expand(B, H, n_q, n_k)
    vals = v
    if prefix_k is not None and prefix_k.shape[1] > 0:
        l = prefix_k.shape[1]
        Sp = torch.matmul(q, prefix_k.transpose(-1, -2)) * scale          # (B, H, n_q, l)
        S = torch.cat([Sp, S], dim=-1)
        vals = torch.cat([prefix_v.unsqueeze(0).expand(B, H, l, p), v], dim=2)
        if allowed is not None:
            allowed = torch.cat([torch.ones(B, H, n_q, l, dtype=torch.bool, device=q.device),
                                 allowed], dim=-1)
    neg_inf = torch.tensor(float("-inf"), dtype=S.dtype, device=S.device)
    if allowed is not None:
        S_masked = torch.where(allowed, S, neg_inf)
        row_any = allowed.any(-1, keepdim=True)
        # A row with no visible key would give softmax(-inf, ..., -inf) = NaN (and NaN
        # gradients); feed it zeros instead and zero its probabilities: f = 0.
        P = torch.softmax(torch.where(row_any, S_masked, torch.zeros_like(S)), dim=-1)
        P = torch.where(allowed, P, torch.zeros_like(P))
    else:
        S_masked = S
        P = torch.softmax(S, dim=-1)
    f = torch.matmul(P, vals)
    lse = torch.logsumexp(S_masked, dim=-1)

    lam = None
    u = None
    out = f
    if Ak is not None:
        s0 = inducer_key_logit(q, Ak, ak, Bk, ck, scale)
        # The released code's way: the virtual column joins the softmax; λ is its weight.
        ext = torch.cat([s0.unsqueeze(-1), S_masked], dim=-1)
        w = torch.softmax(ext, dim=-1)
        lam = w[..., 0]
        hidden = inducer_value_hidden(q, W1, b1)
        if composition == "add":
            u = lam.unsqueeze(-1) * hidden
        elif composition == "gate":
            pv = torch.matmul(hidden, W2) + b2[:, None, :]
            # 1 − λ as the keys' own weights: formed as 1 − lam it is 0 once λ rounds to 1
            # (s0 − LSE > 37 in float64, > 17 in float32), where the kernels keep e^(LSE − s0)
            lam_c = w[..., 1:].sum(-1)
            out = lam_c.unsqueeze(-1) * f + lam.unsqueeze(-1) * pv
        else:
            raise ValueError(f"composition must be 'add' or 'gate', got {composition!r}")
    if upcast:
        out = out.to(dtype)
        u = None if u is None else u.to(dtype)
    if return_stats:
        return out, u, lse, lam
    return out, u


def inducer_attention_varlen_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: Optional[torch.Tensor] = None, *args, **kwargs,
):
    """Packed variable-length batch, one sequence at a time: q (total_q, H, p), k/v
    (total_k, H_kv, p), sequence b is rows ``cu[b]:cu[b+1]``. Every other argument as in
    :func:`inducer_attention_ref` (no key masks). Returns ``(out (total_q, H, p), u)`` with
    u (total_q, H, r) or None."""
    if cu_seqlens_k is None:
        cu_seqlens_k = cu_seqlens_q
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, us = [], []
    for b in range(len(cq) - 1):
        def seq(t, cu):
            return t[cu[b]:cu[b + 1]].transpose(0, 1).unsqueeze(0)    # (1, heads, n, p)
        out, u = inducer_attention_ref(seq(q, cq), seq(k, ck), seq(v, ck), *args, **kwargs)
        outs.append(out[0].transpose(0, 1))
        if u is not None:
            us.append(u[0].transpose(0, 1))
    out = torch.cat(outs, 0) if outs else q.new_empty(q.shape)
    return out, (torch.cat(us, 0) if us else None)


def inducer_output_projection_ref(f: torch.Tensor, u: Optional[torch.Tensor], W_o: torch.Tensor,
                                  b_o: Optional[torch.Tensor], W2: Optional[torch.Tensor] = None,
                                  b2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y = concat_h(f^h) W_oᵀ + b_o + Σ_h u^h W2_h + b2`` (docs/math.md §3, "add").

    f (B, H, n, p), u (B, H, n, r), W_o (d, H·p) nn.Linear layout, W2 (H, r, d), b2 (d,)
    -> (B, n, d).
    """
    B, H, n, p = f.shape
    y = torch.matmul(f.transpose(1, 2).reshape(B, n, H * p), W_o.transpose(0, 1))
    if b_o is not None:
        y = y + b_o
    if u is not None:
        r = u.shape[-1]
        y = y + torch.matmul(u.transpose(1, 2).reshape(B, n, H * r), W2.reshape(H * r, -1))
        if b2 is not None:
            y = y + b2
    return y

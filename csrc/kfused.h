// Host entry points of the kfused CUDA C++ extension (kfused._C).
//
// Every op lives in its own csrc/<op>/<op>.cu and declares its host functions here; the
// pybind11 module in csrc/bindings.cpp exposes them as `<op>_fwd` / `<op>_bwd`, the names the
// Python loader (kfused/cuda/__init__.py) looks for. Signatures, dtypes and layouts are
// documented in csrc/README.md. This header must stay free of CUDA headers so that the
// bindings compile with the host compiler.
#pragma once

#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace kfused {

// docs/math.md §1: y[t] = vec(A X[t] B^T), x (T, a_in*b_in), A (a_out, a_in), B (b_out, b_in).
at::Tensor kron_matvec_fwd(const at::Tensor& x, const at::Tensor& A, const at::Tensor& B);
// -> (dx (T, a_in*b_in), dA (a_out, a_in), dB (b_out, b_in)) of scale * kron(x): every
// gradient times scale before its one rounding; need_dx false: dx is (0,) and not formed.
std::tuple<at::Tensor, at::Tensor, at::Tensor> kron_matvec_bwd(
    const at::Tensor& g, const at::Tensor& x, const at::Tensor& A, const at::Tensor& B,
    bool need_dx, double scale);
// docs/math.md §1, the folded KronA weight: W + scale * (A ⊗ B), (a_out*b_out, a_in*b_in)
// contiguous in W's dtype, each element formed in float32 and rounded once.
at::Tensor krona_fold_fwd(const at::Tensor& W, const at::Tensor& A, const at::Tensor& B,
                          double scale);

// docs/math.md §2: out[t, h] = B_h A_h basis[t(, h)] + bias_h. -> (out, U): with save_u and a
// 16-bit basis (1 <= r <= 64), U (T, H, uw) = the rank-space A_h basis rounded to the basis
// dtype, uw = r + 1 rounded up to 8, column r = 1, zeros after — what headwise_lowrank_bwd
// takes so that it neither recomputes U nor reads g twice (the ones column gives dbias); else
// (0,).
std::tuple<at::Tensor, at::Tensor> headwise_lowrank_fwd(const at::Tensor& basis,
                                                        const at::Tensor& A, const at::Tensor& B,
                                                        const std::optional<at::Tensor>& bias,
                                                        bool save_u);
// -> (dbasis, dA, dB, dbias); dbias is an empty (0,) tensor when has_bias is false. U: the
// forward's or None (recomputed).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> headwise_lowrank_bwd(
    const at::Tensor& g, const at::Tensor& basis, const at::Tensor& A, const at::Tensor& B,
    bool has_bias, const std::optional<at::Tensor>& U);

// docs/math.md §3 forward (inference): -> (f (B, H, n_q, p), lse (B, H, n_q) fp32,
// lam (B, H, n_q) fp32, u (B, H, n_q, r): lam tanh(q W1 + b1), float32 when u_float, else q's
// dtype; (0,) without the MLP). Either s0 (B, H, n_q) or the MLP weights Ak (H, p, L),
// ak (H, L), Bk (H, L, p), ck (H, p), W1 (H, p, r), b1 (H, r) (16-bit q, q's dtype).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> inducer_attention_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& s0, const std::optional<at::Tensor>& prefix_k,
    const std::optional<at::Tensor>& prefix_v, const std::optional<at::Tensor>& key_lengths,
    bool causal, const std::optional<at::Tensor>& Ak, const std::optional<at::Tensor>& ak,
    const std::optional<at::Tensor>& Bk, const std::optional<at::Tensor>& ck,
    const std::optional<at::Tensor>& W1, const std::optional<at::Tensor>& b1, bool u_float);

}  // namespace kfused

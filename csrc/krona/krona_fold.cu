// The folded KronA weight (docs/math.md §1): W' = W + scale * (A ⊗ B), the CUDA C++ twin of
// kfused/triton_kernels/krona_linear.py `_kron_fold_kernel`. Element (o, c) with
// o = i * b_out + j, c = k * b_in + l is W[o, c] + s * A[i, k] * B[j, l], formed in float32
// (the product of two 16-bit factors is exact there) and rounded once to W's dtype.
//
// krona_linear(backend="cuda") at large T multiplies by W' with cuBLAS (forward and dx) instead
// of running the adapter as separate passes: this kernel is its only extra d_out x d_in pass.
// Memory-bound: W read once and W' written once, 8 consecutive columns per thread with 128-bit
// loads/stores when W's rows are contiguous and 16-byte aligned (scalar otherwise); the factors
// (a few KB) come from L1/L2.

#include "common/common.cuh"
#include "kfused.h"

namespace kfused {
namespace {

struct FoldParams {
  const void* W;
  const void* A;
  const void* B;
  void* out;  // (d_out, d_in) contiguous
  int64_t sW0, sW1, sA0, sA1, sB0, sB1;
  int64_t d_out, d_in;
  int b_out, b_in;
  float scale;
  bool vec;  // W rows contiguous, 16-byte aligned, d_in % 8 == 0 (16-bit types)
};

template <typename T>
__device__ __forceinline__ float fold_one(const FoldParams& P, const T* A, const T* B, int o,
                                          int c, float w) {
  const int i = o / P.b_out, j = o - i * P.b_out;  // 32-bit: d_out, d_in < 2^31
  const int k = c / P.b_in, l = c - k * P.b_in;
  const float a = to_float(A[i * P.sA0 + k * P.sA1]);
  const float b = to_float(B[j * P.sB0 + l * P.sB1]);
  return P.scale * (a * b) + w;  // the Triton kernel's order: s * (a b), then + w
}

// I: the flat index type (int when the element count fits, so that no 64-bit division,
// a called subroutine, sits in the loop).
template <typename T, typename I>
__global__ void __launch_bounds__(256) krona_fold_kernel(const FoldParams P) {
  const T* W = static_cast<const T*>(P.W);
  const T* A = static_cast<const T*>(P.A);
  const T* B = static_cast<const T*>(P.B);
  T* out = static_cast<T*>(P.out);
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  const I tid = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int d_in = static_cast<int>(P.d_in);
  if constexpr (sizeof(T) == 2) {
    if (P.vec) {
      const int per_row = d_in / 8;
      const I total = static_cast<I>(P.d_out) * per_row;
      for (I e = tid; e < total; e += stride) {
        const int o = static_cast<int>(e / per_row), c0 = static_cast<int>(e - I(o) * per_row) * 8;
        alignas(16) T w[8], r[8];
        *reinterpret_cast<uint4*>(w) = *reinterpret_cast<const uint4*>(W + o * P.sW0 + c0);
#pragma unroll
        for (int u = 0; u < 8; ++u)
          r[u] = static_cast<T>(fold_one<T>(P, A, B, o, c0 + u, to_float(w[u])));
        *reinterpret_cast<uint4*>(out + I(o) * d_in + c0) = *reinterpret_cast<const uint4*>(r);
      }
      return;
    }
  }
  const I total = static_cast<I>(P.d_out) * d_in;
  for (I e = tid; e < total; e += stride) {
    const int o = static_cast<int>(e / d_in), c = static_cast<int>(e - I(o) * d_in);
    out[e] = static_cast<T>(fold_one<T>(P, A, B, o, c, to_float(W[o * P.sW0 + c * P.sW1])));
  }
}

}  // namespace

at::Tensor krona_fold_fwd(const at::Tensor& W, const at::Tensor& A, const at::Tensor& B,
                          double scale) {
  check_float_cuda(W, "W");
  check_float_cuda(A, "A");
  check_float_cuda(B, "B");
  check_like(A, "A", W, "W");
  check_like(B, "B", W, "W");
  check_dim(W, 2, "W", "(a_out*b_out, a_in*b_in)");
  check_dim(A, 2, "A", "(a_out, a_in)");
  check_dim(B, 2, "B", "(b_out, b_in)");
  const int64_t d_out = A.size(0) * B.size(0), d_in = A.size(1) * B.size(1);
  TORCH_CHECK(W.size(0) == d_out && W.size(1) == d_in, "kfused: krona_fold_fwd: W (",
              describe(W), ") must be (a_out*b_out, a_in*b_in) = (", d_out, ", ", d_in,
              ") for A ", A.sizes(), " and B ", B.sizes());
  TORCH_CHECK(d_out < (int64_t(1) << 31) && d_in < (int64_t(1) << 31),
              "kfused: krona_fold_fwd: W (", describe(W), ") has a side of 2^31 or more");
  at::Tensor out = at::empty({d_out, d_in}, W.options());
  if (out.numel() == 0) return out;
  DeviceGuard guard(W);
  FoldParams P{};
  P.W = W.data_ptr();
  P.A = A.data_ptr();
  P.B = B.data_ptr();
  P.out = out.data_ptr();
  P.sW0 = W.stride(0);
  P.sW1 = W.stride(1);
  P.sA0 = A.stride(0);
  P.sA1 = A.stride(1);
  P.sB0 = B.stride(0);
  P.sB1 = B.stride(1);
  P.d_out = d_out;
  P.d_in = d_in;
  P.b_out = static_cast<int>(B.size(0));
  P.b_in = static_cast<int>(B.size(1));
  P.scale = static_cast<float>(scale);
  P.vec = W.element_size() == 2 && (d_in == 1 || P.sW1 == 1) && d_in % 8 == 0 &&
          P.sW0 % 8 == 0 && (reinterpret_cast<uintptr_t>(P.W) & 15) == 0;
  const int64_t work = P.vec ? d_out * (d_in / 8) : d_out * d_in;
  const unsigned blocks =
      static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(ceil_div(work, 256), 8 * sm_count())));
  cudaStream_t stream = current_stream();
  const bool small = d_out * d_in < (int64_t(1) << 31) - int64_t(blocks) * 256;
  KFUSED_DISPATCH_FLOAT(W.scalar_type(), "krona_fold_fwd", [&] {
    if (small)
      krona_fold_kernel<scalar_t, int><<<blocks, 256, 0, stream>>>(P);
    else
      krona_fold_kernel<scalar_t, int64_t><<<blocks, 256, 0, stream>>>(P);
  });
  check_launch("krona_fold_kernel");
  return out;
}

}  // namespace kfused

// Shared host and device helpers for the kfused CUDA kernels.
//
// Header policy: kernels include only light ATen headers (no torch/extension.h, no
// ATen/cuda/CUDAContext.h, which pulls in cuBLAS/cuSPARSE headers). The current stream and
// device guard come from c10/cuda when the installed torch is a CUDA build; a CPU-only torch
// ships c10/cuda headers that cannot be compiled (c10/cuda/impl/cuda_cmake_macros.h is
// generated only by CUDA builds), so there the code falls back to the legacy default stream
// and a cudaSetDevice guard. That fallback exists for the CI compile check only: setup.py
// builds the extension solely against a CUDA build of torch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#if !defined(KFUSED_NO_C10_CUDA) && defined(__has_include)
#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#define KFUSED_HAVE_C10_CUDA 1
#endif
#endif

#ifdef KFUSED_HAVE_C10_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace kfused {

// ------------------------------------------------------------------------------------------
// Host: stream, device guard, launch checks, device limits
// ------------------------------------------------------------------------------------------

inline cudaStream_t current_stream() {
#ifdef KFUSED_HAVE_C10_CUDA
  return c10::cuda::getCurrentCUDAStream().stream();
#else
  return nullptr;  // legacy default stream (compile-check builds only, see above)
#endif
}

#ifdef KFUSED_HAVE_C10_CUDA
struct DeviceGuard {
  explicit DeviceGuard(const at::Tensor& t) : guard_(t.device()) {}
  c10::cuda::CUDAGuard guard_;
};
#else
struct DeviceGuard {
  explicit DeviceGuard(const at::Tensor& t) {
    cudaGetDevice(&prev_);
    if (t.is_cuda() && t.get_device() != prev_) {
      cudaSetDevice(t.get_device());
      changed_ = true;
    }
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  int prev_ = 0;
  bool changed_ = false;
};
#endif

inline void check_launch(const char* kernel) {
  cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "kfused: launch of ", kernel, " failed: ",
              cudaGetErrorString(err));
}

inline int current_device() {
  int dev = 0;
  cudaGetDevice(&dev);
  return dev;
}

inline int sm_count() {
  int v = 0;
  cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, current_device());
  return v > 0 ? v : 1;
}

// Largest dynamic shared memory one block may opt into (227 KiB on sm_90).
inline int max_smem_optin() {
  int v = 0;
  cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, current_device());
  return v > 0 ? v : 48 * 1024;
}

// Raise a kernel's dynamic shared memory limit when it needs more than the default 48 KiB.
template <typename Kernel>
inline void set_smem(Kernel kernel, size_t bytes, const char* name) {
  if (bytes > 48 * 1024) {
    cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    TORCH_CHECK(err == cudaSuccess, "kfused: ", name, " cannot use ", bytes,
                " bytes of shared memory: ", cudaGetErrorString(err));
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ------------------------------------------------------------------------------------------
// Host: argument checks (messages name the tensor and its shape)
// ------------------------------------------------------------------------------------------

inline std::string describe(const at::Tensor& t) {
  std::ostringstream os;
  os << "shape " << t.sizes() << ", dtype " << t.scalar_type() << ", device " << t.device();
  return os.str();
}

inline void check_float_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), "kfused: ", name, " is undefined");
  TORCH_CHECK(t.is_cuda(), "kfused: ", name, " must be a CUDA tensor (", describe(t), ")");
  auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kHalf || s == at::kBFloat16, "kfused: ", name,
              " must be float32, float16 or bfloat16 (", describe(t), ")");
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), "kfused: ", name, " must be contiguous (", describe(t),
              ", strides ", t.strides(), ")");
}

inline void check_like(const at::Tensor& t, const char* name, const at::Tensor& ref,
                       const char* ref_name) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "kfused: ", name, " (", describe(t),
              ") must have the dtype of ", ref_name, " (", ref.scalar_type(), ")");
  TORCH_CHECK(t.device() == ref.device(), "kfused: ", name, " (", describe(t),
              ") must be on the device of ", ref_name, " (", ref.device(), ")");
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* name, const char* layout) {
  TORCH_CHECK(t.dim() == dim, "kfused: ", name, " must be ", dim, "-D ", layout, " (",
              describe(t), ")");
}

// Dispatch over the three fused dtypes only (no double: keeps compile time and binary small).
#define KFUSED_DISPATCH_FLOAT(TYPE, NAME, ...)                                           \
  [&] {                                                                                  \
    switch (TYPE) {                                                                      \
      case at::kFloat: {                                                                 \
        using scalar_t = float;                                                          \
        return __VA_ARGS__();                                                            \
      }                                                                                  \
      case at::kHalf: {                                                                  \
        using scalar_t = c10::Half;                                                      \
        return __VA_ARGS__();                                                            \
      }                                                                                  \
      case at::kBFloat16: {                                                              \
        using scalar_t = c10::BFloat16;                                                  \
        return __VA_ARGS__();                                                            \
      }                                                                                  \
      default:                                                                           \
        TORCH_CHECK(false, "kfused: ", NAME, " does not support dtype ", TYPE);          \
    }                                                                                    \
  }()

// ------------------------------------------------------------------------------------------
// Device: conversions
// ------------------------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  return static_cast<float>(v);
}

// Round a float accumulator to T and back: the intermediate a torch matmul chain in dtype T
// would hold between two products.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// ------------------------------------------------------------------------------------------
// Device: block-wide register-tiled GEMM on float operands (shared or global memory)
// ------------------------------------------------------------------------------------------
//
// C (M x N) = sum_{b < kbatch} A_b (M x K) * B_b (K x N), handed element by element to an
// epilogue functor epi(m, n, value). Every thread owns TM x TN outputs: TM consecutive rows
// and TN columns interleaved with stride tiles_n, so that a warp's threads touch consecutive
// columns (conflict-free shared-memory reads when the column stride is 1 or odd, coalesced
// global stores in the epilogue). Out-of-range rows/columns read a valid address and are
// dropped before the epilogue, so the inner loop has no branches.

struct GemmA {  // element (m, k) of batch b: p[b*batch + m*row + k*kstride]
  const float* p;
  int row;
  int kstride;
  int batch;
};

struct GemmB {  // element (k, n) of batch b: p[b*batch + k*kstride + (n/cdiv)*cbatch + (n%cdiv)*col]
  const float* p;
  int kstride;
  int col;
  int cdiv;
  int cbatch;
  int batch;
};

template <int TM, int TN, typename Epi>
__device__ __forceinline__ void block_gemm(int M, int N, int K, int kbatch, const GemmA& a,
                                           const GemmB& b, Epi epi) {
  const int tiles_m = (M + TM - 1) / TM;
  const int tiles_n = (N + TN - 1) / TN;
  const int ntiles = tiles_m * tiles_n;
  for (int tile = threadIdx.x; tile < ntiles; tile += blockDim.x) {
    const int tm = tile / tiles_n;
    const int tn = tile - tm * tiles_n;
    int aoff[TM], boff[TN];
#pragma unroll
    for (int r = 0; r < TM; ++r) {
      int m = tm * TM + r;
      m = m < M ? m : M - 1;
      aoff[r] = m * a.row;
    }
#pragma unroll
    for (int c = 0; c < TN; ++c) {
      int n = tn + c * tiles_n;
      n = n < N ? n : N - 1;
      const int q = n / b.cdiv;
      boff[c] = q * b.cbatch + (n - q * b.cdiv) * b.col;
    }
    float acc[TM][TN];
#pragma unroll
    for (int r = 0; r < TM; ++r)
#pragma unroll
      for (int c = 0; c < TN; ++c) acc[r][c] = 0.f;
    for (int bt = 0; bt < kbatch; ++bt) {
      const float* ap = a.p + static_cast<int64_t>(bt) * a.batch;
      const float* bp = b.p + static_cast<int64_t>(bt) * b.batch;
#pragma unroll 4
      for (int k = 0; k < K; ++k) {
        float av[TM], bv[TN];
#pragma unroll
        for (int r = 0; r < TM; ++r) av[r] = ap[aoff[r] + k * a.kstride];
#pragma unroll
        for (int c = 0; c < TN; ++c) bv[c] = bp[boff[c] + k * b.kstride];
#pragma unroll
        for (int r = 0; r < TM; ++r)
#pragma unroll
          for (int c = 0; c < TN; ++c) acc[r][c] = fmaf(av[r], bv[c], acc[r][c]);
      }
    }
#pragma unroll
    for (int r = 0; r < TM; ++r) {
      const int m = tm * TM + r;
      if (m >= M) continue;
#pragma unroll
      for (int c = 0; c < TN; ++c) {
        const int n = tn + c * tiles_n;
        if (n < N) epi(m, n, acc[r][c]);
      }
    }
  }
}

// Deterministic reduction of per-block float partials: value e = sum_b part[b*n + e], cast to
// T and written to out0 or out1 (reduce_partials: a split at n0; reduce_partials_rows: the
// columns of rows, e.g. a weight gradient and a bias gradient packed side by side in one
// GEMM's output). Used for weight gradients (no atomics:
// run-to-run identical for a given grid). A block takes 32 consecutive values (one per lane,
// coalesced rows of part) and its 8 warps split the partials: warp w sums b = w, w + 8, ...
// in order, then warp 0 adds the 8 warp sums in order — a fixed tree for a given nparts, with
// 8x the memory parallelism of one thread per value (few values, many partials).
constexpr int kReduceGroups = 8;

template <typename T>
__global__ void __launch_bounds__(32 * kReduceGroups) reduce_partials_kernel(
    const float* __restrict__ part, int64_t nparts, int64_t n, int64_t w, int64_t w0,
    int64_t w1, T* __restrict__ out0, T* __restrict__ out1, float scale) {
  __shared__ float sums[kReduceGroups][33];
  const int lane = threadIdx.x & 31, grp = threadIdx.x >> 5;
  for (int64_t c0 = static_cast<int64_t>(blockIdx.x) * 32; c0 < n;
       c0 += static_cast<int64_t>(gridDim.x) * 32) {
    const int64_t e = c0 + lane;
    float s = 0.f;
    if (e < n)
      for (int64_t b = grp; b < nparts; b += kReduceGroups) s += part[b * n + e];
    sums[grp][lane] = s;
    __syncthreads();
    if (grp == 0 && e < n) {
      float t = sums[0][lane];
#pragma unroll
      for (int g = 1; g < kReduceGroups; ++g) t += sums[g][lane];
      t *= scale;  // 1 (exact) unless the caller scales the sums before their one rounding
      // value e is column `col` of a row of w: the first w0 columns of every row go to out0,
      // the next w1 to out1, any further ones nowhere
      const int64_t row = e / w, col = e - row * w;
      if (col < w0)
        out0[row * w0 + col] = static_cast<T>(t);
      else if (col - w0 < w1)
        out1[row * w1 + col - w0] = static_cast<T>(t);
    }
    __syncthreads();  // sums is reused by the next 32 values
  }
}

// out0[row * w0 + c] = sum of the nparts partials of value row * w + c for c < w0, and
// out1[row * w1 + c - w0] for w0 <= c < w0 + w1 (n = rows * w values per partial, float32
// sums in a fixed order: deterministic).
template <typename T>
inline void reduce_partials_rows(const float* part, int64_t nparts, int64_t n, int64_t w,
                                 int64_t w0, int64_t w1, T* out0, T* out1, cudaStream_t stream,
                                 float scale = 1.f) {
  if (n == 0) return;
  const int64_t blocks = std::min<int64_t>(ceil_div(n, 32), 4096);
  reduce_partials_kernel<T><<<static_cast<unsigned>(blocks), 32 * kReduceGroups, 0, stream>>>(
      part, nparts, n, w, w0, w1, out0, out1, scale);
  check_launch("reduce_partials_kernel");
}

// The first n0 of the n sums to out0, the rest to out1 (one row of n values).
template <typename T>
inline void reduce_partials(const float* part, int64_t nparts, int64_t n, int64_t n0, T* out0,
                            T* out1, cudaStream_t stream, float scale = 1.f) {
  reduce_partials_rows<T>(part, nparts, n, n, n0, n - n0, out0, out1, stream, scale);
}

}  // namespace kfused

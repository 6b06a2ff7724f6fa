// Tensor-core inducer attention forward, c10::BFloat16 instantiations (see inducer_mma.cuh).
#include "inducer/inducer_mma.cuh"

namespace kfused {
namespace inducer {
template void launch_inducer_mma_p<c10::BFloat16>(const InducerParams&, bool, int, dim3, cudaStream_t);
}  // namespace inducer
}  // namespace kfused

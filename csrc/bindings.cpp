// pybind11 module kfused._C: one entry per host function declared in kfused.h.
// Adding an op: its .cu file under csrc/<op>/, its declarations in kfused.h, and the m.def
// lines below (names `<op>_fwd` / `<op>_bwd`, which kfused/cuda/__init__.py looks for).
// Signatures, dtypes and layouts: csrc/README.md.
//
// torch/csrc/utils/pybind.h (the at::Tensor / optional type casters, `py` alias) instead of
// torch/extension.h: the latter drags in all of libtorch's C++ API and compiles 4x slower.
#include <torch/csrc/utils/pybind.h>

#include "kfused.h"

// Mirrors the check in common/common.cuh (same include path): true when the kernels launch on
// torch's current stream (a CUDA build of torch), false in compile-check builds against a
// CPU-only torch, which fall back to the legacy default stream.
#if !defined(KFUSED_NO_C10_CUDA) && defined(__has_include)
#if __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#define KFUSED_BINDINGS_C10_CUDA 1
#endif
#endif

namespace {

// A c10::Error (every TORCH_CHECK of the host code) as the Python exception torch itself raises
// for it, with what_without_backtrace(), as torch's own bindings do. pybind11's generic
// std::exception translator calls what(), which renders the C++ backtrace the error captured:
// on the H200 machine of 2026-11-30 every argument check of this module that failed on CUDA
// tensors ended the process with a segmentation fault there (tests/test_cuda_ext.py, the seven
// *_errors tests), where the same build raised on this project's CPU machine. Python's own
// exception types for c10's typed errors (TORCH_CHECK_VALUE, _TYPE, _INDEX, _NOT_IMPLEMENTED);
// torch.OutOfMemoryError for an allocation that failed.
void translate_c10_error(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const c10::OutOfMemoryError& e) {
    py::object oom = py::module_::import("torch").attr("OutOfMemoryError");
    PyErr_SetString(oom.ptr(), e.what_without_backtrace());
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
  } catch (const c10::TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
  } catch (const c10::IndexError& e) {
    PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
  } catch (const c10::NotImplementedError& e) {
    PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kfused CUDA C++ kernels (see csrc/README.md)";
  // local: first for this module's functions, other modules' translators untouched
  py::register_local_exception_translator(&translate_c10_error);
#ifdef KFUSED_BINDINGS_C10_CUDA
  m.attr("USES_TORCH_CURRENT_STREAM") = true;
#else
  m.attr("USES_TORCH_CURRENT_STREAM") = false;
#endif
  // The sm_XY targets setup.py compiled the kernels for (-DKFUSED_CUDA_ARCH_LIST=80,90), as
  // ints; kfused.backends refuses a GPU none of them runs on. Empty when the build did not say.
#ifdef KFUSED_CUDA_ARCH_LIST
  m.attr("CUDA_ARCHS") = py::make_tuple(KFUSED_CUDA_ARCH_LIST);
#else
  m.attr("CUDA_ARCHS") = py::make_tuple();
#endif

  m.def("kron_matvec_fwd", &kfused::kron_matvec_fwd,
        "y (T, a_out*b_out) = vec(A X[t] B^T) for x (T, a_in*b_in)", py::arg("x"), py::arg("A"),
        py::arg("B"));
  m.def("kron_matvec_bwd", &kfused::kron_matvec_bwd,
        "(dx, dA, dB) of scale * kron_matvec (need_dx false: dx is (0,), not formed)",
        py::arg("g"), py::arg("x"), py::arg("A"), py::arg("B"), py::arg("need_dx") = true,
        py::arg("scale") = 1.0);
  m.def("krona_fold_fwd", &kfused::krona_fold_fwd,
        "W + scale * kron(A, B) (a_out*b_out, a_in*b_in), formed in float32, rounded once",
        py::arg("W"), py::arg("A"), py::arg("B"), py::arg("scale") = 1.0);

  m.def("headwise_lowrank_fwd", &kfused::headwise_lowrank_fwd,
        "(out (T, H, p) = per head basis A_h^T B_h^T + bias_h, U for the backward when save_u "
        "(16-bit), else (0,))",
        py::arg("basis"), py::arg("A"), py::arg("B"), py::arg("bias") = py::none(),
        py::arg("save_u") = false);
  m.def("headwise_lowrank_bwd", &kfused::headwise_lowrank_bwd,
        "(dbasis, dA, dB, dbias) of headwise_lowrank; U: the forward's saved U or None",
        py::arg("g"), py::arg("basis"), py::arg("A"), py::arg("B"), py::arg("has_bias"),
        py::arg("U") = py::none());

  m.def("inducer_attention_fwd", &kfused::inducer_attention_fwd,
        "(f, lse, lam, u) of inducer attention (forward only): s0 given, or computed in the "
        "kernel from the inducer MLP (Ak, ak, Bk, ck, W1, b1; float16 / bfloat16)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("s0") = py::none(),
        py::arg("prefix_k") = py::none(), py::arg("prefix_v") = py::none(),
        py::arg("key_lengths") = py::none(), py::arg("causal") = false,
        py::arg("Ak") = py::none(), py::arg("ak") = py::none(), py::arg("Bk") = py::none(),
        py::arg("ck") = py::none(), py::arg("W1") = py::none(), py::arg("b1") = py::none(),
        py::arg("u_float") = false);
}

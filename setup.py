"""Build script. The CUDA C++ extension (kfused._C, from csrc/) is built only when a CUDA
toolkit and a CUDA build of torch are present in the build environment, e.g.

    pip install -e . --no-build-isolation        # on a GPU machine with nvcc

Everywhere else the install succeeds without it and the ``cuda`` backend reports itself
unavailable. ``KFUSED_NO_CUDA=1`` skips the extension explicitly.
"""

import glob
import os

from setuptools import setup


def _cuda_build():
    if os.environ.get("KFUSED_NO_CUDA", "").strip().lower() in ("1", "true", "yes", "on"):
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except Exception:
        return [], {}
    if torch.version.cuda is None or CUDA_HOME is None:
        return [], {}
    here = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True)
                     + glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    if not sources:
        return [], {}
    archs = os.environ.get("KFUSED_CUDA_ARCHS", "80;90").split(";")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs if a]
    ext = CUDAExtension(
        name="kfused._C",
        sources=sources,
        include_dirs=[os.path.join(here, "csrc")],
        extra_compile_args={"cxx": ["-O3", "-std=c++17"],
                            "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr"] + gencode},
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _cuda_build()
setup(ext_modules=ext_modules, cmdclass=cmdclass)

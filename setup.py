"""Build script. The CUDA C++ extension (kfused._C, from csrc/) is built only when a CUDA
toolkit and a CUDA build of torch are present in the build environment, e.g.

    pip install -e . --no-build-isolation        # on a GPU machine with nvcc

Everywhere else the install succeeds without it and the ``cuda`` backend reports itself
unavailable. ``KFUSED_NO_CUDA=1`` skips the extension explicitly.
"""

import glob
import os
import re

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
    spec = os.environ.get("KFUSED_CUDA_ARCHS", "").strip() or "80;90"
    archs = [a.strip() for a in spec.split(";") if a.strip()]
    bad = [a for a in archs if not re.fullmatch(r"\d+a?", a)]
    if bad or not archs:
        raise SystemExit(f"KFUSED_CUDA_ARCHS={os.environ.get('KFUSED_CUDA_ARCHS')!r}: expected "
                         "';'-separated compute capabilities without dots, e.g. 80;90 (or 90a)")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    # the bindings expose the list (kfused._C.CUDA_ARCHS): a GPU none of them runs on is
    # refused by kfused.backends instead of failing at the first launch
    arch_list = "-DKFUSED_CUDA_ARCH_LIST=" + ",".join(a.rstrip("a") for a in archs)
    ext = CUDAExtension(
        name="kfused._C",
        sources=sources,
        include_dirs=[os.path.join(here, "csrc")],
        extra_compile_args={"cxx": ["-O3", "-std=c++17", arch_list],
                            "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr"] + gencode},
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _cuda_build()
setup(ext_modules=ext_modules, cmdclass=cmdclass)

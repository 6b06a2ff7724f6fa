"""Compile every Triton kernel for a GPU target on a machine without a GPU.

The CPU interpreter accepts programs the GPU compiler rejects (tl.dot on tiles < 16, layout
conversions, shared-memory overflows). This tool runs each op's host functions on small CPU
tensors with launches *recorded* instead of executed (host functions pick their GPU block
sizes, see ``_common.targets_gpu``), then compiles each distinct launch for sm_90 with Triton's
own compiler and ptxas, and reports registers, spills and shared memory from the cubin.

    python -m kfused.triton_kernels._aot [--arch 90] [--jobs 2] [ops...]

Must run without TRITON_INTERPRET (kernels must be JITFunctions). Exit status 1 if any launch
fails to compile. Each op registers a driver with :func:`register`.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import os
import re
import subprocess
import sys
import tempfile
from typing import Callable, Dict, List, Tuple

import torch

_DRIVERS: Dict[str, Callable[[], None]] = {}


def register(op: str):
    def deco(fn):
        _DRIVERS[op] = fn
        return fn
    return deco


_TORCH_TO_TRITON = {
    torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
    torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32",
    torch.int64: "i64", torch.bool: "i1",
}


@contextlib.contextmanager
def recording():
    """Within the block, ``kernel[grid](...)`` records the launch instead of running it."""
    from triton.runtime.jit import JITFunction

    from kfused.triton_kernels import _common

    launches: List[Tuple[object, tuple, dict]] = []
    orig = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))
        return None

    JITFunction.run = run
    old = dict(_common._AOT_TARGET)
    _common._AOT_TARGET["on"] = True
    try:
        yield launches
    finally:
        JITFunction.run = orig
        _common._AOT_TARGET.update(old)


def _spec(fn, args: tuple, kwargs: dict):
    """(signature, constexprs, attrs, options) for ASTSource from a recorded launch."""
    import triton.language as tl

    names = fn.arg_names
    bound = dict(zip(names, args))
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    bound.update(kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(names, fn.params)):
        if name not in bound:
            if not param.has_default:
                raise TypeError(f"{fn.__name__}: argument {name} missing from the launch")
            bound[name] = param.default
        v = bound[name]
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[(i,)] = v
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + _TORCH_TO_TRITON[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            signature[name] = "i1"
        elif isinstance(v, int):
            signature[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0 and v != 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[name] = "fp32"
        elif v is None:
            signature[name] = "constexpr"
            constexprs[(i,)] = None
        elif isinstance(v, tl.dtype):
            signature[name] = "constexpr"
            constexprs[(i,)] = v
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {name}={v!r}")
    return signature, constexprs, attrs, options


def _key(fn, spec) -> str:
    sig, consts, attrs, opts = spec
    return f"{fn.__name__}|{sorted(sig.items())}|{sorted((k, str(v)) for k, v in consts.items())}|{sorted(opts.items())}"


def _cuobjdump() -> str:
    """Triton ships cuobjdump next to its ptxas; fall back to the one on PATH."""
    try:
        import triton.backends.nvidia as nv

        path = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
        if os.path.exists(path):
            return path
    except Exception:
        pass
    return "cuobjdump"


def _resource_usage(cubin: bytes) -> Dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        out = subprocess.run([_cuobjdump(), "-res-usage", path], capture_output=True, text=True,
                             timeout=60).stdout
    except Exception:
        return {}
    finally:
        os.unlink(path)
    usage = {}
    for key, pat in (("regs", r"REG:(\d+)"), ("stack", r"STACK:(\d+)"), ("shared", r"SHARED:(\d+)"),
                     ("local", r"LOCAL:(\d+)")):
        m = re.search(pat, out)
        if m:
            usage[key] = int(m.group(1))
    return usage


def compile_launch(fn, spec, arch: int = 90) -> Dict[str, object]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, consts, attrs, opts = spec
    src = ASTSource(fn, sig, consts, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(opts))
    info: Dict[str, object] = {"shared_bytes": getattr(k.metadata, "shared", None)}
    info.update(_resource_usage(k.asm["cubin"]))
    return info


def _describe(fn, spec) -> str:
    sig, consts, _, opts = spec
    names = fn.arg_names
    c = ",".join(f"{names[i[0]]}={v.name if hasattr(v, 'name') else v}" for i, v in consts.items()
                 if not isinstance(v, str) or len(v) < 8)
    dts = sorted({t for t in sig.values() if t.startswith("*")})
    return f"{fn.__name__}[{'/'.join(dts)}] {c} {opts}"


_WORK: List[tuple] = []  # filled before forking; workers take items by index


def _compile_one(index: int):
    op, fn, spec, arch = _WORK[index]
    try:
        return op, _describe(fn, spec), compile_launch(fn, spec, arch), None
    except Exception as exc:  # report every failure, not only the first
        msg = f"{type(exc).__name__}: {exc}"
        return op, _describe(fn, spec), None, msg[:2000]


def collect(ops: List[str]) -> List[tuple]:
    """Run the registered drivers and return unique (op, fn, spec) launches."""
    _load_drivers()
    items, seen = [], set()
    for op in ops or list(_DRIVERS):
        if op not in _DRIVERS:
            raise SystemExit(f"no AOT driver for {op!r} (have: {', '.join(_DRIVERS)})")
        with recording() as launches:
            _DRIVERS[op]()
        for fn, args, kwargs in launches:
            spec = _spec(fn, args, dict(kwargs))
            key = _key(fn, spec)
            if key not in seen:
                seen.add(key)
                items.append((op, fn, spec))
    return items


def _load_drivers() -> None:
    # Each kernel module registers its driver when imported.
    import importlib
    import pkgutil

    import kfused.triton_kernels as pkg

    for m in pkgutil.iter_modules(pkg.__path__):
        if not m.name.startswith("_"):
            importlib.import_module(f"kfused.triton_kernels.{m.name}")


def main(argv=None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("run without TRITON_INTERPRET: the kernels must be compiled, not interpreted",
              file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("ops", nargs="*")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    args = p.parse_args(argv)
    items = collect(args.ops)
    print(f"compiling {len(items)} distinct launches for sm_{args.arch} ...", flush=True)
    failures = 0
    # Compilation happens in worker processes (fork keeps the registered kernels).
    ctx = __import__("multiprocessing").get_context("fork")
    _WORK[:] = [(op, fn, spec, args.arch) for op, fn, spec in items]
    with cf.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) as ex:
        for op, desc, info, err in ex.map(_compile_one, range(len(_WORK))):
            if err:
                failures += 1
                print(f"FAIL {op}: {desc}\n     {err}")
            else:
                spill = info.get("local", 0) or info.get("stack", 0)
                print(f"ok   {op}: {desc}\n     regs={info.get('regs')} spill/stack={spill} "
                      f"shared={info.get('shared_bytes')}B")
    print(f"{len(items) - failures} compiled, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    # Run the imported module's main so kernel modules register into the same registry.
    from kfused.triton_kernels._aot import main as _main

    sys.exit(_main())

"""One compile tool: record Triton launches, compile them as the JIT would, read the cubin.

* :func:`recording` — inside the block ``kernel[grid](...)`` records a :class:`Launch` (the
  kernel, its bound arguments, options and grid) instead of running it; host functions pick
  their GPU configurations (``_common._AOT_TARGET``), so CPU tensors stand in for CUDA ones.
* :func:`jit_spec` — the (signature, constexprs, attrs, options) Triton's own JIT derives
  from those arguments: its binder (``create_function_from_signature``) and ``_pack_args``
  for the CUDA backend of the target, so integer arguments equal to 1 become constexprs and
  pointers / integers divisible by 16 get ``tt.divisibility`` exactly as at run time. Older
  Triton without that path falls back to a hand-written equivalent (:func:`_manual_spec`).
* :func:`compile_launch` — ``triton.compile`` for ``sm_<arch>`` and :func:`cubin_stats`:
  registers, spill (local) bytes, shared memory, CTAs per SM and the SASS instruction mix
  (cuobjdump / nvdisasm shipped with Triton). Results are cached as JSON under
  ``$KFUSED_CACHE`` or ``~/.cache/kfused/perf``, keyed on the kernel's source hash (Triton's
  ``cache_key`` covers the functions it calls), the specialisation, the options, the arch and
  the Triton version.
* :func:`csrc_stats` — the same statistics for the CUDA C++ objects in ``csrc/``.

Nothing here needs a GPU.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

import torch

# ------------------------------------------------------------------------------------------
# hardware limits used for occupancy (CUDA C Programming Guide, "Compute capabilities" table)

SM_LIMITS = {
    90: dict(regs=65536, smem=233472, smem_per_block=232448, threads=2048, ctas=32,
             reserved_smem=1024, sms=132),
    80: dict(regs=65536, smem=167936, smem_per_block=166912, threads=2048, ctas=32,
             reserved_smem=1024, sms=108),
}


def occupancy(regs: int, shared: int, num_warps: int, arch: int) -> int:
    """CTAs per SM from registers (allocated per warp in units of 256), shared memory (plus the
    1 KB the driver reserves per CTA) and threads (the rule the runtime sizes persistent grids
    with: kfused.triton_kernels._common.ctas_per_sm)."""
    from kfused.triton_kernels._common import ctas_per_sm

    lim = SM_LIMITS[arch]
    return ctas_per_sm(regs, shared, num_warps, sm_regs=lim["regs"], sm_smem=lim["smem"],
                       sm_threads=lim["threads"], max_ctas=lim["ctas"],
                       smem_per_block=lim["smem_per_block"],
                       reserved_smem=lim["reserved_smem"])


# ------------------------------------------------------------------------------------------
# recording launches


@dataclasses.dataclass
class Launch:
    fn: object               # triton JITFunction
    args: tuple
    kwargs: dict
    grid: Tuple[int, int, int]
    # Launches recorded for one autotuned call (one per config: the autotuner would time them
    # on a GPU and run the fastest) share an ``alt`` id >= 0; the report keeps the one with the
    # lowest predicted time. -1: an ordinary launch.
    alt: int = -1

    @property
    def name(self) -> str:
        return self.fn.__name__

    def bound(self) -> Dict[str, object]:
        """Every argument by name (defaults applied), options included."""
        out = dict(zip(self.fn.arg_names, self.args))
        out.update(self.kwargs)
        for name, p in zip(self.fn.arg_names, self.fn.params):
            if name not in out and p.has_default:
                out[name] = p.default
        return out

    def programs(self) -> int:
        g = self.grid
        return int(g[0] * g[1] * g[2])


@contextlib.contextmanager
def recording():
    """Within the block, ``kernel[grid](...)`` records a :class:`Launch` instead of running it;
    host functions choose their GPU configurations (``_common._AOT_TARGET``)."""
    from triton.runtime.jit import JITFunction

    from kfused.triton_kernels import _common

    launches: List[Launch] = []
    orig = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        g = grid
        if callable(g):
            g = g(dict(zip(self.arg_names, args), **kwargs))
        g = tuple(int(v) for v in g) + (1,) * (3 - len(g))
        launches.append(Launch(self, args, dict(kwargs), g))
        return None

    JITFunction.run = run
    old = dict(_common._AOT_TARGET)
    _common._AOT_TARGET["on"] = True
    try:
        yield launches
    finally:
        JITFunction.run = orig
        _common._AOT_TARGET.clear()
        _common._AOT_TARGET.update(old)


# ------------------------------------------------------------------------------------------
# the JIT's specialisation

_TORCH_TO_TRITON = {
    torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
    torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32",
    torch.int64: "i64", torch.bool: "i1",
}


def _target(arch: int):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", arch, 32)


def jit_spec(fn, args: tuple, kwargs: dict, arch: int = 90):
    """(signature, constexprs, attrs, options dict) exactly as ``JITFunction.run`` builds them."""
    try:
        return _triton_spec(fn, args, dict(kwargs), arch)
    except Exception:  # older / newer Triton without these internals: the same rules by hand
        return _manual_spec(fn, args, dict(kwargs), arch)


def _triton_spec(fn, args, kwargs, arch):
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(_target(arch))
    kwargs["debug"] = kwargs.get("debug", getattr(fn, "debug", None)) or knobs.runtime.debug
    for k, v in (("instrumentation_mode", "instrumentation_mode"),
                 ("fpsan_homomorphic_casts", "fpsan_homomorphic_casts")):
        if hasattr(knobs.compilation, v):
            kwargs[k] = getattr(knobs.compilation, v)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound,
                                                          specialization, options)
    return signature, constexprs, attrs, dict(options.__dict__)


def _manual_spec(fn, args, kwargs, arch):
    """Triton's rules (runtime/jit.py specialize_impl): tensors -> pointer, 16-byte aligned
    data -> divisibility 16; ints equal to 1 -> constexpr; ints % 16 == 0 -> divisibility 16;
    ints beyond i32 -> i64; bools -> i1; floats -> fp32 (never specialised)."""
    import triton.language as tl

    names = fn.arg_names
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "num_ctas", "maxnreg")
               if k in kwargs}
    bound = dict(zip(names, args))
    bound.update(kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(names, fn.params)):
        if name not in bound:
            bound[name] = param.default
        v = bound[name]
        if param.is_constexpr or v is None or isinstance(v, (tl.dtype, str)):
            signature[name] = "constexpr"
            constexprs[(i,)] = v
        elif isinstance(v, torch.Tensor):
            signature[name] = "*" + _TORCH_TO_TRITON[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]] if v.data_ptr() % 16 == 0 else []
        elif isinstance(v, bool):
            signature[name] = "i1"
        elif isinstance(v, int):
            if v == 1 and not param.do_not_specialize:
                signature[name] = "constexpr"
                constexprs[(i,)] = 1
                continue
            signature[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            attrs[(i,)] = [["tt.divisibility", 16]] if v % 16 == 0 else []
        elif isinstance(v, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {name}={v!r}")
    options.setdefault("num_warps", 4)
    options.setdefault("num_stages", 3)
    options["arch"] = f"sm{arch}"
    return signature, constexprs, attrs, options


def _jsonable(v):
    if hasattr(v, "name") and not isinstance(v, (str, bytes)):
        return str(v.name)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return str(v)


# Bumped when the statistics recorded per compile change meaning (2: "dot_tf32" counts only
# float32 dots that name TF32; IEEE float32 dots, whose precision the TTIR omits, are
# "dot_f32_ieee"), so that no cache or seed entry of the old meaning is reused.
STATS_VERSION = 4       # 3: spill_bytes from the stack frame where SASS has LDL/STL;
#                         4: the SASS mix has hgmma_loop_feed_milli (hgmma_loop_feed)


def spec_key(fn, spec, arch: int) -> str:
    import triton

    sig, consts, attrs, opts = spec
    keep = {k: opts[k] for k in sorted(opts) if k in ("num_warps", "num_stages", "num_ctas",
                                                        "maxnreg", "enable_fp_fusion",
                                                        "debug", "arch")}
    text = json.dumps([fn.cache_key, sorted(sig.items()),
                       sorted((str(k), _jsonable(v)) for k, v in consts.items()),
                       sorted((str(k), _jsonable(v)) for k, v in attrs.items()),
                       _jsonable(keep), arch, triton.__version__,
                       # unset = enabled in Triton <= 3.9 (options carry the effective flag)
                       os.environ.get("TRITON_DEFAULT_FP_FUSION", "1") or "1",
                       STATS_VERSION], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def constexpr_summary(fn, spec) -> Dict[str, object]:
    """Named constexprs (block sizes, flags) and warps/stages of a spec, for reports."""
    sig, consts, _, opts = spec
    names = fn.arg_names
    out = {}
    for k, v in consts.items():
        name = names[k[0]]
        if fn.params[k[0]].is_constexpr:
            out[name] = _jsonable(v)
    out["num_warps"] = opts.get("num_warps")
    out["num_stages"] = opts.get("num_stages")
    return out


def spec_dtypes(spec) -> List[str]:
    return sorted({t[1:] for t in spec[0].values() if isinstance(t, str) and t.startswith("*")})


# ------------------------------------------------------------------------------------------
# tools and SASS statistics


def _nv_bin(tool: str) -> str:
    try:
        import triton.backends.nvidia as nv

        path = os.path.join(os.path.dirname(nv.__file__), "bin", tool)
        if os.path.exists(path):
            return path
    except Exception:
        pass
    found = shutil.which(tool)
    if found:
        return found
    return os.path.join("/usr/local/cuda/bin", tool)


_OPCODE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.x]*)",
                     re.MULTILINE)


_SASS_AT = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.MULTILINE)
_HGMMA = re.compile(r"HGMMA\.(\d+)x(\d+)x(\d+)\S*\s+R\w+,\s*(\S+)")
_BRA_TO = re.compile(r"\bBRA\s+(0x[0-9a-f]+)")


def hgmma_loop_feed(body: str) -> float:
    """The wgmma operand feed of a function's loop products (``cuobjdump -sass`` text):
    1 / (the tensor-core time of its HGMMA instructions at their shapes' feed efficiency,
    :func:`kfused.perf.roofline.wgmma_feed_efficiency`, over that time at full rate),
    weighting each instruction by its FLOPs (M·N·K). Counted are the HGMMAs inside a loop
    (from a backward branch's target to the branch: what runs per tile), all of them in a
    function without loops; 1.0 without any. A operand in registers (``R.., gdesc``) or in
    shared memory (``gdesc`` first) as the instruction says. An m64n32 wgmma, as Triton
    issues S = QKᵀ of a 64-row tile split over two warpgroups, reaches 2/3 of the rate."""
    from kfused.perf.roofline import wgmma_feed_efficiency

    lines = [(int(a, 16), t) for a, t in _SASS_AT.findall(body)]
    loops = []
    for addr, text in lines:
        b = _BRA_TO.search(text)
        if b and int(b.group(1), 16) < addr:
            loops.append((int(b.group(1), 16), addr))
    full = slow = 0.0
    for addr, text in lines:
        m = _HGMMA.search(text)
        if not m or (loops and not any(lo <= addr <= hi for lo, hi in loops)):
            continue
        flops = float(m.group(1)) * float(m.group(2)) * float(m.group(3))
        a_regs = m.group(4).startswith("R")
        full += flops
        slow += flops / wgmma_feed_efficiency(int(m.group(2)), a_in_registers=a_regs)
    return full / slow if slow else 1.0


def classify_sass(opcodes: Sequence[str]) -> Dict[str, int]:
    """Static instruction mix. Counts are instructions in the code, not executions."""
    mix = dict(hgmma=0, hmma=0, dmma=0, ffma=0, fmul_fadd=0, dfma=0, hfma2=0, mufu=0,
               ldg128=0, ldg64=0, ldg_narrow=0, ldgsts128=0, ldgsts_narrow=0, tma_load=0,
               stg128=0, stg_narrow=0, ldl=0, stl=0, total=0)
    for op in opcodes:
        mix["total"] += 1
        head = op.split(".")[0]
        if head == "HGMMA":
            mix["hgmma"] += 1
        elif head == "HMMA":
            mix["hmma"] += 1
        elif head == "DMMA":
            mix["dmma"] += 1
        elif head == "FFMA":
            mix["ffma"] += 1
        elif head in ("FMUL", "FADD"):
            mix["fmul_fadd"] += 1
        elif head in ("DFMA", "DADD", "DMUL"):
            mix["dfma"] += 1
        elif head in ("HFMA2", "HMUL2", "HADD2"):
            mix["hfma2"] += 1
        elif head == "MUFU":
            mix["mufu"] += 1
        elif head == "LDG":
            w = ".128" in op and "ldg128" or ".64" in op and "ldg64" or "ldg_narrow"
            mix[w] += 1
        elif head == "LDGSTS":
            mix["ldgsts128" if ".128" in op else "ldgsts_narrow"] += 1
        elif head in ("UTMALDG", "UBLKCP"):
            mix["tma_load"] += 1
        elif head == "STG":
            mix["stg128" if ".128" in op else "stg_narrow"] += 1
        elif head == "LDL":                 # local (thread-private) memory: register spills
            mix["ldl"] += 1
        elif head == "STL":
            mix["stl"] += 1
    return mix


def spill_bytes(st: Dict[str, object]) -> int:
    """Per-thread local memory a kernel spills to, from ``cuobjdump -res-usage`` and its SASS.

    ptxas puts spilled registers in the thread's stack frame: cuobjdump reports them as
    STACK, not LOCAL (LOCAL is only .local variables, which neither Triton nor csrc/ declare).
    A test kernel nvcc spills (``-maxrregcount=32``; ptxas -v: "9888 bytes stack frame, 10000
    bytes spill stores") reads ``REG:32 STACK:9888 LOCAL:0``, and Triton's inducer dQ kernel
    (ptxas -v: 2024 bytes spill stores, 2052 loads) ``REG:255 STACK:1552 LOCAL:0``: reading
    LOCAL, the tool saw no spill in either (before STATS_VERSION 3). A stack frame is also
    used without spilling (a call's frame), so it counts as spill where the SASS stores to or
    loads from local memory (STL / LDL)."""
    local = int(st.get("local", 0) or 0)
    sass = st.get("sass") or {}
    if sass.get("stl", 0) or sass.get("ldl", 0):
        return max(local, int(st.get("stack", 0) or 0), 1)
    return local


def cubin_stats(cubin: bytes) -> Dict[str, Dict[str, object]]:
    """Per kernel function in the cubin (or object file): regs, stack/local bytes, static
    shared bytes and the SASS instruction mix."""
    with _cubin_file(cubin) as path:
        return file_stats(path)


@contextlib.contextmanager
def _cubin_file(cubin: bytes):
    """A temporary file holding ``cubin`` for the NVIDIA tools; its path."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        yield path


def file_stats(path: str) -> Dict[str, Dict[str, object]]:
    res = subprocess.run([_nv_bin("cuobjdump"), "-res-usage", path], capture_output=True,
                         text=True, timeout=120).stdout
    funcs: Dict[str, Dict[str, object]] = {}
    cur = None
    for line in res.splitlines():
        m = re.search(r"Function (\S+):", line)
        if m:
            cur = m.group(1)
            funcs[cur] = {}
            continue
        if cur and "REG:" in line:
            for key, pat in (("regs", r"REG:(\d+)"), ("stack", r"STACK:(\d+)"),
                             ("shared_static", r"SHARED:(\d+)"), ("local", r"LOCAL:(\d+)")):
                mm = re.search(pat, line)
                funcs[cur][key] = int(mm.group(1)) if mm else 0
    sass = subprocess.run([_nv_bin("cuobjdump"), "-sass", path], capture_output=True,
                          text=True, timeout=300).stdout
    # split per function
    parts = re.split(r"\n\s*Function : (\S+)\n", "\n" + sass)
    for i in range(1, len(parts) - 1, 2):
        name, body = parts[i], parts[i + 1]
        mix = classify_sass(_OPCODE.findall(body))
        if mix["hgmma"]:
            mix["hgmma_loop_feed_milli"] = int(round(1000 * hgmma_loop_feed(body)))
        funcs.setdefault(name, {})["sass"] = mix
    return funcs


_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.MULTILINE)
_LABEL = re.compile(r"^(\.L_x_\d+):", re.MULTILINE)


def sass_loops(cubin: bytes) -> Dict[str, List[Tuple[int, int]]]:
    """Per kernel function in the cubin, its loops as (first instruction, instruction count)
    in program order: every backward branch (``BRA`` to a label above it) closes a loop
    whose body runs from that label to the branch. Static counts (instructions in the code);
    a nested loop's body is inside its parent's count."""
    with _cubin_file(cubin) as path:
        text = subprocess.run([_nv_bin("nvdisasm"), "-c", path], capture_output=True,
                              text=True, timeout=300).stdout
    out: Dict[str, List[Tuple[int, int]]] = {}
    # nvdisasm -c prints each function after a ".text.<name>:" line
    chunks = re.split(r"^\s*\.text\.([A-Za-z_][\w$]*):\s*$", text, flags=re.MULTILINE)
    for i in range(1, len(chunks) - 1, 2):
        name, body = chunks[i], chunks[i + 1]
        labels, count, loops = {}, 0, []
        for line in body.splitlines():
            m = _LABEL.match(line)
            if m:
                labels[m.group(1)] = count
                continue
            m = _SASS_LINE.match(line)
            if not m:
                continue
            b = re.search(r"BRA\s+`\((\.L_x_\d+)\)", m.group(2))
            if b and labels.get(b.group(1), count) < count:     # (not the trailing self-jump)
                loops.append((labels[b.group(1)], count + 1 - labels[b.group(1)]))
            count += 1
        out[name] = sorted(loops)
    return out


# ------------------------------------------------------------------------------------------
# compiling Triton launches (cached)


def cache_dir() -> str:
    d = os.environ.get("KFUSED_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                        "kfused")
    d = os.path.join(d, "perf")
    os.makedirs(d, exist_ok=True)
    return d


@functools.lru_cache(maxsize=None)
def _seed(path: str) -> Dict[str, dict]:
    try:
        with open(path) as f:
            data = json.load(f)
        return data.get("entries", {}) if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def cached_stats(fn, spec, arch: int) -> Optional[dict]:
    """The statistics of an earlier compile of exactly this launch: the cache folder's file,
    else an entry of a seed file (``$KFUSED_CACHE_SEED``, os.pathsep-separated JSON files
    written by :func:`write_seed`; the test suite ships one so a fresh CI machine need not
    compile what an identical compile already measured). Keyed as the cache is (kernel
    source, specialisation, options, arch, Triton version): a stale entry is never hit."""
    name = f"{fn.__name__}-sm{arch}-{spec_key(fn, spec, arch)}.json"
    path = os.path.join(cache_dir(), name)
    if os.path.exists(path):
        try:
            with open(path) as f:
                return json.load(f)
        except Exception:
            pass
    for seed in filter(None, os.environ.get("KFUSED_CACHE_SEED", "").split(os.pathsep)):
        hit = _seed(os.path.abspath(seed)).get(name)
        if hit is not None:   # into the cache folder too: it then holds every entry a run used
            tmp = path + f".{os.getpid()}.tmp"
            with contextlib.suppress(OSError):
                with open(tmp, "w") as f:
                    json.dump(hit, f)
                os.replace(tmp, path)
            return hit
    return None


def write_seed(path: str, names: Sequence[str]) -> int:
    """Write the cache entries ``names`` (file names in the cache folder) into one seed file
    at ``path`` (replaced whole); returns how many were found."""
    from kfused._files import replace_atomically

    entries = {}
    for name in sorted(set(names)):
        try:
            with open(os.path.join(cache_dir(), name)) as f:
                entries[name] = json.load(f)
        except (OSError, ValueError):
            continue

    def dump(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump({"written_by": "kfused.perf.compile.write_seed", "entries": entries}, f,
                      sort_keys=True, separators=(",", ":"))

    replace_atomically(path, dump)
    return len(entries)


def _ttir_dots(ttir: str) -> Dict[str, int]:
    """tt.dot ops in the TTIR by operand element type (f16/bf16 -> tensor-core able;
    f32 / f64 -> CUDA cores unless TF32). A float32 dot counts as "dot_tf32" only when its
    line names a TF32 precision (``inputPrecision = tf32`` / ``tf32x3``): IEEE is the op's
    default, which the printer omits. kfused requests IEEE for every float32 dot, so a
    "dot_tf32" is a defect (report.launch_violations): Triton <= 3.6's combine pass turned
    plain broadcast-and-sum products into TF32 dots (see
    kfused.triton_kernels._common._bcast_mm), which the CPU interpreter never shows."""
    out = {"dot16": 0, "dot_f32_ieee": 0, "dot_tf32": 0, "dot_f64": 0, "dot_other": 0}
    for line in ttir.splitlines():
        if "tt.dot " not in line and "tt.dot\t" not in line:
            continue
        m = re.search(r":\s*tensor<[0-9x]+x(\w+)", line)
        ety = m.group(1) if m else ""
        if ety in ("f16", "bf16"):
            out["dot16"] += 1
        elif ety == "f32":
            tf32 = re.search(r"inputPrecision\s*=\s*tf32", line)
            out["dot_tf32" if tf32 else "dot_f32_ieee"] += 1
        elif ety == "f64":
            out["dot_f64"] += 1
        else:
            out["dot_other"] += 1
    return out


def compile_kernel(fn, spec, arch: int = 90):
    """``triton.compile`` of one specialisation (:func:`jit_spec`) for sm_<arch>, uncached:
    the compiled kernel (``.asm["cubin"]``, ``.metadata``)."""
    import triton
    from triton.compiler import ASTSource

    sig, consts, attrs, opts = spec
    opts = {k: v for k, v in opts.items() if k != "arch"}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=_target(arch), options=opts)


def compile_launch(fn, spec, arch: int = 90, use_cache: bool = True) -> Dict[str, object]:
    """Compile one specialisation for sm_<arch>; returns its statistics (cached)."""
    key = spec_key(fn, spec, arch)
    path = os.path.join(cache_dir(), f"{fn.__name__}-sm{arch}-{key}.json")
    if use_cache:
        hit = cached_stats(fn, spec, arch)
        if hit is not None:
            return hit
    opts = spec[3]
    k = compile_kernel(fn, spec, arch)
    stats = cubin_stats(k.asm["cubin"])
    name = getattr(k.metadata, "name", fn.__name__)
    st = stats.get(name) or (next(iter(stats.values())) if stats else {})
    shared = int(getattr(k.metadata, "shared", 0) or 0)
    warps = int(getattr(k.metadata, "num_warps", opts.get("num_warps", 4)))
    regs = int(st.get("regs", 0))
    info = dict(kernel=fn.__name__, arch=arch, regs=regs,
                spill_bytes=spill_bytes(st), stack_bytes=int(st.get("stack", 0)),
                shared_bytes=shared, num_warps=warps,
                num_stages=int(getattr(k.metadata, "num_stages", opts.get("num_stages", 3))),
                ctas_per_sm=occupancy(regs, shared, warps, arch),
                sass=st.get("sass", {}), dots=_ttir_dots(k.asm.get("ttir", "")))
    tmp = path + f".{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)
    return info


_WORK: List[tuple] = []


def _work_one(i: int):
    fn, spec, arch = _WORK[i]
    try:
        return compile_launch(fn, spec, arch), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {str(exc)[:1500]}"


def launch_error(stats: dict, arch: int) -> Optional[str]:
    """Why a compiled kernel cannot launch on sm_<arch> (None when it can): Triton compiles
    a kernel whatever shared memory it needs and raises OutOfResources only when it loads
    it on the GPU, so a compile that succeeds here may still never run there."""
    if stats.get("ctas_per_sm", 1) > 0:
        return None
    lim = SM_LIMITS[arch]
    shared = int(stats.get("shared_bytes", 0))
    if shared > lim["smem_per_block"]:
        return (f"OutOfResources: needs {shared} B of shared memory, sm_{arch} allows "
                f"{lim['smem_per_block']} B per block (it compiles but cannot launch)")
    return (f"OutOfResources: {stats.get('regs')} registers x {stats.get('num_warps')} warps "
            f"and {shared} B of shared memory fit no CTA on an sm_{arch} SM (it compiles but "
            "cannot launch)")


def compile_many(items: Sequence[tuple], jobs: int = 2) -> List[Tuple[Optional[dict],
                                                                       Optional[str]]]:
    """items: (fn, spec, arch). Compiles the uncached ones in ``jobs`` forked processes.
    A kernel that compiles but cannot launch on the arch (:func:`launch_error`) is a failure
    like one that does not compile."""
    results = _compile_many(items, jobs)
    for i, ((_, _, arch), (st, err)) in enumerate(zip(items, results)):
        why = None if err or st is None else launch_error(st, arch)
        if why:
            results[i] = (None, why)
    return results


def _compile_many(items: Sequence[tuple], jobs: int) -> List[Tuple[Optional[dict],
                                                                  Optional[str]]]:
    results: List[Tuple[Optional[dict], Optional[str]]] = [(None, None)] * len(items)
    todo = []
    for i, (fn, spec, arch) in enumerate(items):
        hit = cached_stats(fn, spec, arch)
        if hit is not None:
            results[i] = (hit, None)
            continue
        todo.append(i)
    if not todo:
        return results
    _WORK[:] = list(items)
    if jobs <= 1 or len(todo) == 1:
        for i in todo:
            results[i] = _work_one(i)
        return results
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as ex:
        for i, r in zip(todo, ex.map(_work_one, todo)):
            results[i] = r
    return results


# ------------------------------------------------------------------------------------------
# CUDA C++ objects

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CSRC = os.path.join(ROOT, "csrc")


def find_nvcc() -> Optional[str]:
    for env in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(env)
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    return "/usr/local/cuda/bin/nvcc" if os.path.isfile("/usr/local/cuda/bin/nvcc") else None


def csrc_sources_hash() -> str:
    h = hashlib.sha256()
    for p in sorted(glob.glob(os.path.join(CSRC, "**", "*"), recursive=True)):
        if os.path.isfile(p) and p.endswith((".cu", ".cuh", ".h", ".cpp")):
            h.update(os.path.relpath(p, CSRC).encode())
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:24]


def csrc_object_stats(obj: str, arch: int = 90) -> Dict[str, Dict[str, object]]:
    """Statistics of every kernel in an object file / cubin (its sm_<arch> code)."""
    out = {}
    for name, st in file_stats(obj).items():
        out[name] = dict(kernel=name, arch=arch, regs=int(st.get("regs", 0)),
                         spill_bytes=spill_bytes(st),
                         stack_bytes=int(st.get("stack", 0)),
                         shared_bytes=int(st.get("shared_static", 0)), sass=st.get("sass", {}))
    return out


def csrc_stats(archs: Sequence[int] = (90,), jobs: int = 2) -> Dict[str, object]:
    """Compile each csrc/*.cu to a cubin per arch (cached on the sources' hash and nvcc's
    version) and return {"files": {rel: {arch: {kernel: stats}}}} or {"skipped": reason}."""
    nvcc = find_nvcc()
    if nvcc is None:
        return {"skipped": "nvcc not found"}
    ver = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    vhash = hashlib.sha256((ver + csrc_sources_hash() + f"stats{STATS_VERSION}").encode()
                           ).hexdigest()[:24]
    out_dir = os.path.join(cache_dir(), f"csrc-{vhash}")
    os.makedirs(out_dir, exist_ok=True)
    try:
        from torch.utils.cpp_extension import include_paths

        incs = [CSRC] + list(include_paths())
    except Exception:
        incs = [CSRC]
    import sysconfig

    incs.append(sysconfig.get_paths()["include"])
    try:
        from torch.utils.cpp_extension import COMMON_NVCC_FLAGS
        flags = list(COMMON_NVCC_FLAGS)
    except Exception:
        flags = ["--expt-relaxed-constexpr"]
    srcs = sorted(glob.glob(os.path.join(CSRC, "**", "*.cu"), recursive=True))
    jobs_l = []
    for src in srcs:
        for arch in archs:
            cub = os.path.join(out_dir, os.path.relpath(src, CSRC).replace("/", "_")
                               + f".sm{arch}.cubin")
            if not os.path.exists(cub):
                cmd = [nvcc, "-cubin", "-std=c++17", f"-arch=sm_{arch}", "-x", "cu", *flags,
                       "-Xcudafe", "--diag_suppress=3306", "-DTORCH_EXTENSION_NAME=_C",
                       "-DTORCH_API_INCLUDE_EXTENSION_H", *[f"-I{i}" for i in incs], src,
                       "-o", cub + ".tmp"]
                jobs_l.append((cmd, cub))

    def run(job):
        cmd, cub = job
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode == 0:
            os.replace(cub + ".tmp", cub)
        return r.returncode, r.stderr[-3000:]

    errors = []
    with cf.ThreadPoolExecutor(max_workers=jobs) as ex:
        for (cmd, cub), (rc, err) in zip(jobs_l, ex.map(run, jobs_l)):
            if rc:
                errors.append(f"{os.path.basename(cub)}: {err}")
    files: Dict[str, Dict[int, dict]] = {}
    for src in srcs:
        rel = os.path.relpath(src, CSRC)
        for arch in archs:
            cub = os.path.join(out_dir, rel.replace("/", "_") + f".sm{arch}.cubin")
            if os.path.exists(cub):
                files.setdefault(rel, {})[arch] = csrc_object_stats(cub, arch)
    return {"files": files, "errors": errors}

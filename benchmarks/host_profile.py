"""Where a benchmark case's time goes on a GPU: host (Python, launches) or device.

    python3 benchmarks/host_profile.py [--cases krona:sqrt:768:768,headwise:...] [--iters 40]

For each selected benchmark case and provider (``kfused bench``'s own cases), after a warm-up:
- ``wall``: fwd+bwd per call, synchronised after the loop (what ``kfused bench`` reports);
- ``host``: the Python loop's own time per call with the GPU left to run behind it (launches
  are asynchronous: a loop whose host time is close to ``wall`` is host-bound);
- ``device``: the sum of the call's kernel times (torch.profiler);
- the top functions by own time and by cumulative time under cProfile;
- every compiled Triton kernel of kfused so far: registers, spills, shared memory, warps,
  stages (a spill or an odd configuration explains a kernel slower than its model).
Prints text; meant for one device call (about a minute after compilation).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch


def _select(spec: str):
    from kfused.cases import bench_cases

    fam, *want = spec.split(":")
    dev = torch.device("cuda")
    for case in bench_cases(fam, dev, torch.bfloat16):
        text = case.op + ":" + ",".join(f"{k}={v}" for k, v in case.shape.items()) + ","
        if all(w in text for w in want):
            return case
    raise SystemExit(f"no {fam} case matches {want}")


def _fwdbwd(prov):
    from kfused.bench import fwdbwd_step

    return fwdbwd_step(prov)


def _device_us(step, calls=5):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    tot = 0.0
    per = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.device_type == torch.autograd.DeviceType.CUDA:
            tot += t
            per[e.key] = per.get(e.key, 0.0) + t / calls
    return tot / calls, per


def _triton_kernels():
    import kfused.triton_kernels as tk
    import pkgutil
    import importlib

    from triton.runtime.jit import JITFunction

    seen = []
    for m in pkgutil.iter_modules(tk.__path__):
        try:
            mod = importlib.import_module(f"kfused.triton_kernels.{m.name}")
        except Exception:
            continue
        for name, obj in vars(mod).items():
            fn = getattr(obj, "fn", obj)   # autotuners and heuristics wrap the JITFunction
            while not isinstance(fn, JITFunction) and hasattr(fn, "fn"):
                fn = fn.fn
            if not isinstance(fn, JITFunction) or id(fn) in {id(s) for s, _ in seen}:
                continue
            caches = getattr(fn, "device_caches", {}) or {}
            for entry in caches.values():
                cache = entry[0] if isinstance(entry, tuple) else entry
                for kern in list(cache.values()):
                    try:
                        kern._init_handles()
                    except Exception:
                        pass
                    md = kern.metadata
                    seen.append((fn, f"{m.name}.{name}: regs {getattr(kern, 'n_regs', '?')} "
                                     f"spills {getattr(kern, 'n_spills', '?')} shared "
                                     f"{getattr(md, 'shared', '?')} warps "
                                     f"{getattr(md, 'num_warps', '?')} stages "
                                     f"{getattr(md, 'num_stages', '?')}"))
    return [s for _, s in seen]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="krona:factors=sqrt,:d_in=768,:d_out=768,:T=16384,;"
                                      "headwise:gpt2-small:qvo-intermediate:headwise_qkv:;"
                                      "headwise:gpt2-small:qvo-intermediate:headwise_oproj:;"
                                      "inducer:B=8,:n=2048,:causal=True:composition=add")
    p.add_argument("--providers", default="floor,kfused-triton,kfused-triton-exact")
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--no-cprofile", action="store_true",
                   help="skip cProfile and the profiler pass (under ncu: launches only)")
    args = p.parse_args(argv)
    provs = args.providers.split(",")
    for spec in args.cases.split(";"):
        case = _select(spec)
        print(f"\n=== {case.op} {case.shape}", flush=True)
        for prov in case.providers:
            if prov.name not in provs or prov.skip_reason:
                continue
            step = _fwdbwd(prov)
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                step()
            host = (time.perf_counter() - t0) / args.iters
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / args.iters
            if args.no_cprofile:
                print(f"--- {prov.name}: wall {wall * 1e6:.1f} us/call", flush=True)
                continue
            dev, per = _device_us(step)
            print(f"--- {prov.name}: wall {wall * 1e6:.1f} us/call, host loop {host * 1e6:.1f} "
                  f"us/call, device {dev:.1f} us/call", flush=True)
            for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:8]:
                print(f"      {v:9.1f} us  {k[:110]}")
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(10):
                step()
            pr.disable()
            torch.cuda.synchronize()
            for key in ("tottime", "cumulative"):
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats(key).print_stats(22)
                body = s.getvalue().splitlines()
                start = next((i for i, ln in enumerate(body) if "ncalls" in ln), 0)
                print(f"    cProfile (10 calls) by {key}:")
                print("\n".join("    " + ln[:160] for ln in body[start:start + 24]))
    print("\n=== compiled Triton kernels of kfused")
    for line in _triton_kernels():
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`kfused check`: run every available kernel on this device against the float64 reference
on random inputs (docs/math.md §4) and print a table: op, backend, dtype, tensor, kernel error,
same-precision torch error, bound, verdict. Exit status 1 if any check fails or none could
run (every case skipped: nothing was compared)."""

from __future__ import annotations

import argparse
from typing import List, Optional

import torch


DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
               "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def op_names() -> dict:
    """Name accepted on the command line -> `kfused check` op: each op, and its family
    module's name where that differs (``inducer``, as ``kfused bench`` calls it)."""
    from kfused import cases

    names = {op: op for op in cases.check_ops()}
    for op, fam in cases.CHECK_FAMILIES.items():
        names.setdefault(fam, op)
    return names


def build_parser() -> argparse.ArgumentParser:
    from kfused import cases
    from kfused.cli.args import device

    p = argparse.ArgumentParser(prog="kfused check", description=__doc__)
    aliases = ", ".join(f"{k} = {v}" for k, v in op_names().items() if k != v)
    p.add_argument("ops", nargs="*",
                   help=f"ops to check (default all: {', '.join(cases.check_ops())}"
                        + (f"; also by family name: {aliases})" if aliases else ")"))
    p.add_argument("--device", type=device,
                   default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--dtypes", default=None,
                   help="comma list of fp32,fp16,bf16 (or float32, float16, bfloat16; default: all "
                   "the device supports)")
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse and validate ``kfused check`` arguments (usage errors exit with status 2 before
    any kernel is imported); ``args.ops`` holds op names, ``args.dtypes`` a list of dtypes
    (None: all the device supports)."""
    p = build_parser()
    args = p.parse_args(argv)
    known = op_names()
    unknown = [op for op in args.ops if op not in known]
    if unknown:
        p.error(f"argument ops: unknown op(s) {', '.join(unknown)}; expected any of "
                f"{', '.join(known)}")
    args.ops = list(dict.fromkeys(known[op] for op in args.ops))
    if args.dtypes is not None:
        wanted = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        unknown = [d for d in wanted if d not in DTYPE_NAMES]
        if unknown or not wanted:
            p.error(f"--dtypes: unknown dtype(s) {', '.join(unknown) or '(none given)'}; "
                    f"expected a comma list of {', '.join(DTYPE_NAMES)}")
        args.dtypes = list(dict.fromkeys(DTYPE_NAMES[d] for d in wanted))
    return args


def run(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    from kfused import backends, cases
    from kfused.testing import check_against_reference

    device = torch.device(args.device)
    dtypes = args.dtypes or ([torch.float32, torch.float16]
                             + ([torch.bfloat16] if device.type == "cuda" else []))
    print(f"kfused check on {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}"
          f" (TRITON_INTERPRET={int(backends.triton_interpret())})")
    print(f"{'op':<20} {'backend':<8} {'shape':<28} {'tensor':<8} {'dtype':<9} "
          f"{'kernel err':>10} {'torch err':>10} {'bound':>10}  verdict")
    failures = 0
    ran = 0
    for case in cases.check_cases(device, args.ops or None):
        for dt in dtypes:
            reason = (backends.triton_unfit(device, dt) if case.backend == "triton"
                      else backends.cuda_unfit(device, dt, case.op))
            if reason:
                print(f"{case.op:<20} {case.backend:<8} {case.label:<28} {'-':<8} "
                      f"{str(dt).replace('torch.', ''):<9} skipped: {reason}")
                continue
            try:
                results = check_against_reference(case.kernel_fn, case.ref_fn, case.inputs, dt,
                                                  device, grad_names=case.grad_names)
            except Exception as exc:  # a crash is a failure with its reason
                failures += 1
                print(f"{case.op:<20} {case.backend:<8} {case.label:<28} {'-':<8} "
                      f"{str(dt).replace('torch.', ''):<9} ERROR {type(exc).__name__}: {exc}")
                continue
            for r in results:
                ran += 1
                failures += not r.ok
                print(f"{case.op:<20} {case.backend:<8} {case.label:<28} {r.name:<8} "
                      f"{str(dt).replace('torch.', ''):<9} {r.kernel_err:10.3e} "
                      f"{r.torch_err:10.3e} {r.bound:10.3e}  {'ok' if r.ok else 'FAIL'}")
    print(f"{ran - failures} passed, {failures} failed")
    if not ran and not failures:
        print("nothing was checked: no backend here can run these cases (the reasons above)")
        return 1
    return 1 if failures else 0

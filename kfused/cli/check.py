"""`kfused check`: run every available kernel on this device against the float64 reference
on random inputs (docs/math.md §4) and print a table: op, backend, dtype, tensor, kernel error,
same-precision torch error, bound, verdict. Exit status 1 if any check fails."""

from __future__ import annotations

import argparse
from typing import List, Optional

import torch


def run(argv: Optional[List[str]] = None) -> int:
    from kfused import backends, cases
    from kfused.testing import check_against_reference

    p = argparse.ArgumentParser(prog="kfused check", description=__doc__)
    p.add_argument("ops", nargs="*",
                   help=f"ops to check (default all: {', '.join(cases.check_ops())})")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", default=None,
                   help="comma list of fp32,fp16,bf16 (or float32, float16, bfloat16; default: all "
                   "the device supports)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
             "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if args.dtypes:
        wanted = [d.strip() for d in args.dtypes.split(",") if d.strip()]
        unknown = [d for d in wanted if d not in names]
        if unknown or not wanted:
            p.error(f"--dtypes: unknown dtype(s) {', '.join(unknown) or '(none given)'}; "
                    f"expected a comma list of {', '.join(names)}")
        dtypes = [names[d] for d in wanted]
    else:
        dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device.type == "cuda" else [])
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
    return 1 if failures else 0

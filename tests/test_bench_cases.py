"""The benchmark cases through pytest-benchmark (forward+backward of every provider):

    pytest tests/test_bench_cases.py --benchmark-only [-k krona]

Uses the quick shape set on a GPU and the CPU-sized cases elsewhere; `kfused bench` is the
full run that writes benchmarks/results/. On the CPU (the test suite) each provider's step runs
once: the cases must build and run, their timings mean nothing there.
"""

import pytest
import torch

from kfused.bench import allow_backward_replay, fwdbwd_step
from kfused.cases import BENCH_FAMILIES, bench_cases

allow_backward_replay()   # as kfused bench does: one process may run both (see its docstring)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def _params():
    out = []
    for op in BENCH_FAMILIES:
        for case in bench_cases(op, DEVICE, DTYPE, quick=True):
            for prov in case.providers:
                sid = ",".join(f"{k}={v}" for k, v in case.shape.items()
                               if not isinstance(v, (list, dict)))
                out.append(pytest.param(case, prov, id=f"{case.op}-{sid}-{prov.name}"))
    return out


@pytest.mark.parametrize("case,provider", _params())
def test_bench(benchmark, case, provider):
    if provider.skip_reason:
        pytest.skip(provider.skip_reason)
    # the step host_overhead.py and host_profile.py time: fwd+bwd, or the forward alone of a
    # forward-only (decode) case
    fwdbwd = fwdbwd_step(provider)

    def step():
        fwdbwd()
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    benchmark.extra_info.update(op=case.op, shape=case.shape, provider=provider.name)
    if DEVICE == "cuda":
        benchmark(step)
    else:
        benchmark.pedantic(step, rounds=1, iterations=1)

#!/usr/bin/env bash
# The whole GPU proof in one script (issue 6): build the CUDA extension, run the full test suite
# (GPU tests in float32/float16/bfloat16 included), `kfused check`, and every benchmark.
#
#   bash benchmarks/gpu_suite.sh [OUT_DIR] [STAGES]
#
# OUT_DIR defaults to benchmarks/results/gpu_<utc>; STAGES is a comma list of
# build,test,check,bench (default all). Everything lands in OUT_DIR: build.log, pytest.log,
# check.log, bench.log, the benchmark JSON/PNG files and env.txt. A stage's failure is recorded
# and the next stage still runs; the exit status is non-zero if any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/gpu_$(date -u +%Y%m%dT%H%M%SZ)}
STAGES=${2:-build,test,check,bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0
has() { [[ ",$STAGES," == *",$1,"* ]]; }

{
  echo "git: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version 2>/dev/null | tail -1
} | tee "$OUT/env.txt"

if has build; then
  echo "== build (pip install -e . with the CUDA extension)"
  MAX_JOBS=16 KFUSED_CUDA_ARCHS="90" python3 -m pip install -e . --no-deps --no-build-isolation \
    >"$OUT/build.log" 2>&1 || { echo "build FAILED (see build.log)"; status=1; }
  python3 -c "import kfused.cuda as c; print('CUDA extension:', c.unavailable_reason() or 'loaded')" \
    | tee -a "$OUT/build.log"
fi
if has test; then
  echo "== tests"
  python3 -m pytest -q -rs tests 2>&1 | tee "$OUT/pytest.log" | tail -25
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if has check; then
  echo "== kfused check"
  kfused check 2>&1 | tee "$OUT/check.log" | tail -8
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if has bench; then
  echo "== kfused bench"
  kfused bench --out "$OUT" ${KFUSED_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | grep -v "^bench " | tail -60
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
echo "suite status: $status (results in $OUT)"
exit $status

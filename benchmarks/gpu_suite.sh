#!/usr/bin/env bash
# The GPU proof in stages that each fit one device call (10 minutes a command, 30 minutes a
# session, at most 8 files of 16 MiB back from $OUT).
#
#   bash benchmarks/gpu_suite.sh STAGES
#
# STAGES is a comma list, run in order:
#   proof         the whole proof in one call (a session lent 15 minutes of device time fits
#                 one): build, then the CUDA tests and check ‖ kernel tests (PROOF_P1_S, 200 s), then krona, headwise,
#                 inducer, e2e benchmarks alone on the GPU after tune (PROOF_TUNE_S, 60 s:
#                 KronA's factor-gradient pass, the headwise rank pass and the inducer
#                 attention's kernels, their launch configurations timed; targets first; PROOF_BENCH,
#                 PROOF_SHARES), the krona rows again with the one-pass folded backward
#                 (onepass, into bench-one-pass/), then results.
#                 On the device: KFUSED_GIT_COMMIT=<sha> bash benchmarks/gpu_suite.sh proof
#   ncu           Nsight Compute (--set full, details page as CSV) on one launch of each kernel
#                 the model misjudged most (benchmarks/host_profile.py drives them)
#   sanitize      compute-sanitizer (memcheck) over the CUDA C++ kernels' GPU tests
#                 (SANITIZE_TESTS, default tests/test_cuda_ext.py; SANITIZE_K a -k filter, default "not _errors"), torch's
#                 caching allocator off so that a stray access past a tensor is seen; the Triton
#                 kernels are bounds-checked in the interpreter by every CI run (kfused/
#                 triton_kernels/_bounds.py). gVisor machines refuse the tool (device KINDS.md)
#   tune          KronA's factor-gradient pass, the headwise rank pass and the inducer attention's
#                 forward, dQ and dK/dV kernels: each candidate launch
#                 configuration timed per benchmark shape (benchmarks/tune_kernels.py), the fastest into
#                 WORK/kernel_tuning.json (proof runs it first and benchmarks with its table)
#   onepass       the krona family's kfused-triton rows again with KronA's one-pass folded
#                 backward (KFUSED_KRONA_FOLDED_BWD=one-pass), beside the default two passes
#   build         pip install -e . --no-deps --no-build-isolation (offline; the machine's torch
#                 and triton), CUDA extension for sm_90                       (~2-4 min)
#   test          the GPU test suite, without the CPU-only compiler checks CI already runs: one
#                 process per file, TEST_JOBS (12) at a time, TEST_FILE_LIMIT_S (400) each
#   check         python -m kfused.cli.main check (every kernel vs the float64 reference)
#   quick         every benchmark family with --quick, quick cases first
#   bench:<op>    one benchmark family in full (krona, headwise, inducer, e2e)
#   perf          the performance model's predicted table and JSON for this commit and this
#                 GPU (kfused perf --device: h100, h200), to set beside the measured benchmark
#                 JSON (RESULTS.md: predicted vs measured)
#   results       RESULTS.md in WORK from every bench JSON of the run: measured ratio against
#                 each issue's target, met or not, the predicted ratio and time beside it, per
#                 case and per kernel (python -m kfused.cli.main results; the prediction is
#                 perf_predicted.json when the perf stage ran, else the committed
#                 benchmarks/results/predicted/perf-latest.json — perf-h200.json on an H200 —
#                 whose commit it names)
#   probe         benchmarks/gpu_probe.py: the CUDA generator after a failed capture, and
#                 headwise_lowrank's Triton path draw by draw (one process each, launches
#                 blocking), memcheck on the draw that faulted on 2026-11-30
#   demo          the main job with --runs both: fused kernels vs the unfused reference on the
#                 same data order (loss curves overlaid, largest loss difference, tokens/s, peak
#                 memory; issue 18 item 3); DEMO_ARGS adds options (e.g. "--steps 8")
# Every stage has its own time limit (STAGE_LIMIT_S, default 540 s) and the whole call one
# (CALL_LIMIT_S, default 570 s: stages that would not fit are not started, and the results are
# packed before the device's 10 minutes end). Logs and JSON accumulate in WORK (default
# benchmarks/results/local/suite, git-ignored, kept on a warm machine between calls); when $OUT is
# set (the device tool sets it), the call ends by packing WORK into $OUT: one results.tar.gz,
# summary.txt, RESULTS.md (after the results stage) and at most 5 PNG plots, i.e. never more
# than 8 files.
#
# A session lent 15 minutes of device time (2026-11-27: a machine's start took ~35 s of it;
# a second start needs 4 minutes left): one call,
#   KFUSED_GIT_COMMIT=<sha> CALL_LIMIT_S=582 bash benchmarks/gpu_suite.sh proof   (timeout_s 600)
# then, if the machine is still warm and time is left (a call must follow within the device's
# idle release, 30 s on 2026-11-29), `probe,sanitize` (the 2026-11-30 defects' probes, then
# compute-sanitizer on the CUDA C++ kernels; CALL_LIMIT_S set to what is left), then `ncu`.
# (2026-11-30 on an H200: proof 425 s, the machine's start about 35 s; sanitize 41 s.) With 30 minutes or more, the
# stages one family per call (a call that ran out of its time starts no more stages, so list
# a second one only where the first is known to be short):
#   bash benchmarks/gpu_suite.sh build,test
#   bash benchmarks/gpu_suite.sh check,quick
#   bash benchmarks/gpu_suite.sh bench:krona      (then bench:headwise, bench:inducer, bench:e2e)
#   bash benchmarks/gpu_suite.sh results,demo     (RESULTS.md comes back in $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
STAGES=${1:-build,test}
WORK=${WORK:-benchmarks/results/local/suite}
STAGE_LIMIT=${STAGE_LIMIT_S:-540}
# The device tool ends a command at 600 s and only what is in $OUT by then comes back: the
# whole call (every stage, then the packing) stays inside CALL_LIMIT_S. A stage gets the
# smaller of STAGE_LIMIT and what the call has left (less 20 s); one with under 60 s left is
# not started (said in summary.txt), and the packing still runs.
CALL_LIMIT=${CALL_LIMIT_S:-570}
CALL_T0=$(date +%s)
left() { echo $(( CALL_LIMIT - ($(date +%s) - CALL_T0) )); }
LIMIT=$STAGE_LIMIT
mkdir -p "$WORK"
export PYTHONUNBUFFERED=1
status=0
py() { timeout "$LIMIT" python3 "$@"; }
# The providers the proof stage leaves out of benchmark family $1 (PROOF_SKIP overrides; the
# onepass family is krona again). sdpa-default (torch's own SDPA backend, no target) is left to
# a bench:inducer call; e2e has no eager provider (the H200 run of 2026-11-30 lost its e2e
# family to `--skip eager`). GPU_SUITE_PROOF_SKIP_OF=<family> prints the list and exits
# (tests/test_gpu_suite.py hands each one to `kfused bench`, which refuses an unknown name).
# Only the providers of a target (and the CUDA backend beside Triton) run in the proof: on the
# H200 of 2026-11-30 the headwise family finished 3 of its 12 cases in its 83 s with the
# exact and torch.compile rows among them (neither is in a target there; torch.compile is one
# of KronA's, FlexAttention the inducer's).
proof_skip() {
  case $1 in
    krona) echo "${PROOF_SKIP:-eager,kfused-triton-exact}" ;;
    headwise) echo "${PROOF_SKIP:-eager,compile,kfused-triton-exact}" ;;
    inducer) echo "${PROOF_SKIP:-eager,sdpa-default,compile}" ;;
    e2e) echo "${PROOF_SKIP:-}" ;;
    onepass) echo "kfused-triton-exact,kfused-cuda,eager,compile,kron-dense" ;;
    *) echo "${PROOF_SKIP:-eager}" ;;
  esac
}
if [ -n "${GPU_SUITE_PROOF_SKIP_OF:-}" ]; then proof_skip "$GPU_SUITE_PROOF_SKIP_OF"; exit 0; fi
note() { echo "$*" | tee -a "$WORK/summary.txt"; }
# the performance model's key for this GPU (kfused.perf.roofline.DEVICES; h100 when unknown)
model_device() {
  local name
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) || true
  python3 -c "import sys; from kfused.perf.roofline import device_key
print(device_key(sys.argv[1]) or 'h100')" "$name" 2>/dev/null || echo h100
}
# the committed prediction for this GPU (the same model per device: H100, or H200 with its
# HBM3e bandwidth), or this run's own when the perf stage made one
predicted_json() {
  if [ -f "$WORK/perf_predicted.json" ]; then echo "$WORK/perf_predicted.json"
  elif [ "$(model_device)" = h200 ] && [ -f benchmarks/results/predicted/perf-h200.json ]; then
    echo benchmarks/results/predicted/perf-h200.json
  else echo benchmarks/results/predicted/perf-latest.json; fi
}

{
  echo "== $(date -u +%FT%TZ) stages: $STAGES"
  echo "git: ${KFUSED_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version 2>/dev/null | tail -1
} >>"$WORK/env.txt" 2>&1
tail -5 "$WORK/env.txt"

IFS=',' read -ra LIST <<<"$STAGES"
for stage in "${LIST[@]}"; do
  t0=$(date +%s)
  rem=$(left)
  if [ "$rem" -lt 60 ]; then
    note "stage $stage: not started, $rem s left of the call's $CALL_LIMIT s (run it in the next call)"
    status=1
    continue
  fi
  LIMIT=$(( STAGE_LIMIT < rem - 20 ? STAGE_LIMIT : rem - 20 ))
  # a bench stage starts no case after this (the one running may take a minute or two more);
  # its JSON is rewritten after every case, so even a stage killed at LIMIT keeps what it
  # measured
  BENCH_LIMIT=${BENCH_LIMIT_S:-$(( LIMIT > 240 ? LIMIT - 150 : LIMIT / 2 ))}
  case "$stage" in
    build)
      MAX_JOBS=16 KFUSED_CUDA_ARCHS="90" timeout "$LIMIT" python3 -m pip install -e . --no-deps \
        --no-build-isolation >"$WORK/build.log" 2>&1 || status=1
      python3 -c "import kfused.cuda as c; print('CUDA extension:', c.unavailable_reason() or 'loaded')" \
        2>&1 | tee -a "$WORK/build.log" ;;
    test)
      # one pytest process per test file, TEST_JOBS at a time: an illegal memory access
      # poisons the CUDA context of its process (the H100 run of 2026-11-25 lost the rest of
      # a one-process run to one faulting kernel), and compilation dominates, so files
      # compile in parallel. Kernel files first; TEST_FILES overrides the list.
      mkdir -p "$WORK/pytest"
      : >"$WORK/pytest/rc.txt"
      files=${TEST_FILES:-$(printf '%s\n' tests/test_krona.py tests/test_headwise_ops.py \
        tests/test_inducer.py tests/test_inducer_varlen.py tests/test_inducer_decode.py \
        tests/test_cuda_ext.py tests/test_*.py | awk '!seen[$0]++' \
        | grep -v -E 'test_(triton_sm90_compile|csrc_compile|csrc_sass|perf_[a-z_]*)\.py$')}
      t_end=$(( $(date +%s) + LIMIT ))
      for f in $files; do
        while [ "$(jobs -rp | wc -l)" -ge "${TEST_JOBS:-12}" ]; do wait -n; done
        n=$(basename "$f" .py)
        # each file gets TEST_FILE_LIMIT_S or what the stage has left, whichever is less
        fl=$(( t_end - $(date +%s) ))
        fl=$(( fl < ${TEST_FILE_LIMIT_S:-400} ? fl : ${TEST_FILE_LIMIT_S:-400} ))
        if [ "$fl" -lt 30 ]; then
          echo "not run: the stage's time is spent" >"$WORK/pytest/$n.log"
          echo "$n rc=not-run" >>"$WORK/pytest/rc.txt"
          continue
        fi
        ( timeout "$fl" python3 -m pytest -q -rs -p no:cacheprovider "$f" \
            >"$WORK/pytest/$n.log" 2>&1
          echo "$n rc=$?" >>"$WORK/pytest/rc.txt" ) &
      done
      wait
      for l in "$WORK"/pytest/*.log; do
        echo "$(basename "$l" .log): $(grep -E "passed|failed|skipped|error|no tests|not run" "$l" | tail -1)"
      done | tee -a "$WORK/summary.txt"
      # 0 passed, 5 no tests collected (a GPU-only file skipped at import); 124 timed out
      if grep -v -E ' rc=(0|5)$' "$WORK/pytest/rc.txt" | tee -a "$WORK/summary.txt" | grep -q .; then
        status=1
      fi ;;
    proof)
      # The whole proof in ONE device call, for a session lent 15 minutes of device time (a
      # machine's start costs a minute or two of it and a second start needs 4 minutes left:
      # one full call is what fits). Phase 1 (PROOF_P1_S, default 200 s), correctness only, the
      # GPU shared: the CUDA extension's build in the background, then `check` (every kernel vs
      # the float64 reference, CUDA included when the build made it), and beside them the
      # kernel test files under pytest-xdist (-v: every finished test is in the log even when
      # the phase's end cuts the run). Phase 2, the GPU alone: one benchmark family at a time,
      # the performance model's target cases first (kfused bench without --quick orders them
      # so), each family its share of what the call has left; then `results` (RESULTS.md).
      p1=${PROOF_P1_S:-200}
      p1_end=$(( $(date +%s) + p1 ))

      # one seed for every xdist worker (they must collect the same shapes), and each failure's
      # report written the moment it happens (a cut run prints none: 2026-11-27 lost 28); set
      # before the background phase, whose CUDA tests report there too
      export KFUSED_TEST_SEED=${KFUSED_TEST_SEED:-$RANDOM$RANDOM}
      export KFUSED_FAILURE_LOG=$WORK/failures.txt
      ( MAX_JOBS=8 KFUSED_CUDA_ARCHS="90" timeout "$p1" python3 -m pip install -e . --no-deps \
          --no-build-isolation >"$WORK/build.log" 2>&1
        echo "build rc=$?" >>"$WORK/build.log"
        python3 -c "import kfused.cuda as c; print('CUDA extension:', c.unavailable_reason() or 'loaded')" \
          >>"$WORK/build.log" 2>&1
        # the CUDA extension's GPU tests once it is built (collected before, they skip:
        # the H200 run of 2026-11-30 ran none of them in this phase); about 30 s with -n 8
        rest=$(( p1_end - $(date +%s) ))
        if [ "$rest" -gt 30 ] && python3 -c "import kfused._C" 2>/dev/null; then
          xd=(); python3 -c "import xdist" 2>/dev/null && xd=(-n 8)
          PYTHONPATH=$PWD timeout $(( rest * 2 / 5 )) python3 -m pytest -v --tb=short "${xd[@]}" \
            -p no:cacheprovider tests/test_cuda_ext.py >"$WORK/pytest_cuda_ext.log" 2>&1
          echo "pytest rc=$? (124: cut)" >>"$WORK/pytest_cuda_ext.log"
        fi
        rest=$(( p1_end - $(date +%s) ))
        if [ "$rest" -gt 20 ]; then
          timeout "$rest" python3 -m kfused.cli.main check >"$WORK/check.log" 2>&1
          echo "check rc=$? (124: cut at the phase's end)" >>"$WORK/check.log"
        else
          echo "check: not started, the build took the phase" >"$WORK/check.log"
        fi ) &
      # the factor-gradient candidates compiled and launched once beside the tests (untimed:
      # the tune step of phase 2 then only times them, from Triton's cache)
      for k in krona rank narrow attn; do   # one process per kernel: compilations in parallel
        ( PYTHONPATH=$PWD timeout "$p1" python3 benchmarks/tune_kernels.py --warm-only \
            --kernels "$k" >"$WORK/tune_warm_$k.log" 2>&1
          echo "warm rc=$?" >>"$WORK/tune_warm_$k.log" ) &
      done
      popts=()   # the device image has pytest-xdist and pytest-timeout; elsewhere they may lack
      # --dist loadfile: each file on a worker of its own, all files at once (the default
      # order-of-collection scheduling ran only test_krona and test_headwise_ops in the
      # H200's 200 s: 63 % of the tests, none of the inducer's)
      python3 -c "import xdist" 2>/dev/null && popts+=(-n "${TEST_JOBS:-8}" --dist loadfile)
      python3 -c "import pytest_timeout" 2>/dev/null && popts+=(--timeout 150)
      # shellcheck disable=SC2086  # PROOF_TESTS is a list of files
      PYTHONPATH=$PWD timeout "$p1" python3 -m pytest -v --tb=short "${popts[@]}" -p no:cacheprovider \
        ${PROOF_TESTS:-tests/test_krona.py tests/test_headwise_ops.py \
        tests/test_inducer.py tests/test_inducer_varlen.py tests/test_inducer_decode.py \
        tests/test_gpu_configs.py tests/test_tuning.py} >"$WORK/pytest.log" 2>&1
      echo "pytest rc=$? (124: cut at the phase's end)" >>"$WORK/pytest.log"
      wait
      # nothing of phase 1 may share the GPU with the timings (xdist workers, nvcc, check)
      pkill -9 -f "pytest|kfused.cli.main check|tune_kernels|pip install|nvcc|cicc|ptxas" 2>/dev/null
      sleep 2
      { grep "build rc\|CUDA extension" "$WORK/build.log"
        tail -4 "$WORK/check.log"
        c() { grep -c " $1" "$WORK/pytest.log"; }
        echo "pytest: $(c PASSED) passed, $(c FAILED) failed, $(c SKIPPED) skipped, $(c ERROR)" \
          "errors; $(tail -1 "$WORK/pytest.log")"
        [ -f "$WORK/pytest_cuda_ext.log" ] && echo "pytest test_cuda_ext:" \
          "$(grep -c ' PASSED' "$WORK/pytest_cuda_ext.log") passed," \
          "$(grep -c ' FAILED' "$WORK/pytest_cuda_ext.log") failed; $(tail -1 "$WORK/pytest_cuda_ext.log")"
        grep ' FAILED\| ERROR' "$WORK/pytest.log" | sed 's/^/  /' | head -40
        [ -f "$WORK/failures.txt" ] && grep -A3 '^====' "$WORK/failures.txt" | head -60
      } | tee -a "$WORK/summary.txt"
      # onepass: KronA's kfused-triton rows again with the one-pass folded backward
      # (KFUSED_KRONA_FOLDED_BWD=one-pass) into bench-one-pass/, outside RESULTS.md: the
      # comparison that chose two passes (stop 40), measured
      # before them, tune (PROOF_TUNE_S, 60 s): the candidate configurations of KronA's
      # factor-gradient pass, the headwise rank pass and the inducer attention's three
      # kernels timed (benchmarks/tune_kernels.py); the benchmarks use its table
      tune_s=${PROOF_TUNE_S:-60}
      if [ "$tune_s" -gt 0 ]; then
        PYTHONPATH=$PWD timeout "$tune_s" python3 benchmarks/tune_kernels.py --table "$WORK/kernel_tuning.json" \
          --out "$WORK/tune.json" --time-limit $(( tune_s - 15 )) >"$WORK/tune.log" 2>&1
        rc=$?
        [ -f "$WORK/kernel_tuning.json" ] && export KFUSED_KERNEL_TUNING=$WORK/kernel_tuning.json
        note "tune: rc=$rc, limit $tune_s s; the benchmarks' table: ${KFUSED_KERNEL_TUNING:-none}"
        tail -8 "$WORK/tune.log"
      fi
      fams=(${PROOF_BENCH:-krona headwise inducer e2e onepass})
      share=(${PROOF_SHARES:-28 26 22 16 8})   # percent of what the call has left, in order
      rest=$(( $(left) - 30 ))   # kept for results and the packing
      i=0
      for op in "${fams[@]}"; do
        lim=$(( rest * ${share[$i]:-30} / 100 ))
        i=$(( i + 1 ))
        if [ "$lim" -lt 40 ]; then note "bench $op: not started, $lim s share"; continue; fi
        prefs=()
        case $op in inducer|krona) prefs=(--write-prefs "$WORK/backend_prefs.json") ;; esac
        skipf=$(proof_skip "$op")
        skip=()
        [ -n "$skipf" ] && skip=(--skip "$skipf")
        tl=$(( lim > 90 ? lim - 45 : lim / 2 ))
        if [ "$op" = onepass ]; then
          KFUSED_KRONA_FOLDED_BWD=one-pass timeout "$lim" python3 -m kfused.cli.main bench \
            krona --out "$WORK/bench-one-pass" --rep-ms "${PROOF_REP_MS:-100}" --time-limit "$tl" \
            "${skip[@]}" >"$WORK/bench_$op.log" 2>&1
        else
          timeout "$lim" python3 -m kfused.cli.main bench "$op" --out "$WORK/bench" \
            --rep-ms "${PROOF_REP_MS:-100}" --time-limit "$tl" "${skip[@]}" \
            "${prefs[@]}" >"$WORK/bench_$op.log" 2>&1
        fi
        rc=$?
        [ "$rc" -ne 0 ] && status=1
        note "bench $op: rc=$rc, limit $lim s (124: cut there; its JSON holds every case measured)"
        grep -v "^bench " "$WORK/bench_$op.log" | grep -v "skipped\|not run" | tail -30
      done
      LIMIT=$(( $(left) > 25 ? $(left) - 10 : 15 ))
      py -m kfused.cli.main results "$WORK/bench" --predicted "$(predicted_json)" \
        --out "$WORK/RESULTS.md" >"$WORK/results.log" 2>&1 || status=1
      tail -3 "$WORK/results.log"
      if [ -n "${OUT:-}" ] && [ -f "$WORK/RESULTS.md" ]; then cp "$WORK/RESULTS.md" "$OUT/"; fi ;;
    ncu)
      # Nsight Compute on the kernels the model misjudged most on the H100 of 2026-11-27
      # (measured / predicted: _krona_fwd_kernel 16-26x — on a GPU at T >= 1024 the exact
      # path runs cuBLAS since, _kron_grad_kernel 1.8-4.5x (the folded backward's factor
      # pass), _lr_rank_bwd_kernel 4-5.7x, the section kernels 3.2-3.7x,
      # _inducer_attn_bwd_dq_kernel 1.9-4.6x): one launch each after warm-up, the details
      # page as text (NCU_KERNELS overrides the regex). Stop 41 changed the rank pass's and the
      # section kernels' loads (issued a step ahead): their stall reasons say whether it held.
      if command -v ncu >/dev/null; then
        # the H200 of 2026-11-30: the inducer MLP-row kernels at 15-21x their prediction
        # (0.8 ms forward, 1.4-1.9 ms backward at 16k tokens x 32 heads: most of the inducer's
        # time at n <= 2048), _kron_grad_kernel 2.4x (longer than the frozen GEMM); the inducer
        # dK/dV kernel 1.2-1.4x (p = 64) and 2.0-2.2x (p = 128) its prediction even with the
        # wgmma feed read from its SASS
        re=${NCU_KERNELS:-_inducer_fwd_mlp_kernel|_inducer_attn_bwd_mlp_kernel|_kron_grad_kernel|_lr_rank_bwd_kernel|_inducer_attn_bwd_dkdv_kernel}
        PYTHONPATH=$PWD timeout "$LIMIT" ncu --set full -k "regex:$re" --launch-skip 6 \
          --launch-count 3 --page details --csv python3 benchmarks/host_profile.py \
          --cases "krona:factors=sqrt,:d_in=768,:d_out=768,:T=16384,;headwise:gpt2-small:qvo-intermediate:headwise_qkv:;inducer:B=8,:n=2048,:causal=True:composition=add" \
          --providers kfused-triton,kfused-triton-exact --iters 3 --no-cprofile \
          >"$WORK/ncu.csv" 2>"$WORK/ncu.log" || status=1
        tail -3 "$WORK/ncu.log"; wc -l "$WORK/ncu.csv"
      else
        echo "ncu: not on this machine" | tee "$WORK/ncu.log"
      fi ;;
    sanitize)
      if command -v compute-sanitizer >/dev/null; then
        # the argument-error tests launch no kernel; on the H200 of 2026-11-30 the first of them
        # ended the process (a segfault as the extension raised) and memcheck saw nothing after
        kf=(-k "${SANITIZE_K:-not _errors}")
        # shellcheck disable=SC2086  # SANITIZE_TESTS is a list of files
        PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONPATH=$PWD timeout "$LIMIT" compute-sanitizer \
          --tool memcheck --error-exitcode 86 --print-limit 50 python3 -m pytest -q -rs \
          -p no:cacheprovider "${kf[@]}" ${SANITIZE_TESTS:-tests/test_cuda_ext.py} \
          >"$WORK/sanitize.log" 2>&1
        rc=$?
        if grep -q "Device not supported" "$WORK/sanitize.log"; then
          note "sanitize: compute-sanitizer refused this machine's device (rc=$rc; gVisor does)"
        else
          [ "$rc" -ne 0 ] && status=1
          note "sanitize: rc=$rc (86: memcheck found errors; 124: cut at the stage's limit);" \
            "$(grep -E 'ERROR SUMMARY' "$WORK/sanitize.log" | tail -1)"
          grep -E "passed|failed|error" "$WORK/sanitize.log" | tail -1
          grep -m 20 -E "^========= (Invalid|Address|Program hit|    at )" "$WORK/sanitize.log"
        fi
      else
        note "sanitize: compute-sanitizer is not on this machine"
      fi ;;
    tune)
      # the candidate configurations of KronA's factor-gradient pass and the headwise rank
      # pass, timed (device time, CUDA graphs): the fastest per shape into
      # WORK/kernel_tuning.json; copy it to kfused/data/kernel_tuning.json to commit it (the
      # library reads that file, or the one KFUSED_KERNEL_TUNING names)
      PYTHONPATH=$PWD py benchmarks/tune_kernels.py --table "$WORK/kernel_tuning.json" --out "$WORK/tune.json" \
        --shapes "${TUNE_SHAPES:-targets}" --time-limit "$BENCH_LIMIT" >"$WORK/tune.log" 2>&1 \
        || status=1
      tail -20 "$WORK/tune.log" ;;
    onepass)
      # KronA's folded backward in its one-pass form (KFUSED_KRONA_FOLDED_BWD=one-pass), the
      # kfused-triton rows only, beside the default two passes of the krona family's run: the
      # measurement that chose two passes, repeated (the JSON's meta.env records the mode)
      KFUSED_KRONA_FOLDED_BWD=one-pass py -m kfused.cli.main bench krona \
        --out "$WORK/bench-one-pass" --time-limit "$BENCH_LIMIT" \
        --skip kfused-triton-exact,kfused-cuda,eager,compile,kron-dense \
        >"$WORK/bench_one_pass.log" 2>&1 || status=1
      grep -v "^bench " "$WORK/bench_one_pass.log" | tail -20 ;;
    check)
      py -m kfused.cli.main check >"$WORK/check.log" 2>&1 || status=1
      tail -8 "$WORK/check.log" ;;
    quick)
      py -m kfused.cli.main bench --quick --out "$WORK/bench" --time-limit "$BENCH_LIMIT" \
        >"$WORK/bench_quick.log" 2>&1 \
        || status=1
      grep -v "^bench " "$WORK/bench_quick.log" | tail -40 ;;
    bench:*)
      op=${stage#bench:}
      # the inducer and krona families also record which fused backend was faster per regime
      # on this GPU model (backend="auto" reads it: KFUSED_BACKEND_PREFS /
      # kfused/data/backend_prefs.json)
      prefs=()
      case $op in inducer|krona) prefs=(--write-prefs "$WORK/backend_prefs.json") ;; esac
      py -m kfused.cli.main bench "$op" --out "$WORK/bench" --time-limit "$BENCH_LIMIT" \
        "${prefs[@]}" >"$WORK/bench_$op.log" 2>&1 || status=1
      grep -v "^bench " "$WORK/bench_$op.log" | tail -40 ;;
    perf)
      if python3 -c "import kfused.perf" 2>/dev/null; then
        py -m kfused.cli.main perf --arch 90 --device "$(model_device)" \
          --json "$WORK/perf_predicted.json" >"$WORK/perf.log" 2>&1 || status=1
        tail -40 "$WORK/perf.log"
      else
        echo "perf: no performance model in this checkout" | tee "$WORK/perf.log"
      fi ;;
    results)
      # the prediction of this run's commit (perf stage), else the committed one (the model
      # needs no GPU: regenerate it on a CPU rather than spend device time on it)
      # (an H200: the committed H200 prediction, the same model with HBM3e bandwidth)
      py -m kfused.cli.main results "$WORK/bench" --predicted "$(predicted_json)" \
        --out "$WORK/RESULTS.md" >"$WORK/results.log" 2>&1 || status=1
      tail -3 "$WORK/results.log"
      if [ -n "${OUT:-}" ] && [ -f "$WORK/RESULTS.md" ]; then cp "$WORK/RESULTS.md" "$OUT/"; fi ;;
    probe)
      # the defects the H200 proof of 2026-11-30 found, probed (benchmarks/gpu_probe.py): the
      # generator a failed capture leaves behind, then headwise_lowrank's Triton path (wrong
      # dbasis/dA, then an illegal address) over draws one process each under
      # CUDA_LAUNCH_BLOCKING=1 (a fault names its launch), then the inducer's MLP-rows kernels
      # as redesigned after that proof (draws against float64, then their device times), then
      # memcheck on the first lowrank draw
      PYTHONPATH=$PWD timeout "$LIMIT" python3 benchmarks/gpu_probe.py rng lowrank inducer \
        >"$WORK/probe.log" 2>&1 || status=1
      cat "$WORK/probe.log"
      if command -v compute-sanitizer >/dev/null; then
        PYTHONPATH=$PWD timeout $(( LIMIT / 3 + 10 )) compute-sanitizer --tool memcheck \
          --print-limit 10 python3 benchmarks/gpu_probe.py lowrank-one False float16 45 1 24 2 33 \
          >"$WORK/probe_memcheck.log" 2>&1
        note "probe memcheck: rc=$?"
        grep -m 12 "Invalid\|at .*in \|ok:\|BAD:\|ERROR SUMMARY" "$WORK/probe_memcheck.log"
      fi
      # where the eager calls' time goes on this machine (the H200 of 2026-11-30: KronA's fold
      # path 0.5-1.3 ms of host per fwd+bwd where this project's CPU harness sees 0.17 ms):
      # wall, host loop, device and cProfile's top functions, PEFT LoRA beside
      PYTHONPATH=$PWD timeout $(( LIMIT / 3 + 10 )) python3 benchmarks/host_profile.py \
        --cases "krona:factors=sqrt,:d_in=768,:d_out=768,:T=16384,;headwise:gpt2-small:qvo-intermediate:headwise_qkv:" \
        --providers floor,kfused-triton,peft-lora --iters 20 >"$WORK/probe_host.log" 2>&1
      note "probe host profile: rc=$?"
      grep "^---\|^===" "$WORK/probe_host.log" | head -12 ;;
    demo)
      # shellcheck disable=SC2086  # DEMO_ARGS is a list of options
      py -m kfused.cli.main demo --runs both --no-progress --out "$WORK/demo" ${DEMO_ARGS:-} \
        >"$WORK/demo.log" 2>&1 || status=1
      tail -40 "$WORK/demo.log" ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
  note "stage $stage: status so far $status, $(( $(date +%s) - t0 )) s"
done

if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/results.tar.gz" -C "$WORK" . 2>/dev/null
  cp "$WORK/summary.txt" "$OUT/summary.txt"
  find "$WORK" -name '*.png' -newer "$WORK/env.txt" 2>/dev/null | head -5 | while read -r f; do
    cp "$f" "$OUT/$(basename "$f")"; done
  echo "packed into \$OUT: $(ls "$OUT" | tr '\n' ' ')"
fi
echo "suite status: $status (work folder $WORK)"
exit $status

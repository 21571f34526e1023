#!/usr/bin/env bash
# One pass on a GPU machine: build the extension, run the whole test suite, the side-by-side
# benchmark and an Nsight Compute profile, with every log under OUT_DIR.
#
# Usage: tools/gpu_pass.sh OUT_DIR [steps...]
#   steps: any of build test bench bench_bwd profile profile_bwd sanitize compact (default: build test bench profile)
#   sanitize: compute-sanitizer memcheck and racecheck over tools/sanitize_calls.py (SANITIZE_ARGS: its options)
#   compact: the kernels of GPUs that allow a block less shared memory (FLASH_CUTLASS_SMEM_PER_BLOCK):
#     their tests, then memcheck and racecheck over tools/sanitize_calls.py --kernel sm80 under 99 KiB
#     (docs/DEVELOPING.md); on a Hopper GPU, the sm80 backward's smaller tiles need a build with
#     FLASH_CUTLASS_SM90_SMALL_TILES=1 (and, at head dims 64-256, FLASH_CUTLASS_SM80_ON_HOPPER=1, this
#     script's default)
# Environment: the build variables of setup.py (FLASH_CUTLASS_CUDA_ARCHS, FLASH_CUTLASS_HEAD_DIMS,
#   MAX_JOBS, ...; FLASH_CUTLASS_SM80_ON_HOPPER defaults to 1 here, so that a Hopper GPU runs the sm80
#   path's tests and the flash_cutlass_sm80 benchmark at every head dim), BENCH_ARGS (extra
#   benchmark_forward.py options), BENCH_BWD_IMPLS (bench_bwd's --impls, e.g. with
#   flash_cutlass_gqa_walk or flash_cutlass_v_after_q: docs/DEVELOPING.md's opt-ins), PYTEST_ARGS,
#   PYTEST_WORKERS (test: pytest processes at once, default 8; tools/parallel_pytest.py; the parts'
#   logs in pytest_logs.tgz, their FAILED/ERROR lines in failures.txt), PYTEST_PATHS (test: the
#   files, default tests/; to run the suite in turns over device calls, the build kept warm).
set -uo pipefail

out_dir=${1:?usage: tools/gpu_pass.sh OUT_DIR [build|test|bench|profile...]}
shift
steps=${*:-build test bench profile}
mkdir -p "$out_dir"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
export FLASH_CUTLASS_SM80_ON_HOPPER=${FLASH_CUTLASS_SM80_ON_HOPPER:-1}

summary() { echo "$*" | tee -a "$out_dir/summary.txt"; }

# sanitize_both NAME [VAR=VALUE...] -- [sanitize_calls.py options]: compute-sanitizer memcheck and
# racecheck over tools/sanitize_calls.py with those variables set, logs NAME_TOOL.log, each exit
# status or'ed into $status.
sanitize_both() {
  local name=$1 tool tool_status
  shift
  local variables=()
  while [ "$1" != "--" ]; do variables+=("$1"); shift; done
  shift
  for tool in memcheck racecheck; do
    env "${variables[@]}" compute-sanitizer --tool "$tool" --error-exitcode 1 python3 tools/sanitize_calls.py "$@" \
      ${SANITIZE_ARGS:-} >"$out_dir/${name}_$tool.log" 2>&1
    tool_status=$?
    status=$(( status | tool_status ))
    summary "$name $tool: exit $tool_status; $(grep -a -E "ERROR SUMMARY|RACECHECK SUMMARY|mismatches" \
      "$out_dir/${name}_$tool.log" | tr '\n' ' ')"
  done
}

summary "$(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
summary "torch $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)')"

for step in $steps; do
  start=$(date +%s)
  case $step in
    build)
      FLASH_CUTLASS_PTXAS_VERBOSE=1 python3 -m pip install --no-build-isolation --no-deps -v -e . >"$out_dir/build.log" 2>&1
      status=$?
      grep -a -E "spill stores|Used [0-9]+ registers" "$out_dir/build.log" | sort | uniq -c >"$out_dir/ptxas.txt"
      ;;
    test)
      python3 tools/parallel_pytest.py --workers "${PYTEST_WORKERS:-8}" --log-dir "$out_dir/pytest_logs" ${PYTEST_PATHS:-tests} \
        -- ${PYTEST_ARGS:-} >"$out_dir/pytest.log" 2>&1
      status=$?
      grep -h -a -E "^(FAILED|ERROR) " "$out_dir"/pytest_logs/pytest_*.log >"$out_dir/failures.txt"
      tar czf "$out_dir/pytest_logs.tgz" -C "$out_dir" pytest_logs && rm -r "$out_dir/pytest_logs"
      summary "pytest: exit $status; $(grep -c -E "exit 0:" "$out_dir/pytest.log") parts passed," \
        "$(grep -c -E "exit " "$out_dir/pytest.log") run; $(tail -1 "$out_dir/pytest.log");" \
        "$(wc -l <"$out_dir/failures.txt") FAILED/ERROR lines (failures.txt)"
      ;;
    bench)
      python3 benchmarks/benchmark_forward.py --check --memory ${BENCH_ARGS:-} \
        --json "$out_dir/bench.json" --markdown "$out_dir/bench.md" --plot "$out_dir/bench.png" \
        >"$out_dir/bench.log" 2>&1
      status=$?
      ;;
    bench_bwd)
      for direction in backward forward+backward; do
        python3 benchmarks/benchmark_forward.py --direction "$direction" \
          --impls "${BENCH_BWD_IMPLS:-flash_cutlass,flash_cutlass_sm80,sdpa_flash,sdpa_cudnn}" \
          ${BENCH_ARGS:-} --json "$out_dir/bench_$direction.json" --markdown "$out_dir/bench_$direction.md" \
          >"$out_dir/bench_$direction.log" 2>&1
      done
      status=$?
      ;;
    profile)
      # The automatic choice (the Hopper path on an H100/H200), then the sm80 path.
      bash benchmarks/profile_ncu.sh "$out_dir/ncu" >"$out_dir/ncu_console.log" 2>&1
      status=$?
      bash benchmarks/profile_ncu.sh "$out_dir/ncu_sm80" --kernel sm80 >>"$out_dir/ncu_console.log" 2>&1
      status=$(( status | $? ))
      ;;
    profile_bwd)
      bash benchmarks/profile_ncu.sh "$out_dir/ncu_bwd" --direction backward --seqlen 4096 --batch 4 \
        >"$out_dir/ncu_bwd_console.log" 2>&1
      status=$?
      ;;
    sanitize)
      status=0
      sanitize_both sanitize --
      ;;
    compact)
      python3 -m pytest -q -p no:cacheprovider tests/test_forward_cuda.py tests/test_backward_cuda.py \
        tests/test_kvcache_cuda.py -k "compact or smaller or smem" >"$out_dir/pytest_compact.log" 2>&1
      status=$?
      summary "pytest compact: $(tail -n 1 "$out_dir/pytest_compact.log")"
      sanitize_both sanitize_compact FLASH_CUTLASS_SMEM_PER_BLOCK=101376 -- --kernel sm80
      ;;
    *)
      echo "unknown step: $step" >&2
      exit 2
      ;;
  esac
  summary "$step: exit $status in $(( $(date +%s) - start )) s"
done

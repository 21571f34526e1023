#!/usr/bin/env bash
# Same-machine A/B of several source trees (e.g. branches checked out under .ab/) on a GPU: builds
# each tree's extension in place, then runs one benchmark command against each tree in turn (the
# trees alternate per round, so clock drift hits them alike) and keeps every log under OUT_DIR.
#
# Usage: tools/ab_trees.sh OUT_DIR TREE [TREE...] -- BENCHMARK ARGS...
#   TREE: a directory holding a flash_cutlass checkout ("." is this one)
#   BENCHMARK ARGS: a script of benchmarks/ and its options, e.g.
#     benchmarks/benchmark_forward.py --direction backward --head-dims 64,128 --seqlens 1024,16384
# Environment: the build variables of setup.py (FLASH_CUTLASS_HEAD_DIMS, MAX_JOBS, ...), ROUNDS
# (default 2), PYTHONPATH entries to keep (e.g. the CUTLASS wheel's target directory).
#
# Preparing the trees on the development machine (the device copy has no .git):
#   echo /.ab/ >> .git/info/exclude; git worktree add .ab/BRANCH BRANCH
# and pass the run tool carry: [".ab", ".whl"].
set -uo pipefail

usage() { sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0"; }
if [[ $# -lt 4 || "$1" == -h || "$1" == --help ]]; then
  usage
  exit 2
fi
out_dir=$1
shift
trees=()
while [[ $# -gt 0 && "$1" != -- ]]; do
  trees+=("$(cd "$1" && pwd)")
  shift
done
[[ $# -gt 0 ]] && shift
if [[ ${#trees[@]} -eq 0 || $# -eq 0 ]]; then
  usage
  exit 2
fi
mkdir -p "$out_dir"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
keep_path=${PYTHONPATH:-}

for tree in "${trees[@]}"; do
  name=$(basename "$tree")
  start=$(date +%s)
  (cd "$tree" && python3 setup.py -q build_ext --inplace) >"$out_dir/build_$name.log" 2>&1
  echo "build $name: exit $? in $(( $(date +%s) - start )) s" | tee -a "$out_dir/summary.txt"
done

for round in $(seq 1 "${ROUNDS:-2}"); do
  for tree in "${trees[@]}"; do
    name=$(basename "$tree")
    # The tree's package first; the benchmark script itself is this checkout's.
    PYTHONPATH="$tree${keep_path:+:$keep_path}" python3 "$here/$1" "${@:2}" \
      >"$out_dir/bench_${name}_round$round.log" 2>&1
    echo "bench $name round $round: exit $?" | tee -a "$out_dir/summary.txt"
  done
done

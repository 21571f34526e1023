#!/usr/bin/env bash
# Profile one flash_cutlass forward (or backward) kernel launch with Nsight Compute.
#
# Usage: benchmarks/profile_ncu.sh [OUT_DIR] [profile_ncu.py options...]
#
#   OUT_DIR    where the results go (default: ./ncu_out); leave it out to start with an option
#   options    passed to benchmarks/profile_ncu.py, e.g. --seqlen 4096 --head-dim 64 --causal
#
# Environment:
#   NCU             ncu executable (default: ncu)
#   PYTHON          interpreter that can import torch and flash_cutlass (default: python3)
#   KERNEL_REGEX    kernels to profile, matched against the kernel's function name
#                   (default: flash_fwd, or flash_bwd_sm with --direction backward)
#   NCU_METRICS     comma-separated metrics, replacing the METRICS list in this script
#   NCU_EXTRA_ARGS  more ncu options, split on spaces, e.g. "--set full" or
#                   "--import-source yes"
#
# ncu runs with --clock-control none (the clocks the benchmark sees) and --profile-from-start off,
# so only the launch that profile_ncu.py brackets with cudaProfilerStart/Stop is profiled.
# Writes to OUT_DIR:
#   flash_fwd.ncu-rep   the report, for the Nsight Compute GUI or `ncu --import`
#   ncu.log             ncu's and the script's console output
#   details.txt         sections and metrics as ncu prints them
#   details.csv         the same as CSV
#   raw.csv             every collected metric, in base units
#   summary.txt         the METRICS values, shared-memory bank conflicts / wavefronts, tensor-pipe
#                       utilization, achieved occupancy and the top stall reasons
set -euo pipefail

SECTIONS=(SpeedOfLight Occupancy LaunchStats SchedulerStats WarpStateStats)
METRICS=(
  l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum
  l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum
  l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum
  l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum
  smsp__sass_inst_executed_op_ldsm.sum
  smsp__inst_executed_pipe_tensor.sum
)

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
  exit 0
fi

out_dir=./ncu_out
if [[ $# -gt 0 && "$1" != -* ]]; then
  out_dir=$1
  shift
fi

ncu=${NCU:-ncu}
python=${PYTHON:-python3}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if ! command -v "$ncu" >/dev/null 2>&1; then
  echo "profile_ncu.sh: '$ncu' not found; install Nsight Compute or set NCU" >&2
  exit 1
fi

if [[ -n "${NCU_METRICS:-}" ]]; then
  metrics=$NCU_METRICS
else
  metrics=$(IFS=,; echo "${METRICS[*]}")
fi
section_args=()
for section in "${SECTIONS[@]}"; do
  section_args+=(--section "$section")
done
read -r -a extra_args <<< "${NCU_EXTRA_ARGS:-}"

mkdir -p "$out_dir"
report=$out_dir/flash_fwd
rm -f "$report.ncu-rep"

default_regex=flash_fwd
[[ " $* " == *" --direction backward "* ]] && default_regex=flash_bwd_sm
"$ncu" --clock-control none --profile-from-start off \
  --kernel-name "regex:${KERNEL_REGEX:-$default_regex}" --launch-count 1 \
  "${section_args[@]}" --metrics "$metrics" \
  --export "$report" --force-overwrite \
  "${extra_args[@]}" \
  "$python" "$here/profile_ncu.py" "$@" 2>&1 | tee "$out_dir/ncu.log"

if [[ ! -f "$report.ncu-rep" ]]; then
  echo "profile_ncu.sh: ncu wrote no report; no kernel matching '${KERNEL_REGEX:-flash_fwd}'" \
       "ran between cudaProfilerStart and Stop (see $out_dir/ncu.log)" >&2
  exit 1
fi

"$ncu" --import "$report.ncu-rep" --page details > "$out_dir/details.txt"
"$ncu" --import "$report.ncu-rep" --page details --csv > "$out_dir/details.csv"
"$ncu" --import "$report.ncu-rep" --page raw --csv --print-units base > "$out_dir/raw.csv"

"$python" - "$out_dir/raw.csv" "$metrics" > "$out_dir/summary.txt" <<'EOF'
import csv
import sys

path, metrics = sys.argv[1], [m for m in sys.argv[2].split(",") if m]
with open(path, newline="") as f:
    table = list(csv.reader(f))
header = table[0]
# ncu puts a row of units, with an empty ID column, between the header and the launches.
units = next((row for row in table[1:] if row and not row[0]), [""] * len(header))
launches = [row for row in table[1:] if row and row[0]]
for launch in launches:
    values = dict(zip(header, launch))
    print(values.get("Kernel Name", "kernel"))
    for metric in metrics:
        unit = units[header.index(metric)] if metric in header else ""
        print(f"  {metric:<60} {values.get(metric, 'not collected')} {unit}".rstrip())
    for op in ("ld", "st"):
        conflicts = values.get(f"l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_{op}.sum")
        wavefronts = values.get(f"l1tex__data_pipe_lsu_wavefronts_mem_shared_op_{op}.sum")
        try:
            share = float(conflicts.replace(",", "")) / float(wavefronts.replace(",", ""))
        except (AttributeError, ValueError, ZeroDivisionError):
            continue
        print(f"  shared {op}: bank conflicts / wavefronts = {share:.3f}")
    # From the sections: how busy the tensor cores were, how full the SM, and where warps waited.
    for label, metric in (
            ("tensor pipe active, % of elapsed cycles", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"),
            ("achieved occupancy, % of the SM's warps", "sm__warps_active.avg.pct_of_peak_sustained_active"),
            ("active warps per SM", "sm__warps_active.avg.per_cycle_active"),
            ("instructions issued per scheduler per cycle", "smsp__issue_active.avg.per_cycle_active")):
        print(f"  {label:<60} {values.get(metric, 'not collected')}")
    prefix, suffix = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
    stalls = []
    for metric, value in values.items():
        if metric.startswith(prefix) and metric.endswith(suffix):
            try:
                stalls.append((float(value.replace(",", "")), metric[len(prefix):-len(suffix)]))
            except ValueError:
                continue
    stalls.sort(reverse=True)
    print("  stall reasons, warps stalled per issued instruction: " +
          ", ".join(f"{reason} {ratio:.2f}" for ratio, reason in stalls[:8] if ratio >= 0.01))
EOF
cat "$out_dir/summary.txt"
echo "profile_ncu.sh: report and summaries in $out_dir"

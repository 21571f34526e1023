#!/usr/bin/env bash
# Builds and runs tools/compare_paths.cu for one head dim: both forward kernel paths checked
# against a float64 reference and timed on the benchmark's shapes, without building the extension.
#
# Usage: tools/compare_paths.sh [HEAD_DIM]     (64, 128 or 256; default 128)
# Needs nvcc, the CUTLASS headers (CUTLASS_PATH, third_party/cutlass or the nvidia-cutlass wheel)
# and, to run, a compute capability 9.0 GPU. The binary goes to build/compare_paths_hdim<N>.
set -euo pipefail
head_dim=${1:-128}
case $head_dim in 64|128|256) ;; *) echo "HEAD_DIM must be 64, 128 or 256, got $head_dim" >&2; exit 2 ;; esac
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -n "${CUTLASS_PATH:-}" ]]; then
  cutlass=$CUTLASS_PATH/include
elif [[ -f "$root/third_party/cutlass/include/cute/tensor.hpp" ]]; then
  cutlass=$root/third_party/cutlass/include
else
  cutlass=$(python3 -c 'import importlib.util, pathlib; s = importlib.util.find_spec("cutlass_library"); print(pathlib.Path(list(s.submodule_search_locations)[0]) / "source" / "include")')
fi
mkdir -p "$root/build"
# flash_cutlass/compiled.h of a Hopper build that keeps the sm80 path at every head dim
# (FLASH_CUTLASS_SM80_ON_HOPPER=1): this tool runs both paths on the GPU.
generated=$root/build/compare_paths_generated
python3 - "$root" "$generated" <<'PY'
import runpy, sys
from pathlib import Path
catalogue = runpy.run_path(str(Path(sys.argv[1]) / "setup.py"), run_name="flash_cutlass_setup")["load_catalogue"]()
catalogue.generate(catalogue.BuildSelection(archs=(90,), sm80_on_hopper=True), Path(sys.argv[2]))
PY
binary=$root/build/compare_paths_hdim$head_dim
nvcc -gencode=arch=compute_90a,code=sm_90a -O3 --use_fast_math --expt-relaxed-constexpr -std=c++20 \
  -I "$root/include" -I "$generated/include" -I "$cutlass" -DHEAD_DIM="$head_dim" "$root/tools/compare_paths.cu" \
  -o "$binary"
"$binary"

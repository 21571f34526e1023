"""Builds flash_cutlass's CUDA extension with torch.utils.cpp_extension and ninja.

Build options (environment variables; see README.md):
  FLASH_CUTLASS_CUDA_ARCHS  ";"- or ","-separated compute capabilities, e.g. "80;90".
                            Default: the local GPU's, else "80;90". Each must be >= 80.
  FLASH_CUTLASS_HEAD_DIMS   subset of 32,64,96,128,192,256 to compile (default: all).
  FLASH_CUTLASS_DTYPES      subset of fp16,bf16 to compile (default: both).
  FLASH_CUTLASS_SM90        1 (default when 90 is among the archs) builds the Hopper path (TMA +
                            wgmma; forward head dims 64/96/128/192/256, backward 64/128) and
                            targets sm_90a instead of sm_90; 0 leaves it out. It needs 90 in
                            FLASH_CUTLASS_CUDA_ARCHS.
  FLASH_CUTLASS_WINDOW      1 (default) builds the sliding-window kernels (window_size=); 0 leaves
                            them out (a call with a window then raises, naming this flag).
  FLASH_CUTLASS_SOFTCAP     1 (default) accepts softcap=, FLASH_CUTLASS_ALIBI 1 (default)
  FLASH_CUTLASS_ALIBI       alibi_slopes=, FLASH_CUTLASS_DROPOUT 1 (default) dropout_p=; all
  FLASH_CUTLASS_DROPOUT     run in the extended kernels: softcap and ALiBi in one instantiation
                            (built when either flag is 1), dropout in another (which takes the
                            other two as well). A call with an option whose flag is 0 raises,
                            naming the flag.
  FLASH_CUTLASS_BACKWARD    1 (default) builds the backward kernels; 0 leaves them out for
                            inference (8 of the 17 instantiation files, the slowest ones: 43% of
                            the build time on 2 cores; the backward of a CUDA call then raises,
                            naming this flag).
  CUTLASS_PATH              a CUTLASS checkout to use instead of the nvidia-cutlass wheel.
  MAX_JOBS / NVCC_THREADS   parallel compile jobs / nvcc threads per job; the defaults keep
                            about 3 GB of memory per concurrent nvcc.
  FLASH_CUTLASS_PTXAS_VERBOSE=1  print ptxas's register and spill report for every kernel.
  FLASH_CUTLASS_TIMELINE    0 (default); 1 records a clock64 timeline of every Hopper forward tile
                            for developers (tools/timeline.py reads it). Not for production.
"""

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
ALL_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
ALL_DTYPES = ("fp16", "bf16")
GIB = 1024**3


def toolkit_root_from_nvcc():
    """The CUDA toolkit root as nvcc itself reports it (TOP=...), or None."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    probe = ROOT / "build" / "nvcc_probe.cu"
    probe.parent.mkdir(parents=True, exist_ok=True)
    probe.write_text("")
    try:
        result = subprocess.run([nvcc, "--dryrun", "-c", str(probe)], capture_output=True, text=True, check=False)
    except OSError:
        return None
    match = re.search(r"TOP=(\S+)", result.stdout + result.stderr)
    return str(Path(match.group(1)).resolve()) if match else None


def ensure_cuda_home():
    """torch guesses CUDA_HOME from the location of nvcc; where nvcc is a wrapper script
    outside the toolkit that guess lacks the headers, so ask nvcc for the real root."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        guess = Path(nvcc).parent.parent  # what torch guesses: no symlinks followed
        if (guess / "include" / "cuda_runtime_api.h").exists():
            return
    root = toolkit_root_from_nvcc()
    if root is not None and (Path(root) / "include" / "cuda_runtime_api.h").exists():
        os.environ["CUDA_HOME"] = root


def cutlass_include_dirs():
    """CUTLASS_PATH, else third_party/cutlass, else the nvidia-cutlass wheel's headers."""
    if os.environ.get("CUTLASS_PATH"):
        root = Path(os.environ["CUTLASS_PATH"])
        if not (root / "include" / "cute" / "tensor.hpp").exists():
            raise RuntimeError(f"CUTLASS_PATH={root}: no include/cute/tensor.hpp there; point it at a CUTLASS checkout")
        return [str(root / "include"), str(root / "tools" / "util" / "include")]
    candidates = [ROOT / "third_party" / "cutlass"]
    spec = importlib.util.find_spec("cutlass_library")
    if spec is not None and spec.submodule_search_locations:
        candidates.append(Path(list(spec.submodule_search_locations)[0]) / "source")
    for root in candidates:
        if (root / "include" / "cute" / "tensor.hpp").exists():
            return [str(root / "include"), str(root / "tools" / "util" / "include")]
    raise RuntimeError(
        "CUTLASS headers not found: pip install nvidia-cutlass==4.2.0.0, or set CUTLASS_PATH to a "
        "CUTLASS checkout, or clone CUTLASS into third_party/cutlass"
    )


def parse_list(name, default, allowed, convert=str):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return list(default)
    try:
        values = [convert(item.strip().lower()) for item in re.split(r"[;, ]+", raw) if item.strip()]
    except ValueError:
        values = []
    if not values or any(v not in allowed for v in values):
        raise RuntimeError(f"{name}={raw!r}: accepted values are {', '.join(map(str, allowed))}")
    return sorted(set(values), key=list(allowed).index)


def cuda_archs():
    raw = os.environ.get("FLASH_CUTLASS_CUDA_ARCHS", "").strip()
    if not raw:
        try:
            import torch

            if torch.cuda.is_available():
                major, minor = torch.cuda.get_device_capability()
                raw = f"{major}{minor}"
        except Exception:
            raw = ""
    if not raw:
        raw = "80;90"
    archs = []
    for item in re.split(r"[;, ]+", raw):
        item = item.strip().lower().removeprefix("sm_").replace(".", "")
        if not item:
            continue
        if not item.isdigit() or int(item) < 80:
            raise RuntimeError(
                f"FLASH_CUTLASS_CUDA_ARCHS={raw!r}: each entry must be a compute capability >= 80 "
                "(e.g. 80, 86, 89, 90); older GPUs are not supported"
            )
        archs.append(int(item))
    return sorted(set(archs))


def sm90_enabled(archs):
    raw = os.environ.get("FLASH_CUTLASS_SM90", "").strip()
    if raw not in ("", "0", "1"):
        raise RuntimeError(f"FLASH_CUTLASS_SM90={raw!r}: accepted values are 0 and 1")
    if raw == "1" and 90 not in archs:
        raise RuntimeError(
            "FLASH_CUTLASS_SM90=1 builds the Hopper path, which needs 90 in FLASH_CUTLASS_CUDA_ARCHS "
            f"(got {';'.join(map(str, archs))})"
        )
    return 90 in archs and raw != "0"


def feature_enabled(variable, default=True):
    """A build flag: 0 or 1, `default` when unset (1 for features, 0 for developer options)."""
    raw = os.environ.get(variable, "").strip()
    if raw not in ("", "0", "1"):
        raise RuntimeError(f"{variable}={raw!r}: accepted values are 0 and 1")
    return default if raw == "" else raw == "1"


def default_jobs():
    cpus = os.cpu_count() or 1
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        available = 8 * GIB
    return max(1, min(cpus, int(available // (3 * GIB))))


def main():
    ensure_cuda_home()
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    os.environ.setdefault("MAX_JOBS", str(default_jobs()))
    head_dims = parse_list("FLASH_CUTLASS_HEAD_DIMS", ALL_HEAD_DIMS, ALL_HEAD_DIMS, int)
    dtypes = parse_list("FLASH_CUTLASS_DTYPES", ALL_DTYPES, ALL_DTYPES)
    archs = cuda_archs()
    nvcc_threads = os.environ.get("NVCC_THREADS", "1")

    sm90 = sm90_enabled(archs)
    backward = feature_enabled("FLASH_CUTLASS_BACKWARD")

    sources = ["csrc/flash_api.cpp", "csrc/sm80_kernel_info.cu"]
    # One file per (direction, path, head dim); the dtype defines below select what it instantiates.
    for path in sorted((ROOT / "csrc" / "instantiations").glob("*_sm*.cu")):
        match = re.fullmatch(r"(fwd|bwd)_(sm80|sm90)_hdim(\d+)\.cu", path.name)
        if not match or int(match.group(3)) not in head_dims or (match.group(1) == "bwd" and not backward):
            continue
        if match.group(2) == "sm80" or sm90:
            sources.append(str(path.relative_to(ROOT)))

    defines = [f"-DFLASH_CUTLASS_HDIM_{d}" for d in head_dims]
    defines += [f"-DFLASH_CUTLASS_DTYPE_{t.upper()}" for t in dtypes]
    if sm90:
        defines.append("-DFLASH_CUTLASS_SM90")
    extended_options = ("FLASH_CUTLASS_SOFTCAP", "FLASH_CUTLASS_ALIBI", "FLASH_CUTLASS_DROPOUT")
    for feature in ("FLASH_CUTLASS_WINDOW", "FLASH_CUTLASS_BACKWARD") + extended_options:
        if feature_enabled(feature):
            defines.append(f"-D{feature}")
    if feature_enabled("FLASH_CUTLASS_TIMELINE", default=False):
        defines.append("-DFLASH_CUTLASS_TIMELINE")
    # The score-options instantiation; the dropout one (FLASH_CUTLASS_DROPOUT) carries them too.
    if feature_enabled("FLASH_CUTLASS_SOFTCAP") or feature_enabled("FLASH_CUTLASS_ALIBI"):
        defines.append("-DFLASH_CUTLASS_SCORE_MODS")
    # wgmma and setmaxnreg exist only in the architecture-specific sm_90a target.
    targets = [f"{a}a" if a == 90 and sm90 else str(a) for a in archs]
    # A bare comma list (no quotes, no ';') survives ninja's shell; the C++ side stringifies it.
    arch_names = ",".join([f"sm_{t}" for t in targets] + [f"compute_{archs[-1]}"])
    defines.append(f"-DFLASH_CUTLASS_ARCHS={arch_names}")

    gencode = [f"-gencode=arch=compute_{t},code=sm_{t}" for t in targets]
    # PTX of the newest arch, so newer GPUs can still JIT the kernels.
    gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    nvcc_flags = [
        "-O3",
        "--use_fast_math",
        "--expt-relaxed-constexpr",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-lineinfo",
        f"--threads={nvcc_threads}",
        *gencode,
        *defines,
    ]
    if os.environ.get("FLASH_CUTLASS_PTXAS_VERBOSE") == "1":
        nvcc_flags.append("-Xptxas=-v")

    extension = CUDAExtension(
        name="flash_cutlass._C",
        sources=sources,
        include_dirs=[str(ROOT / "include"), *cutlass_include_dirs()],
        extra_compile_args={"cxx": ["-O3", *defines], "nvcc": nvcc_flags},
    )
    setup(
        packages=find_packages(include=["flash_cutlass", "flash_cutlass.*"]),
        ext_modules=[extension],
        cmdclass={"build_ext": BuildExtension},
    )


main()

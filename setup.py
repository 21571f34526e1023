"""Builds flash_cutlass's CUDA extension with torch.utils.cpp_extension and ninja.

Build options (environment variables; see README.md):
  FLASH_CUTLASS_CUDA_ARCHS  ";"- or ","-separated compute capabilities, e.g. "80;90".
                            Default: the local GPU's, else "80;90". Each must be >= 80.
  FLASH_CUTLASS_HEAD_DIMS   subset of the head dims in csrc/catalogue.py (32,64,96,128,192,256)
                            to compile (default: all).
  FLASH_CUTLASS_DTYPES      subset of fp16,bf16 to compile (default: both).
  FLASH_CUTLASS_SM90        1 (default when 90 is among the archs) builds the Hopper path (TMA +
                            wgmma; forward head dims 64/96/128/192/256, backward 64/128/192/256) and
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
                            inference (9 of the 27 instantiation files, the slowest ones: 43% of
                            the build time on 2 cores; the backward of a CUDA call then raises,
                            naming this flag).
  FLASH_CUTLASS_KVCACHE     1 (default) builds the KV-cache kernels (flash_attention_with_kvcache:
                            one attention instantiation per head dim and dtype, whose mask and
                            score options are runtime values, an append kernel per dtype, and
                            the Hopper forward's causal kernel over paged caches per head dim);
                            0 leaves them out (a CUDA call then raises, naming this flag).
  CUTLASS_PATH              a CUTLASS checkout to use instead of the nvidia-cutlass wheel.
  MAX_JOBS / NVCC_THREADS   parallel compile jobs / nvcc threads per job; the defaults keep
                            about 3 GB of memory per concurrent nvcc.
  FLASH_CUTLASS_PTXAS_VERBOSE=1  print ptxas's register and spill report for every kernel.
  FLASH_CUTLASS_TIMELINE    0 (default); 1 records a clock64 timeline of every Hopper forward tile
                            for developers (tools/timeline.py reads it). Not for production.
  FLASH_CUTLASS_PTX         1 embeds the PTX of the oldest target next to the machine code, so that
                            GPUs newer than every target can JIT-compile the kernels (at their first
                            load); nvcc makes it in the pass that compiles that target, at almost no
                            cost. 0 leaves it out. With a single sm_90a target the PTX (compute_90)
                            is a pass of its own: a build of head dim 128 for sm_90a on 2 cores
                            takes 0.8x the time without it; level on 16 cores.
                            Default: 0 when the targets are the visible GPU's (the build runs where
                            it will run), else 1.
  FLASH_CUTLASS_SM90_SMALL_TILES  0 (default) leaves the sm80 backward's smaller tiles (those of
                            GPUs that allow a block less shared memory: sm_86/89/120, the A100) out
                            of the sm_90a code, where no Hopper GPU picks them (the sm80 backward
                            files' longest pass, 0.7x the time); 1 keeps them, for the tests that
                            force them on a Hopper GPU through FLASH_CUTLASS_SMEM_PER_BLOCK.
  FLASH_CUTLASS_SM80_ON_HOPPER  0 (default) leaves the sm80 path's forward and backward kernels out of
                            the sm_90a code at the head dims the Hopper path has, where a Hopper GPU
                            runs them only when a call forces kernel="sm80" (the automatic choice takes
                            the Hopper path there; head dim 32 keeps them); 1 keeps them, for the
                            tests and A/B runs that force the sm80 path on a Hopper GPU.
"""

import importlib.util
import os
import sys
import re
import shutil
import subprocess
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
GIB = 1024**3
# Where the build's generated instantiation files and flash_cutlass/compiled.h go.
GENERATED = ROOT / "build" / "generated"


def load_catalogue():
    """csrc/catalogue.py, the one list of what can be compiled (not a package: loaded by path)."""
    spec = importlib.util.spec_from_file_location("flash_cutlass_catalogue", ROOT / "csrc" / "catalogue.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


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


def local_gpu_arch():
    """The visible GPU's compute capability as "XY", or "" without one."""
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"{major}{minor}"
    except Exception:
        pass
    return ""


def cuda_archs():
    """The targets, and whether they are the visible GPU's (FLASH_CUTLASS_CUDA_ARCHS unset)."""
    raw = os.environ.get("FLASH_CUTLASS_CUDA_ARCHS", "").strip()
    local = False
    if not raw:
        raw = local_gpu_arch()
        local = bool(raw)
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
    return sorted(set(archs)), local


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


def build_selection(catalogue):
    """What this build compiles, from the environment variables in this file's docstring."""
    archs, local = cuda_archs()
    return catalogue.BuildSelection(
        head_dims=tuple(parse_list("FLASH_CUTLASS_HEAD_DIMS", catalogue.ALL_HEAD_DIMS, catalogue.ALL_HEAD_DIMS, int)),
        dtypes=tuple(parse_list("FLASH_CUTLASS_DTYPES", catalogue.DTYPES, tuple(catalogue.DTYPES))),
        archs=tuple(archs),
        sm90=sm90_enabled(archs),
        backward=feature_enabled("FLASH_CUTLASS_BACKWARD"),
        window=feature_enabled("FLASH_CUTLASS_WINDOW"),
        softcap=feature_enabled("FLASH_CUTLASS_SOFTCAP"),
        alibi=feature_enabled("FLASH_CUTLASS_ALIBI"),
        dropout=feature_enabled("FLASH_CUTLASS_DROPOUT"),
        kvcache=feature_enabled("FLASH_CUTLASS_KVCACHE"),
        timeline=feature_enabled("FLASH_CUTLASS_TIMELINE", default=False),
        ptx=feature_enabled("FLASH_CUTLASS_PTX", default=not local),
        sm90_small_tiles=feature_enabled("FLASH_CUTLASS_SM90_SMALL_TILES", default=False),
        sm80_on_hopper=feature_enabled("FLASH_CUTLASS_SM80_ON_HOPPER", default=False),
    )


def main():
    ensure_cuda_home()
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    os.environ.setdefault("MAX_JOBS", str(default_jobs()))
    nvcc_threads = os.environ.get("NVCC_THREADS", "1")
    catalogue = load_catalogue()
    selection = build_selection(catalogue)
    sources = ["csrc/flash_api.cpp", "csrc/sm80_kernel_info.cu"]
    sources += [str(path.relative_to(ROOT)) for path in catalogue.sources(selection, GENERATED)]
    # The kernels' one build-time switch; everything else the build selected is in compiled.h.
    defines = ["-DFLASH_CUTLASS_TIMELINE"] if selection.timeline else []
    targets = selection.targets()

    gencode = [f"-gencode=arch=compute_{t},code=sm_{t}" for t in targets]
    if selection.ptx_arch() is not None:  # so that GPUs newer than the targets can JIT the kernels
        ptx = selection.ptx_arch()
        gencode.append(f"-gencode=arch=compute_{ptx},code=compute_{ptx}")
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
        include_dirs=[str(ROOT / "include"), str(GENERATED / "include"), *cutlass_include_dirs()],
        extra_compile_args={"cxx": ["-O3", *defines], "nvcc": nvcc_flags},
    )

    class BuildFromCatalogue(BuildExtension):
        """Writes the build's generated files (csrc/catalogue.py) just before compiling them, so
        that commands that build nothing (setup.py --name) write nothing."""

        def run(self):
            catalogue.generate(selection, GENERATED)
            super().run()

    setup(
        packages=find_packages(include=["flash_cutlass", "flash_cutlass.*"]),
        ext_modules=[extension],
        cmdclass={"build_ext": BuildFromCatalogue},
    )


if __name__ == "__main__":  # pip's build backend runs setup.py as __main__; tests import its functions
    main()

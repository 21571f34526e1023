#!/usr/bin/env python3
"""Compile one kernel instantiation and summarize its SASS, without a GPU.

Reads what usually answers a performance question before any GPU time is spent: registers and
spills (ptxas; for the Hopper path's warp-specialized kernels also whose they are, the consumers'
code or the producer's), the matrix instructions (HMMA for the sm80 path, HGMMA for the Hopper path),
shared-memory and global copies, local-memory traffic, and, for the Hopper path, the order of
warpgroup MMA issue/wait points and softmax exponentials in the main loop (a block of MUFU.EX2
between `WARPGROUP.DEPBAR.LE gsb0, 0x1` and `... 0x0` means the softmax overlaps an MMA).

    python3 tools/sass_report.py --path sm90 --head-dim 128
    python3 tools/sass_report.py --path sm80 --head-dim 64 --dtype fp16 --mask causal
    python3 tools/sass_report.py --direction backward --path sm80 --head-dim 128
    python3 tools/sass_report.py --direction kvcache --path sm80 --head-dim 128   # attention, merge, append
    python3 tools/sass_report.py --direction kvcache --path sm80 --arch 90a       # the same as Hopper runs it

Needs nvcc and cuobjdump (from the CUDA toolkit, or the copy Triton ships under
triton/backends/nvidia/bin) and the CUTLASS headers setup.py would use (CUTLASS_PATH,
third_party/cutlass or the nvidia-cutlass wheel).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("flash_cutlass_catalogue", ROOT / "csrc" / "catalogue.py")
catalogue = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = catalogue  # dataclasses look their module up by name
_SPEC.loader.exec_module(catalogue)
TARGETS = {"sm80": "-gencode=arch=compute_80,code=sm_80", "sm90": "-gencode=arch=compute_90a,code=sm_90a"}
ARCHS = {"80": TARGETS["sm80"], "90a": TARGETS["sm90"]}
COUNTED = ("HMMA", "HGMMA", "LDSM", "LDGSTS", "UTMALDG", "MUFU.EX2", "BAR.SYNC", "LDL", "STL", "SHFL")
SEQUENCE = re.compile(r"(WARPGROUP\.ARRIVE|WARPGROUP\.DEPBAR\.LE gsb0, 0x[0-9a-f]+|MUFU\.EX2|HGMMA)")


def cutlass_include() -> Path:
    """The CUTLASS headers setup.py would use: $CUTLASS_PATH, third_party/cutlass, the wheel."""
    if os.environ.get("CUTLASS_PATH"):
        return Path(os.environ["CUTLASS_PATH"]) / "include"
    spec = importlib.util.find_spec("cutlass_library")
    candidates = [ROOT / "third_party" / "cutlass"]
    if spec is not None and spec.submodule_search_locations:
        candidates.append(Path(list(spec.submodule_search_locations)[0]) / "source")
    for root in candidates:
        if (root / "include" / "cute" / "tensor.hpp").exists():
            return root / "include"
    sys.exit("CUTLASS headers not found: pip install nvidia-cutlass==4.2.0.0 or clone third_party/cutlass")


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    spec = importlib.util.find_spec("triton")
    if spec is not None and spec.origin:
        bundled = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if bundled.exists():
            return str(bundled)
    sys.exit("cuobjdump not found on PATH or in Triton's package")


def opcodes(sass: str) -> list[str]:
    """The opcodes of the instructions in a SASS listing (after any predicate)."""
    return [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9._]*)", sass)]


def is_opcode(opcode: str, name: str) -> bool:
    """Whether `opcode` is instruction `name` with or without modifiers (LDL.LU is LDL)."""
    return opcode == name or opcode.startswith(name + ".")


def function_label(text: str) -> str | None:
    """The name and template arguments of the kernel whose mangled name `text` holds (a ptxas line
    or a SASS function header), or None when it holds none of ours."""
    entry = re.search(r"_ZN13flash_cutlass4sm[89]0\d+(flash_\w+?)I", text)
    if not entry:
        return None
    flags = re.findall(r"Lb([01])E", text)
    kinds = re.findall(r"MaskKindE(\d)E", text)
    extensions = re.findall(r"ExtensionE(\d)E", text)
    # The KV-cache attention has an instantiation per pipeline depth and warp count (kvcache_kernel.h's
    # KVCacheStages): its int template arguments are the head dim, the stages, and after the
    # element type the warps.
    stages = re.match(r"flash_kvcache_sm80ILi(\d+)ELi(\d+)EN\d+cutlass\d+\w+?ELi(\d+)E", text[entry.start(1):])
    details = ([f"{stages.group(2)} stages, {stages.group(3)} warps"] if stages else []) + (
        [f"mask kind {', '.join(kinds)}"] if kinds else []) + (
        [f"extension {', '.join(extensions)}"] if extensions else []) + (
        [f"bool template arguments {', '.join(flags)}"] if flags else [])
    return entry.group(1) + (f" ({'; '.join(details)})" if details else "")


def local_memory_by_role(sass: str) -> list:
    """Per warp-specialized kernel (one with setmaxnreg), its local-memory stores and loads (spills)
    in the consumers' code and in the producer's: the instructions between the consumers'
    `USETMAXREG.TRY_ALLOC` and the producer's `USETMAXREG.DEALLOC` and those after the latter (or
    the other way round), as ptxas laid them out. ptxas's spill totals do not say whose they are."""
    found = []
    for function in re.split(r"\n\s*Function : ", sass)[1:]:
        mangled, _, body = function.partition("\n")
        lines = body.splitlines()
        alloc = next((i for i, line in enumerate(lines) if re.search(r"USETMAXREG\.(TRY_)?ALLOC", line)), None)
        dealloc = next((i for i, line in enumerate(lines) if "USETMAXREG.DEALLOC" in line), None)
        if alloc is None or dealloc is None:
            continue

        def count(section):
            found_opcodes = opcodes("\n".join(section))
            return (sum(is_opcode(op, "STL") for op in found_opcodes),
                    sum(is_opcode(op, "LDL") for op in found_opcodes))

        if alloc < dealloc:
            consumers, producer = count(lines[alloc:dealloc]), count(lines[dealloc:])
        else:
            producer, consumers = count(lines[dealloc:alloc]), count(lines[alloc:])
        found.append((function_label(mangled) or mangled.strip(), consumers, producer))
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--direction", choices=("forward", "backward", "kvcache"), default="forward",
                        help="which kernels (default: %(default)s); the backward's ptxas lines cover each of its "
                             "kernels, kvcache's the KV-cache attention, its split merge and the append")
    parser.add_argument("--path", choices=sorted(TARGETS), default="sm90", help="kernel path (default: %(default)s)")
    parser.add_argument("--arch", choices=sorted(ARCHS),
                        help="the GPU code to compile for (default: the path's own, 80 or 90a; the sm80 path's "
                             "kernels run as 90a code on Hopper)")
    parser.add_argument("--head-dim", type=int, default=128, help="compiled head dim (default: %(default)s)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="(default: %(default)s)")
    parser.add_argument("--mask", choices=("none", "causal", "local"), default="none",
                        help="the instantiation of this mask kind (local: sliding window; default: %(default)s)")
    parser.add_argument("--extension", choices=("none", "score_mods", "dropout"), default="none",
                        help="the runtime options the instantiation carries (score_mods: soft cap and ALiBi; "
                             "dropout: those and dropout; both use --mask local; default: %(default)s)")
    parser.add_argument("--define", action="append", default=[], metavar="MACRO[=VALUE]",
                        help="pass -DMACRO[=VALUE] to nvcc, e.g. FLASH_CUTLASS_TIMELINE (repeatable)")
    parser.add_argument("--sass", type=Path, metavar="PATH",
                        help="also write the whole SASS here (to diff two versions of a kernel)")
    args = parser.parse_args(argv)
    head_dims = (catalogue.KVCACHE_HEAD_DIMS if args.path == "sm80" else ()) if args.direction == "kvcache" else \
        catalogue.HEAD_DIMS.get((args.direction, args.path), ())
    if not head_dims:
        parser.error(f"there is no {args.direction} kernel of the {args.path} path")
    if args.head_dim not in head_dims:
        parser.error(f"--head-dim must be one of {head_dims} for the {args.direction} {args.path} path")

    if args.path == "sm90" and args.arch not in (None, "90a"):
        parser.error("the sm90 path's kernels need --arch 90a (wgmma and TMA)")
    target = ARCHS[args.arch] if args.arch else TARGETS[args.path]
    dtype = {"bf16": "kBFloat16", "fp16": "kFloat16"}[args.dtype]
    short, params = {"forward": ("fwd", "FwdParams"), "backward": ("bwd", "BwdParams"),
                     "kvcache": ("kvcache", "KVCacheParams")}[args.direction]
    if args.extension != "none" and args.mask != "local":
        parser.error("--extension score_mods and dropout are instantiated with --mask local only")
    if args.direction == "kvcache" and (args.mask, args.extension) != ("none", "none"):
        parser.error("the KV-cache kernels take the mask and score options at run time: no --mask or --extension")
    name = f"{short}_{args.path}_hdim{args.head_dim}_{args.dtype}_{args.mask}_{args.extension}"
    mask_kind = {"none": "kNone", "causal": "kCausal", "local": "kLocal"}[args.mask]
    extension = {"none": "kNone", "score_mods": "kScoreMods", "dropout": "kDropout"}[args.extension]
    if args.direction == "kvcache":
        instance = catalogue.kvcache_instances(args.head_dim, dtype) + catalogue.kvcache_append_instances(dtype)
    else:
        instance = (f"template cudaError_t flash_cutlass::{args.path}::run_{short}<{args.head_dim}, "
                    f"flash_cutlass::DType::{dtype}, flash_cutlass::MaskKind::{mask_kind}, "
                    f"flash_cutlass::Extension::{extension}>("
                    f"flash_cutlass::{params} const&, cudaStream_t);\n")
    with tempfile.TemporaryDirectory() as tmp:
        # One instantiation alone (a build's files group every dtype and mask of a head dim), with
        # the default build's flash_cutlass/compiled.h, which the launch headers include, except
        # that the sm80 path's kernels keep their code in sm_90a's pass at every head dim
        # (FLASH_CUTLASS_SM80_ON_HOPPER): the report is of the kernel asked for.
        catalogue.generate(catalogue.BuildSelection(sm80_on_hopper=True), Path(tmp))
        source = Path(tmp) / f"{name}.cu"
        source.write_text(f'#include "flash_cutlass/{args.path}/{short}_launch.h"\n' + instance)
        cubin = Path(tmp) / "kernel.cubin"
        nvcc = [shutil.which("nvcc") or "nvcc", "-cubin", target, "-O3", "--use_fast_math",
                "--expt-relaxed-constexpr", "-std=c++17", f"-I{ROOT / 'include'}", f"-I{Path(tmp) / 'include'}",
                f"-I{cutlass_include()}",
                *(f"-D{macro}" for macro in args.define), "-Xptxas=-v", str(source), "-o", str(cubin)]
        build = subprocess.run(nvcc, capture_output=True, text=True)
        if build.returncode != 0:
            sys.exit(f"nvcc failed:\n{build.stderr}")
        sass = subprocess.run([cuobjdump(), "--dump-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    if args.sass:
        args.sass.write_text(sass)

    print(f"{name} ({target.rsplit('code=', 1)[1]})")
    for line in build.stderr.splitlines():
        label = function_label(line) if "Compiling entry function" in line else None
        if label:
            print(f"  {label}")
        elif "registers" in line or "spill" in line:
            print("    ptxas:", line.split(":", 1)[-1].strip())
        elif "Performance Loss" in line:
            # e.g. wgmma.mma_async serialized: every GEMM then waits for the one before.
            print("    ptxas warning:", line.split("(C", 1)[-1].split(") ", 1)[-1].strip())
    instructions = opcodes(sass)
    counts = collections.Counter()
    for opcode in instructions:
        for name in COUNTED:
            if is_opcode(opcode, name):
                counts[name] += 1
    print(f"  {len(instructions)} SASS instructions; " + ", ".join(f"{n} {counts[n]}" for n in COUNTED))
    if args.path == "sm90":
        runs = []
        for match in SEQUENCE.finditer(sass):
            token = match.group(1)
            if runs and runs[-1][0] == token:
                runs[-1][1] += 1
            else:
                runs.append([token, 1])
        print("  issue/wait/softmax order: " + " | ".join(f"{t} x{n}" if n > 1 else t for t, n in runs))
        for label, consumers, producer in local_memory_by_role(sass):
            print(f"  {label}: local memory instructions, consumers STL {consumers[0]} / LDL {consumers[1]}, "
                  f"producer STL {producer[0]} / LDL {producer[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

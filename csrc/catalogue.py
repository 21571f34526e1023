"""The one list of what flash_cutlass can compile, and the generator of what a build compiles.

setup.py reads the lists below, narrows them with the build's environment variables (BuildSelection)
and calls generate(), which writes one instantiation file per (direction, kernel path, head dim)
(so ninja compiles them in parallel) and the header flash_cutlass/compiled.h: the head dims, dtypes,
instantiations and options of this build as constexpr lists, from which include/flash_cutlass/
dispatch.h builds its switches and include/flash_cutlass/select.h picks kernels. The KV-cache
kernels (flash_attention_with_kvcache) add one file per head dim (the attention and its split
merge, one instantiation per dtype: their options are runtime values) and one for the append and
the gather. tools/ and the tests read the lists from here too. Adding a head dim to a path is one
entry of HEAD_DIMS (plus, for a new size, its tile configuration in that path's traits).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, Optional, Tuple

# Head dims of each (direction, kernel path).
HEAD_DIMS: Dict[Tuple[str, str], Tuple[int, ...]] = {
    ("forward", "sm80"): (32, 64, 96, 128, 192, 256),
    ("forward", "sm90"): (64, 96, 128, 192, 256),
    ("backward", "sm80"): (32, 64, 96, 128, 192, 256),
    ("backward", "sm90"): (64, 96, 128, 192, 256),
}
# Head dims of the KV-cache kernels (sm80 path, built for every target).
KVCACHE_HEAD_DIMS: Tuple[int, ...] = (32, 64, 96, 128, 192, 256)
ALL_HEAD_DIMS = tuple(sorted({d for dims in (*HEAD_DIMS.values(), KVCACHE_HEAD_DIMS) for d in dims}))
# Build name -> the C++ DType and the torch dtype's name.
DTYPES = {"fp16": ("kFloat16", "float16"), "bf16": ("kBFloat16", "bfloat16")}
# Each kernel is instantiated once per (mask kind, extension); the window's and the extended ones
# only when the build asks for them (the option that needs them: BuildSelection).
INSTANTIATIONS = (
    # (mask kind, extension, the option it exists for or None)
    ("kNone", "kNone", None),
    ("kCausal", "kNone", None),
    ("kLocal", "kNone", "window"),
    ("kLocal", "kScoreMods", "score_mods"),
    ("kLocal", "kDropout", "dropout"),
)
# Compute capabilities a build may target; 90 builds the Hopper path for sm_90a.
DEFAULT_ARCHS = (80, 90)
FILE_PREFIX = {"forward": "fwd", "backward": "bwd"}
PARAMS = {"forward": "FwdParams", "backward": "BwdParams"}


@dataclasses.dataclass(frozen=True)
class BuildSelection:
    """What one build compiles: a subset of the lists above."""

    head_dims: Tuple[int, ...] = ALL_HEAD_DIMS
    dtypes: Tuple[str, ...] = tuple(DTYPES)
    archs: Tuple[int, ...] = DEFAULT_ARCHS
    sm90: bool = True  # the Hopper path (needs 90 in archs)
    backward: bool = True
    window: bool = True
    softcap: bool = True
    alibi: bool = True
    dropout: bool = True
    kvcache: bool = True  # the KV-cache kernels
    timeline: bool = False  # the Hopper forward's developer timeline
    ptx: bool = True  # PTX of the oldest arch next to the machine code, for GPUs newer than the targets
    # The sm80 backward's smaller tiles (for GPUs that allow a block less shared memory) in the sm_90a
    # code as well: only FLASH_CUTLASS_SMEM_PER_BLOCK makes a Hopper GPU pick them (tests).
    sm90_small_tiles: bool = False
    # The sm80 path's kernels in the sm_90a code at the head dims the Hopper path has too, where only
    # kernel="sm80" reaches them (the automatic choice runs the Hopper path there): tests, A/B runs.
    sm80_on_hopper: bool = False

    def paths(self) -> Tuple[str, ...]:
        return ("sm80", "sm90") if self.sm90 else ("sm80",)

    def head_dims_of(self, direction: str, path: str) -> Tuple[int, ...]:
        """The compiled head dims of one (direction, kernel path); empty when it is left out."""
        if path not in self.paths() or (direction == "backward" and not self.backward):
            return ()
        return tuple(d for d in HEAD_DIMS[(direction, path)] if d in self.head_dims)

    def kvcache_head_dims(self) -> Tuple[int, ...]:
        """The KV-cache kernels' compiled head dims; empty when they are left out."""
        return tuple(d for d in KVCACHE_HEAD_DIMS if d in self.head_dims) if self.kvcache else ()

    def instantiations(self) -> Tuple[Tuple[str, str], ...]:
        wanted = {None: True, "window": self.window, "score_mods": self.softcap or self.alibi,
                  "dropout": self.dropout}
        return tuple((mask, extension) for mask, extension, option in INSTANTIATIONS if wanted[option])

    def targets(self) -> Tuple[str, ...]:
        """nvcc's machine-code targets; wgmma and setmaxnreg exist only in the sm_90a target."""
        return tuple(f"{a}a" if a == 90 and self.sm90 else str(a) for a in self.archs)

    def ptx_arch(self) -> Optional[int]:
        """The compute capability whose PTX the build embeds, or None. The oldest arch's: it runs on
        every newer GPU, and nvcc makes it in the pass that compiles that arch's machine code (any
        other arch's PTX is a pass of its own, about a third of an sm80 file's compile time)."""
        return self.archs[0] if self.ptx else None

    def hopper_runs_machine_code(self) -> bool:
        """Whether a Hopper GPU runs machine code compiled for sm_90 (or sm_90a), which holds the
        programmatic dependent launch's griddepcontrol instructions; otherwise it JIT-compiles older
        PTX without them."""
        return 90 in self.archs

    def hopper_has_small_tiles(self) -> bool:
        """Whether the code a Hopper GPU runs holds the sm80 backward's smaller tiles: all but the
        sm_90a target's do (sm_90, or PTX compiled there)."""
        return self.sm90_small_tiles or "90a" not in self.targets()

    def hopper_has_every_sm80_head_dim(self) -> bool:
        """Whether the code a Hopper GPU runs holds the sm80 path's kernels at every compiled head dim:
        all but the sm_90a target's do; sm_90a's holds them only at the head dims the Hopper path lacks
        unless the build keeps them all (sm80_on_hopper)."""
        return self.sm80_on_hopper or "90a" not in self.targets()

    def arch_names(self) -> str:
        """The compiled targets as flash_cutlass.compiled_archs() reports them, with the PTX if any."""
        ptx = [] if self.ptx_arch() is None else [f"compute_{self.ptx_arch()}"]
        return ",".join([f"sm_{t}" for t in self.targets()] + ptx)


_INSTANCE = """template cudaError_t flash_cutlass::{path}::run_{prefix}<{hdim}, flash_cutlass::DType::{dtype},
    flash_cutlass::MaskKind::{mask}, flash_cutlass::Extension::{extension}>(flash_cutlass::{params} const&,
    cudaStream_t);
"""
_TIMELINE_READER = "template cudaError_t flash_cutlass::sm90::read_fwd_timeline<{hdim}>(unsigned long long*);\n"


def instantiation_source(selection: BuildSelection, direction: str, path: str, hdim: int) -> str:
    prefix = FILE_PREFIX[direction]
    text = ("// Generated by csrc/catalogue.py for this build; do not edit.\n"
            f'#include "flash_cutlass/{path}/{prefix}_launch.h"\n\n')
    for dtype in selection.dtypes:
        for mask, extension in selection.instantiations():
            text += _INSTANCE.format(path=path, prefix=prefix, hdim=hdim, dtype=DTYPES[dtype][0], mask=mask,
                                     extension=extension, params=PARAMS[direction])
    if (direction, path) == ("forward", "sm90") and selection.timeline:
        text += _TIMELINE_READER.format(hdim=hdim)
    return text


def kvcache_instances(hdim: int, dtype: str) -> str:
    """The explicit instantiations of the KV-cache attention of one head dim and C++ DType."""
    args = f"{hdim}, flash_cutlass::DType::{dtype}"
    return (f"template cudaError_t flash_cutlass::sm80::run_kvcache<{args}>(flash_cutlass::KVCacheParams const&, "
            "flash_cutlass::KVCacheDevice const&, cudaStream_t);\n"
            f"template int flash_cutlass::sm80::kvcache_ctas_per_sm<{args}>(flash_cutlass::KVCacheDevice const&);\n")


def kvcache_append_instances(dtype: str) -> str:
    """The explicit instantiations of the KV-cache append and gather of one C++ DType."""
    return (f"template cudaError_t flash_cutlass::sm80::run_kvcache_append<flash_cutlass::DType::{dtype}>("
            "flash_cutlass::KVCacheParams const&, cudaStream_t);\n"
            f"template cudaError_t flash_cutlass::sm80::run_kvcache_gather<flash_cutlass::DType::{dtype}>("
            "flash_cutlass::KVCacheParams const&, flash_cutlass::KVCachePacked const&, cudaStream_t);\n")


_KVCACHE_HEADER = ('// Generated by csrc/catalogue.py for this build; do not edit.\n'
                   '#include "flash_cutlass/sm80/kvcache_launch.h"\n\n')


def kvcache_source(selection: BuildSelection, hdim) -> str:
    """The KV-cache attention of one head dim (every dtype), or with hdim None the append and the
    gather (every dtype)."""
    text = _KVCACHE_HEADER
    for dtype in selection.dtypes:
        text += kvcache_append_instances(DTYPES[dtype][0]) if hdim is None else kvcache_instances(hdim, DTYPES[dtype][0])
    if hdim is not None:
        text += f"template int flash_cutlass::sm80::kvcache_smem_bytes_of<{hdim}>(flash_cutlass::KVCacheDevice const&);\n"
    return text


def _list(name: str, values) -> str:
    return f"using {name} = List<{', '.join(str(v) for v in values)}>;\n"


def compiled_header(selection: BuildSelection) -> str:
    """flash_cutlass/compiled.h: what this build compiled, as constexpr values (see dispatch.h)."""
    instantiations = selection.instantiations()
    flags = {
        "kBackward": selection.backward,
        "kWindow": ("kLocal", "kNone") in instantiations,
        "kScoreMods": ("kLocal", "kScoreMods") in instantiations,
        "kDropout": ("kLocal", "kDropout") in instantiations,
        "kKVCache": bool(selection.kvcache_head_dims()),
        "kSoftcap": selection.softcap,
        "kAlibi": selection.alibi,
        "kTimeline": selection.timeline,
        "kSm80SmallTilesOnHopper": selection.hopper_has_small_tiles(),
        "kSm80EveryHeadDimOnHopper": selection.hopper_has_every_sm80_head_dim(),
        "kSm90MachineCode": selection.hopper_runs_machine_code(),
    }
    text = ("// Generated by csrc/catalogue.py for this build; do not edit.\n#pragma once\n\n"
            '#include "flash_cutlass/params.h"\n\nnamespace flash_cutlass::compiled {\n\n'
            "template <auto... kValues>\nstruct List {};\n\n")
    for direction in ("forward", "backward"):
        for path in ("sm80", "sm90"):
            name = f"{path.capitalize()}{direction.capitalize()}HeadDims"
            text += _list(name, selection.head_dims_of(direction, path))
    text += _list("KVCacheHeadDims", selection.kvcache_head_dims())
    text += _list("DTypes", (f"DType::{DTYPES[d][0]}" for d in selection.dtypes))
    text += "\n" + "".join(f"inline constexpr bool {name} = {str(value).lower()};\n" for name, value in flags.items())
    text += f'inline constexpr char kArchs[] = "{selection.arch_names()}";\n\n}}  // namespace flash_cutlass::compiled\n'
    return text


def _write_if_changed(path: Path, text: str) -> None:
    """Unchanged files keep their timestamps, so ninja does not recompile them."""
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _instantiation_files(selection: BuildSelection, out_dir: Path) -> dict:
    """Each file and its text."""
    files = {out_dir / "instantiations" / f"{FILE_PREFIX[direction]}_{path}_hdim{hdim}.cu":
             instantiation_source(selection, direction, path, hdim)
             for (direction, path) in HEAD_DIMS for hdim in selection.head_dims_of(direction, path)}
    for hdim in selection.kvcache_head_dims():
        files[out_dir / "instantiations" / f"kvcache_sm80_hdim{hdim}.cu"] = kvcache_source(selection, hdim)
    if selection.kvcache_head_dims():
        files[out_dir / "instantiations" / "kvcache_sm80_append.cu"] = kvcache_source(selection, None)
    return files


def sources(selection: BuildSelection, out_dir: Path) -> list:
    """The instantiation files generate() writes for this build."""
    return list(_instantiation_files(selection, out_dir))


def generate(selection: BuildSelection, out_dir: Path) -> None:
    """Writes the build's instantiation files and include/flash_cutlass/compiled.h under out_dir,
    and removes instantiation files of head dims the build no longer compiles."""
    files = _instantiation_files(selection, out_dir)
    for source, text in files.items():
        _write_if_changed(source, text)
    wanted = {s.name for s in files}
    for stale in (out_dir / "instantiations").glob("*.cu"):
        if stale.name not in wanted:
            stale.unlink()
    _write_if_changed(out_dir / "include" / "flash_cutlass" / "compiled.h", compiled_header(selection))

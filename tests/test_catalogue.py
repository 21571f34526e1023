"""csrc/catalogue.py: the one list of what can be compiled, and what it generates for a build."""

import re

import pytest

from helpers import catalogue


def test_every_path_compiles_a_subset_of_the_head_dims():
    for (direction, path), dims in catalogue.HEAD_DIMS.items():
        assert direction in ("forward", "backward") and path in ("sm80", "sm90")
        assert list(dims) == sorted(dims) and set(dims) <= set(catalogue.ALL_HEAD_DIMS)
        assert all(d % 8 == 0 for d in dims)


def test_the_default_build_generates_a_file_per_direction_path_and_head_dim(tmp_path):
    selection = catalogue.BuildSelection()
    catalogue.generate(selection, tmp_path)
    written = sorted(p.name for p in (tmp_path / "instantiations").glob("*.cu"))
    expected = sorted([f"{catalogue.FILE_PREFIX[direction]}_{path}_hdim{d}.cu"
                       for (direction, path), dims in catalogue.HEAD_DIMS.items() for d in dims]
                      + [f"kvcache_sm80_hdim{d}.cu" for d in catalogue.KVCACHE_HEAD_DIMS] + ["kvcache_sm80_append.cu"])
    assert written == expected
    assert sorted(p.name for p in catalogue.sources(selection, tmp_path)) == expected
    source = (tmp_path / "instantiations" / "fwd_sm90_hdim128.cu").read_text()
    # Every dtype and every instantiation (mask kind, extension).
    assert source.count("template cudaError_t") == len(catalogue.DTYPES) * len(catalogue.INSTANTIATIONS)
    assert "read_fwd_timeline" not in source


def test_a_pruned_build_generates_only_what_it_asked_for(tmp_path):
    selection = catalogue.BuildSelection(head_dims=(64, 96), dtypes=("bf16",), archs=(90,), backward=False,
                                         window=False, softcap=False, alibi=True, dropout=False, kvcache=False,
                                         timeline=True)
    catalogue.generate(selection, tmp_path)
    assert sorted(p.name for p in (tmp_path / "instantiations").glob("*.cu")) == [
        "fwd_sm80_hdim64.cu", "fwd_sm80_hdim96.cu", "fwd_sm90_hdim64.cu", "fwd_sm90_hdim96.cu"]
    source = (tmp_path / "instantiations" / "fwd_sm90_hdim64.cu").read_text()
    assert "kFloat16" not in source and "kBFloat16" in source
    assert re.findall(r"MaskKind::(\w+), flash_cutlass::Extension::(\w+)", source) == [
        ("kNone", "kNone"), ("kCausal", "kNone"), ("kLocal", "kScoreMods")]
    assert "read_fwd_timeline<64>" in source
    header = (tmp_path / "include" / "flash_cutlass" / "compiled.h").read_text()
    assert "using Sm80ForwardHeadDims = List<64, 96>;" in header
    assert "using Sm90ForwardHeadDims = List<64, 96>;" in header
    assert "using Sm80BackwardHeadDims = List<>;" in header
    assert "using DTypes = List<DType::kBFloat16>;" in header
    assert "using KVCacheHeadDims = List<>;" in header and "inline constexpr bool kKVCache = false;" in header
    for flag, value in (("kBackward", "false"), ("kWindow", "false"), ("kScoreMods", "true"), ("kSoftcap", "false"),
                        ("kAlibi", "true"), ("kDropout", "false"), ("kTimeline", "true")):
        assert f"inline constexpr bool {flag} = {value};" in header
    assert 'kArchs[] = "sm_90a,compute_90"' in header


@pytest.mark.parametrize("field,holds,constant", [
    # FLASH_CUTLASS_SM90_SMALL_TILES: the sm80 backward's smaller tiles, which a Hopper GPU picks only
    # under FLASH_CUTLASS_SMEM_PER_BLOCK.
    ("sm90_small_tiles", "hopper_has_small_tiles", "kSm80SmallTilesOnHopper"),
    # FLASH_CUTLASS_SM80_ON_HOPPER: the sm80 path at the Hopper path's head dims (only kernel="sm80").
    ("sm80_on_hopper", "hopper_has_every_sm80_head_dim", "kSm80EveryHeadDimOnHopper"),
])
def test_the_sm90a_code_keeps_sm80_kernels_that_hopper_does_not_pick_only_when_asked(tmp_path, field, holds, constant):
    # A Hopper GPU runs them only from code other than sm_90a's, or where the build keeps them.
    assert not getattr(catalogue.BuildSelection(archs=(80, 90)), holds)()
    assert getattr(catalogue.BuildSelection(archs=(80, 90), **{field: True}), holds)()
    assert getattr(catalogue.BuildSelection(archs=(80, 90), sm90=False), holds)()  # sm_90 code
    assert getattr(catalogue.BuildSelection(archs=(80, 86), sm90=False), holds)()  # PTX
    for keep, value in ((False, "false"), (True, "true")):
        catalogue.generate(catalogue.BuildSelection(archs=(90,), **{field: keep}), tmp_path)
        header = (tmp_path / "include" / "flash_cutlass" / "compiled.h").read_text()
        assert f"inline constexpr bool {constant} = {value};" in header


def test_the_hopper_paths_head_dims_are_the_sm80_paths():
    # compiled_head_dims.h's sm80_kernel_on_hopper asks whether the Hopper path has the sm80 path's
    # kernel head dim, which equals select.h's test (the two paths' head dims for the call's) only
    # while the Hopper path's head dims are among the sm80 path's.
    for direction in ("forward", "backward"):
        assert set(catalogue.HEAD_DIMS[(direction, "sm90")]) <= set(catalogue.HEAD_DIMS[(direction, "sm80")])


def test_the_ptx_is_reported_only_where_the_build_embeds_it():
    # The PTX of the oldest target, for GPUs newer than the targets (FLASH_CUTLASS_PTX in setup.py).
    assert catalogue.BuildSelection(archs=(80, 90)).arch_names() == "sm_80,sm_90a,compute_80"
    assert catalogue.BuildSelection(archs=(80, 90), ptx=False).arch_names() == "sm_80,sm_90a"
    assert catalogue.BuildSelection(archs=(86,), sm90=False, ptx=False).ptx_arch() is None
    assert catalogue.BuildSelection(archs=(80, 86), sm90=False).ptx_arch() == 80
    assert catalogue.BuildSelection(archs=(90,)).arch_names() == "sm_90a,compute_90"


def test_programmatic_launches_are_left_to_hopper_gpus_that_run_sm90_machine_code(tmp_path):
    # The KV-cache launches wait on the GPU with griddepcontrol, which PTX older than compute_90 lacks.
    for archs, sm90, value in (((80, 90), True, "true"), ((80, 90), False, "true"), ((80, 86), False, "false")):
        catalogue.generate(catalogue.BuildSelection(archs=archs, sm90=sm90), tmp_path)
        header = (tmp_path / "include" / "flash_cutlass" / "compiled.h").read_text()
        assert f"inline constexpr bool kSm90MachineCode = {value};" in header


def test_regenerating_removes_files_the_build_no_longer_compiles_and_keeps_the_others(tmp_path):
    catalogue.generate(catalogue.BuildSelection(head_dims=(64, 128), archs=(80,), sm90=False, kvcache=False), tmp_path)
    kept = tmp_path / "instantiations" / "fwd_sm80_hdim64.cu"
    stamp = kept.stat().st_mtime_ns
    catalogue.generate(catalogue.BuildSelection(head_dims=(64,), archs=(80,), sm90=False, kvcache=False), tmp_path)
    assert sorted(p.name for p in (tmp_path / "instantiations").glob("*.cu")) == [
        "bwd_sm80_hdim64.cu", "fwd_sm80_hdim64.cu"]
    assert kept.stat().st_mtime_ns == stamp  # unchanged content: ninja does not recompile it


def test_the_kvcache_kernels_are_one_file_per_head_dim_and_one_append(tmp_path):
    selection = catalogue.BuildSelection(head_dims=(64, 128), dtypes=("bf16",), archs=(80,), sm90=False,
                                         backward=False)
    catalogue.generate(selection, tmp_path)
    names = sorted(p.name for p in (tmp_path / "instantiations").glob("kvcache_*.cu"))
    assert names == ["kvcache_sm80_append.cu", "kvcache_sm80_hdim128.cu", "kvcache_sm80_hdim64.cu"]
    source = (tmp_path / "instantiations" / "kvcache_sm80_hdim64.cu").read_text()
    assert source.count("run_kvcache<64, flash_cutlass::DType::kBFloat16>") == 1 and "kFloat16>" not in source
    append = (tmp_path / "instantiations" / "kvcache_sm80_append.cu").read_text()
    assert append.count("run_kvcache_append<") == 1
    header = (tmp_path / "include" / "flash_cutlass" / "compiled.h").read_text()
    assert "using KVCacheHeadDims = List<64, 128>;" in header and "inline constexpr bool kKVCache = true;" in header

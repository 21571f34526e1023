"""The CUDA forward kernel against the fp32 oracle, with FlashAttention-2's pass rule.

Skipped (with the reason) where no CUDA GPU is visible.
"""

import math

import pytest
import torch

import flash_cutlass
from flash_cutlass.backend import _extension
from flash_cutlass.options import AttentionOptions
from flash_cutlass.reference import naive_attention
from helpers import (COMPILED_DTYPES, COMPILED_HEAD_DIMS, COMPILED_SM90_HEAD_DIMS, SMEM_99_KIB, SMEM_PER_BLOCK_ENV,
                     backward_left_out, fa2_check, off_16_bytes, options_left_out, requires_cuda)

pytestmark = requires_cuda

# Every compiled kernel: the sm80 path at each head dim, the Hopper path at each of its own.
KERNEL_HEAD_DIMS = [("sm80", d) for d in COMPILED_HEAD_DIMS] + [("sm90", d) for d in COMPILED_SM90_HEAD_DIMS]
KERNELS = ("sm80", "sm90")


def forward_into(q, k, v, out, lse, scale, causal, kernel):
    """The extension's forward into poisoned out and lse, with nothing allocated around it."""
    _extension().forward(q, k, v, out, lse, None, AttentionOptions(softmax_scale=scale, causal=causal, kernel=kernel))


def sm90_unavailable() -> str:
    """Why the Hopper path cannot run here, or '' when it can."""
    if not COMPILED_SM90_HEAD_DIMS:
        return "the Hopper path was not built (FLASH_CUTLASS_SM90, arch 90)"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"the Hopper path needs compute capability 9.0, this GPU has {torch.cuda.get_device_capability()}"
    return ""


def skip_unless_runs(kernel: str) -> None:
    if kernel == "sm90" and sm90_unavailable():
        pytest.skip(sm90_unavailable())

DTYPES = (torch.float16, torch.bfloat16)
HEADS = 8
# (seqlen_q, seqlen_k): equal, odd, block-aligned and not, and seqlen_q != seqlen_k both ways.
SEQLENS = [(1, 1), (17, 17), (113, 255), (255, 113), (256, 256), (1023, 1023), (2049, 2049),
           (1, 2049), (2049, 17), (256, 1023)]
GQA_HEADS_K = {"mha": HEADS, "gqa4": HEADS // 4, "mqa": 1}


def make_qkv(cuda_gen, batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype):
    def rand(*shape):
        return torch.randn(*shape, generator=cuda_gen, device="cuda").to(dtype)

    return (rand(batch, seqlen_q, heads, head_dim), rand(batch, seqlen_k, heads_k, head_dim),
            rand(batch, seqlen_k, heads_k, head_dim))


def check_against_oracle(q, k, v, out, lse, scale, causal, name, **options):
    oracle_out, oracle_lse = naive_attention(q, k, v, scale, causal, compute_dtype=torch.float32, **options)
    same_out, same_lse = naive_attention(q, k, v, scale, causal, **options)
    fa2_check(out, oracle_out, same_out, f"{name} out")
    fa2_check(lse, oracle_lse, same_lse, f"{name} lse")


@pytest.mark.parametrize("gqa", list(GQA_HEADS_K))
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel,head_dim", KERNEL_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_forward_matches_oracle(cuda_gen, dtype, kernel, head_dim, causal, seqlen_q, seqlen_k, gqa):
    if dtype not in COMPILED_DTYPES:
        pytest.skip(f"{dtype} was not compiled into this build (FLASH_CUTLASS_DTYPES)")
    skip_unless_runs(kernel)
    batch = 2 if seqlen_q * seqlen_k < 1 << 20 else 1
    q, k, v = make_qkv(cuda_gen, batch, seqlen_q, seqlen_k, HEADS, GQA_HEADS_K[gqa], head_dim, dtype)
    scale = 1.0 / math.sqrt(head_dim)
    # Poisoned outputs: every element the kernel should write starts as NaN.
    out = torch.full_like(q, math.nan)
    lse = torch.full((batch, HEADS, seqlen_q), math.nan, device="cuda")
    forward_into(q, k, v, out, lse, scale, causal, kernel)
    check_against_oracle(q, k, v, out, lse, scale, causal, kernel)

    out_again = torch.full_like(q, math.nan)
    lse_again = torch.full_like(lse, math.nan)
    forward_into(q, k, v, out_again, lse_again, scale, causal, kernel)
    assert torch.equal(out, out_again) and torch.equal(lse, lse_again), "two runs differ bitwise"


# (causal, window_size, softcap, seqlen_q, seqlen_k): each mask kind and the score-options kernel.
# With seqlen_q > seqlen_k and a causal mask the first seqlen_q - seqlen_k query rows see no key, so
# the first query block of every (head, batch) is a tile without work. 1100 rows make 9 query blocks
# of 128 (an odd count, whose middle block is a causal pair of its own in the persistent grid), 2400 rows
# 13 of 192: a causal call long enough for head dim 64's wide tiles (fwd_launch.h), whose warpgroups
# skip the key blocks past their rows' diagonal, with the diagonal shifted either way.
MANY_TILES_CASES = [
    (False, (-1, -1), 0.0, 1100, 900),
    (True, (-1, -1), 0.0, 1100, 900),
    (True, (-1, -1), 0.0, 900, 1100),
    (True, (-1, -1), 0.0, 2400, 2100),
    (True, (-1, -1), 0.0, 2200, 2500),
    (False, (200, 30), 0.0, 1100, 900),
    (True, (-1, -1), 20.0, 1100, 900),
]


@pytest.mark.parametrize("causal,window_size,softcap,seqlen_q,seqlen_k", MANY_TILES_CASES)
@pytest.mark.parametrize("head_dim", COMPILED_SM90_HEAD_DIMS)
def test_more_tiles_than_sms(cuda_gen, head_dim, causal, window_size, softcap, seqlen_q, seqlen_k):
    """The Hopper path's persistent grid (one CTA per SM taking tiles in turn, causal ones in pairs,
    at the head dims that use it): every CTA takes several tiles, ragged in both sequence lengths, under GQA; each
    batch entry's bits equal its call alone (fewer tiles, other CTAs) and the results pass the
    oracle."""
    skip_unless_runs("sm90")
    left_out = options_left_out(window_size, softcap)
    if left_out:
        pytest.skip(left_out)
    dtype = COMPILED_DTYPES[-1]
    batch, heads, heads_k = 4, 16, 4
    q, k, v = make_qkv(cuda_gen, batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype)
    tiles = batch * heads * math.ceil(seqlen_q / 192)  # at most: the widest query tiles have 192 rows
    assert tiles > 2 * torch.cuda.get_device_properties(0).multi_processor_count
    scale = 1.0 / math.sqrt(head_dim)
    options = dict(window_size=window_size, softcap=softcap)
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=causal, kernel="sm90", **options)
    check_against_oracle(q, k, v, out, lse, scale, causal, "sm90", **options)
    for b in range(batch):
        alone_out, alone_lse = flash_cutlass.flash_forward(q[b:b + 1], k[b:b + 1], v[b:b + 1], causal=causal,
                                                           kernel="sm90", **options)
        assert torch.equal(out[b:b + 1], alone_out) and torch.equal(lse[b:b + 1], alone_lse), f"batch entry {b}"


# (batch, heads, heads_k, seqlen_q, seqlen_k): the persistent grid turns a work item (a tile, or a
# causal pair) into its (batch, head) with divisors the host computes (cutlass::FastDivmod): one
# item per head and one head (both divisors 1), odd divisors, seqlen_q < seqlen_k; each case has
# more items than an H200 has SMs. Causal pairs that end in a partial wave leave their last full
# wave and the partial one to single tiles (the causal tail): on 132 SMs the tail starts at a
# (head, batch)'s first pair in the first three cases, with all 36 pairs of the second, and in the
# middle of a (head, batch) in the last one (128-row tiles: 9 query blocks, the tail from pair 2).
PERSISTENT_NUMBERING_CASES = [
    (300, 1, 1, 64, 64),
    (12, 3, 1, 1000, 1000),
    (20, 7, 7, 333, 517),
    (12, 5, 5, 1100, 1300),
]


@pytest.mark.parametrize("batch,heads,heads_k,seqlen_q,seqlen_k", PERSISTENT_NUMBERING_CASES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", COMPILED_SM90_HEAD_DIMS)
def test_persistent_work_numbering(cuda_gen, head_dim, causal, batch, heads, heads_k, seqlen_q, seqlen_k):
    """Every tile of the Hopper path's persistent grid is computed once, whatever the divisors of
    its numbering: outputs start as NaN and must all be written, and pass the oracle."""
    skip_unless_runs("sm90")
    dtype = COMPILED_DTYPES[-1]
    q, k, v = make_qkv(cuda_gen, batch, seqlen_q, seqlen_k, heads, heads_k, head_dim, dtype)
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.full_like(q, math.nan)
    lse = torch.full((batch, heads, seqlen_q), math.nan, device="cuda")
    forward_into(q, k, v, out, lse, scale, causal, "sm90")
    check_against_oracle(q, k, v, out, lse, scale, causal, "sm90")


@pytest.mark.parametrize("kernel", KERNELS)
def test_causal_tiles_longest_first_across_bands(cuda_gen, kernel):
    """Causal grids of one CTA per tile (the sm80 path; the Hopper path at head dim 256) number
    their tiles longest first across bands of (head, batch) pairs whose K and V fit 16 MiB: with
    4096 keys, 21 pairs make one band at head dim 32 and up to six, the last partial, at 256. Every
    tile is computed once, whichever band it falls in. (The Hopper path's persistent head dims run
    the same shapes through their pairs.)"""
    skip_unless_runs(kernel)
    dtype = COMPILED_DTYPES[-1]
    batch, heads, seqlen_q, seqlen_k = 3, 7, 3000, 4096
    for head_dim in COMPILED_SM90_HEAD_DIMS if kernel == "sm90" else COMPILED_HEAD_DIMS:
        q, k, v = make_qkv(cuda_gen, batch, seqlen_q, seqlen_k, heads, heads, head_dim, dtype)
        scale = 1.0 / math.sqrt(head_dim)
        out, lse = flash_cutlass.flash_forward(q, k, v, causal=True, kernel=kernel)
        check_against_oracle(q, k, v, out, lse, scale, True, f"{kernel} head dim {head_dim}")


@pytest.mark.parametrize("diagonal", [-65, -64, -63, -1, 0, 1, 63, 64, 65])
def test_causal_first_key_block_halved(cuda_gen, diagonal):
    """The Hopper path's causal consumer warpgroups score only the first half of the first key block
    they visit where their rows see none of its second half: with seqlen_k - seqlen_q = `diagonal`
    around the half block's edge (64 keys), in 128-row tiles (1000 query rows) and, at head dim 64,
    192-row ones (2500), at every compiled head dim."""
    skip_unless_runs("sm90")
    dtype = COMPILED_DTYPES[-1]
    batch, heads = 2, 4
    for seqlen_q in (1000, 2500):
        seqlen_k = seqlen_q + diagonal
        for head_dim in COMPILED_SM90_HEAD_DIMS:
            q, k, v = make_qkv(cuda_gen, batch, seqlen_q, seqlen_k, heads, heads, head_dim, dtype)
            scale = 1.0 / math.sqrt(head_dim)
            out, lse = flash_cutlass.flash_forward(q, k, v, causal=True, kernel="sm90")
            check_against_oracle(q, k, v, out, lse, scale, True, f"head dim {head_dim}, {seqlen_q} x {seqlen_k}")


@pytest.mark.parametrize("growth_log2", [0.5, 7.5, 8.5, 40.0, 200.0])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", KERNELS)
def test_row_maximum_growing_tile_by_tile(cuda_gen, kernel, causal, growth_log2):
    """Scores that rise toward the first keys, which the kernels visit last: every key tile raises
    each row's maximum by about growth_log2 (in log2 units of the scaled score per 128 keys), below
    and above the threshold up to which the Hopper path keeps a stale maximum (P up to 2^8), at
    every compiled head dim. At head dims 64, 96 and 128 the unmasked tiles are exponentiated
    against the kept maximum before their own is known and scored again where a P exceeds the
    bound: at growth 200 those first P overflow to +inf."""
    skip_unless_runs(kernel)
    dtype = COMPILED_DTYPES[-1]
    batch, seqlen, heads = 2, 1000, 4
    for head_dim in COMPILED_SM90_HEAD_DIMS if kernel == "sm90" else COMPILED_HEAD_DIMS:
        q, k, v = make_qkv(cuda_gen, batch, seqlen, seqlen, heads, heads, head_dim, dtype)
        scale = 1.0 / math.sqrt(head_dim)
        # score(i, j) = scale * q_i . k_j ~ slope * (seqlen - j) + noise, with q_i[0] = 1.
        slope = growth_log2 / (128 * math.log2(math.e)) / scale
        q[..., 0] = 1.0
        k[..., 0] = (slope * (seqlen - torch.arange(seqlen, device="cuda"))).to(dtype)[None, :, None]
        out, lse = flash_cutlass.flash_forward(q, k, v, causal=causal, kernel=kernel)
        check_against_oracle(q, k, v, out, lse, scale, causal, f"{kernel} head dim {head_dim} growth {growth_log2}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_nan_in_a_key_reaches_its_rows(cuda_gen, kernel):
    """Batch entry j has a NaN in key j of the first head: every output row and lse of that head is
    NaN (no maximum, sum or skipped rescale hides it), none of the second head's. Keys 0..127 take
    every column position of a key tile."""
    skip_unless_runs(kernel)
    dtype = COMPILED_DTYPES[-1]
    batch, seqlen_q, seqlen_k, heads = 128, 64, 300, 2
    for head_dim in COMPILED_SM90_HEAD_DIMS if kernel == "sm90" else COMPILED_HEAD_DIMS:
        q, k, v = make_qkv(cuda_gen, batch, seqlen_q, seqlen_k, heads, heads, head_dim, dtype)
        keys = torch.arange(batch, device="cuda")
        k[keys, keys, 0] = math.nan
        for causal in (False, True):
            out, lse = flash_cutlass.flash_forward(q, k, v, causal=causal, kernel=kernel)
            name = f"{kernel} head dim {head_dim} causal {causal}"
            assert out[:, :, 0].isnan().all() and lse[:, 0].isnan().all(), name
            assert not out[:, :, 1].isnan().any() and not lse[:, 1].isnan().any(), name


@pytest.mark.parametrize("head_dim", [8, 40, 72, 80, 136, 200, 3, 50, 100, 255])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", KERNELS)
def test_head_dims_between_compiled_sizes(cuda_gen, kernel, head_dim, causal):
    skip_unless_runs(kernel)
    compiled = COMPILED_SM90_HEAD_DIMS if kernel == "sm90" else COMPILED_HEAD_DIMS
    if head_dim > max(compiled):
        pytest.skip(f"head_dim {head_dim} exceeds the {kernel} path's compiled head dims {compiled}")
    q, k, v = make_qkv(cuda_gen, 2, 129, 77, 4, 2, head_dim, COMPILED_DTYPES[-1])
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=causal, kernel=kernel)
    assert out.shape == q.shape and out.is_contiguous()
    check_against_oracle(q, k, v, out, lse, 1.0 / math.sqrt(head_dim), causal, f"head_dim {head_dim}")


def test_public_api_defaults_and_custom_scale(cuda_gen):
    head_dim = COMPILED_HEAD_DIMS[-1]
    q, k, v = make_qkv(cuda_gen, 2, 300, 300, 4, 4, head_dim, COMPILED_DTYPES[0])
    out, lse = flash_cutlass.flash_forward(q, k, v)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (2, 4, 300)
    check_against_oracle(q, k, v, out, lse, head_dim ** -0.5, False, "default scale")
    out, lse = flash_cutlass.flash_forward(q, k, v, softmax_scale=0.3, causal=True)
    check_against_oracle(q, k, v, out, lse, 0.3, True, "scale 0.3")


def first_head_dim(kernel: str) -> int:
    return (COMPILED_SM90_HEAD_DIMS if kernel == "sm90" else COMPILED_HEAD_DIMS)[0]


@pytest.mark.parametrize("kernel", KERNELS)
def test_strided_slices_of_packed_qkv(gen, kernel):
    skip_unless_runs(kernel)
    head_dim = first_head_dim(kernel)
    qkv = torch.randn(2, 333, 3, 6, head_dim, generator=gen).to("cuda", COMPILED_DTYPES[-1])
    q, k, v = qkv.unbind(dim=2)
    assert not q.is_contiguous()
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=True, kernel=kernel)
    check_against_oracle(q, k, v, out, lse, head_dim ** -0.5, True, "packed qkv")


@pytest.mark.parametrize("kernel", KERNELS)
def test_misaligned_views_are_copied(gen, kernel):
    skip_unless_runs(kernel)
    head_dim = first_head_dim(kernel)
    base = torch.randn(2, 100, 4, head_dim + 1, generator=gen).to("cuda", COMPILED_DTYPES[0])
    q = base[..., 1:]  # rows start 2 bytes past a 16-byte boundary
    out, lse = flash_cutlass.flash_forward(q, q, q, kernel=kernel)
    check_against_oracle(q, q, q, out, lse, head_dim ** -0.5, False, "misaligned")


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_inputs_off_a_16_byte_boundary_give_the_aligned_results(cuda_gen, kernel, which):
    # Contiguous, but with data 2 bytes past a 16-byte boundary (a view at an odd storage offset):
    # the extension, which loads 16 bytes at a time, would refuse it; the call copies it instead.
    skip_unless_runs(kernel)
    head_dim = first_head_dim(kernel)
    tensors = dict(zip("qkv", make_qkv(cuda_gen, 2, 300, 257, 4, 2, head_dim, COMPILED_DTYPES[-1])))
    expected_out, expected_lse = flash_cutlass.flash_forward(**tensors, causal=True, kernel=kernel)
    tensors[which] = off_16_bytes(tensors[which])
    out, lse = flash_cutlass.flash_forward(**tensors, causal=True, kernel=kernel)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 160, 192])
def test_auto_picks_the_hopper_path_where_it_runs_unpadded(cuda_gen, head_dim):
    sm80_kernel = min((d for d in COMPILED_HEAD_DIMS if d >= head_dim), default=None)
    if sm80_kernel is None:
        pytest.skip(f"no compiled head dim runs head_dim {head_dim}")
    sm90_kernel = min((d for d in COMPILED_SM90_HEAD_DIMS if d >= head_dim), default=None)
    q, k, v = make_qkv(cuda_gen, 2, 300, 300, 4, 4, head_dim, COMPILED_DTYPES[-1])
    expected = "sm90" if not sm90_unavailable() and sm90_kernel == sm80_kernel else "sm80"
    auto_out, auto_lse = flash_cutlass.flash_forward(q, k, v, causal=True)
    forced_out, forced_lse = flash_cutlass.flash_forward(q, k, v, causal=True, kernel=expected)
    # Each kernel is deterministic, and the two paths sum in different orders: bitwise equality
    # says which one ran.
    assert torch.equal(auto_out, forced_out) and torch.equal(auto_lse, forced_lse), f"auto did not run {expected}"


def test_environment_variable_forces_the_kernel(cuda_gen, monkeypatch):
    head_dim = COMPILED_HEAD_DIMS[-1]
    q, k, v = make_qkv(cuda_gen, 1, 200, 200, 2, 2, head_dim, COMPILED_DTYPES[-1])
    sm80_out, _ = flash_cutlass.flash_forward(q, k, v, kernel="sm80")
    monkeypatch.setenv("FLASH_CUTLASS_FORWARD_KERNEL", "sm80")
    env_out, _ = flash_cutlass.flash_forward(q, k, v)
    assert torch.equal(env_out, sm80_out)


def test_forced_hopper_path_where_it_cannot_run_raises(cuda_gen):
    reason = sm90_unavailable()
    if not reason:
        pytest.skip("the Hopper path runs on this GPU; nothing to refuse")
    q, k, v = make_qkv(cuda_gen, 1, 16, 16, 2, 2, COMPILED_HEAD_DIMS[0], COMPILED_DTYPES[-1])
    with pytest.raises(RuntimeError, match="kernel='sm90' cannot run this call"):
        flash_cutlass.flash_forward(q, k, v, kernel="sm90")


def test_extension_checks_with_numbers_in_their_messages_raise(cuda_gen):
    """The extension's own checks (behind the Python ones) raise with the numbers in their
    messages: on the H200 machine, messages that torch's TORCH_CHECK streamed numbers into crashed
    the interpreter (csrc/flash_api.cpp: FLASH_CHECK builds them as strings first)."""
    extension = _extension()
    lse = torch.zeros(1, 1, 4, device="cuda")
    narrow = torch.zeros(1, 4, 1, 12, device="cuda", dtype=COMPILED_DTYPES[-1])
    with pytest.raises(RuntimeError, match=r"q stride 1 \(12\) must be a multiple of 8 elements"):
        extension.forward(narrow, narrow, narrow, narrow.clone(), lse, None, AttentionOptions())
    q = torch.zeros(1, 4, 1, 8, device="cuda", dtype=COMPILED_DTYPES[-1])
    with pytest.raises(RuntimeError, match=r"window_size entries must be >= -1, got \(-2, -1\)"):
        extension.forward(q, q, q, q.clone(), lse, None, AttentionOptions(window_left=-2))
    with pytest.raises(RuntimeError, match=r"softcap must be finite and >= 0, got -1.5"):
        extension.forward(q, q, q, q.clone(), lse, None, AttentionOptions(softcap=-1.5))


@pytest.mark.skipif(not backward_left_out(), reason="this build has the backward kernels")
def test_forward_only_build_runs_the_forward_and_refuses_the_backward(cuda_gen):
    """FLASH_CUTLASS_BACKWARD=0: the forward and its autograd op run; the backward raises before
    any launch, naming the flag, whichever entry point asks for it."""
    q, k, v = make_qkv(cuda_gen, 1, 64, 64, 2, 2, COMPILED_HEAD_DIMS[0], COMPILED_DTYPES[-1])
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=True)
    check_against_oracle(q, k, v, out, lse, q.shape[-1] ** -0.5, True, "forward-only build")
    with pytest.raises(RuntimeError, match="FLASH_CUTLASS_BACKWARD=0"):
        flash_cutlass.flash_backward(out, q, k, v, out, lse, causal=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attended = flash_cutlass.flash_attention(*leaves, causal=True)
    assert torch.equal(attended, out)
    with pytest.raises(RuntimeError, match="FLASH_CUTLASS_BACKWARD=0"):
        attended.sum().backward()


def test_empty_inputs_return_empty_results():
    head_dim = COMPILED_HEAD_DIMS[0]
    dtype = COMPILED_DTYPES[-1]
    for batch, seqlen_q in ((0, 16), (2, 0)):
        q = torch.randn(batch, seqlen_q, 4, head_dim, device="cuda", dtype=dtype)
        k = torch.randn(batch, 16, 4, head_dim, device="cuda", dtype=dtype)
        out, lse = flash_cutlass.flash_forward(q, k, k)
        assert out.shape == q.shape and lse.shape == (batch, 4, seqlen_q)


def test_no_keys_gives_zero_output_and_minus_inf_lse(gen):
    head_dim = COMPILED_HEAD_DIMS[0]
    q = torch.randn(2, 5, 4, head_dim, generator=gen).to("cuda", COMPILED_DTYPES[-1])
    k = torch.empty(2, 0, 4, head_dim, device="cuda", dtype=COMPILED_DTYPES[-1])
    out, lse = flash_cutlass.flash_forward(q, k, k)
    assert torch.equal(out, torch.zeros_like(q))
    assert torch.equal(lse, torch.full_like(lse, -math.inf))


@pytest.mark.parametrize("kernel", KERNELS)
def test_offsets_past_two_to_the_31_elements(gen, kernel):
    # q and out hold more than 2^31 elements: row offsets must be 64-bit.
    skip_unless_runs(kernel)
    heads, head_dim = 16, 128
    if head_dim not in COMPILED_HEAD_DIMS:
        pytest.skip("needs head dim 128 compiled")
    seqlen_q = (1 << 31) // (heads * head_dim) + 300
    q = torch.empty(1, seqlen_q, heads, head_dim, device="cuda", dtype=COMPILED_DTYPES[-1])
    q[:, -300:] = torch.randn(1, 300, heads, head_dim, generator=gen).to("cuda", COMPILED_DTYPES[-1])
    q[:, :-300] = 1.0
    k, v = (torch.randn(1, 64, heads, head_dim, generator=gen).to("cuda", COMPILED_DTYPES[-1]) for _ in range(2))
    out, lse = flash_cutlass.flash_forward(q, k, v, kernel=kernel)
    tail = slice(seqlen_q - 300, seqlen_q)
    check_against_oracle(q[:, tail], k, v, out[:, tail], lse[:, :, tail], head_dim ** -0.5, False, "2^31 offsets")


# Head dims whose sm80 forward has tiles for smaller shared memories (sm80/kernel_traits.h,
# FwdTraitsOfTier): sm_86, sm_89 and sm_120 (99 KiB a block) run them.
SM80_COMPACT_HEAD_DIMS = (192, 256)


@pytest.mark.parametrize("gqa", ["mha", "gqa4"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (17, 17), (113, 255), (255, 113), (1023, 1023), (1, 2049)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [d for d in COMPILED_HEAD_DIMS if d in SM80_COMPACT_HEAD_DIMS])
def test_compact_sm80_tiles_match_oracle(cuda_gen, monkeypatch, head_dim, causal, seqlen_q, seqlen_k, gqa):
    """The sm80 forward on the 64-row tiles a GPU of 99 KiB a block picks (forced here by the
    extension's cap on a block's shared memory) against the fp32 oracle."""
    dtype = COMPILED_DTYPES[-1]
    q, k, v = make_qkv(cuda_gen, 2, seqlen_q, seqlen_k, HEADS, GQA_HEADS_K[gqa], head_dim, dtype)
    monkeypatch.setenv(SMEM_PER_BLOCK_ENV, str(SMEM_99_KIB))
    out, lse = flash_cutlass.flash_forward(q, k, v, causal=causal, kernel="sm80")
    check_against_oracle(q, k, v, out, lse, head_dim ** -0.5, causal, "sm80 compact forward")


def test_smaller_limit_leaves_head_dims_without_compact_forward_tiles_alone(cuda_gen, monkeypatch):
    without = [d for d in COMPILED_HEAD_DIMS if d not in SM80_COMPACT_HEAD_DIMS]
    if not without:
        pytest.skip("every compiled head dim has compact sm80 forward tiles")
    q = torch.randn(1, 100, 2, without[0], generator=cuda_gen, device="cuda").to(COMPILED_DTYPES[-1])
    usual = flash_cutlass.flash_forward(q, q, q, kernel="sm80")
    monkeypatch.setenv(SMEM_PER_BLOCK_ENV, str(SMEM_99_KIB))
    switched = flash_cutlass.flash_forward(q, q, q, kernel="sm80")
    for a, b in zip(usual, switched):
        assert torch.equal(a, b)

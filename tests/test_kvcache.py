"""flash_cutlass.flash_attention_with_kvcache on the CPU: it is the reference there (bitwise), its
argument checks are the reference's (one implementation, check_kvcache_arguments, which reads no
tensor data: meta tensors go through it), and its own arguments (num_splits, return_lse) are checked;
the GPU tests' log-sum-exp tolerance sees a mask one key off."""

import pytest
import torch

import flash_cutlass
from flash_cutlass import reference
from kvcache_cases import check_lse, cloned, make_call, rotary_tables


@pytest.mark.parametrize("page_size", [None, 1, 4, 16])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"window_size": (3, 1)}, {"softcap": 5.0}, "rotary"],
                         ids=["plain", "causal", "window", "softcap", "rotary"])
def test_cpu_call_is_the_reference(gen, page_size, options):
    call = make_call(gen, seqlen_q=3, seqlen_new=2, page_size=page_size, capacity=32, dtype=torch.float32)
    if options == "rotary":
        cos, sin = rotary_tables(gen, 32, 16, torch.float32, "cpu")
        options = {"rotary_cos": cos, "rotary_sin": sin, "causal": True, "rotary_interleaved": False}
    mine, theirs = cloned(call), cloned(call)
    out, lse = flash_cutlass.flash_attention_with_kvcache(**mine, **options, return_lse=True)
    expected_out, expected_lse = reference.attention_with_kvcache(**theirs, **options)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    assert torch.equal(mine["k_cache"], theirs["k_cache"]) and torch.equal(mine["v_cache"], theirs["v_cache"])
    only_out = flash_cutlass.flash_attention_with_kvcache(**cloned(call), **options, num_splits=3)
    assert torch.equal(only_out, expected_out)


def test_return_lse_false_returns_the_output_alone(gen):
    out = flash_cutlass.flash_attention_with_kvcache(**make_call(gen, dtype=torch.float32))
    assert isinstance(out, torch.Tensor) and out.shape == (2, 1, 8, 64)


@pytest.mark.parametrize("arguments,error,message", [
    ({"num_splits": -1}, ValueError, r"num_splits must be in \[0, 128\]"),
    ({"num_splits": 129}, ValueError, r"num_splits must be in \[0, 128\]"),
    ({"num_splits": 2.0}, TypeError, "num_splits must be an int"),
    ({"num_splits": True}, TypeError, "num_splits must be an int"),
    ({"return_lse": 1}, TypeError, "return_lse must be a bool"),
    ({"cache_seqlens": torch.tensor([1, 2])}, TypeError, "cache_seqlens must be int32"),
    ({"block_table": torch.zeros(1, 4, dtype=torch.int32)}, ValueError, "block_table must have batch = 2 rows"),
    ({"cache_seqlens": 64}, ValueError, r"cache_seqlens\[0\] = 64 plus 1 new tokens is past the cache"),
    ({"k": None, "v": None, "rotary_cos": torch.zeros(4, 4), "rotary_sin": torch.zeros(4, 4)}, ValueError,
     "rotary_cos and rotary_sin need k and v"),
], ids=["splits_negative", "splits_large", "splits_float", "splits_bool", "return_lse", "seqlens_dtype",
        "block_table_rows", "seqlens_past", "rotary_without_k"])
def test_bad_arguments_raise_before_the_cache_is_written(gen, arguments, error, message):
    call = make_call(gen, dtype=torch.float32)
    before = call["k_cache"].clone(), call["v_cache"].clone()
    if "block_table" in arguments:
        call = make_call(gen, dtype=torch.float32, page_size=16)
        before = call["k_cache"].clone(), call["v_cache"].clone()
    with pytest.raises(error, match=message):
        flash_cutlass.flash_attention_with_kvcache(**{**call, **arguments})
    assert torch.equal(call["k_cache"], before[0]) and torch.equal(call["v_cache"], before[1])


def test_shared_checks_read_no_tensor_data():
    """Meta tensors have no data: check_kvcache_arguments, the CUDA path's checks, accepts them."""
    meta = torch.device("meta")
    q = torch.empty(3, 2, 8, 64, device=meta, dtype=torch.bfloat16)
    cache = torch.empty(10, 16, 2, 64, device=meta, dtype=torch.bfloat16)
    new = torch.empty(3, 2, 2, 64, device=meta, dtype=torch.bfloat16)
    table = torch.empty(3, 4, device=meta, dtype=torch.int32)
    seqlens = torch.empty(3, device=meta, dtype=torch.int32)
    cos = torch.empty(64, 16, device=meta, dtype=torch.bfloat16)
    arguments = reference.check_kvcache_arguments(q, cache, cache, new, new, seqlens, block_table=table, causal=True,
                                                  rotary_cos=cos, rotary_sin=cos, alibi_slopes=None)
    assert arguments.paged and arguments.page_size == 16 and arguments.capacity == 64
    assert arguments.seqlen_new == 2 and arguments.rotary and arguments.rotary_q_per_row
    assert arguments.softmax_scale == pytest.approx(64 ** -0.5)


def test_shared_checks_bound_what_the_shapes_bound():
    """The checks a CUDA call gets without reading lengths: new tokens past the capacity, an int
    length past it, a negative int length."""
    q = torch.empty(2, 1, 4, 16, device="meta", dtype=torch.float16)
    cache = torch.empty(2, 8, 2, 16, device="meta", dtype=torch.float16)
    new = torch.empty(2, 9, 2, 16, device="meta", dtype=torch.float16)
    seqlens = torch.empty(2, device="meta", dtype=torch.int32)
    with pytest.raises(ValueError, match="k has 9 new tokens but the cache holds 8 positions a sequence"):
        reference.check_kvcache_arguments(q, cache, cache, new, new, seqlens)
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\] = 8 plus 9 new tokens is past the cache"):
        reference.check_kvcache_arguments(q, cache, cache, new, new, 8)
    with pytest.raises(ValueError, match="cache_seqlens must be >= 0"):
        reference.check_kvcache_arguments(q, cache, cache, None, None, -1)


def test_shared_checks_bound_rotary_positions_of_an_int_length():
    """An int cache_seqlens is known without data: rotary positions past seqlen_ro raise on the CUDA
    path too (its kernels would clamp them); a tensor's lengths are left to the kernels."""
    q = torch.empty(2, 3, 4, 16, device="meta", dtype=torch.float16)
    cache = torch.empty(2, 16, 2, 16, device="meta", dtype=torch.float16)
    new = torch.empty(2, 2, 2, 16, device="meta", dtype=torch.float16)
    cos = torch.empty(8, 4, device="meta", dtype=torch.float16)
    # Positions 6 and 7 (keys), 6-8 (queries, causal): up to 8, one past seqlen_ro = 8.
    with pytest.raises(ValueError, match=r"have 8 positions \(seqlen_ro\) but the call rotates positions up to 8"):
        reference.check_kvcache_arguments(q, cache, cache, new, new, 6, causal=True, rotary_cos=cos, rotary_sin=cos)
    # Without a mask every query turns at the length: positions up to 7 fit.
    reference.check_kvcache_arguments(q, cache, cache, new, new, 6, rotary_cos=cos, rotary_sin=cos)
    seqlens = torch.empty(2, device="meta", dtype=torch.int32)
    reference.check_kvcache_arguments(q, cache, cache, new, new, seqlens, causal=True, rotary_cos=cos, rotary_sin=cos)


@pytest.mark.parametrize("seqlens,options", [((200, 511), {"causal": True}), ((33, 150), {"causal": True}),
                                             ((33, 150), {"softcap": 4.0, "causal": True})],
                         ids=["decode", "options", "softcap"])
@pytest.mark.parametrize("shift", [1, -1])
def test_the_gpu_tests_lse_tolerance_sees_a_mask_one_key_off(gen, seqlens, options, shift):
    """kvcache_cases.check_lse (the GPU tests' log-sum-exp check) fails on the log-sum-exp of a mask
    one key longer or shorter, at the GPU tests' shapes and lengths, and passes on the right one."""
    call = make_call(gen, batch=2, heads=8, heads_k=2, head_dim=128, seqlens=seqlens, seqlen_new=0, page_size=16,
                     capacity=512)
    _, expected = reference.attention_with_kvcache(**cloned(call), **options)
    _, same = reference.attention_with_kvcache(**cloned(call), **options, block_size=64)
    check_lse(same, expected, options.get("softcap", 0.0))
    off = cloned(call)
    off["cache_seqlens"] = off["cache_seqlens"] + shift
    _, wrong = reference.attention_with_kvcache(**off, **options)
    with pytest.raises(AssertionError):
        check_lse(wrong, expected, options.get("softcap", 0.0))


def test_exported_from_the_package():
    assert "flash_attention_with_kvcache" in flash_cutlass.__all__
    assert flash_cutlass.flash_attention_with_kvcache.__module__ == "flash_cutlass.kvcache"


def test_flash_attention_2_door_has_its_signature_and_runs_the_kvcache_call(gen):
    import inspect

    from flash_cutlass.flash_attn_interface import flash_attn_with_kvcache

    # FlashAttention-2's flash_attn_with_kvcache (flash_attn/flash_attn_interface.py), in order.
    fa2 = (("q", None), ("k_cache", None), ("v_cache", None), ("k", None), ("v", None), ("rotary_cos", None),
           ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
           ("block_table", None), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
           ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None), ("num_splits", 0),
           ("return_softmax_lse", False))
    parameters = list(inspect.signature(flash_attn_with_kvcache).parameters.values())
    assert [p.name for p in parameters] == [name for name, _ in fa2]
    assert [p.default for p in parameters[3:]] == [default for _, default in fa2[3:]]
    call = make_call(gen, page_size=4, capacity=32, dtype=torch.float32)
    out, lse = flash_attn_with_kvcache(**cloned(call), causal=True, return_softmax_lse=True)
    expected_out, expected_lse = reference.attention_with_kvcache(**cloned(call), causal=True)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    with pytest.raises(NotImplementedError, match="cache_leftpad"):
        flash_attn_with_kvcache(**cloned(call), cache_leftpad=torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged"])
@pytest.mark.parametrize("form", ["append_tensor_lengths", "append_int_length", "no_append", "sinks"])
def test_kvcache_op_passes_opcheck(gen, page_size, form):
    """The custom op's schema (it writes the caches), fake implementation and dispatch."""
    from flash_cutlass import kvcache

    call = make_call(gen, page_size=page_size, dtype=torch.float32)
    if form == "append_int_length":
        call["cache_seqlens"] = 9
    elif form == "no_append":
        del call["k"], call["v"]
    sinks = torch.linspace(-1.0, 2.0, call["q"].shape[2]) if form == "sinks" else None
    arguments = reference.check_kvcache_arguments(**call, causal=True, sinks=sinks)
    op_args = kvcache._op_args(call["q"], call["k_cache"], call["v_cache"], call.get("k"), call.get("v"),
                               arguments, 0)
    torch.library.opcheck(kvcache.kvcache_op, op_args)


@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("page_size", [None, 4], ids=["contiguous", "paged"])
def test_torch_compile_traces_decoding_steps_in_one_graph(gen, page_size, sinks):
    """Three decoding steps, compiled with fullgraph=True (a graph break raises), give the eager
    steps' outputs and leave the caches as the eager steps do."""
    call = make_call(gen, page_size=page_size, dtype=torch.float32)
    cos, sin = rotary_tables(gen, 64, 16, torch.float32, "cpu")
    options = {"causal": True, "rotary_cos": cos, "rotary_sin": sin}
    if sinks:
        options["sinks"] = torch.linspace(-1.0, 2.0, call["q"].shape[2])

    def step(q, k_cache, v_cache, k, v, cache_seqlens, block_table):
        return flash_cutlass.flash_attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens,
                                                          block_table=block_table, return_lse=True, **options)

    compiled_step = torch.compile(step, fullgraph=True)
    eager, compiled = cloned(call), cloned(call)
    for _ in range(3):
        args = [eager[name] if name in eager else None
                for name in ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table")]
        out, lse = step(*args)
        args = [compiled[name] if name in compiled else None
                for name in ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table")]
        compiled_out, compiled_lse = compiled_step(*args)
        torch.testing.assert_close(compiled_out, out, rtol=0, atol=1e-6)
        torch.testing.assert_close(compiled_lse, lse, rtol=0, atol=1e-6)
        assert torch.equal(compiled["k_cache"], eager["k_cache"]) and torch.equal(compiled["v_cache"], eager["v_cache"])
        for state in (eager, compiled):
            state["cache_seqlens"] += 1

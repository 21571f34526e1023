#!/usr/bin/env python3
"""Small calls of every kernel this build holds, for compute-sanitizer to watch (GPU).

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/sanitize_calls.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python3 tools/sanitize_calls.py --head-dims 128,256
    FLASH_CUTLASS_SMEM_PER_BLOCK=101376 compute-sanitizer --tool racecheck python3 tools/sanitize_calls.py \
        --kernel sm80     # the kernels of a GPU of 99 KiB a block (Hopper: builds with FLASH_CUTLASS_SM90_SMALL_TILES=1
                          # and FLASH_CUTLASS_SM80_ON_HOPPER=1)

For each compiled head dim (or --head-dims) and the first compiled dtype: the forward and backward
of fixed-length calls with tails (seqlens that are no multiple of any tile, seqlen 1, more queries
than keys and fewer), MHA and GQA 2:1, causal and not, one deterministic backward, backwards of
more key tiles than SMs (72 heads), deterministic and not, and GQA tails again with dQ's first
store switched off and on (docs/DEVELOPING.md); a variable-length batch (lengths 1, 77
and 130); the window, soft cap, ALiBi and dropout kernels where the build has them, and a causal
call with attention sinks; and KV-cache calls (paged, pages of 16 in shuffled order, lengths 0, 1
and 100 with as many appended tokens as queries, split and unsplit, with sinks; a contiguous cache;
4 queries a sequence; 128, chunked prefill, over pages of 128 that the Hopper forward reads
through the block table, the last length 4,200: 34 key blocks). Each result is checked against
the same call on CPU copies (the pure-PyTorch reference, fp32 inside), loosely: this is
for the sanitizer, the tests check accuracy, but a kernel that ran and wrote garbage fails here too
(dropout's results are only checked finite: test_dropout.py checks its mask). Prints a line a
result and exits 1 on any mismatch. tools/gpu_pass.sh's `sanitize` step runs both tools over it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout's flash_cutlass, built in place
import flash_cutlass  # noqa: E402

DEVICE = "cuda"  # --device cpu runs the same calls on the reference (a check of this script)
TOLERANCE = 0.05  # of the largest reference value (at least 1): bf16 results of unit-scale inputs


def _close(name: str, got, want, failures: list) -> None:
    error = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    scale = max(1.0, want.float().abs().max().item()) if want.numel() else 1.0
    ok = error <= TOLERANCE * scale and bool(torch.isfinite(got).all())
    print(f"  {name:<70} max error {error:.3g} {'ok' if ok else 'MISMATCH'}", flush=True)
    if not ok:
        failures.append(name)


def _cpu(*tensors):
    return [t.detach().cpu() for t in tensors]


@contextlib.contextmanager
def _switched(variable: str, value: str):
    """A switch of docs/DEVELOPING.md set to `value` for the calls inside (the extension reads it at
    each call), then as it was."""
    before = os.environ.get(variable)
    os.environ[variable] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[variable]
        else:
            os.environ[variable] = before


def _dense_case(name, head_dim, dtype, batch, heads, heads_k, seqlen_q, seqlen_k, backward, failures, **options):
    q = torch.randn(batch, seqlen_q, heads, head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(batch, seqlen_k, heads_k, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    deterministic = options.pop("deterministic", False)
    result = flash_cutlass.flash_forward(q, k, v, **options)
    out, lse = result[0], result[1]
    extra = {"rng_state": result[2]} if len(result) == 3 else {}
    grads = flash_cutlass.flash_backward(dout, q, k, v, out, lse, deterministic=deterministic, **options,
                                         **extra) if backward else None
    if extra:  # dropout: its mask is the tests' business (test_dropout.py); here only that it ran
        for label, got in zip(("out", "dq", "dk", "dv"), (out, *(grads or ()))):
            finite = bool(torch.isfinite(got).all())
            print(f"  {name + ' ' + label:<70} {'finite' if finite else 'NOT FINITE'}", flush=True)
            if not finite:
                failures.append(f"{name} {label}")
        return
    cpu_options = {key: (value.cpu() if isinstance(value, torch.Tensor) else value) for key, value in options.items()
                   if key != "kernel"}
    q_cpu, k_cpu, v_cpu, dout_cpu = _cpu(q, k, v, dout)
    ref_out, ref_lse = flash_cutlass.flash_forward(q_cpu, k_cpu, v_cpu, **cpu_options)
    _close(f"{name} forward", out.cpu(), ref_out, failures)
    if grads is None:
        return
    ref_grads = flash_cutlass.flash_backward(dout_cpu, q_cpu, k_cpu, v_cpu, ref_out, ref_lse, **cpu_options)
    for label, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        _close(f"{name} backward {label}", got.cpu(), want, failures)


def _varlen_case(name, head_dim, dtype, heads, lengths, causal, backward, failures):
    total = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    q = torch.randn(total, heads, head_dim, device=DEVICE, dtype=dtype)
    k, v, dout = torch.randn_like(q), torch.randn_like(q), torch.randn_like(q)
    longest = max(lengths)
    out, lse = flash_cutlass.flash_forward_varlen(q, k, v, cu, cu, longest, longest, causal=causal)[:2]
    grads = (flash_cutlass.flash_backward_varlen(dout, q, k, v, out, lse, cu, cu, longest, longest, causal=causal)
             if backward else None)
    q_cpu, k_cpu, v_cpu, dout_cpu = _cpu(q, k, v, dout)
    cu_cpu = cu.cpu()
    ref_out, ref_lse = flash_cutlass.flash_forward_varlen(q_cpu, k_cpu, v_cpu, cu_cpu, cu_cpu, longest, longest,
                                                          causal=causal)
    _close(f"{name} forward", out.cpu(), ref_out, failures)
    if grads is None:
        return
    ref_grads = flash_cutlass.flash_backward_varlen(dout_cpu, q_cpu, k_cpu, v_cpu, ref_out, ref_lse, cu_cpu, cu_cpu,
                                                    longest, longest, causal=causal)
    for label, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        _close(f"{name} backward {label}", got.cpu(), want, failures)


def _kvcache_cases(head_dim, dtype, failures):
    batch, heads, heads_k = 3, 8, 2
    for seqlen_q, num_splits in ((1, 0), (1, 3), (4, 1), (128, 0)):
        # 128 positions a sequence in pages of 16; chunked prefill 4,352 in pages of 128, the longest
        # sequence of more key blocks (34) than the paged forward's producer warp reads of its block
        # table at a time (32).
        page, blocks = (16, 8) if seqlen_q < 128 else (128, 34)
        lengths = torch.tensor([0, 1, 100 if seqlen_q < 128 else 4200], dtype=torch.int32, device=DEVICE)
        q = torch.randn(batch, seqlen_q, heads, head_dim, device=DEVICE, dtype=dtype)
        new_k = torch.randn(batch, seqlen_q, heads_k, head_dim, device=DEVICE, dtype=dtype)
        new_v = torch.randn_like(new_k)
        # The splits' merge and the unsplit epilogue with attention sinks too.
        sinks = torch.randn(heads, device=DEVICE) if num_splits in (1, 3) else None
        for paged in (True, False):
            if paged:
                k_cache = torch.randn(batch * blocks, page, heads_k, head_dim, device=DEVICE, dtype=dtype)
                table = torch.randperm(batch * blocks, device=DEVICE).to(torch.int32).view(batch, blocks)
            else:
                k_cache = torch.randn(batch, blocks * page, heads_k, head_dim, device=DEVICE, dtype=dtype)
                table = None
            v_cache = torch.randn_like(k_cache)
            ref_k, ref_v = k_cache.clone(), v_cache.clone()
            out = flash_cutlass.flash_attention_with_kvcache(q, k_cache, v_cache, new_k, new_v, lengths,
                                                             block_table=table, causal=True, num_splits=num_splits,
                                                             sinks=sinks)
            ref_out = flash_cutlass.flash_attention_with_kvcache(
                *_cpu(q, ref_k, ref_v, new_k, new_v), lengths.cpu(),
                block_table=None if table is None else table.cpu(), causal=True,
                sinks=None if sinks is None else sinks.cpu())
            name = (f"kvcache d{head_dim} {'paged' if paged else 'contiguous'} seqlen_q {seqlen_q} "
                    f"num_splits {num_splits}{' sinks' if sinks is not None else ''}")
            _close(name, out.cpu(), ref_out, failures)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--head-dims", default="", help="comma-separated (default: every compiled head dim)")
    parser.add_argument("--skip-kvcache", action="store_true", help="leave the KV-cache calls out")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the same calls on CPU tensors, against themselves (tests this script)")
    parser.add_argument("--kernel", choices=("auto", "sm80"), default="auto",
                        help="the dense calls' kernel path (sm80: with FLASH_CUTLASS_SMEM_PER_BLOCK its tiles "
                             "for smaller shared memories; default: %(default)s)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    global DEVICE
    DEVICE = args.device
    compiled = flash_cutlass.compiled_head_dims()
    head_dims = [int(d) for d in args.head_dims.split(",") if d] or list(compiled)
    missing = [d for d in head_dims if d not in compiled]
    if missing:
        parser.error(f"--head-dims {missing} are not in this build (it has {list(compiled)})")
    dtype = flash_cutlass.compiled_dtypes()[0]
    backward = flash_cutlass.compiled_backward()
    torch.manual_seed(0)
    failures: list = []
    dense_case = _dense_case if args.kernel == "auto" else functools.partial(_dense_case, kernel=args.kernel)
    for head_dim in head_dims:
        print(f"head dim {head_dim} ({dtype}, backward {'built' if backward else 'left out'})", flush=True)
        shapes = ((1, 1, 4, 4), (77, 77, 4, 4), (130, 200, 4, 2), (200, 130, 4, 2))
        for seqlen_q, seqlen_k, heads, heads_k in shapes:
            for causal in (False, True):
                dense_case(f"d{head_dim} {seqlen_q}x{seqlen_k} heads {heads}/{heads_k} causal {causal}", head_dim,
                            dtype, 2, heads, heads_k, seqlen_q, seqlen_k, backward, failures, causal=causal)
        if backward:
            # More key tiles than SMs: persistent and rotated walks take several tiles a CTA.
            for deterministic in (False, True):
                dense_case(f"d{head_dim} 200x200 heads 72/72 deterministic {deterministic}", head_dim, dtype, 2, 72,
                            72, 200, 200, True, failures, deterministic=deterministic)
            dense_case(f"d{head_dim} 130x200 heads 4/2 causal deterministic", head_dim, dtype, 2, 4, 2, 130, 200,
                        True, failures, causal=True, deterministic=True)
            # dQ's first store switched off (dq_accum zeroed by the preprocess, every key block adds) and
            # on (the default only up to head dim 128).
            for switch, label in (("0", "dq_accum zeroed"), ("1", "dQ first store")):
                with _switched("FLASH_CUTLASS_BWD_DQ_FIRST_STORE", switch):
                    for causal in (False, True):
                        dense_case(f"d{head_dim} 130x200 heads 4/2 causal {causal} {label}", head_dim, dtype, 2, 4,
                                    2, 130, 200, True, failures, causal=causal)
        for causal in (False, True):
            _varlen_case(f"d{head_dim} varlen causal {causal}", head_dim, dtype, 4, (1, 77, 130), causal, backward,
                         failures)
        options = []
        if flash_cutlass.compiled_window():
            options.append(("window (32, 8)", dict(window_size=(32, 8))))
        if flash_cutlass.compiled_softcap():
            options.append(("softcap 5", dict(softcap=5.0)))
        if flash_cutlass.compiled_alibi():
            options.append(("alibi", dict(alibi_slopes=torch.rand(4, device=DEVICE))))
        if flash_cutlass.compiled_dropout():
            options.append(("dropout 0.1", dict(dropout_p=0.1)))
        options.append(("causal sinks", dict(causal=True, sinks=torch.randn(4, device=DEVICE))))
        for label, option in options:
            dense_case(f"d{head_dim} 130x200 heads 4/2 {label}", head_dim, dtype, 2, 4, 2, 130, 200, backward,
                        failures, **option)
        if (not args.skip_kvcache and flash_cutlass.compiled_kvcache()
                and head_dim in flash_cutlass.compiled_kvcache_head_dims()):
            _kvcache_cases(head_dim, dtype, failures)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    print(f"{len(failures)} mismatches" + (": " + ", ".join(failures) if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

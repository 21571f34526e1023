"""Calls from threads that have never touched CUDA: PyTorch's autograd engine runs backward on a
thread of its own, and serving code often runs the model on one. Such a thread may have no CUDA
context bound (c10 skips cudaSetDevice where the device number already matches), which the TMA
descriptors' encoding on the Hopper path needs; the calls must then give what the main thread
gives. Each case runs in a fresh interpreter, so that no earlier test has bound a context to the
autograd engine's thread and a crash fails the case instead of the whole test run."""

import subprocess
import sys
import textwrap

import pytest
import torch

import flash_cutlass
from helpers import COMPILED_DTYPES, COMPILED_HEAD_DIMS, ROOT, backward_left_out, requires_cuda

pytestmark = requires_cuda

# Shared by every case: small tensors (the caching allocator then serves the thread's allocations
# from blocks the main thread freed, without a CUDA call that would bind a context), and a runner
# that takes a function to a fresh thread and returns its result.
PRELUDE = textwrap.dedent("""
    import threading
    import torch
    import flash_cutlass

    def on_fresh_thread(fn):
        result = {}
        def run():
            try:
                result["value"] = fn()
            except BaseException as error:
                result["error"] = error
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if "error" in result:
            raise result["error"]
        return result["value"]

    def equal(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))

    torch.manual_seed(0)
    dtype = getattr(torch, DTYPE)
    q, k, v, dout = (torch.randn(1, 128, 4, HEAD_DIM, device="cuda", dtype=dtype) for _ in range(4))
""")

CASES = {
    "forward_and_backward": """
        out, lse = flash_cutlass.flash_forward(q, k, v)
        grads = flash_cutlass.flash_backward(dout, q, k, v, out, lse)
        assert equal(on_fresh_thread(lambda: flash_cutlass.flash_forward(q, k, v)), (out, lse))
        assert equal(on_fresh_thread(lambda: flash_cutlass.flash_backward(dout, q, k, v, out, lse)), grads)
    """,
    "autograd_backward": """
        out, lse = flash_cutlass.flash_forward(q, k, v)
        grads = flash_cutlass.flash_backward(dout, q, k, v, out, lse)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        assert equal(torch.autograd.grad(flash_cutlass.flash_attention(*leaves), leaves, dout), grads)
    """,
    "kvcache": """
        pages = torch.randperm(8, device="cuda").to(torch.int32).view(1, 8)
        k_cache, v_cache = (torch.randn(8, 16, 4, HEAD_DIM, device="cuda", dtype=dtype) for _ in range(2))
        seqlens = torch.tensor([100], dtype=torch.int32, device="cuda")
        query = q[:, :1]
        call = lambda: flash_cutlass.flash_attention_with_kvcache(query, k_cache, v_cache, cache_seqlens=seqlens,
                                                                  block_table=pages, num_splits=2)
        assert torch.equal(on_fresh_thread(call), call())
    """,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fresh_thread_matches_main_thread(case):
    head_dim = 128 if 128 in COMPILED_HEAD_DIMS else COMPILED_HEAD_DIMS[-1]
    dtype = "bfloat16" if torch.bfloat16 in COMPILED_DTYPES else "float16"
    if case == "kvcache" and head_dim not in flash_cutlass.compiled_kvcache_head_dims():
        pytest.skip(f"head dim {head_dim} has no KV-cache kernel in this build")
    if case != "kvcache" and backward_left_out():
        pytest.skip(backward_left_out())
    code = f"HEAD_DIM = {head_dim}\nDTYPE = {dtype!r}\n" + PRELUDE + textwrap.dedent(CASES[case]) + "print('ok')\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
        f"exit {result.returncode}\nstdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-4000:]}")

#!/usr/bin/env python3
"""Forward attention benchmark: flash_cutlass side by side with torch SDPA's fused backends.

Every implementation runs in one process on the same random inputs, one shape after another,
so the peers share the GPU, the clocks and the software stack of the run. Shapes follow the
project convention: 16k tokens per batch and hidden size 2048, so batch = 16384 // seqlen and
heads = 2048 // head_dim; --batch, --heads and --heads-k fix them instead (e.g. cuDNN's published
GQA shape: --batch 1 --heads 64 --heads-k 8). benchmarks/README.md describes the output and the
FLOP convention.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import importlib.util
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

TOKENS_PER_BATCH = 16384
HIDDEN_SIZE = 2048
DEFAULT_HEAD_DIMS = (64, 128, 256)
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)

SUBJECT = "flash_cutlass"
# flash_cutlass with a kernel path forced (kernel="sm80" / "sm90"); SUBJECT is the automatic
# choice, the Hopper path on an H100/H200 where it has the call's head dim.
SUBJECT_SM80 = "flash_cutlass_sm80"
SUBJECT_SM90 = "flash_cutlass_sm90"
# flash_cutlass's automatic choice with deterministic=True (the backward's dQ in a fixed order);
# run only when asked for.
SUBJECT_DETERMINISTIC = "flash_cutlass_deterministic"
# flash_cutlass's automatic choice with attention sinks (sinks=, one logit a query head, learned in
# forward+backward); run only when asked for.
SUBJECT_SINKS = "flash_cutlass_sinks"
# A switch of the Hopper backward (docs/DEVELOPING.md) set around each call of another subject (the
# extension reads these variables per call), for an A/B against that subject in one process; run
# only when asked for: the GQA walks chosen by their rule, V loaded after the first Q and dO, and
# dQ's first store switched off (dq_accum zeroed by the preprocess, as before it became the default).
SUBJECT_GQA_WALK = "flash_cutlass_gqa_walk"
SUBJECT_V_AFTER_Q = "flash_cutlass_v_after_q"
SUBJECT_DQ_ZEROED = "flash_cutlass_dq_zeroed"
SUBJECT_ENVIRONMENT = {SUBJECT_GQA_WALK: (SUBJECT, "FLASH_CUTLASS_GQA_WALK_HEADS", "auto"),
                       SUBJECT_V_AFTER_Q: (SUBJECT, "FLASH_CUTLASS_BWD_V_AFTER_Q", "1"),
                       SUBJECT_DQ_ZEROED: (SUBJECT, "FLASH_CUTLASS_BWD_DQ_FIRST_STORE", "0")}
FORCED_KERNELS = {SUBJECT: None, SUBJECT_SM80: "sm80", SUBJECT_SM90: "sm90", SUBJECT_DETERMINISTIC: None,
                  SUBJECT_SINKS: None, **{subject: None for subject in SUBJECT_ENVIRONMENT}}
SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_mem_efficient": SDPBackend.EFFICIENT_ATTENTION,
}
IMPLS = (SUBJECT, SUBJECT_SM80, SUBJECT_SM90, SUBJECT_DETERMINISTIC, SUBJECT_SINKS, *SUBJECT_ENVIRONMENT,
         *SDPA_BACKENDS)
DEFAULT_IMPLS = tuple(impl for impl in IMPLS
                      if impl not in (SUBJECT_DETERMINISTIC, SUBJECT_SINKS, *SUBJECT_ENVIRONMENT))
# What is timed, and its matmul FLOPs as a multiple of the forward's (the FlashAttention
# convention: the backward does 2.5x the forward's matmul work).
DIRECTIONS = {"forward": 1.0, "training-forward": 1.0, "backward": 2.5, "forward+backward": 3.5}
MATH_IMPL = "sdpa_math"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# --check compares flash_cutlass with SDPA's default backend; both round P and O to the input
# dtype, so their outputs differ by a few units in the last place. A relative L2 bound catches
# wrong tiles and missing rescales at any output magnitude; the LSE is compared with fp32 math.
CHECK_REL_L2 = {"bf16": 2e-2, "fp16": 5e-3}
CHECK_LSE_ATOL = 1e-3
CHECK_LSE_ROWS = 128


@dataclass(frozen=True)
class Case:
    head_dim: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    heads_k: int | None = None  # K/V heads (GQA/MQA); None: heads

    @property
    def kv_heads(self) -> int:
        return self.heads if self.heads_k is None else self.heads_k


@dataclass
class Inputs:
    """q, k, v as flash_cutlass takes them, (b, s, h, d), and contiguous (b, h, s, d) copies of
    them for SDPA, made outside the timed region."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_bhsd: torch.Tensor
    k_bhsd: torch.Tensor
    v_bhsd: torch.Tensor


def attention_forward_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                            causal: bool) -> float:
    """Matmul FLOPs of the forward pass: QK^T and PV, 2 * sq * sk * d each; causal does half."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


def case_flops(case: Case, direction: str = "forward") -> float:
    return DIRECTIONS[direction] * attention_forward_flops(case.batch, case.heads, case.seqlen, case.seqlen,
                                                           case.head_dim, case.causal)


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def benchmark_cases(head_dims: Sequence[int], seqlens: Sequence[int], causals: Sequence[bool],
                    tokens: int = TOKENS_PER_BATCH, hidden: int = HIDDEN_SIZE, batch: int | None = None,
                    heads: int | None = None, heads_k: int | None = None) -> list[Case]:
    """Cases ordered by head_dim, then causal, then seqlen; batch and heads keep the token count
    and hidden size fixed (each at least 1) unless given; heads_k (K/V heads) defaults to heads."""
    return [Case(head_dim=d, causal=c, seqlen=s, batch=batch or max(1, tokens // s),
                 heads=heads or max(1, hidden // d), heads_k=heads_k)
            for d in head_dims for c in causals for s in seqlens]


def _format(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def heads_text(heads: int, heads_k: int | None) -> str:
    """The heads of a shape as the tables show them: "16", or "64/8" with fewer K/V heads."""
    return str(heads) if heads_k in (None, heads) else f"{heads}/{heads_k}"


def markdown_table(rows: Sequence[dict], impls: Sequence[str]) -> str:
    """One line per (head_dim, causal, seqlen): TFLOPS of each impl, then flash_cutlass / peer."""
    peers = [i for i in impls if i != SUBJECT] if SUBJECT in impls else []
    header = ["hdim", "causal", "seqlen", "batch", "heads", *impls,
              *(f"{SUBJECT}/{p}" for p in peers)]
    grouped: dict[tuple[int, bool, int], dict[str, dict]] = {}
    for row in rows:
        grouped.setdefault((row["head_dim"], row["causal"], row["seqlen"]), {})[row["impl"]] = row
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for (head_dim, causal, seqlen), by_impl in grouped.items():
        first = next(iter(by_impl.values()))
        speed = {i: by_impl.get(i, {}).get("tflops") for i in impls}
        ratios = [speed[SUBJECT] / speed[p] if speed[SUBJECT] and speed[p] else None
                  for p in peers]
        cells = [str(head_dim), "yes" if causal else "no", str(seqlen), str(first["batch"]),
                 heads_text(first["heads"], first.get("heads_k")), *(_format(speed[i], ".1f") for i in impls),
                 *(_format(r, ".2f") for r in ratios)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def memory_table(memory: Sequence[dict]) -> str:
    header = ["impl", "hdim", "causal", "seqlen", "batch", "heads", "peak extra MiB"]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for m in memory:
        peak = "OOM" if m["oom"] else _format(
            None if m["peak_bytes"] is None else m["peak_bytes"] / 2**20, ".1f")
        cells = [m["impl"], str(m["head_dim"]), "yes" if m["causal"] else "no", str(m["seqlen"]),
                 str(m["batch"]), str(m["heads"]), peak]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def power_table(rows: Sequence[dict]) -> str:
    """One line per measured (shape, impl) with --power: TFLOPS, the median SM clock and board
    power while it ran, and TFLOPS per GHz of SM clock (the work of one cycle)."""
    header = ["hdim", "causal", "seqlen", "impl", "TFLOPS", "SM clock MHz", "board W", "TFLOPS per GHz", "samples"]
    lines = ["| " + " | ".join(header) + " |", "|---:|---:|---:|---|" + "---:|" * (len(header) - 4)]
    for row in rows:
        if row.get("sm_clock_mhz") is None:
            continue
        per_ghz = row["tflops"] / (row["sm_clock_mhz"] / 1000) if row["tflops"] else None
        cells = [str(row["head_dim"]), "yes" if row["causal"] else "no", str(row["seqlen"]), row["impl"],
                 _format(row["tflops"], ".1f"), _format(row["sm_clock_mhz"], ".0f"), _format(row["power_w"], ".0f"),
                 _format(per_ghz, ".1f"), str(row["power_samples"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_report(meta: dict, rows: Sequence[dict], impls: Sequence[str],
                  checks: Sequence[dict], memory: Sequence[dict]) -> str:
    direction = meta.get("direction", "forward")
    parts = [
        f"## {direction.capitalize()} attention, " + meta["dtype"],
        "",
        f"GPU: {meta['gpu']}; torch {meta['torch']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}; "
        f"{meta['date']}",
        "",
        f"Command: `{meta['command']}`",
        "",
        "TFLOPS = 4 * batch * heads * seqlen^2 * head_dim / time (half that for causal), "
        f"times {DIRECTIONS[direction]:g} for the {direction} pass; "
        "time is the median of CUDA-event timings. "
        f"{SUBJECT}/peer columns are TFLOPS ratios: above 1 means {SUBJECT} is faster. "
        "n/a: the implementation rejected the shape or failed --check.",
        "",
        markdown_table(rows, impls),
    ]
    failed = [c for c in checks if not c["passed"]]
    if checks:
        parts += ["", f"--check: {len(checks) - len(failed)} of {len(checks)} shapes passed."]
        parts += [f"- FAILED hdim {c['head_dim']} causal {c['causal']} seqlen {c['seqlen']}: "
                  f"{c['detail']}" for c in failed]
    if any(row.get("sm_clock_mhz") is not None for row in rows):
        parts += ["", "SM clock and board power while each was timed (--power; nvidia-smi samples, medians):",
                  "", power_table(rows)]
    if memory:
        parts += ["", "Peak memory allocated during one forward call, beyond the inputs:", "",
                  memory_table(memory)]
    return "\n".join(parts) + "\n"


def plot_tflops(rows: Sequence[dict], impls: Sequence[str], path: Path, title: str) -> None:
    """One subplot per (head_dim, causal); x = seqlen on a log2 axis, a line per impl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head_dims = list(dict.fromkeys(r["head_dim"] for r in rows))
    causals = list(dict.fromkeys(r["causal"] for r in rows))
    seqlens = sorted({r["seqlen"] for r in rows})
    fig, axes = plt.subplots(len(head_dims), len(causals), squeeze=False,
                             figsize=(5.5 * len(causals), 3.8 * len(head_dims)))
    for i, head_dim in enumerate(head_dims):
        for j, causal in enumerate(causals):
            ax = axes[i][j]
            for impl in impls:
                points = sorted((r["seqlen"], r["tflops"]) for r in rows
                                if r["impl"] == impl and r["head_dim"] == head_dim
                                and r["causal"] == causal and r["tflops"] is not None)
                if points:
                    ax.plot(*zip(*points, strict=True), marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, labels=[f"{s // 1024}k" if s >= 1024 else str(s)
                                           for s in seqlens])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.set_title(f"head_dim {head_dim}, {'causal' if causal else 'non-causal'}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOPS")
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --power: nvidia-smi's query of the SM clock and the board power, one CSV line per sample.
POWER_QUERY = "clocks.sm,power.draw"


def parse_clock_power(text: str) -> list[tuple[float, float]]:
    """nvidia-smi's `--query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits` output as
    (SM clock in MHz, board power in W) samples; lines it could not read ("[N/A]", a last line cut
    short when the sampler stopped) are left out."""
    samples = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 2:
            continue
        try:
            samples.append((float(fields[0]), float(fields[1])))
        except ValueError:
            continue
    return samples


class ClockPowerSampler:
    """Inside a `with` block, nvidia-smi samples one GPU's SM clock and board power every
    interval_ms; afterwards `samples` holds them as (MHz, W). On a power-capped GPU the clocks
    settle where the board's power limit holds, so two implementations at the same power compare
    by their work per joule (docs/PERFORMANCE.md, power and clocks). nvidia-smi needs a few hundred
    milliseconds to start sampling: windows of a second or more give stable medians."""

    def __init__(self, gpu: str, interval_ms: int = 100, command: str = "nvidia-smi"):
        self.argv = [command, f"--id={gpu}", f"--query-gpu={POWER_QUERY}", "--format=csv,noheader,nounits",
                     f"--loop-ms={interval_ms}"]
        self.samples: list[tuple[float, float]] = []
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> ClockPowerSampler:
        self._process = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc_info) -> None:
        assert self._process is not None
        self._process.terminate()
        out, _ = self._process.communicate(timeout=10)
        self.samples = parse_clock_power(out)


def median_clock_power(samplers: Sequence[ClockPowerSampler]) -> tuple[float | None, float | None, int]:
    """The median SM clock (MHz) and board power (W) over every sample of the samplers, and how
    many samples there were; (None, None, 0) without any."""
    samples = [sample for sampler in samplers for sample in sampler.samples]
    if not samples:
        return None, None, 0
    return (statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples), len(samples))


def gpu_for_nvidia_smi(device: int = 0) -> str:
    """The torch device as nvidia-smi's --id names it (its UUID, which CUDA_VISIBLE_DEVICES does
    not renumber)."""
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def median_ms(fn: Callable[[], object], warmup: int, min_reps: int, min_time_ms: float,
              warmup_ms: float = 0.0, sampler: ClockPowerSampler | None = None) -> float:
    """Median of per-call CUDA-event timings, after warm-up (warmup calls, then about warmup_ms of
    GPU time); at least min_reps calls and about min_time_ms of GPU time. A sampler, if given,
    samples the clocks and power from the time-based warm-up to the end of the timed calls."""
    for _ in range(warmup):
        fn()
    probe_start = torch.cuda.Event(enable_timing=True)
    probe_end = torch.cuda.Event(enable_timing=True)
    probe_calls = 5
    probe_start.record()
    for _ in range(probe_calls):
        fn()
    probe_end.record()
    torch.cuda.synchronize()
    per_call = max(probe_start.elapsed_time(probe_end) / probe_calls, 1e-3)
    reps = max(min_reps, math.ceil(min_time_ms / per_call))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    with sampler if sampler is not None else contextlib.nullcontext():
        # The GPU's clocks follow its power draw over tens of milliseconds: a time-based warm-up
        # lets them settle under this implementation's own load instead of the one measured
        # before it.
        for _ in range(math.ceil(warmup_ms / per_call)):
            fn()
        for start, end in zip(starts, ends, strict=True):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def interleaved_rounds(measures: dict[str, Callable[[int], float]], rounds: int) -> dict[str, list[float]]:
    """Calls every measure once per round, in the given order, round after round (A B C A B C ...),
    so that a drift of the GPU's clocks during a shape's measurements falls on every implementation
    alike instead of on whichever runs last. measure(round_index) returns a time; the result holds
    each one's times in round order."""
    times: dict[str, list[float]] = {name: [] for name in measures}
    for round_index in range(rounds):
        for name, measure in measures.items():
            times[name].append(measure(round_index))
    return times


def peer_ms(make_peer: Callable[[], Callable[[], object] | None], name: str, min_time_ms: float) -> float | None:
    """median_ms of a peer's runner, None when make_peer() has none for this case or the peer fails
    (its first error line goes to stderr: a peer that fails must not stop the run)."""
    try:
        runner = make_peer()
        return median_ms(runner, 3, 10, min_time_ms) if runner else None
    except Exception as err:
        print(f"{name} failed: {str(err).splitlines()[0]}", file=sys.stderr)
        return None


def peer_columns(peer: float | None, ms: float) -> str:
    """A peer's two table cells: its time and its time over ours ("n/a | n/a" without one)."""
    return f"{peer:.3f} | {peer / ms:.2f}" if peer else "n/a | n/a"


def write_rows(path: Path | None, rows: Sequence[dict]) -> None:
    """The rows of a small benchmark, with the GPU and torch version, as JSON at path (if given)."""
    if path is not None:
        path.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "rows": list(rows)}, indent=1))


def make_inputs(case: Case, dtype: torch.dtype, device: str = "cuda") -> Inputs:
    q = torch.randn(case.batch, case.seqlen, case.heads, case.head_dim, device=device, dtype=dtype)
    k, v = (torch.randn(case.batch, case.seqlen, case.kv_heads, case.head_dim, device=device, dtype=dtype)
            for _ in range(2))
    return Inputs(q, k, v, *(t.transpose(1, 2).contiguous() for t in (q, k, v)))


def sdpa_gqa_kwargs(q_bhsd: torch.Tensor, k_bhsd: torch.Tensor) -> dict:
    """SDPA's own GQA (enable_gqa, torch 2.5+) where K/V have fewer heads than q."""
    return {"enable_gqa": True} if k_bhsd.shape[1] != q_bhsd.shape[1] else {}


def sdpa_call(inputs: Inputs, causal: bool, backend: SDPBackend | None) -> torch.Tensor:
    """SDPA on the (b, h, s, d) copies, restricted to one backend unless backend is None."""
    args = (inputs.q_bhsd, inputs.k_bhsd, inputs.v_bhsd)
    gqa = sdpa_gqa_kwargs(inputs.q_bhsd, inputs.k_bhsd)
    if backend is None:
        return F.scaled_dot_product_attention(*args, is_causal=causal, **gqa)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(*args, is_causal=causal, **gqa)


def sinks_of(impl: str, inputs: Inputs) -> torch.Tensor | None:
    """The attention sinks SUBJECT_SINKS runs with (one logit a query head, around the scores'
    log-sum-exps), None for the others."""
    if impl != SUBJECT_SINKS:
        return None
    return torch.linspace(-1.0, 3.0, inputs.q.shape[2], device=inputs.q.device)


def make_runner(impl: str, inputs: Inputs, causal: bool, subject: ModuleType | None,
                direction: str = "forward") -> Callable[[], object]:
    if direction == "training-forward":
        return make_training_forward_runner(impl, inputs, causal, subject)
    if direction != "forward":
        return make_gradient_runner(impl, inputs, causal, subject, direction)
    if impl in FORCED_KERNELS:
        sinks = sinks_of(impl, inputs)
        return lambda: subject.flash_forward(inputs.q, inputs.k, inputs.v, causal=causal,
                                             kernel=FORCED_KERNELS[impl], sinks=sinks)
    backend = SDPBackend.MATH if impl == MATH_IMPL else SDPA_BACKENDS[impl]
    return lambda: sdpa_call(inputs, causal, backend)


def with_environment(run: Callable[[], object], variable: str, value: str) -> Callable[[], object]:
    """run with the environment variable set to value for the call, as it was before after it."""
    def call():
        previous = os.environ.get(variable)
        os.environ[variable] = value
        try:
            return run()
        finally:
            if previous is None:
                del os.environ[variable]
            else:
                os.environ[variable] = previous
    return call


def make_training_forward_runner(impl: str, inputs: Inputs, causal: bool,
                                 subject: ModuleType | None) -> Callable[[], object]:
    """A training step's forward: the autograd call on leaves that require grad (the graph it
    records is dropped with the output)."""
    if impl in SUBJECT_ENVIRONMENT:
        base, variable, value = SUBJECT_ENVIRONMENT[impl]
        return with_environment(make_training_forward_runner(base, inputs, causal, subject), variable, value)
    if impl in FORCED_KERNELS:
        sinks = sinks_of(impl, inputs)
        leaves = [t.detach().requires_grad_() for t in (inputs.q, inputs.k, inputs.v)]
        return lambda: subject.flash_attention(*leaves, causal=causal, kernel=FORCED_KERNELS[impl], sinks=sinks)
    leaves = [t.detach().requires_grad_() for t in (inputs.q_bhsd, inputs.k_bhsd, inputs.v_bhsd)]
    backend = SDPBackend.MATH if impl == MATH_IMPL else SDPA_BACKENDS[impl]
    gqa = sdpa_gqa_kwargs(leaves[0], leaves[1])

    def forward():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(*leaves, is_causal=causal, **gqa)
    return forward


def make_gradient_runner(impl: str, inputs: Inputs, causal: bool, subject: ModuleType | None,
                         direction: str) -> Callable[[], object]:
    """The backward pass alone (its forward run once, outside the timed call) or forward and
    backward together, with a random upstream gradient."""
    if impl in SUBJECT_ENVIRONMENT:
        base, variable, value = SUBJECT_ENVIRONMENT[impl]
        return with_environment(make_gradient_runner(base, inputs, causal, subject, direction), variable, value)
    if impl in FORCED_KERNELS:
        kernel = FORCED_KERNELS[impl]
        deterministic = impl == SUBJECT_DETERMINISTIC
        sinks = sinks_of(impl, inputs)
        q, k, v = inputs.q, inputs.k, inputs.v
        dout = torch.randn_like(q)
        if direction == "backward":
            out, lse = subject.flash_forward(q, k, v, causal=causal, kernel=kernel, sinks=sinks)
            return lambda: subject.flash_backward(dout, q, k, v, out, lse, causal=causal, kernel=kernel,
                                                  deterministic=deterministic, sinks=sinks)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        if sinks is not None:  # learned: their gradient too
            leaves.append(sinks.requires_grad_())
        return lambda: torch.autograd.grad(
            subject.flash_attention(*leaves[:3], causal=causal, kernel=kernel, deterministic=deterministic,
                                    sinks=sinks), leaves, dout)
    backend = SDPBackend.MATH if impl == MATH_IMPL else SDPA_BACKENDS[impl]
    leaves = [t.detach().requires_grad_() for t in (inputs.q_bhsd, inputs.k_bhsd, inputs.v_bhsd)]
    dout = torch.randn_like(leaves[0])

    gqa = sdpa_gqa_kwargs(leaves[0], leaves[1])

    def forward():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(*leaves, is_causal=causal, **gqa)

    if direction == "backward":
        out = forward()
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
    return lambda: torch.autograd.grad(forward(), leaves, dout)


def first_call_error(fn: Callable[[], object]) -> str | None:
    """Run fn once; return why it failed (its error and any warnings it gave), or None."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
            torch.cuda.synchronize()
        except (RuntimeError, ValueError) as err:
            reasons = [str(err)] + [str(w.message) for w in caught]
            first_lines = [r.strip().splitlines()[0] for r in reasons if r.strip()]
            torch.cuda.empty_cache()
            return "; ".join(dict.fromkeys(first_lines)) or type(err).__name__
    return None


def reference_lse(q_rows: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, causal: bool,
                  scale: float) -> torch.Tensor:
    """fp32 log-sum-exp of the scaled scores of some query rows of one batch element.
    q_rows (r, h, d), k (seqlen_k, h, d); returns (h, r)."""
    scores = torch.einsum("rhd,khd->hrk", q_rows.float(), k.float()) * scale
    if causal:
        keys = torch.arange(k.shape[0], device=k.device)
        scores.masked_fill_(keys[None, None, :] > rows[None, :, None], float("-inf"))
    return torch.logsumexp(scores, dim=-1)


def check_case(subject: ModuleType, inputs: Inputs, case: Case, dtype_name: str) -> dict:
    """Compare flash_cutlass with SDPA's default backend (output) and fp32 math (LSE)."""
    result = {"head_dim": case.head_dim, "causal": case.causal, "seqlen": case.seqlen,
              "max_abs_diff": None, "rel_l2": None, "lse_max_abs_diff": None, "passed": False}
    try:
        out, lse = subject.flash_forward(inputs.q, inputs.k, inputs.v, causal=case.causal)
    except (RuntimeError, ValueError) as err:
        result["detail"] = f"flash_forward raised: {str(err).strip().splitlines()[0]}"
        return result
    lse_shape = (case.batch, case.heads, case.seqlen)
    if out.shape != inputs.q.shape or out.dtype != inputs.q.dtype or tuple(lse.shape) != lse_shape:
        result["detail"] = (f"out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)}; expected "
                            f"out {tuple(inputs.q.shape)} {inputs.q.dtype}, lse {lse_shape}")
        return result
    ref = sdpa_call(inputs, case.causal, backend=None).transpose(1, 2).float()
    diff = out.float() - ref
    rows = torch.linspace(0, case.seqlen - 1, min(CHECK_LSE_ROWS, case.seqlen),
                          device=inputs.q.device).round().long().unique()
    k_per_query_head = inputs.k[0].repeat_interleave(case.heads // case.kv_heads, dim=1)
    lse_ref = reference_lse(inputs.q[0, rows], k_per_query_head, rows, case.causal, case.head_dim ** -0.5)
    finite = bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    result["max_abs_diff"] = diff.abs().max().item()
    result["rel_l2"] = (diff.norm() / ref.norm()).item()
    result["lse_max_abs_diff"] = (lse[0][:, rows].float() - lse_ref).abs().max().item()
    result["passed"] = (finite and result["rel_l2"] <= CHECK_REL_L2[dtype_name]
                        and result["lse_max_abs_diff"] <= CHECK_LSE_ATOL)
    result["detail"] = (f"max |out - sdpa| {result['max_abs_diff']:.3e}, "
                        f"rel L2 {result['rel_l2']:.3e} (limit {CHECK_REL_L2[dtype_name]:.0e}), "
                        f"max |lse - fp32| {result['lse_max_abs_diff']:.3e} "
                        f"(limit {CHECK_LSE_ATOL:.0e})" + ("" if finite else ", non-finite values"))
    return result


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated during one call of fn beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del result
    return peak - baseline


def measure_memory(case: Case, dtype: torch.dtype, subject: ModuleType | None) -> list[dict]:
    inputs = make_inputs(case, dtype)
    impls = ([SUBJECT] if subject is not None else []) + [MATH_IMPL]
    results = []
    for impl in impls:
        fn = make_runner(impl, inputs, case.causal, subject)
        entry = {"impl": impl, "head_dim": case.head_dim, "causal": case.causal,
                 "seqlen": case.seqlen, "batch": case.batch, "heads": case.heads,
                 "peak_bytes": None, "oom": False, "error": None}
        try:
            fn()
            entry["peak_bytes"] = peak_extra_bytes(fn)
        except torch.cuda.OutOfMemoryError:
            entry["oom"] = True
        except (RuntimeError, ValueError) as err:
            entry["error"] = str(err).strip().splitlines()[0]
        torch.cuda.empty_cache()
        results.append(entry)
        peak = ("OOM" if entry["oom"] else entry["error"] if entry["error"]
                else f"{entry['peak_bytes'] / 2**20:.1f} MiB")
        print(f"memory {impl:<14} hdim {case.head_dim} causal {case.causal} seqlen {case.seqlen} "
              f"(b {case.batch}, h {case.heads}): {peak}", flush=True)
    return results


def _int_list(text: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _impl_list(text: str) -> list[str]:
    names = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [n for n in names if n not in IMPLS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown implementation(s) {unknown or text!r}; choose from {', '.join(IMPLS)}")
    return [i for i in IMPLS if i in names]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Forward attention benchmark: flash_cutlass.flash_forward side by side with "
                    "torch SDPA restricted to its flash, cuDNN and memory-efficient backends, in "
                    "one process on the same random inputs. Shapes: batch = 16384 // seqlen, "
                    "heads = 2048 // head_dim, seqlen_q = seqlen_k, heads_k = heads, unless "
                    "--batch, --heads, --heads-k say otherwise. Reports "
                    "TFLOPS (forward FLOPs 4*b*h*s*s*d, half for causal, over the median "
                    "CUDA-event time) and the ratio flash_cutlass/peer.",
        epilog="Prints a progress line per measurement and a markdown report at the end. "
               "Exits with status 1 if --check finds a wrong flash_cutlass result (that shape is "
               "then not timed for flash_cutlass), 0 otherwise. Needs a CUDA GPU.",
    )
    parser.add_argument("--head-dims", type=_int_list, metavar="D[,D...]",
                        default=",".join(map(str, DEFAULT_HEAD_DIMS)),
                        help="head dims (default: %(default)s); those not in "
                             "flash_cutlass.compiled_head_dims() are skipped with a note while "
                             "flash_cutlass is among --impls")
    parser.add_argument("--seqlens", type=_int_list, metavar="S[,S...]",
                        default=",".join(map(str, DEFAULT_SEQLENS)),
                        help="sequence lengths, seqlen_q = seqlen_k (default: %(default)s)")
    parser.add_argument("--batch", type=int, metavar="B",
                        help="batch size of every shape (default: 16384 // seqlen)")
    parser.add_argument("--heads", type=int, metavar="H",
                        help="query heads of every shape (default: 2048 // head_dim)")
    parser.add_argument("--heads-k", type=int, metavar="HK",
                        help="K/V heads (GQA/MQA; must divide --heads, which it then needs; SDPA "
                             "runs with enable_gqa) (default: the query heads)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                        help="dtype of q, k and v (default: %(default)s)")
    parser.add_argument("--causal", choices=("both", "true", "false"), default="both",
                        help="which masking to measure (default: %(default)s)")
    parser.add_argument("--direction", choices=tuple(DIRECTIONS), default="forward",
                        help="what is timed: the forward pass (flash_forward; SDPA without "
                             "gradients), a training step's forward (flash_attention and SDPA on "
                             "inputs that require grad, so that autograd records the graph), the "
                             "backward pass alone (its forward runs once, untimed) or both; FLOPs are "
                             "1, 1, 2.5 and 3.5 times the forward's (default: %(default)s)")
    parser.add_argument("--impls", type=_impl_list, metavar="NAME[,NAME...]",
                        default=",".join(DEFAULT_IMPLS),
                        help=f"implementations to run, of {', '.join(IMPLS)} (default: all but "
                             f"{SUBJECT_DETERMINISTIC}, the automatic choice with deterministic=True, "
                             f"{SUBJECT_SINKS}, with attention sinks, and the switches of docs/DEVELOPING.md, "
                             f"{', '.join(SUBJECT_ENVIRONMENT)}); without a flash_cutlass one the extension is not "
                             "imported")
    parser.add_argument("--check", action="store_true",
                        help="before timing each shape, compare flash_cutlass's output with "
                             "SDPA's default backend and its LSE with fp32 math on sampled rows; "
                             "print the max abs diff and skip timing flash_cutlass where it fails")
    parser.add_argument("--warmup", type=int, default=25, metavar="N",
                        help="untimed calls before timing (default: %(default)s)")
    parser.add_argument("--warmup-ms", type=float, default=100.0, metavar="MS",
                        help="then untimed calls for about this much GPU time before each timing, so "
                             "that the clocks settle under the implementation's own load rather than "
                             "the previous one's (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=50, metavar="N",
                        help="minimum number of timed calls (default: %(default)s)")
    parser.add_argument("--min-time-ms", type=float, default=200.0, metavar="MS",
                        help="time more calls until about this much GPU time is covered "
                             "(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="measure the implementations of a shape in N alternating rounds (A B C "
                             "A B C ...), each a full measurement (warm-up, --reps, --min-time-ms), "
                             "and report the median of the rounds' medians: a drift of the clocks "
                             "then falls on every implementation alike (default: %(default)s)")
    parser.add_argument("--power", action="store_true",
                        help="sample the GPU's SM clock and board power with nvidia-smi while "
                             "each implementation is timed (from its time-based warm-up on) and "
                             "report their medians and TFLOPS per GHz; nvidia-smi takes a few "
                             "hundred ms to start sampling, so use windows of a second or more, "
                             "e.g. --warmup-ms 1000 --min-time-ms 2000")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random inputs (default: %(default)s)")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="write environment, command and every measurement as JSON")
    parser.add_argument("--markdown", type=Path, metavar="PATH",
                        help="write the markdown report (the one printed at the end)")
    parser.add_argument("--plot", type=Path, metavar="PATH",
                        help="write a PNG (needs matplotlib): a subplot per (head_dim, causal), "
                             "TFLOPS against seqlen, a line per implementation")
    parser.add_argument("--memory", action="store_true",
                        help="after timing, measure the peak memory allocated by one forward "
                             "call beyond the inputs, for flash_cutlass and SDPA's math backend, "
                             "at --memory-seqlen and --memory-head-dim (batch and heads by the "
                             "shape convention) for each --causal setting; records OOM if the "
                             "math backend runs out")
    parser.add_argument("--memory-seqlen", type=int, default=8192, metavar="S",
                        help="seqlen of the --memory measurement (default: %(default)s)")
    parser.add_argument("--memory-head-dim", type=int, default=128, metavar="D",
                        help="head dim of the --memory measurement (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.check and SUBJECT not in args.impls:
        parser.error(f"--check verifies {SUBJECT}; include it in --impls")
    if args.warmup < 0 or args.warmup_ms < 0 or args.reps < 1 or args.min_time_ms < 0 or args.rounds < 1:
        parser.error("--warmup and --warmup-ms must be >= 0, --reps >= 1, --min-time-ms >= 0 and --rounds >= 1")
    if any(n is not None and n < 1 for n in (args.batch, args.heads, args.heads_k)):
        parser.error("--batch, --heads and --heads-k must be positive")
    if args.heads_k is not None and (args.heads is None or args.heads % args.heads_k):
        parser.error("--heads-k needs --heads, a multiple of it")
    if args.memory_seqlen < 1 or args.memory_head_dim < 1:
        parser.error("--memory-seqlen and --memory-head-dim must be positive")
    if args.power and shutil.which("nvidia-smi") is None:
        parser.error("--power samples the clocks with nvidia-smi, which is not on PATH")
    args.causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    return args


def load_subject() -> ModuleType:
    try:
        return importlib.import_module(SUBJECT)
    except ImportError as err:
        sys.exit(f"cannot import {SUBJECT} ({err}). Install it from the repository root with "
                 f"`pip install --no-build-isolation -e .`, or leave it out of --impls.")


def environment(dtype_name: str, subject: ModuleType | None) -> dict:
    return {
        "gpu": torch.cuda.get_device_name(),
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "flash_cutlass": getattr(subject, "__version__", None) if subject else None,
        "dtype": dtype_name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit(f"{Path(sys.argv[0]).name}: no CUDA GPU is visible to torch {torch.__version__} "
                 f"(CUDA build {torch.version.cuda}); this benchmark times CUDA kernels and "
                 f"needs one.")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        sys.exit("--plot needs matplotlib, which is not installed.")

    subject = load_subject() if any(impl in FORCED_KERNELS for impl in args.impls) else None
    head_dims = args.head_dims
    compiled = tuple(subject.compiled_head_dims()) if subject is not None else None
    if compiled is not None:
        for d in head_dims:
            if d not in compiled:
                print(f"note: head_dim {d} is not compiled into {SUBJECT} (compiled: "
                      f"{', '.join(map(str, compiled))}); skipping it", flush=True)
        head_dims = [d for d in head_dims if d in compiled]

    torch.manual_seed(args.seed)
    nvidia_smi_gpu = gpu_for_nvidia_smi() if args.power else ""
    dtype = DTYPES[args.dtype]
    meta = {**environment(args.dtype, subject), "direction": args.direction}
    rows: list[dict] = []
    checks: list[dict] = []
    for case in benchmark_cases(head_dims, args.seqlens, args.causals, batch=args.batch, heads=args.heads,
                                heads_k=args.heads_k):
        inputs = make_inputs(case, dtype)
        label = (f"hdim {case.head_dim:>3} {'causal' if case.causal else 'non-causal':<10} "
                 f"seqlen {case.seqlen:>5} (b {case.batch}, h {heads_text(case.heads, case.kv_heads)})")
        subject_wrong = False
        if args.check:
            result = check_case(subject, inputs, case, args.dtype)
            checks.append(result)
            subject_wrong = not result["passed"]
            print(f"check {label}: {'ok' if result['passed'] else 'FAILED'}: {result['detail']}",
                  flush=True)
        errors: dict[str, str | None] = {}
        measures: dict[str, Callable[[int], float]] = {}
        samplers: dict[str, list[ClockPowerSampler]] = {impl: [] for impl in args.impls}
        for impl in args.impls:
            fn = make_runner(impl, inputs, case.causal, subject, args.direction)
            errors[impl] = "failed --check" if impl == SUBJECT and subject_wrong else first_call_error(fn)
            if errors[impl] is None:
                # Each round: warm-up (the full count in the first), then the median of its calls.
                def measure(round_index: int, fn=fn, impl=impl) -> float:
                    sampler = ClockPowerSampler(nvidia_smi_gpu) if args.power else None
                    if sampler is not None:
                        samplers[impl].append(sampler)
                    return median_ms(fn, args.warmup if round_index == 0 else min(args.warmup, 3), args.reps,
                                     args.min_time_ms, args.warmup_ms, sampler)
                measures[impl] = measure
        round_times = interleaved_rounds(measures, args.rounds)
        for impl in args.impls:
            error = errors[impl]
            ms = None if error else statistics.median(round_times[impl])
            speed = None if ms is None else tflops(case_flops(case, args.direction), ms)
            clock, power, power_samples = median_clock_power(samplers[impl])
            rows.append({"head_dim": case.head_dim, "seqlen": case.seqlen, "batch": case.batch,
                         "heads": case.heads, "heads_k": case.kv_heads, "causal": case.causal,
                         "dtype": args.dtype,
                         "direction": args.direction, "impl": impl, "ms": ms, "tflops": speed,
                         "ms_rounds": round_times.get(impl, []), "error": error,
                         "sm_clock_mhz": clock, "power_w": power, "power_samples": power_samples})
            result_text = f"not run: {error}" if error else f"{ms:8.3f} ms {speed:7.1f} TFLOPS"
            if clock is not None:
                result_text += f"  {clock:5.0f} MHz {power:4.0f} W ({power_samples} samples)"
            elif args.power and not error:
                result_text += "  (no clock samples: nvidia-smi printed none in the timed window)"
            print(f"{label} {impl:<18} {result_text}", flush=True)
        del inputs
        torch.cuda.empty_cache()

    memory: list[dict] = []
    if args.memory:
        if compiled is not None and args.memory_head_dim not in compiled:
            print(f"note: --memory-head-dim {args.memory_head_dim} is not compiled into "
                  f"{SUBJECT}; skipping the memory measurement", flush=True)
        else:
            for causal in args.causals:
                case = benchmark_cases([args.memory_head_dim], [args.memory_seqlen], [causal])[0]
                memory += measure_memory(case, dtype, subject)

    report = render_report(meta, rows, args.impls, checks, memory)
    if args.json is not None:
        payload = {**meta, "flop_convention": "forward 4*b*h*sq*sk*d, halved for causal",
                   "rows": rows, "checks": checks, "memory": memory}
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    if args.markdown is not None:
        args.markdown.write_text(report)
    if args.plot is not None and rows:
        plot_tflops(rows, args.impls, args.plot,
                    f"Forward attention, {args.dtype}, {meta['gpu']}")
    elif args.plot is not None:
        print(f"note: nothing was measured, so no plot was written to {args.plot}", flush=True)
    print()
    print(report, end="")
    return 1 if any(not c["passed"] for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())

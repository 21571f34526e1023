"""Plot docs/results/side_by_side_h200_bf16.json: forward and backward TFLOPS of flash_cutlass,
torch SDPA's flash backend (FlashAttention-2) and its cuDNN backend over the sequence length.

    python3 tools/plot_results.py [--json PATH] [--out PATH]

The JSON is a list of records with grid ("proj": 16k tokens per batch, hidden 2048), b, s, h, d,
causal, backend ("flash_cutlass", "flash", "cudnn"), fwd_tflops and bwd_tflops. Needs matplotlib
(not a project requirement: pip install matplotlib).
"""

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BACKENDS = (("flash_cutlass", "flash_cutlass", "tab:red"),
            ("cudnn", "SDPA cuDNN", "tab:blue"),
            ("flash", "SDPA flash (FlashAttention-2)", "tab:gray"))
DIRECTIONS = (("fwd_tflops", "forward"), ("bwd_tflops", "backward"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(REPO / "docs" / "results" / "side_by_side_h200_bf16.json"))
    parser.add_argument("--out", default=str(REPO / "docs" / "results" / "performance_h200_bf16.png"))
    args = parser.parse_args()

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in json.loads(Path(args.json).read_text()) if r["grid"] == "proj"]
    head_dims = sorted({r["d"] for r in records})
    fig, axes = plt.subplots(len(DIRECTIONS), len(head_dims), figsize=(4.2 * len(head_dims), 7.5),
                             sharex=True, sharey=True, squeeze=False)
    for row, (field, direction) in enumerate(DIRECTIONS):
        for col, head_dim in enumerate(head_dims):
            ax = axes[row][col]
            for backend, label, color in BACKENDS:
                for causal, style in ((False, "-"), (True, "--")):
                    points = sorted((r["s"], r[field]) for r in records
                                    if r["d"] == head_dim and r["backend"] == backend and r["causal"] == causal)
                    if points:
                        ax.plot([p[0] for p in points], [p[1] for p in points], style, color=color, marker="o",
                                markersize=4, label=f"{label}{', causal' if causal else ''}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r["s"] for r in records}))
            ax.set_xticklabels([f"{s // 1024}k" for s in sorted({r["s"] for r in records})])
            ax.set_ylim(0, 800)
            ax.grid(True, alpha=0.3)
            ax.set_title(f"{direction}, head dim {head_dim}")
            if col == 0:
                ax.set_ylabel("TFLOPS")
            if row == len(DIRECTIONS) - 1:
                ax.set_xlabel("sequence length (16k tokens per batch)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=9, frameon=False)
    fig.suptitle("H200, bf16, hidden 2048: flash_attention(...) and .backward() vs torch SDPA backends")
    fig.tight_layout(rect=(0, 0.08, 1, 0.97))
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

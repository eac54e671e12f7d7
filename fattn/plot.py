"""Pictures of benchmark results (matplotlib, an optional extra: `pip install fattn[plot]`).

    python -m fattn.plot evidence/bench/h100_v2_fa3.json -o fa3.png
    python -m fattn.bench --grid fa3 --plot fa3.png

Sequence-length grids (fa3, cpu): TFLOP/s against sequence length, one panel per (head dim, causal), one line per
implementation -- the layout of the FlashAttention-3 paper's figures.  Other grids (seeds, decode): p50 latency as
grouped bars per point.  The cp grid (fattn.testing.cp): scaling efficiency against tokens (plot_cp_efficiency).
"""
import argparse
import json
import os
import sys

FORMATS = ("png", "pdf", "svg", "eps", "ps", "jpg", "jpeg")  # what the pictures are written as, by file name


def output_path(path):
    """The file a picture goes to: `path`, with .png added when it has no suffix (as matplotlib would)."""
    return path if os.path.splitext(path)[1] else path + ".png"


def _plt():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("fattn.plot needs matplotlib: pip install 'fattn[plot]' (or pip install matplotlib)") from None
    return plt


def _style(impl):
    """fattn variants solid, torch backends dashed."""
    return "-" if impl.startswith("fattn:") else "--"


def _title(meta):
    return f"{meta.get('gpu', '?')}  torch {meta.get('torch', '?')}  git {str(meta.get('git_sha') or '?')[:7]}"


def is_seqlen_grid(rows):
    return len({r["Sq"] for r in rows}) > 1 and all(r["Sq"] == r["Sk"] for r in rows)


def plot_seqlen(rows, meta, path):
    """TFLOP/s vs sequence length; a panel per (D, causal, dtype)."""
    plt = _plt()
    panels = sorted({(r["D"], str(r["causal"]), r["dtype"]) for r in rows})
    cols = min(3, len(panels))
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.6 * nrows), squeeze=False)
    impls = sorted({r["impl"] for r in rows})
    for ax, (d, causal, dtype) in zip(axes.flat, panels):
        for impl in impls:
            pts = sorted((r["Sq"], r["tflops"]) for r in rows
                         if r["impl"] == impl and r["D"] == d and str(r["causal"]) == causal and r["dtype"] == dtype)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], _style(impl), marker="o", ms=3, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"D={d} {'causal' if causal not in ('False', 'None') else 'non-causal'} {dtype}", fontsize=10)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(_title(meta), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency(rows, meta, path):
    """Grouped bars of p50 latency per point."""
    plt = _plt()
    keys = sorted({(r["B"], r["H"], r["Sq"], r["Sk"], r["D"], str(r["causal"])) for r in rows})
    impls = sorted({r["impl"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(keys)), 4))
    width = 0.8 / len(impls)
    for n, impl in enumerate(impls):
        by = {(r["B"], r["H"], r["Sq"], r["Sk"], r["D"], str(r["causal"])): r["p50_us"] for r in rows if r["impl"] == impl}
        xs = [i + n * width for i, k in enumerate(keys) if k in by]
        ax.bar(xs, [by[k] for k in keys if k in by], width, label=impl, hatch="" if impl.startswith("fattn:") else "//")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
    ax.set_xticklabels([f"B{k[0]} H{k[1]}\nSq{k[2]} Sk{k[3]}\n{'causal' if k[5] not in ('False', 'None') else ''}"
                        for k in keys], fontsize=7)
    ax.set_ylabel("p50 latency (us)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(_title(meta), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(rows, meta, path, impls=None):
    """The right picture for these rows; `impls` limits the lines (e.g. to drop torch:math)."""
    rows = [r for r in rows if r.get("tflops") and (impls is None or r["impl"] in impls)]
    if not rows:
        raise ValueError("no rows to plot")
    path = output_path(path)
    (plot_seqlen if is_seqlen_grid(rows) else plot_latency)(rows, meta, path)
    return path


def plot_cp_efficiency(rows, meta_, path):
    """PNG: efficiency T_1 / (gpus * T) against tokens, a panel per mode, a line per (gpus, impl, strategy, kv
    heads): a colour per (impl, strategy, kv heads), circles for fattn and squares for torch, a line style per GPU
    count; a point measured more than once shows the last row's value."""
    plt = _plt()
    modes = sorted({r["mode"] for r in rows})
    counts = sorted({r["gpus"] for r in rows if r["gpus"] > 1})
    styles = dict(zip(counts, ["-", "--", ":", "-."] * 4))
    series = sorted({(r["impl"], r["strategy"], r["kv_heads"]) for r in rows if r["gpus"] > 1})
    colours = {key: plt.get_cmap("tab10")(i % 10) for i, key in enumerate(series)}
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        lines = {}
        for r in rows:
            if r["mode"] == mode and r["gpus"] > 1 and r["efficiency"]:
                lines.setdefault((r["gpus"], r["impl"], r["strategy"], r["kv_heads"]), {})[r["tokens"]] = \
                    r["efficiency"]
        for (gpus, impl, strategy, kv), pts in sorted(lines.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], styles[gpus], marker="o" if impl == "fattn" else "s",
                    color=colours[(impl, strategy, kv)], label=f"{gpus} GPUs {impl} {strategy} H_kv={kv}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel("efficiency T_1 / (gpus T)")
        ax.set_ylim(0, 1.15)
        ax.set_title(f"{mode}, {' and '.join(map(str, counts))} x {meta_['device']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    shas = sorted({str(m)[:7] for m in meta_.get("shas", [meta_.get("fattn_git_sha")])})
    fig.suptitle(f"context parallelism, torch {meta_['torch']}, git {', '.join(shas)}")
    fig.tight_layout()
    path = output_path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m fattn.plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="a file written by python -m fattn.bench --json")
    ap.add_argument("-o", "--out", required=True, help=f"the picture's path ({', '.join(FORMATS)}; none: .png)")
    ap.add_argument("--impls", help="comma-separated implementations to draw (default: all)")
    args = ap.parse_args(argv)
    from .testing.report import check_writable

    check_writable(output_path(args.out), "-o", ap.error, FORMATS)
    try:
        with open(args.json) as f:
            doc = json.load(f)
        rows, meta = doc["rows"], doc["meta"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"{args.json}: not a readable fattn.bench --json file ({type(e).__name__}: {e})")
    try:
        path = plot(rows, meta, args.out, args.impls.split(",") if args.impls else None)
    except (ValueError, KeyError, TypeError) as e:
        ap.error(f"{args.json}: {e}")
    except OSError as e:
        print(f"fattn.plot: -o {args.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-point ratio table from `python -m fattn.bench --json` files: each fattn variant's p50 against torch flash
(FlashAttention-2) and torch cudnn measured in the same run (> 1 = fattn faster), as Markdown.

    python3 bench/ratios.py evidence/bench/h100_v2_fa3.json [more.json ...] > table.md
"""
import json
import sys


def table(path):
    doc = json.load(open(path))
    meta, rows = doc["meta"], doc["rows"]
    key = lambda r: (r["grid"], r["D"], r["B"], r["H"], r["Sq"], r["Sk"], str(r["causal"]), r["dtype"])  # noqa: E731
    points = {}
    for r in rows:
        points.setdefault(key(r), {})[r["impl"]] = r
    impls = sorted({r["impl"] for r in rows if r["impl"].startswith("fattn:")})
    out = [f"### {path}", "",
           f"{meta['gpu']}, driver {meta['driver']}, CUDA {meta['cuda']}, torch {meta['torch']}, cuDNN {meta['cudnn']}, "
           f"git {meta['git_sha']}, {meta['date']}", ""]
    head = "| D | B | H | Sq | Sk | causal | dtype | torch flash TF/s | torch cudnn TF/s |"
    sep = "|---|---|---|---|---|---|---|---|---|"
    for i in impls:
        head += f" {i} TF/s | vs flash | vs cudnn |"
        sep += "---|---|---|"
    out += [head, sep]
    for k in sorted(points, key=lambda k: (k[1], k[7], k[6], k[4])):
        p = points[k]
        fl, cu = p.get("torch:flash"), p.get("torch:cudnn")
        line = f"| {k[1]} | {k[2]} | {k[3]} | {k[4]} | {k[5]} | {k[6]} | {k[7]} | " \
               f"{fl['tflops']:.0f} | " if fl else f"| {k[1]} | {k[2]} | {k[3]} | {k[4]} | {k[5]} | {k[6]} | {k[7]} | - | "
        line += f"{cu['tflops']:.0f} |" if cu else "- |"
        for i in impls:
            f = p.get(i)
            if not f:
                line += " - | - | - |"
                continue
            vf = f"{fl['p50_us'] / f['p50_us']:.2f}" if fl else "-"
            vc = f"{cu['p50_us'] / f['p50_us']:.2f}" if cu else "-"
            line += f" {f['tflops']:.0f} | {vf} | {vc} |"
        out.append(line)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print("\n".join(table(p) for p in sys.argv[1:]))

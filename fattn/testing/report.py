"""Suite results as tables: aligned text (printed by fattn.bench), JSON (the evidence format), CSV and Markdown."""
import csv
import json
import math
import os

from . import grids
from .suite import COLUMNS, bad


def pivot(rows):
    """(impls in first-seen order, fattn impls, [(grid, [(first row, {impl: row})])])."""
    impls, groups = [], {}
    for r in rows:
        if r["impl"] not in impls:
            impls.append(r["impl"])
        pts = groups.setdefault(r["grid"], {})
        pts.setdefault(grids.key(r), (r, {}))[1][r["impl"]] = r
    return impls, [i for i in impls if i.startswith("fattn:")], [(g, list(p.values())) for g, p in groups.items()]


def _shape_cells(r):
    return [grids.describe(r), str(r["causal"] or "-"), r["dtype"], r.get("mode", "fwd")]


def _ratio(by, i):
    x = by.get(i, {}).get("ratio_vs_best_torch")
    return f"{x:.2f}x" if x else "-"


def format_table(rows):
    """Aligned text: one line per point, p50 us / TFLOP/s per impl, each fattn impl's ratio to the best torch."""
    impls, fimpls, groups = pivot(rows)
    lines = []
    for grid, pts in groups:
        table = [["shape", "causal", "dtype", "mode"] + [f"{i} us/TF" for i in impls] + [f"{i}/torch" for i in fimpls]]
        for first, by in pts:
            cells = _shape_cells(first)
            cells += [f"{by[i]['p50_us']:.1f}/{by[i]['tflops']:.3g}{bad(by[i])}" if i in by else "-" for i in impls]
            cells += [_ratio(by, i) for i in fimpls]
            table.append(cells)
        widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
        lines.append(f"== {grid} ==")
        lines += ["  ".join(c.rjust(w) if j > 3 else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))).rstrip()
                  for row in table]
    if any(bad(r) for r in rows):
        lines.append("! = failed validation (max_abs_err above the accuracy rule's bound)")
    return "\n".join(lines)


def check_writable(path, flag, error, suffixes=None):
    """Before a run, not after it: `path` can be written -- not a folder, in a folder that exists and may be written,
    with one of `suffixes` (lower case, no dot) where given -- else error(message) (an argparse error)."""
    full = os.path.abspath(path)
    folder = os.path.dirname(full)
    if os.path.isdir(full):
        error(f"{flag} {path}: is a folder; give a file name")
    if not os.path.isdir(folder):
        error(f"{flag} {path}: no folder {folder}")
    if not os.access(folder, os.W_OK) or (os.path.exists(full) and not os.access(full, os.W_OK)):
        error(f"{flag} {path}: not writable")
    ext = os.path.splitext(full)[1].lstrip(".").lower()
    if suffixes is not None and ext not in suffixes:
        error(f"{flag} {path}: the file name must end in .{', .'.join(suffixes)}")


def _finite(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


def write_json(path, meta, rows):
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [{c: _finite(r.get(c)) for c in COLUMNS} for r in rows]}, f, indent=1)
        f.write("\n")


def read_json(path):
    """(meta, rows) of a write_json file; rows of older files get tol = None and ratio_noise = None.  A file of
    another shape (not {"meta": {...}, "rows": [...]}, or rows without a benchmark point and impl) raises
    ValueError saying what is missing."""
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or not isinstance(doc.get("meta"), dict) or not isinstance(doc.get("rows"), list):
        raise ValueError('not a fattn.bench --json file (expected {"meta": {...}, "rows": [...]})')
    need = tuple(k for k in grids.POINT_KEYS if k != "mode") + ("impl",)  # (mode: older files have none)
    for n, r in enumerate(doc["rows"]):
        missing = [k for k in need if not isinstance(r, dict) or k not in r]
        if missing:
            raise ValueError(f"row {n} has no {', '.join(missing)}: not a fattn.bench --json row")
        r.setdefault("tol", None)
        r.setdefault("ratio_noise", None)
    return doc["meta"], doc["rows"]


def write_csv(path, meta, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for r in rows:
            w.writerow(["false" if r.get(c) is False else "" if r.get(c) is None else r[c] for c in COLUMNS])


def write_md(path, meta, rows):
    impls, fimpls, groups = pivot(rows)
    out = ["# fattn benchmark", ""]
    out += [f"- **{k}**: {'`' + str(v) + '`' if k == 'command' else 'n/a' if v is None else v}"
            for k, v in meta.items() if k != "notes"]
    out += [""] + [f"> note: {n}" for n in meta["notes"]] + ([""] if meta["notes"] else [])
    for grid, pts in groups:
        head = ["shape", "causal", "dtype", "mode"]
        for i in impls:
            head += [f"{i} p50 us", f"{i} TFLOP/s"]
        head += [f"{i} / best torch" for i in fimpls]
        out += [f"## {grid}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for first, by in pts:
            cells = _shape_cells(first)
            for i in impls:
                cells += [f"{by[i]['p50_us']:.1f}{bad(by[i])}", f"{by[i]['tflops']:.3g}"] if i in by else ["-", "-"]
            cells += [_ratio(by, i) for i in fimpls]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    with open(path, "w") as f:
        f.write("\n".join(out))

"""The run's outputs: ``summary.json`` and, with ``--compare``, ``loss.png``.

matplotlib is imported only to draw the plot; without it a plain PNG (curves and
axes, no text) is written by :func:`plain_png` and a note says how to get labels.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

__all__ = ["steps_to_reach", "compare_runs", "crossings", "write_json", "plot_losses", "plain_png"]

COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189)]


def steps_to_reach(curve: list, target: float) -> dict | None:
    """First evaluated step with loss <= ``target``, and the step linearly interpolated
    between evaluations; None if the curve never gets there.

    Example::

        >>> steps_to_reach([[0, 4.0], [50, 2.0], [100, 1.0]], 1.5)
        {'step': 100, 'interpolated': 75.0}
    """
    prev = None
    for step, loss in curve:
        if loss <= target:
            interp = float(step)
            if prev is not None and prev[1] > loss:
                interp = prev[0] + (prev[1] - target) / (prev[1] - loss) * (step - prev[0])
            return {"step": int(step), "interpolated": round(interp, 1)}
        prev = (step, loss)
    return None


def compare_runs(runs: dict, baseline: str) -> dict:
    """Where every run reaches the baseline's final validation loss."""
    target = runs[baseline]["final_val_loss"]
    out = {"baseline": baseline, "target_val_loss": target, "steps_to_reach": {}, "step_ratio": {}}
    for name, rec in runs.items():
        hit = steps_to_reach(rec["val_curve"], target)
        out["steps_to_reach"][name] = hit
        if hit and hit["interpolated"] > 0:
            out["step_ratio"][name] = round(runs[baseline]["steps"] / hit["interpolated"], 2)
    return out


def crossings(comparison: dict | None) -> list[dict]:
    """Where each run other than the baseline crosses the baseline's final validation loss:
    ``name``, ``step`` (interpolated), ``loss`` (the target), ``ratio`` and a ``label``.

    Example::

        >>> cmp = compare_runs({"muon": {"val_curve": [[0, 4.0], [50, 2.0], [100, 1.0]], "final_val_loss": 1.0,
        ...                              "steps": 100},
        ...                     "adamw": {"val_curve": [[0, 4.0], [50, 3.0], [100, 1.5]], "final_val_loss": 1.5,
        ...                               "steps": 100}}, "adamw")
        >>> [(c["name"], c["step"], c["loss"], c["ratio"]) for c in crossings(cmp)]
        [('muon', 75.0, 1.5, 1.33)]
        >>> print(crossings(cmp)[0]["label"])
        muon reaches adamw's final val loss at step ~75: 1.33x fewer steps
    """
    if not comparison:
        return []
    out = []
    base, target = comparison["baseline"], comparison["target_val_loss"]
    for name, hit in comparison["steps_to_reach"].items():
        if name == base or not hit or name not in comparison["step_ratio"]:
            continue
        ratio = comparison["step_ratio"][name]
        out.append({"name": name, "step": hit["interpolated"], "loss": target, "ratio": ratio,
                    "label": f"{name} reaches {base}'s final val loss at step ~{hit['interpolated']:.0f}: "
                             f"{ratio:.2f}x fewer steps"})
    return out


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _smooth(ys: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= k:
            acc -= ys[i - k]
        out.append(acc / min(i + 1, k))
    return out


def plot_losses(runs: dict, path: Path, title: str, comparison: dict | None = None) -> str:
    """Validation (solid) and smoothed training (faint) loss per run; with ``comparison``
    (:func:`compare_runs`) a dotted line at the baseline's final validation loss and a
    marker where each other run crosses it, labelled "N x fewer steps". Returns a note."""
    marks = crossings(comparison)
    try:
        from matplotlib.figure import Figure
    except ImportError:
        plain_png(runs, path, marks=marks)
        return "matplotlib is not installed: loss.png has curves but no labels (pip install matplotlib)"
    fig = Figure(figsize=(8, 5.6), dpi=100)
    ax = fig.subplots()
    lows = []
    for i, (name, rec) in enumerate(runs.items()):
        c = tuple(v / 255 for v in COLORS[i % len(COLORS)])
        tr = rec["train_curve"]
        if tr:
            smooth = _smooth([v for _, v in tr], 20)
            lows.append(min(smooth))
            ax.plot([s for s, _ in tr], smooth, color=c, alpha=0.3, lw=1)
        va = rec["val_curve"]
        ax.plot([s for s, _ in va], [v for _, v in va], color=c, marker="o", ms=3, lw=2,
                label=f"{name} (val {rec['final_val_loss']:.3f})")
    if comparison:
        ax.axhline(comparison["target_val_loss"], color="0.4", ls=":", lw=1)
    for m in marks:
        ax.axvline(m["step"], color="0.4", ls=":", lw=1)
        ax.plot([m["step"]], [m["loss"]], marker="*", ms=14, color="black", ls="none", label=m["label"])
        ax.annotate(f"{m['ratio']:.2f}x fewer steps", (m["step"], m["loss"]), textcoords="offset points",
                    xytext=(8, 10), fontsize=10, fontweight="bold")
    vals = [v for rec in runs.values() for _, v in rec["val_curve"][1:]]
    if vals:
        ax.set_ylim(min(vals + lows) - 0.05, max(vals) + 0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (val: solid, train: faint)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    # below the axes: inside, it covered the curves where they start to part
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return ""


def plain_png(runs: dict, path: Path, w: int = 640, h: int = 400, marks: list[dict] = ()) -> None:
    """A dependency-free PNG of the validation curves (axes box, one colour per run) and
    grey cross-hairs at each of :func:`crossings`' ``marks``."""
    img = [bytearray(b"\xff" * (3 * w)) for _ in range(h)]
    m = 30
    pts = [(s, v) for rec in runs.values() for s, v in rec["val_curve"]]
    if not pts:
        pts = [(0, 0.0), (1, 1.0)]
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts) or 1
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    y1 = y1 if y1 > y0 else y0 + 1

    def px(s, v):
        return (m + round((s - x0) / max(x1 - x0, 1) * (w - 2 * m)), h - m - round((v - y0) / (y1 - y0) * (h - 2 * m)))

    def dot(x, y, c):
        if 0 <= x < w and 0 <= y < h:
            img[y][3 * x:3 * x + 3] = bytes(c)

    def line(a, b, c, thick=1):
        n = max(abs(b[0] - a[0]), abs(b[1] - a[1]), 1)
        for i in range(n + 1):
            x, y = a[0] + (b[0] - a[0]) * i // n, a[1] + (b[1] - a[1]) * i // n
            for dx in range(thick):
                for dy in range(thick):
                    dot(x + dx, y + dy, c)

    k = (0, 0, 0)
    for a, b in [((m, m), (w - m, m)), ((w - m, m), (w - m, h - m)), ((w - m, h - m), (m, h - m)), ((m, h - m), (m, m))]:
        line(a, b, k)
    grey = (128, 128, 128)
    for mk in marks:
        x, y = px(mk["step"], mk["loss"])
        line((m, y), (w - m, y), grey)
        line((x, m), (x, h - m), grey)
        line((x - 6, y - 6), (x + 6, y + 6), (0, 0, 0), thick=2)
        line((x - 6, y + 6), (x + 6, y - 6), (0, 0, 0), thick=2)
    for i, rec in enumerate(runs.values()):
        c = COLORS[i % len(COLORS)]
        cur = [px(s, v) for s, v in rec["val_curve"]]
        for a, b in zip(cur, cur[1:]):
            line(a, b, c, thick=2)
    raw = b"".join(b"\x00" + bytes(r) for r in img)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png)

"""The SM x time picture of a Timeline (PNG): one row per SM, tasks coloured by kind, waits grey.

Drawn with matplotlib's object API on the Agg canvas (no pyplot, no global backend switch, no
display needed). Without matplotlib (it is not a dependency of mpk, and GPU hosts may lack it) a
plain raster of the same rows is written instead: no axes or legend, colours in kind order.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

from mpk.profile.timeline import Timeline

WAIT_COLOUR = "#d9d9d9"
STEP_COLOUR = "#404040"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# tab10 then tab20's lighter half: matplotlib's own cycles, also used by the raster fallback.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896",
           "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5")


def kind_colours(kinds: tuple[str, ...]) -> dict[str, str]:
    return {k: PALETTE[i % len(PALETTE)] for i, k in enumerate(kinds)}


def draw_timeline(tl: Timeline, path: str | Path, *, title: str | None = None,
                  engine: str = "auto") -> Path:
    """Write the picture to `path`. `engine`: 'matplotlib', 'raster' or 'auto' (matplotlib when
    it is installed). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if engine not in ("auto", "matplotlib", "raster"):
        raise ValueError(f"engine must be 'auto', 'matplotlib' or 'raster', got {engine!r}")
    if engine != "raster":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            if engine == "matplotlib":
                raise
        else:
            _draw_matplotlib(tl, path, title)
            return path
    path.write_bytes(_raster_png(tl))
    return path


def _rects(x0: np.ndarray, x1: np.ndarray, y: np.ndarray, height: float) -> np.ndarray:
    """[n, 4, 2] rectangle vertices for a PolyCollection."""
    lo, hi = y - height / 2, y + height / 2
    return np.stack([np.stack([x0, lo], 1), np.stack([x1, lo], 1), np.stack([x1, hi], 1),
                     np.stack([x0, hi], 1)], axis=1)


def _draw_matplotlib(tl: Timeline, path: Path, title: str | None) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    num_sms = tl.plan.num_sms
    fig = Figure(figsize=(16, float(np.clip(2 + num_sms * 0.07, 4, 14))), dpi=150)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    us = 1e-3
    y = tl.sm.astype(float)
    waited = tl.wait_ns > 0
    if waited.any():
        ax.add_collection(PolyCollection(
            _rects(tl.start_ns[waited] * us, tl.ready_ns[waited] * us, y[waited], 0.8),
            facecolors=WAIT_COLOUR, linewidths=0))
    colours = kind_colours(tl.plan.kinds)
    handles = []
    for kind_id, kind in enumerate(tl.plan.kinds):
        sel = tl.kind_id == kind_id
        if not sel.any():
            continue
        ax.add_collection(PolyCollection(
            _rects(tl.ready_ns[sel] * us, tl.end_ns[sel] * us, y[sel], 0.8),
            facecolors=colours[kind], linewidths=0))
        handles.append(Patch(facecolor=colours[kind], label=kind))
    handles.append(Patch(facecolor=WAIT_COLOUR, label="wait (counters)"))
    handles.append(Line2D([], [], color=STEP_COLOUR, linewidth=0.8, linestyle="--",
                          label="a step begins"))
    for begin, _ in tl.step_spans():
        ax.axvline(begin * us, color=STEP_COLOUR, linewidth=0.6, linestyle="--")
    ax.set_xlim(0, max(tl.span_ns * us, 1e-3))
    ax.set_ylim(num_sms - 0.5, -0.5)  # SM 0 on top, as in the trace
    ax.set_xlabel("time since launch start (us)")
    ax.set_ylabel("SM")
    ax.set_title(title or f"megakernel timeline: {num_sms} SMs, {tl.num_steps} steps, "
                          f"{tl.ns_per_step / 1e3:.1f} us/step")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)
    fig.tight_layout()
    fig.savefig(path, format="png")


def _raster_png(tl: Timeline, width: int = 1600, row: int = 6) -> bytes:
    """The rows as a bare RGB raster: `row` pixels per SM (one of them a gap), white = idle."""
    num_sms = tl.plan.num_sms
    img = np.full((num_sms * row, width, 3), 255, dtype=np.uint8)
    scale = (width - 1) / max(tl.span_ns, 1)
    rgb = [_hex_rgb(c) for c in kind_colours(tl.plan.kinds).values()]
    wait = _hex_rgb(WAIT_COLOUR)
    for e in range(len(tl)):
        top = int(tl.sm[e]) * row
        a, b, c = (int(v * scale) for v in (tl.start_ns[e], tl.ready_ns[e], tl.end_ns[e]))
        img[top:top + row - 1, a:b] = wait
        img[top:top + row - 1, b:max(c, b + 1)] = rgb[int(tl.kind_id[e])]
    return png_bytes(img)


def _hex_rgb(colour: str) -> tuple[int, int, int]:
    return int(colour[1:3], 16), int(colour[3:5], 16), int(colour[5:7], 16)


def png_bytes(rgb: np.ndarray) -> bytes:
    """A minimal PNG (8-bit RGB, no filter) of an [h, w, 3] uint8 array."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    return (PNG_MAGIC + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))

"""The report page's building blocks: sections, tables, figures as embedded PNG, and number
formats. Every text is HTML-escaped here; plots are drawn under html.py's plain-text settings."""

from __future__ import annotations

import base64
import html
import io
import math

import numpy as np


def section(section_id: str, heading: str, *parts: str) -> str:
    return f'<section id="{section_id}">\n<h2>{escape(heading)}</h2>\n' + "\n".join(parts) + "\n</section>"


def figure(width: float, height: float, nrows: int = 1, ncols: int = 1):
    """A figure on matplotlib's Agg canvas and its axes, as a flat list."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(np.ravel(fig.subplots(nrows, ncols, squeeze=False)))


def img(fig, alt: str) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, metadata={"Software": None})  # no version/URL text in the file
    data = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def table(headers, rows, *, header: bool = True, escaped: bool = False, note: str | None = None) -> str:
    def cell(value: str, tag: str) -> str:
        text = str(value) if escaped else escape(str(value))
        attrs = ' class="n"' if tag == "td" and looks_numeric(str(value)) else ""
        return f"<{tag}{attrs}>{text}</{tag}>"

    out = ["<table>"]
    if header:
        out.append("<tr>" + "".join(cell(h, "th") for h in headers) + "</tr>")
    for row in rows:
        out.append("<tr>" + "".join(cell(v, "td") for v in row) + "</tr>")
    out.append("</table>")
    if note:
        out.append(f'<p class="note">{escape(note)}</p>')
    return "\n".join(out)


def looks_numeric(text: str) -> bool:
    return bool(text) and text.lstrip("+-").replace(",", "").replace(".", "", 1).rstrip("%").isdigit()


def escape(text: str) -> str:
    return html.escape(text, quote=True)


def pct(value: float | None) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1%}"


def num(value: float | None, digits: int = 3) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def short(value, limit: int = 60) -> str:
    text = "" if value is None else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"

"""The report page's building blocks: the page itself, sections, tables, figures as embedded PNG,
and number formats. Every text is HTML-escaped here; plots are drawn under `PLAIN_TEXT`."""

from __future__ import annotations

import base64
import html
import io
import math
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: .8em 0; font-size: .92em; }
th, td { border: 1px solid #ddd; padding: .25em .6em; text-align: left; vertical-align: top; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f4f4f4; }
img { max-width: 100%; }
.note { color: #555; font-size: .92em; }
.warn { color: #a04000; }
code, .mono { font-family: ui-monospace, monospace; font-size: .9em; }
nav a { margin-right: 1em; }
"""
# labels, ids and errors are data: `$x^$` is a label, not TeX for matplotlib to parse (and fail on)
PLAIN_TEXT = {"text.usetex": False, "text.parse_math": False}


def document(output: Path, nav: list[tuple[str, str]], sections: list[str]) -> str:
    """The whole HTML page about `output`: title, source line, a link per (section id, text) in
    `nav`, then the sections."""
    title = f"batchscore report — {output.name}"
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    links = "".join(f'<a href="#{escape(target)}">{escape(text)}</a>' for target, text in nav)
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
            f"<h1>{escape(title)}</h1>\n<p class=\"note\">{escape(str(output))}, generated {generated}</p>\n"
            f"<nav>{links}</nav>\n" + "\n".join(sections) + "\n</body>\n</html>\n")


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

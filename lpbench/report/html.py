"""The HTML report: one self-contained page (inline CSS, plots as base64 PNG), no network needed."""

from __future__ import annotations

import base64
import html
import time

from lpbench.report.tables import TextTable

PLOT_TITLES = {
    "throughput_vs_seq.png": "Throughput vs sequence length",
    "speedup.png": "Speedup over BF16",
    "loss_curves.png": "Training loss",
    "peak_memory.png": "Peak memory",
}

_CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 2rem auto;
       max-width: 1800px; padding: 0 1.5rem; color: #1d1d1f; background: #fff; line-height: 1.45; }
h1 { font-size: 1.7rem; margin-bottom: 0.2rem; }
h2 { font-size: 1.3rem; margin-top: 2.2rem; border-bottom: 2px solid #76b900; padding-bottom: 0.2rem; }
.meta { color: #555; font-size: 0.9rem; }
.caption { color: #444; font-size: 0.88rem; margin: 0.3rem 0 0.6rem; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; font-size: 0.82rem; width: 100%; }
th, td { padding: 0.3rem 0.45rem; border-bottom: 1px solid #e3e3e3; text-align: left; }
th { background: #f4f6f0; position: sticky; top: 0; vertical-align: bottom; }
td.num, td:nth-child(-n+2) { white-space: nowrap; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.group td { border-top: 2px solid #b8c4a6; }
tbody tr:hover { background: #fafcf5; }
ul.notes { font-size: 0.85rem; color: #7a1f1f; }
figure { margin: 1.2rem 0 2rem; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-weight: 600; margin-bottom: 0.4rem; }
nav a { margin-right: 1rem; }
"""


def render_page(
    tables: list[TextTable], plots: dict[str, bytes], *, title: str = "lpbench report", meta: list[str] = ()
) -> str:
    e = html.escape
    anchors = [(f"t{i}", t.title) for i, t in enumerate(tables)] + ([("plots", "Plots")] if plots else [])
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{e(title)}</h1>",
    ]
    parts += [f'<p class="meta">{e(m)}</p>' for m in meta]
    parts.append(f'<p class="meta">generated {e(time.strftime("%Y-%m-%d %H:%M:%S %Z"))}</p>')
    if anchors:
        parts.append("<nav>" + "".join(f'<a href="#{a}">{e(t)}</a>' for a, t in anchors) + "</nav>")
    if not tables:
        parts.append("<p>No runs recorded.</p>")
    for i, t in enumerate(tables):
        parts.append(f'<section id="t{i}">{t.to_html(level=2)}</section>')
    if plots:
        parts.append('<section id="plots"><h2>Plots</h2>')
        for name, png in plots.items():
            data = base64.b64encode(png).decode("ascii")
            caption = PLOT_TITLES.get(name, name)
            parts.append(
                f"<figure><figcaption>{e(caption)}</figcaption>"
                f'<img alt="{e(caption)}" src="data:image/png;base64,{data}"></figure>'
            )
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)

"""The HTML report: JCT CDF, utilization over time and queue length, one trace per policy,
plus the summary table. plotly.js is embedded in the file (no CDN, works offline).

plotly is imported here only, and lazily, so the rest of scheduler/ stays numpy + stdlib.
"""
from __future__ import annotations

import html
import pathlib

import numpy as np

from .metrics import format_table

MAX_POINTS = 4000  # per line; longer series are thinned evenly (the table uses exact values)


def _thin(*columns):
    n = columns[0].shape[0]
    if n <= MAX_POINTS:
        return columns
    idx = np.unique(np.linspace(0, n - 1, MAX_POINTS).astype(np.int64))
    return tuple(c[idx] for c in columns)


def write_report(results, path, title="Meridian simulator", command=None):
    """Writes the report for a list of SimResult to `path` (HTML); returns the path."""
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ImportError as exc:  # pragma: no cover - plotly is a pinned dependency
        raise RuntimeError("the HTML report needs plotly (pip install plotly); "
                           "run without --report to get the table only") from exc

    fig = make_subplots(
        rows=3, cols=1, vertical_spacing=0.08,
        subplot_titles=("Job completion time (CDF)", "Utilization over time (allocated solid, useful dotted)",
                        "Jobs waiting"),
    )
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    for i, r in enumerate(results):
        color = palette[i % len(palette)]
        done = ~np.isnan(r.finish)
        jct = np.sort((r.finish - r.submit)[done]) / 3600.0
        cdf = np.arange(1, jct.shape[0] + 1) / max(jct.shape[0], 1)
        x, y = _thin(jct, cdf)
        fig.add_trace(go.Scatter(x=x, y=y, name=r.label, legendgroup=r.label,
                                 line=dict(color=color)), row=1, col=1)
        s = r.samples
        days = s["t"] / 86400.0
        alloc = s["allocated"] / r.n_devices
        useful = s["useful"] / r.n_devices
        t1, a1, u1, p1 = _thin(days, alloc, useful, s["pending"])
        fig.add_trace(go.Scatter(x=t1, y=a1, name=f"{r.label} allocated", legendgroup=r.label,
                                 showlegend=False, line=dict(color=color, width=1)), row=2, col=1)
        fig.add_trace(go.Scatter(x=t1, y=u1, name=f"{r.label} useful", legendgroup=r.label,
                                 showlegend=False, line=dict(color=color, width=1, dash="dot")), row=2, col=1)
        fig.add_trace(go.Scatter(x=t1, y=p1, name=f"{r.label} waiting", legendgroup=r.label,
                                 showlegend=False, line=dict(color=color, width=1)), row=3, col=1)
    fig.update_xaxes(title_text="JCT (hours, log)", type="log", row=1, col=1)
    fig.update_yaxes(title_text="fraction of jobs", row=1, col=1)
    fig.update_xaxes(title_text="days", row=2, col=1)
    fig.update_yaxes(title_text="fraction of devices", row=2, col=1)
    fig.update_xaxes(title_text="days", row=3, col=1)
    fig.update_yaxes(title_text="pending jobs", row=3, col=1)
    fig.update_layout(height=1200, title=title)

    table = format_table([r.summary() for r in results])
    head = results[0] if results else None
    meta = ""
    if head is not None:
        meta = f"trace {html.escape(head.trace)}, fleet {html.escape(head.fleet)} ({head.n_devices} devices)"
    body = fig.to_html(full_html=False, include_plotlyjs=True)
    command_html = f"<p>Command: <code>{html.escape(command)}</code></p>" if command else ""
    page = (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title></head><body>"
        f"<h1>{html.escape(title)}</h1><p>{meta}</p>{command_html}"
        f"<pre>{html.escape(table)}</pre>{body}</body></html>"
    )
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path

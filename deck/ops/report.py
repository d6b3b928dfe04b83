"""``deck report``: an HTML page about one URI, for people who would rather look than read.

Three pictures (PNG files next to the page, drawn with matplotlib's object API, no display
needed): the lineage graph (checkpoints by step and layer, edges = what each applies on or was
merged from), the bytes of every checkpoint, and the restore cost of every restorable step (bytes
its cheapest chain reads, next to the trainer-only chain and a full's size).
"""

from __future__ import annotations

import html
import io
import os
import time
from dataclasses import dataclass, field
from typing import Any

from deck.errors import CheckpointNotFoundError, ConfigError, UnsupportedError
from deck.format.manifest import Kind
from deck.ops.listing import Row, list_rows
from deck.read.lineage import LineageGraph, chain_bytes, chain_for, cheapest_chain
from deck.storage import Storage
from deck.storage.atomic import atomic_write

_COLORS = {"full": "#1f77b4", "delta": "#ff7f0e", "merged": "#2ca02c", "merger full": "#9467bd"}


@dataclass
class ReportFiles:
    """What :func:`write_report` wrote."""

    html: str
    images: list[str] = field(default_factory=list)
    checkpoints: int = 0
    damaged: dict[int, str] = field(default_factory=dict)  # step -> its record's problem


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UnsupportedError(
            "deck report needs matplotlib: pip install matplotlib (deck's report extra)"
        ) from None
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _save(fig: Any, path: str) -> None:
    """``fig`` as a PNG at ``path``, replaced atomically: a link there is replaced, never
    written through (a break-it finding: links named like the images made matplotlib write
    them into a commit record of the URI)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write(path, buf.getbuffer())


def _label(r: Row) -> str:
    if r.merged:
        return "merger full" if r.kind == "full" else "merged"
    return r.kind


def _lineage_png(graph: LineageGraph, rows: list[Row], path: str) -> None:
    fig = _figure(10, 4.5)
    ax = fig.add_subplot()
    pos: dict[str, tuple[float, float]] = {}
    for r in rows:
        y = -1.0 if (r.merged and r.kind == "full") else float(r.layer)
        pos[r.id] = (float(r.step), y)
    # Edges first, under the nodes.
    _draw_edges(ax, graph, pos)
    _draw_nodes(ax, rows, pos)
    layers = sorted({y for _, y in pos.values()})
    ax.set_yticks(
        layers,
        [
            "merger fulls" if y < 0 else ("trainer" if y == 0 else f"merged L{int(y)}")
            for y in layers
        ],
    )
    ax.set_ylim(min(layers) - 0.7, max(layers) + 0.7)
    ax.set_xlabel("step")
    ax.set_title("lineage: checkpoints by step and layer; arrows: applies on / merged from")
    ax.legend(loc="upper left", fontsize=8, ncols=3)
    ax.grid(axis="x", alpha=0.3)
    _save(fig, path)


def _draw_edges(ax: Any, graph: LineageGraph, pos: dict[str, tuple[float, float]]) -> None:
    """An arrow from each checkpoint to what it applies on (a trainer delta: its parent) or was
    merged from (a merger checkpoint: its inputs)."""
    for n in graph.nodes.values():
        for p in graph.parents(n.id):
            (x0, y0), (x1, y1) = pos[p.id], pos[n.id]
            bend = 0.25 if y0 == y1 else 0.0
            ax.annotate(
                "",
                xy=(x1, y1),
                xytext=(x0, y0),
                arrowprops={
                    "arrowstyle": "->",
                    "color": "#999999",
                    "lw": 0.8,
                    "connectionstyle": f"arc3,rad={bend}",
                },
            )


def _draw_nodes(ax: Any, rows: list[Row], pos: dict[str, tuple[float, float]]) -> None:
    """One marker per checkpoint (a merged delta also a bar over the steps it covers), each
    kind and state labelled once for the legend."""
    seen: set[str] = set()
    for r in rows:
        kind = _label(r)
        x, y = pos[r.id]
        if r.merged and r.kind != "full" and r.first_step != r.step:
            ax.plot([r.first_step, r.step], [y, y], color=_COLORS[kind], lw=4, alpha=0.35)
        marker = {"full": "s", "delta": "o", "merged": "D", "merger full": "P"}[kind]
        pending = r.state == "pending"
        ax.scatter(
            [x],
            [y],
            s=60,
            marker=marker,
            facecolors="none" if pending else _COLORS[kind],
            edgecolors="#777777" if pending else _COLORS[kind],
            label=None if kind in seen else kind,
            zorder=3,
        )
        seen.add(kind)
        if r.state == "quarantined":
            ax.scatter([x], [y], s=120, marker="x", color="red", zorder=4)
    if any(r.state == "pending" for r in rows):
        ax.scatter([], [], marker="o", facecolors="none", edgecolors="#777777", label="pending")
    if any(r.state == "quarantined" for r in rows):
        ax.scatter([], [], marker="x", color="red", label="quarantined")


def _bytes_png(rows: list[Row], path: str) -> None:
    fig = _figure(10, 3.5)
    ax = fig.add_subplot()

    # One bar group per step: trainer full / delta, each merged layer, merger fulls side by side.
    def series(r: Row) -> tuple[int, int, str]:
        kind = _label(r)
        order = list(_COLORS).index(kind)
        return (order, r.layer, f"{kind} L{r.layer}" if kind == "merged" else kind)

    keys = sorted({series(r) for r in rows})
    width = 0.8 / max(1, len(keys))
    steps = sorted({r.step for r in rows})
    span = (steps[-1] - steps[0]) / max(1, len(steps) - 1) if len(steps) > 1 else 1.0
    for i, key in enumerate(keys):
        sel = [r for r in rows if series(r) == key]
        xs = [r.step + (i - (len(keys) - 1) / 2) * width * span for r in sel]
        kind = _label(sel[0])
        ax.bar(
            xs,
            [r.bytes / 2**20 for r in sel],
            width=width * span,
            color=_COLORS[kind],
            alpha=1.0 if kind != "merged" else max(0.35, 1.0 - 0.25 * (key[1] - 1)),
            label=key[2],
        )
    ax.set_xlabel("step")
    ax.set_ylabel("MiB (all ranks)")
    ax.set_title("bytes per checkpoint")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path)


def restore_costs(graph: LineageGraph) -> list[tuple[int, int, int | None]]:
    """(step, bytes the cheapest chain reads, bytes the trainer-only chain reads or None) for
    every restorable trainer step."""
    trainer = {s: n.manifest for s, n in graph.trainer.items()}
    out = []
    for s in graph.restorable_steps():
        best = chain_bytes(cheapest_chain(graph, s))
        try:
            plain: int | None = chain_bytes(chain_for(trainer, s))
        except CheckpointNotFoundError:
            plain = None  # only reachable through merger checkpoints (GC removed trainer deltas)
        out.append((s, best, plain))
    return out


def _cost_png(graph: LineageGraph, costs: list[tuple[int, int, int | None]], path: str) -> None:
    fig = _figure(10, 3.5)
    ax = fig.add_subplot()
    steps = [c[0] for c in costs]
    ax.plot(steps, [c[1] / 2**20 for c in costs], "o-", color="#2ca02c", label="cheapest chain")
    plain = [(c[0], c[2]) for c in costs if c[2] is not None]
    if plain:
        ax.plot(
            [s for s, _ in plain],
            [b / 2**20 for _, b in plain],
            "x--",
            color="#ff7f0e",
            label="trainer checkpoints only (no merging)",
        )
    fulls = [n.bytes for n in graph.nodes.values() if n.kind is Kind.FULL]
    if fulls:
        ax.axhline(max(fulls) / 2**20, color="#1f77b4", ls=":", label="one full")
    ax.set_xlabel("step")
    ax.set_ylabel("MiB read to restore")
    ax.set_title("restore cost per step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, path)


def write_report(storage: Storage, out_html: str) -> ReportFiles:
    """Write the report page of ``storage`` to ``out_html`` and its images next to it
    (``<stem>-lineage.png``, ``<stem>-bytes.png``, ``<stem>-restore-cost.png``), each written
    whole before the page that references it. An empty URI gives a page that says so (no
    images)."""
    graph, rows = list_rows(storage)
    damaged = {r.step: r.problem or "unreadable" for r in rows if r.state == "damaged"}
    out_html = os.path.abspath(out_html)
    folder = os.path.dirname(out_html)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ConfigError(f"cannot write {out_html}: {folder} is a file, not a folder")
    os.makedirs(folder, exist_ok=True)
    stem = os.path.splitext(os.path.basename(out_html))[0]
    costs = restore_costs(graph) if graph.nodes else []
    # (a damaged record has no kind to draw: the table lists it)
    figures = _draw_figures(graph, [r for r in rows if r.state != "damaged"], costs, folder, stem)
    parts = [
        *_page_head(storage.uri),
        *_summary(graph, rows),
        *_figure_sections(figures),
        *_checkpoint_table(rows),
        *_cost_table(costs),
        "</body></html>",
    ]
    atomic_write(out_html, "\n".join(parts) + "\n")
    return ReportFiles(
        html=out_html, images=[f for f, _ in figures], checkpoints=len(rows), damaged=damaged
    )


def _draw_figures(
    graph: LineageGraph,
    rows: list[Row],
    costs: list[tuple[int, int, int | None]],
    folder: str,
    stem: str,
) -> list[tuple[str, str]]:
    """Draw the pictures there is something to show in, as ``<stem>-*.png`` files in
    ``folder``; returns each one's file name and title."""
    figures: list[tuple[str, str]] = []
    if rows:
        name = f"{stem}-lineage.png"
        _lineage_png(graph, rows, os.path.join(folder, name))
        figures.append((name, "lineage graph"))
        name = f"{stem}-bytes.png"
        _bytes_png(rows, os.path.join(folder, name))
        figures.append((name, "bytes per checkpoint"))
    if costs:
        name = f"{stem}-restore-cost.png"
        _cost_png(graph, costs, os.path.join(folder, name))
        figures.append((name, "restore cost per step"))
    return figures


def _page_head(uri: str) -> list[str]:
    e = html.escape
    return [
        "<!doctype html>",
        '<html><head><meta charset="utf-8">',
        f"<title>deck report: {e(uri)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:72em}"
        "table{border-collapse:collapse;font-size:90%}td,th{border:1px solid #ccc;padding:2px 6px;"
        "text-align:right}th{background:#eee}img{max-width:100%;display:block;margin:1em 0}</style>",
        "</head><body>",
        f"<h1>deck report</h1><p>URI <code>{e(uri)}</code>, generated "
        f"{e(time.strftime('%Y-%m-%d %H:%M:%S'))}.</p>",
    ]


def _summary(graph: LineageGraph, rows: list[Row]) -> list[str]:
    """The paragraph of counts and sizes, and how the latest restorable step is restored."""
    if not rows:
        return ["<p>No checkpoints at this URI.</p>"]
    e = html.escape
    latest = graph.latest() if graph.nodes else None
    by_kind: dict[str, int] = {}
    for r in rows:
        by_kind[f"{_label(r)} ({r.state})"] = by_kind.get(f"{_label(r)} ({r.state})", 0) + 1
    total = sum(r.bytes for r in rows if r.state != "pending")
    summary = ", ".join(f"{n} {e(k)}" for k, n in sorted(by_kind.items()))
    parts = [
        f"<p>{len(rows)} checkpoints: {summary}; {total / 2**20:.1f} MiB committed. "
        f"Latest restorable step: {latest if latest is not None else 'none'}"
    ]
    if latest is not None:
        chain = cheapest_chain(graph, latest)
        parts.append(
            f", restored from {len(chain)} checkpoints "
            f"({chain_bytes(chain) / 2**20:.1f} MiB): "
            + ", ".join(f"<code>{e(m.folder)}</code>" for m in chain)
        )
    parts.append(".</p>")
    return parts


def _figure_sections(figures: list[tuple[str, str]]) -> list[str]:
    e = html.escape
    return [f'<h2>{e(alt)}</h2><img src="{e(name)}" alt="{e(alt)}">' for name, alt in figures]


def _checkpoint_table(rows: list[Row]) -> list[str]:
    if not rows:
        return []
    e = html.escape
    return [
        "<h2>checkpoints</h2><table><tr><th>kind</th><th>step</th><th>layer</th>"
        "<th>covers</th><th>ranks</th><th>bytes</th><th>state</th><th>folder</th></tr>",
        *(
            f"<tr><td>{e(_label(r))}</td><td>{r.step}</td><td>{r.layer}</td>"
            f"<td>{r.first_step}..{r.step}</td><td>{r.ranks_text}</td>"
            f"<td>{r.bytes}</td><td>{e(r.state)}</td>"
            f"<td style='text-align:left'><code>{e(r.folder)}</code></td></tr>"
            for r in rows
        ),
        "</table>",
    ]


def _cost_table(costs: list[tuple[int, int, int | None]]) -> list[str]:
    if not costs:
        return []
    return [
        "<h2>restore cost</h2><table><tr><th>step</th><th>cheapest chain (bytes)</th>"
        "<th>trainer-only chain (bytes)</th></tr>",
        *(
            f"<tr><td>{s}</td><td>{best}</td><td>{'-' if plain is None else plain}</td></tr>"
            for s, best, plain in costs
        ),
        "</table>",
    ]

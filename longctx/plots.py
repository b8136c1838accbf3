"""Charts of longctx's measures (matplotlib, needed only here): each function returns a
`matplotlib.figure.Figure`, which the CLI saves (`--plot FILE.png`) and a notebook shows. Rows
may be the result objects or their JSON dicts (`longctx bench ... --json`)."""

from __future__ import annotations


def _get(row, key: str):
    return row[key] if isinstance(row, dict) else getattr(row, key)


def _figure(width: float, height: float, cols: int = 1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    return fig, fig.subplots(1, cols, squeeze=False)[0]


def quality_figure(results):
    """Bars per format, one a mode: perplexity change (left) and mean KL divergence from the
    exact cache (right, log scale), from `longctx.eval.quality`'s results of one or both modes
    (the exact cache's rows are the baselines)."""
    base = {r.mode: r for r in results if r.name.startswith("exact")}
    rows = [r for r in results if not r.name.startswith("exact")]
    names = list(dict.fromkeys(r.name for r in rows))
    modes = list(dict.fromkeys(r.mode for r in rows))
    width = 0.8 / len(modes)
    fig, (left, right) = _figure(10, 3.8, 2)
    for k, m in enumerate(modes):
        by_name = {r.name: r for r in rows if r.mode == m}
        xs = [i + (k - (len(modes) - 1) / 2) * width for i in range(len(names))]
        left.bar(xs, [by_name[n].delta_pct(base[m]) for n in names], width, label=f"{m} mode")
        right.bar(xs, [by_name[n].kl_mean for n in names], width, label=f"{m} mode")
    for ax, label in ((left, "perplexity change (%)"), (right, "mean KL from the exact cache (nats)")):
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    right.set_yscale("log")
    fig.suptitle(f"KV formats against the exact cache ({base[modes[0]].tokens:,} tokens)", fontsize=10)
    fig.tight_layout()
    return fig


def needle_figure(grids):
    """One heatmap a cache (`longctx.eval.needle`'s grids): depth (rows) by prompt length
    (columns), green where the key was found."""
    from matplotlib.colors import ListedColormap

    fig, axes = _figure(3.2 * len(grids) + 0.6, 3.4, len(grids))
    for ax, g in zip(axes, grids):
        cells = [[float(g.results[i][j].found) for i in range(len(g.lengths))] for j in range(len(g.depths))]
        ax.imshow(cells, cmap=ListedColormap(["#d62728", "#2ca02c"]), vmin=0, vmax=1, aspect="auto")
        ax.set_xticks(range(len(g.lengths)), [f"{n:,}" for n in g.lengths], rotation=45, fontsize=7)
        ax.set_yticks(range(len(g.depths)), [f"{d:.2f}" for d in g.depths], fontsize=7)
        ax.set(xlabel="prompt tokens", ylabel="depth", title=f"{g.name}\n{100 * g.accuracy:.0f} % found")
        ax.title.set_fontsize(8)
    fig.tight_layout()
    return fig


def decode_figure(rows, title: str):
    """Per-layer decode attention time against context, a line per kernel and batch, log-log
    (`longctx bench decode`'s rows; rows without a time are left out)."""
    rows = [r for r in rows if _get(r, "ms") is not None and _get(r, "ms") == _get(r, "ms")]
    fig, (ax,) = _figure(7, 4.5)
    for batch in sorted({_get(r, "batch") for r in rows}):
        for name in dict.fromkeys(_get(r, "name") for r in rows):
            pts = sorted((_get(r, "context"), _get(r, "ms")) for r in rows if _get(r, "name") == name and _get(r, "batch") == batch)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{name} (B{batch})")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms per layer", title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig

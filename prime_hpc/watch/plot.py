"""Training curves of one or more runs, as one PNG.

Reads each run's `metrics/orchestrator.jsonl` and `metrics/trainer.jsonl` (JSON lines of
`{"step": int, "time": unix seconds, <metric>: value, ...}`; rows of one step may be split
over several lines, e.g. an eval row logged apart from the step row, and are merged by
step; torn or foreign lines are skipped). Draws five panels over a shared "step" axis:

1. reward: `reward/all/mean` (orchestrator, line) and every `eval/<env>/avg@k` (markers);
2. loss: `loss/mean` (trainer, line) and `val/loss` of SFT runs (markers);
3. `mismatch_kl/mean` (trainer), log scale when every value is positive;
4. `entropy/mean` (trainer);
5. seconds per step: `time/step` of the trainer (solid) and the orchestrator (dashed);
   when the number of inference servers changed during a run (`inference/servers`:
   `prime-hpc scale`, a lost server), that count too, as steps on a right-hand axis.

Runs overlay in the same panels, one colour per run, named in the figure's legend; a panel
without data for any run says "no data". matplotlib (Agg) is imported only when drawing,
so importing this module stays cheap.

    plot_runs([("lr=1e-06", RunDir(a)), ("lr=3e-06", RunDir(b))], Path("curves.png"))
"""

from __future__ import annotations

import io
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence, Union

from prime_hpc.rundir import RunDir, atomic_write_bytes, read_rows

if TYPE_CHECKING:  # only for annotations: never imported at run time here
    from matplotlib.figure import Figure

SOURCES = ("orchestrator", "trainer")
EVAL_KEY = re.compile(r"^eval/(?P<env>.+)/avg@(?P<k>\d+)$")
NO_DATA = "no data"
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
SERVERS_KEY = "inference/servers"  # the orchestrator's count of live inference servers at each step
Metrics = dict[str, dict[int, dict]]  # component -> step -> merged row


# ----------------------------------------------------------------------------- reading
def merge_by_step(rows: Iterable[dict]) -> dict[int, dict]:
    """One row per step, in step order; a later line's value of a key wins (a resumed run
    that logs a step again replaces it)."""
    merged: dict[int, dict] = {}
    for row in rows:
        merged.setdefault(row["step"], {}).update(row)
    return dict(sorted(merged.items()))


def load_metrics(run: Union[RunDir, os.PathLike, str]) -> Metrics:
    """`{"orchestrator": {step: row}, "trainer": {step: row}}` of one run (empty dicts
    for a component that logged nothing, e.g. the orchestrator of an SFT run)."""
    run = run if isinstance(run, RunDir) else RunDir(run)
    return {c: merge_by_step(read_rows(run.metrics(c))) for c in SOURCES}


# ----------------------------------------------------------------------------- panel data
@dataclass(frozen=True)
class Series:
    """One curve: metric `key` of `component` in run number `run` (its colour and label)."""

    run: int
    component: str
    key: str
    steps: tuple[int, ...]
    values: tuple[float, ...]
    style: str = "line"  # "line" (every step), "dashed" (second source), "sparse" (markers)


@dataclass
class Panel:
    title: str
    ylabel: str
    series: list[Series] = field(default_factory=list)
    log: bool = False
    twin: list[Series] = field(default_factory=list)  # drawn as steps against a right-hand axis
    twin_label: str = ""

    @property
    def empty(self) -> bool:
        return not any(s.steps for s in self.series)


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def series(metrics: Metrics, run: int, component: str, key: str, style: str = "line") -> Optional[Series]:
    """The finite numeric values of `key` over steps (None when there is none)."""
    points = [(step, _number(row.get(key))) for step, row in metrics.get(component, {}).items()]
    points = [(s, v) for s, v in points if v is not None]
    if not points:
        return None
    steps, values = zip(*points)
    return Series(run, component, key, tuple(steps), tuple(values), style)


def eval_keys(metrics: Metrics) -> list[str]:
    """The run's `eval/<env>/avg@k` keys, sorted."""
    return sorted({k for row in metrics.get("orchestrator", {}).values() for k in row if EVAL_KEY.match(k)})


def build_panels(metrics: Sequence[Metrics]) -> list[Panel]:
    """The five panels of the figure, for the runs' metrics in legend order (pure)."""
    panels = [
        Panel("reward (line: train, markers: eval)", "reward (mean per rollout)"),
        Panel("loss (line: train, markers: validation)", "loss (per token)"),
        Panel("mismatch KL (inference vs trainer)", "KL (nats per token)"),
        Panel("entropy", "entropy (nats per token)"),
        Panel("seconds per step (solid: trainer, dashed: orchestrator)", "time per step (s)"),
    ]
    for i, m in enumerate(metrics):
        wanted = [
            (0, "orchestrator", "reward/all/mean", "line"),
            *((0, "orchestrator", k, "sparse") for k in eval_keys(m)),
            (1, "trainer", "loss/mean", "line"),
            (1, "trainer", "val/loss", "sparse"),
            (2, "trainer", "mismatch_kl/mean", "line"),
            (3, "trainer", "entropy/mean", "line"),
            (4, "trainer", "time/step", "line"),
            (4, "orchestrator", "time/step", "dashed"),
        ]
        for panel, component, key, style in wanted:
            s = series(m, i, component, key, style)
            if s is not None:
                panels[panel].series.append(s)
    for i, m in enumerate(metrics):  # the servers, where their number changed (scale, a lost one)
        servers = series(m, i, "orchestrator", SERVERS_KEY, "steps")
        if servers is not None and len(set(servers.values)) > 1:
            panels[4].twin.append(servers)
    if panels[4].twin:
        panels[4].title += "; steps: inference servers"
        panels[4].twin_label = "inference servers"
    kl = panels[2]
    kl.log = not kl.empty and all(v > 0 for s in kl.series for v in s.values)
    return panels


# ----------------------------------------------------------------------------- drawing
def run_colours(n: int) -> list:
    """One distinct colour per run: tab10 up to 10 runs, then evenly spaced on viridis."""
    from matplotlib import colormaps

    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    return [colormaps["viridis"](i / (n - 1)) for i in range(n)]


def _sparse_markers(panels: Sequence[Panel]) -> dict[str, str]:
    """One marker per sparse key (the same in every run), in order of first appearance."""
    keys: list[str] = []
    for s in (s for p in panels for s in p.series):
        if s.style == "sparse" and s.key not in keys:
            keys.append(s.key)
    return {k: MARKERS[i % len(MARKERS)] for i, k in enumerate(keys)}


def _draw_panel(ax: Any, panel: Panel, colours: list, markers: dict[str, str]) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(panel.title, fontsize=10)
    ax.set_ylabel(panel.ylabel)
    if not panel.empty:
        ax.grid(True, alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for s in panel.series:
        kw: dict[str, Any] = {"color": colours[s.run], "label": f"{s.component} {s.key}"}
        if s.style == "sparse":
            kw.update(marker=markers[s.key], markersize=5, linewidth=1, alpha=0.9)
        else:
            kw.update(linewidth=1.5, linestyle="--" if s.style == "dashed" else "-")
        ax.plot(s.steps, s.values, **kw)
    if panel.log:
        ax.set_yscale("log")
    elif panel.title.startswith("seconds per step") and not panel.empty:
        # the first step also waits for the servers to start: do not let it flatten the rest
        values = sorted(v for s in panel.series for v in s.values)
        ax.set_ylim(0, max(values[len(values) // 2] * 3, values[int(len(values) * 0.95) - 1] * 1.1))
    if panel.twin:
        right = ax.twinx()
        for s in panel.twin:
            right.step(s.steps, s.values, where="post", color=colours[s.run], linewidth=1, alpha=0.6)
        right.set_ylabel(panel.twin_label)
        right.yaxis.set_major_locator(MaxNLocator(integer=True))
        right.set_ylim(0, max(v for s in panel.twin for v in s.values) + 1)
    if panel.empty:
        ax.text(0.5, 0.5, NO_DATA, transform=ax.transAxes, ha="center", va="center", fontsize=14, color="0.5")
        ax.set_yticks([])


def _draw_legends(
    fig: Any, cell: Any, labels: Sequence[str], colours: list, markers: dict[str, str], dashed: bool
) -> None:
    """The figure's legend of the runs in the spare grid cell and, right below it, a key
    of the series drawn with markers or dashes."""
    from matplotlib.lines import Line2D
    from matplotlib.transforms import ScaledTranslation

    cell.axis("off")
    runs = [Line2D([], [], color=c, linewidth=2.5) for c in colours]
    size = {"fontsize": 9} if len(runs) <= 12 else {"fontsize": 7, "ncols": 2}  # big sweeps: two columns
    legend = fig.legend(
        runs,
        list(labels),
        title="run",
        loc="upper center",
        bbox_to_anchor=(0.5, 1.0),
        bbox_transform=cell.transAxes,
        frameon=False,
        **size,
    )
    key = [(Line2D([], [], color="0.3", marker=m, linewidth=1), k) for k, m in markers.items()]
    if dashed:
        key.append((Line2D([], [], color="0.3", linestyle="--"), "orchestrator time/step"))
    if key:
        # the run legend's height does not depend on where the layout puts the cell
        height = legend.get_window_extent(fig.canvas.get_renderer()).height / fig.dpi
        below = cell.transAxes + ScaledTranslation(0, -height - 0.1, fig.dpi_scale_trans)
        fig.legend(
            [h for h, _ in key],
            [k for _, k in key],
            title="series",
            loc="upper center",
            bbox_to_anchor=(0.5, 1.0),
            bbox_transform=below,
            fontsize=8,
            frameon=False,
        )


def _figure_height(n_runs: int, n_key: int) -> float:
    """Inches: 10, or taller when the legends need more than the spare cell (a third of
    the panel area) of a 10-inch figure (big sweeps)."""
    rows = n_runs if n_runs <= 12 else math.ceil(n_runs / 2)
    legends = 0.25 * (rows + 1) + 0.22 * (n_key + 1) + 0.3
    return min(40.0, max(10.0, 1.5 + 3 * legends))


def build_figure(runs: Sequence[tuple[str, Union[RunDir, os.PathLike, str]]], title: Optional[str] = None) -> "Figure":
    """The figure of `runs` ((legend label, run directory) pairs), not yet saved: a 3x2
    grid of the five panels sharing the step axis, the legends in the sixth cell."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not runs:
        raise ValueError("no runs to plot")
    labels = [label for label, _ in runs]
    panels = build_panels([load_metrics(run) for _, run in runs])
    colours, markers = run_colours(len(runs)), _sparse_markers(panels)
    dashed = any(s.style == "dashed" for s in panels[4].series)
    fig = Figure(figsize=(13, _figure_height(len(runs), len(markers) + dashed)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 2, sharex=True).flatten()
    for ax, panel in zip(axes, panels):
        _draw_panel(ax, panel, colours, markers)
    for ax in axes[3:5]:  # bottom of each column: entropy sits above the legend cell
        ax.set_xlabel("step")
        ax.tick_params(labelbottom=True)
    _draw_legends(fig, axes[5], labels, colours, markers, dashed)
    if title:
        fig.suptitle(title, fontsize=13)
    return fig


def plot_runs(
    runs: Sequence[tuple[str, Union[RunDir, os.PathLike, str]]],
    out: Union[os.PathLike, str],
    title: Optional[str] = None,
) -> Path:
    """Draw `runs` ((legend label, run directory) pairs) into the PNG `out` (written
    atomically, parent directories created) and return its path."""
    fig = build_figure(runs, title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return atomic_write_bytes(Path(out), buf.getvalue())

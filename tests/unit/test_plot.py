"""`prime_hpc.watch.plot` on synthetic metrics files, without a cluster: reading and merging the
JSON lines, the panels built from them, and the PNG of one run and of two runs overlaid."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prime_hpc.rundir import RunDir
from prime_hpc.watch import plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RL_STEPS = range(1, 81)
EVAL_STEPS = (0, 40, 80)


def _write(path, rows, tail: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def rl_run(root, scale: float = 1.0) -> RunDir:
    """An RL run: step rows, eval rows of its own at steps 0/40/80, one step logged on two
    lines, a row without "time", a non-JSON line and a torn last line."""
    run = RunDir(root)
    orch = []
    for s in RL_STEPS:
        orch.append({"step": s, "time": 1.7e9 + s, "reward/all/mean": scale * s / 80, "time/step": 2.0})
        if s == 40:
            orch.append(
                {
                    "step": 40,
                    "time": 1.7e9 + s,
                    "eval/reverse_text/avg@4": scale * 0.5,
                    "eval/reverse_text/pass@4": 0.9,
                    "time/eval": 3.0,
                }
            )
    orch.insert(0, {"step": 0, "eval/reverse_text/avg@4": 0.1})  # an older row: no "time"
    orch.append({"step": 80, "time": 1.7e9 + 81, "eval/reverse_text/avg@4": scale * 0.8})
    _write(run.metrics("orchestrator"), orch, tail='not json\n{"step": 81, "reward/all/me')
    trainer = [
        {
            "step": s,
            "time": 1.7e9 + s,
            "loss/mean": 0.01,
            "entropy/mean": 1.0 / s,
            "mismatch_kl/mean": 1e-4 * s,
            "time/step": 3.0,
        }
        for s in RL_STEPS
    ]
    trainer[10] = {k: v for k, v in trainer[10].items() if k != "mismatch_kl/mean"}
    trainer.insert(11, {"step": 11, "time": 1.7e9 + 11, "mismatch_kl/mean": 5e-4})  # same step, second line
    _write(run.metrics("trainer"), trainer)
    return run


def sft_run(root) -> RunDir:
    """An SFT run: trainer rows only, val/loss every 10 steps (step 0 on a line of its own)."""
    run = RunDir(root)
    rows = [{"step": 0, "time": 1.7e9, "val/loss": 3.0}]
    for s in range(1, 31):
        row = {"step": s, "time": 1.7e9 + s, "loss/mean": 3.0 / s, "entropy/mean": 2.0, "time/step": 1.5}
        if s % 10 == 0:
            row["val/loss"] = 3.2 / s
        rows.append(row)
    _write(run.metrics("trainer"), rows)
    return run


def _panel(panels, word: str):
    (found,) = [p for p in panels if p.title.startswith(word)]
    return found


def _keys(panel) -> set[tuple[int, str, str]]:
    return {(s.run, s.component, s.key) for s in panel.series}


# --------------------------------------------------------------------------- reading
def test_rows_of_a_step_merge_and_broken_lines_are_skipped(tmp_path):
    m = plot.load_metrics(rl_run(tmp_path / "rl"))
    orch, trainer = m["orchestrator"], m["trainer"]
    assert list(orch) == list(range(0, 81))  # step 0 (eval only) .. 80; torn step 81 dropped
    assert orch[40]["reward/all/mean"] == 0.5 and orch[40]["eval/reverse_text/avg@4"] == 0.5
    assert orch[80]["eval/reverse_text/avg@4"] == 0.8 and orch[80]["time"] == 1.7e9 + 81  # later line wins
    assert orch[0] == {"step": 0, "eval/reverse_text/avg@4": 0.1}
    assert trainer[11]["mismatch_kl/mean"] == 5e-4 and trainer[11]["loss/mean"] == 0.01
    # an SFT run has no orchestrator file; a path works as well as a RunDir
    assert plot.load_metrics(sft_run(tmp_path / "sft").root)["orchestrator"] == {}
    assert plot.load_metrics(tmp_path / "nothing") == {"orchestrator": {}, "trainer": {}}


# --------------------------------------------------------------------------- panel data
def test_panels_of_an_rl_run(tmp_path):
    panels = plot.build_panels([plot.load_metrics(rl_run(tmp_path / "rl"))])
    assert len(panels) == 5 and all(p.ylabel for p in panels)
    reward = _panel(panels, "reward")
    assert _keys(reward) == {(0, "orchestrator", "reward/all/mean"), (0, "orchestrator", "eval/reverse_text/avg@4")}
    (ev,) = [s for s in reward.series if s.key.startswith("eval/")]
    assert ev.style == "sparse" and ev.steps == EVAL_STEPS and ev.values == (0.1, 0.5, 0.8)
    assert _keys(_panel(panels, "loss")) == {(0, "trainer", "loss/mean")}
    kl = _panel(panels, "mismatch KL")
    assert kl.log and kl.series[0].steps == tuple(RL_STEPS) and kl.series[0].values[10] == 5e-4
    assert _keys(_panel(panels, "entropy")) == {(0, "trainer", "entropy/mean")}
    timing = _panel(panels, "seconds per step")
    assert {(s.component, s.style) for s in timing.series} == {("trainer", "line"), ("orchestrator", "dashed")}
    assert not any(p.empty for p in panels)


def test_panels_of_an_sft_run_and_the_kl_scale(tmp_path):
    panels = plot.build_panels([plot.load_metrics(sft_run(tmp_path / "sft"))])
    assert _panel(panels, "reward").empty and _panel(panels, "mismatch KL").empty
    assert not _panel(panels, "mismatch KL").log
    loss = _panel(panels, "loss")
    (val,) = [s for s in loss.series if s.key == "val/loss"]
    assert val.style == "sparse" and val.steps == (0, 10, 20, 30)
    assert {s.key for s in loss.series} == {"loss/mean", "val/loss"}
    # a zero (or NaN logged as null) keeps the KL panel linear / out of the curve
    zero = {"trainer": {1: {"step": 1, "mismatch_kl/mean": 0.0}, 2: {"step": 2, "mismatch_kl/mean": None}}}
    kl = _panel(plot.build_panels([zero]), "mismatch KL")
    assert not kl.log and kl.series[0].steps == (1,)


# --------------------------------------------------------------------------- the figure
def _texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_one_rl_run_to_png(tmp_path):
    out = plot.plot_runs([("rl", rl_run(tmp_path / "rl"))], tmp_path / "plots" / "rl.png", title="reverse_text")
    assert out == tmp_path / "plots" / "rl.png"
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and 20_000 < len(data) < 2_000_000
    assert not [p for p in out.parent.iterdir() if p != out]  # no temp file left behind


def test_two_runs_overlay_with_one_legend(tmp_path):
    runs = [("trainer.optim.lr=1e-06", rl_run(tmp_path / "a")), ("trainer.optim.lr=3e-06", rl_run(tmp_path / "b", 0.5))]
    fig = plot.build_figure(runs, title="sweep")
    axes = [ax for ax in fig.axes if ax.axison]
    titles = [ax.get_title() for ax in axes]
    assert [t.split(" ")[0] for t in titles] == ["reward", "loss", "mismatch", "entropy", "seconds"]
    assert fig.get_suptitle() == "sweep"
    reward = axes[0]
    assert len(reward.lines) == 4  # per run: train line and eval markers
    colours = {line.get_label(): [] for line in reward.lines}
    for line in reward.lines:
        colours[line.get_label()].append(line.get_color())
    assert all(len(set(c)) == 2 for c in colours.values())  # one colour per run
    evals = [line for line in reward.lines if "eval/" in line.get_label()]
    assert len({line.get_marker() for line in evals}) == 1 and evals[0].get_marker() not in ("None", "")
    assert axes[2].get_yscale() == "log" and axes[4].get_xlabel() == "step" and axes[3].get_xlabel() == "step"
    assert all("(" in ax.get_ylabel() for ax in axes)  # units
    assert not any(plot.NO_DATA in _texts(ax) for ax in axes)
    run_legend = fig.legends[0]
    assert [t.get_text() for t in run_legend.get_texts()] == [label for label, _ in runs]
    out = plot.plot_runs(runs, tmp_path / "sweep.png")
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_sft_run_says_no_data_where_it_has_none(tmp_path):
    fig = plot.build_figure([("sft", sft_run(tmp_path / "sft"))])
    by_title = {ax.get_title().split(" ")[0]: ax for ax in fig.axes if ax.axison}
    assert plot.NO_DATA in _texts(by_title["reward"]) and plot.NO_DATA in _texts(by_title["mismatch"])
    for name in ("loss", "entropy", "seconds"):
        assert plot.NO_DATA not in _texts(by_title[name])
    assert {line.get_label() for line in by_title["loss"].lines} == {"trainer loss/mean", "trainer val/loss"}
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["sft"]
    assert plot.plot_runs([("sft", sft_run(tmp_path / "sft"))], tmp_path / "sft.png").stat().st_size > 10_000


def test_a_big_sweep_gets_a_taller_figure_for_its_legend(tmp_path):
    run = rl_run(tmp_path / "rl")
    assert plot.build_figure([("a", run), ("b", run)]).get_figheight() == 10
    many = plot.build_figure([(f"trainer.optim.lr={i}e-06", run) for i in range(16)])
    assert many.get_figheight() > 10
    assert len(many.legends[0].get_texts()) == 16 and len(set(plot.run_colours(16))) == 16


def test_a_run_without_metrics_still_plots_and_no_runs_is_an_error(tmp_path):
    fig = plot.build_figure([("empty", RunDir(tmp_path / "empty"))])
    assert all(plot.NO_DATA in _texts(ax) for ax in fig.axes if ax.axison)
    with pytest.raises(ValueError):
        plot.plot_runs([], tmp_path / "none.png")


def test_importing_the_module_does_not_import_matplotlib():
    code = "import sys, prime_hpc.watch.plot; print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"

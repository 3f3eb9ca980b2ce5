"""`shardwise report`: one page comparing runs of different strategies, every figure drawn."""

from __future__ import annotations

import base64
import html
import io
import json
import re
import shutil
from pathlib import Path

import matplotlib.image
import pytest

from harness import finish, main_in_process, run_cli, start_cli, train_args
from shardwise.observe import report
from shardwise.observe.report_figures import FIGURES
from shardwise.observe.report_inputs import load_run

STRATEGIES = {
    "ddp": ["strategy.name=ddp", "train.trace_steps=[4, 6]"],
    "zero2": ["strategy.name=zero", "strategy.stage=2"],
    "local_sgd": ["strategy.name=local_sgd", "strategy.period=4"],
}
COMMON = ["train.steps=16", "train.eval_every=8", "train.log_every=4", "optim.warmup_steps=4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("report")
    dirs = [root / name for name in STRATEGIES]
    jobs = [  # (the three jobs run at once)
        start_cli(*train_args(run, *COMMON, *sets, nproc=2, measure=True), cwd=root)
        for run, sets in zip(dirs, STRATEGIES.values(), strict=True)
    ]
    for code, out in finish(*jobs):
        assert code == 0, out[-4000:]
    return dirs


def _has_data(ax) -> bool:
    """Whether an axes shows data: a line with points, a bar or bar segment of some width, a
    scatter with points."""
    lines = any(len(line.get_xdata()) for line in ax.get_lines())
    bars = any(p.get_width() > 0 for p in ax.patches if hasattr(p, "get_width"))
    collections = any(len(c.get_offsets()) or c.get_paths() for c in ax.collections)
    return lines or bars or collections


def test_every_figure_of_three_strategies_shows_data(runs):
    loaded = [load_run(r) for r in runs]
    assert len({run.label for run in loaded}) == 3
    for title, make in FIGURES.items():
        fig = make(loaded)
        for ax in fig.axes:
            if ax.get_visible() and ax.get_label() != "<colorbar>":
                assert _has_data(ax), f"{title}: empty axes {ax.get_title()!r}"


def test_report_page_embeds_every_figure_and_a_markdown_summary(runs, tmp_path):
    out = tmp_path / "report.html"
    result = run_cli("report", *map(str, runs), "-o", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    page = out.read_text()
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(images) == len(FIGURES)  # one run traced: the timeline is drawn too
    for image in images:
        pixels = matplotlib.image.imread(io.BytesIO(base64.b64decode(image)), format="png")
        assert pixels.shape[0] > 100 and pixels.std() > 0.05  # a drawn figure, not a blank
    headline, predicted = out.with_suffix(".md").read_text().split("\n\nPredicted / measured")
    summary = headline.splitlines()
    assert len(summary) == 2 + len(runs)  # header, rule, a row per run
    assert "samples/s" in summary[0]
    # Each run beside its prediction: exact model state, a row per run.
    rows = [line for line in predicted.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(runs) and "step time" in rows[0]
    assert all("(+0.0%)" in row.split("|")[3] for row in rows[1:]), rows  # model state
    for run in runs:
        assert html.escape(load_run(run).label) in page
    assert not list(tmp_path.glob("*.png"))  # nothing else lands beside it


def test_report_refuses_what_is_not_a_run_in_one_line(tmp_path, capsys):
    code, _, err = main_in_process(capsys, "report", str(tmp_path / "nowhere"))
    assert code == 2
    assert err.strip().splitlines() == [
        f"shardwise: report: {tmp_path / 'nowhere'} is not a finished run directory "
        "(no summary.json)"
    ]


def test_runs_of_one_strategy_get_rows_told_apart_and_names_stay_text(runs, tmp_path, capsys):
    """Three copies of one real run (two in folders of one name) and a fourth whose strategy
    is HTML: a row each, told apart; the HTML shown as text in the page and in the Markdown."""
    copies = [tmp_path / "a" / "ddp", tmp_path / "b" / "ddp", tmp_path / "c", tmp_path / "evil"]
    for copy in copies:
        shutil.copytree(runs[0], copy, ignore=shutil.ignore_patterns("checkpoint", "tensorboard"))
    evil = "<script>alert(1)</script> | </td>"
    summary = json.loads((copies[3] / "summary.json").read_text())
    (copies[3] / "summary.json").write_text(json.dumps({**summary, "strategy": evil}))
    out = tmp_path / "page.html"
    assert report.main([*map(str, copies), "-o", str(out)]) == 0
    page, summary_md = out.read_text(), out.with_suffix(".md").read_text()
    label = load_run(runs[0]).label
    labels = [f"{label} [ddp]", f"{label} [ddp] #2", f"{label} [c]", f"{evil} (2 ranks)"]
    assert re.findall(r"<tr><td>(.*?)</td>", page)[: len(copies)] == list(map(html.escape, labels))
    assert "<script>" not in page and "<script>" not in summary_md
    rows = summary_md.split("\n\n")[0].splitlines()
    cells = [re.split(r"(?<!\\)\|", row)[1:-1] for row in rows]  # split at unescaped bars
    assert {len(row) for row in cells} == {len(cells[0])}  # the name's bar splits no cell
    assert [row[0].strip() for row in cells[2:]] == [
        *labels[:3],
        "&lt;script&gt;alert(1)&lt;/script&gt; \\| &lt;/td&gt; (2 ranks)",
    ]


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium")
def test_headless_chromium_renders_the_page(runs, tmp_path):
    out, shot = tmp_path / "report.html", tmp_path / "report.png"
    argv = ["report", *map(str, runs), "-o", str(out), "--screenshot", str(shot)]
    result = run_cli(*argv, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[0] >= 1000 and pixels.std() > 0.05

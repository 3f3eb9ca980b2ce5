"""`shardwise report` on what is not a well-formed run: one line and exit 2, or a sensible page.

Each run directory here is written by hand (the files a finished run leaves, a few steps
long), then broken in one way; the report is run through the command line's own entry point,
in this process (no job is launched: these tests take a few seconds).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from shardwise import cli
from shardwise.observe.report_figures import breakdown_figure, timeline_figure
from shardwise.observe.report_inputs import load_run
from shardwise.observe.report_measures import stability

STEPS = 4


def write_run(path: Path, world_size: int = 2, ranks: int | None = None, **summary) -> Path:
    """A finished run's files: summary.json, metrics.jsonl and one timing file per rank (the
    last step's line carries memory), as the trainer writes them."""
    (path / "timing").mkdir(parents=True)
    fields = {
        "name": "t",
        "strategy": "ddp",
        "world_size": world_size,
        "steps": STEPS,
        "final_train_loss": 1.6,
        "eval_accuracy": 0.5,
        "samples_per_s": 1000.0,
        "comm_bytes_per_step": 4096,
        "wall_time_s": 1.0,
        "skipped_steps": [],
        **summary,
    }
    (path / "summary.json").write_text(json.dumps(fields))
    metrics = [
        {"step": s, "loss": 2.0 - 0.1 * s, "lr": 0.01, "t": 0.01 * s, "grad_norm": 0.3}
        for s in range(1, STEPS + 1)
    ]
    _lines(path / "metrics.jsonl", metrics)
    ranks = world_size if ranks is None else ranks
    assert ranks <= 8, "a large world size: give the few rank files to write"
    for rank in range(ranks):
        _lines(path / "timing" / f"rank{rank}.jsonl", timing_lines(rank))
    return path


def timing_lines(rank: int) -> list[dict]:
    phases = {"data_s": 1e-3, "forward_s": 2e-3, "backward_s": 3e-3, "optimizer_s": 1e-3}
    lines = [
        {"step": s, **phases, "sync_s": 5e-4, "wait_s": 2e-3 * (rank + 1), "overlap_s": 0.0}
        | {"step_s": 0.01 + 2e-3 * rank, "comm_bytes": {"all_reduce": 4096}}
        for s in range(1, STEPS + 1)
    ]
    lines[-1]["memory"] = {"params": 2**20, "grads": 2**20, "optimizer": 2**21, "peak": 2**23}
    return lines


def _lines(path: Path, records: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _summary(**changes) -> Callable[[Path], None]:
    """Breaks a run by changing (a value of None: removing) fields of its summary.json."""

    def change(run: Path) -> None:
        summary = json.loads((run / "summary.json").read_text())
        summary.update(changes)
        (run / "summary.json").write_text(json.dumps(summary))

    return change


def _text(name: str, text: str | bytes) -> Callable[[Path], None]:
    """Breaks a run by writing `text` into its file `name` (directories made as needed)."""

    def write(run: Path) -> None:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            (run / name).write_bytes(text)
        else:
            (run / name).write_text(text)

    return write


def _line(name: str, number: int, **changes) -> Callable[[Path], None]:
    """Breaks a run by changing fields of line `number` (from 1) of its JSON-lines file `name`
    (a value of None: the field removed)."""

    def change(run: Path) -> None:
        lines = [json.loads(x) for x in (run / name).read_text().splitlines()]
        lines[number - 1].update(changes)
        lines[number - 1] = {k: v for k, v in lines[number - 1].items() if v is not None}
        _lines(run / name, lines)

    return change


def _emptied(run: Path) -> None:
    for name in ("summary.json", "metrics.jsonl", "timing/rank0.jsonl", "timing/rank1.jsonl"):
        (run / name).unlink()
    (run / "timing").rmdir()


def _summary_a_directory(run: Path) -> None:
    (run / "summary.json").unlink()
    (run / "summary.json").mkdir()


def _ps_worker(text: str) -> Callable[[Path], None]:
    return _text("ps/worker0.jsonl", text)


TRACE_OK = {"name": "forward", "ph": "X", "pid": 0, "tid": 0, "ts": 0.0, "dur": 5.0}

# name: (how the run is broken, what its one line must say after "shardwise: report: RUN/")
MALFORMED: dict[str, tuple[Callable[[Path], None], str]] = {
    "empty directory": (_emptied, " is not a finished run directory (no summary.json)"),
    "summary.json not JSON": (_text("summary.json", "{oops"), "summary.json: not JSON"),
    "summary.json empty": (_text("summary.json", ""), "summary.json: not JSON"),
    "summary.json not an object": (_text("summary.json", "[1, 2]"), "summary.json: not a JSON"),
    "summary.json not UTF-8": (_text("summary.json", b'{"a": "\xff"}'), "summary.json: not UTF-8"),
    "summary.json nested deep": (_text("summary.json", "[" * 100_000), "nested too deeply"),
    "summary.json a directory": (_summary_a_directory, " is not a finished run"),
    "summary.json {}": (_text("summary.json", "{}"), "summary.json: no 'strategy'"),
    "world_size a string": (_summary(world_size="2"), "world_size must be a whole number"),
    "world_size 1e9 (float)": (_text("summary.json", '{"world_size": 1e9}'), "world_size must"),
    "world_size 2.0": (_summary(world_size=2.0), "world_size must be a whole number >= 1"),
    "world_size negative": (_summary(world_size=-2), "world_size must be a whole number >= 1"),
    "world_size zero": (_summary(world_size=0), "world_size must be a whole number >= 1"),
    "world_size 10**30": (_summary(world_size=10**30), "world_size must be a whole number"),
    "world_size true": (_summary(world_size=True), "world_size must be a whole number >= 1"),
    "strategy a list": (_summary(strategy=["ddp"]), "strategy must be a string, not a list"),
    "steps NaN": (_text("summary.json", '{"steps": NaN}'), "not strict JSON (NaN)"),
    "steps a float": (_summary(steps=4.5), "steps must be a whole number"),
    "samples_per_s Infinity": (_text("summary.json", '{"samples_per_s": 1e999}'), "finite"),
    "samples_per_s a string": (_summary(samples_per_s="fast"), "samples_per_s must be a finite"),
    "skipped_steps a number": (_summary(skipped_steps=3), "skipped_steps must be a list"),
    "predicted not an object": (_summary(predicted=[1]), "predicted must be an object"),
    "predicted row measured text": (
        _summary(predicted={"rows": {"step_time_s": {"predicted": 0.1, "measured": "1"}}}),
        "predicted.rows.step_time_s: measured must be a finite number",
    ),
    "metrics broken line": (_text("metrics.jsonl", '{"step": 1, "loss": 2.0}\n{"st'), ":2: not"),
    "metrics line a list": (_text("metrics.jsonl", "[1, 2]\n"), "metrics.jsonl:1: not a JSON obj"),
    "metrics step a string": (_line("metrics.jsonl", 3, step="3"), ":3: step must be a whole"),
    "metrics loss a string": (_line("metrics.jsonl", 2, loss="high"), ":2: loss must be a finite"),
    "metrics no step": (_line("metrics.jsonl", 1, step=None), "metrics.jsonl:1: no 'step'"),
    "metrics huge loss": (_line("metrics.jsonl", 1, loss=1e300), "loss must be a finite number"),
    "timing garbage": (_text("timing/rank1.jsonl", "\x00\x01garbage"), "rank1.jsonl:1: not JSON"),
    "timing no wait_s": (_line("timing/rank0.jsonl", 2, wait_s=None), ":2: no 'wait_s'"),
    "timing memory a number": (_line("timing/rank1.jsonl", 4, memory=7), "memory must be an obj"),
    "timing comm_bytes text": (
        _line("timing/rank0.jsonl", 1, comm_bytes={"all_reduce": "4k"}),
        "comm_bytes.all_reduce must be a finite number",
    ),
    "timing phases cut": (_line("timing/rank0.jsonl", 1, forward_s=None), "data_s but no forward"),
    "trace.json garbage": (_text("trace.json", "not json"), "trace.json: not JSON"),
    "trace.json no events": (_text("trace.json", '{"events": []}'), "trace.json: not a trace"),
    "trace event pid text": (
        _text("trace.json", json.dumps({"traceEvents": [{**TRACE_OK, "pid": "0"}]})),
        "trace.json: event 0: pid must be a whole number",
    ),
    "trace event a list": (_text("trace.json", '{"traceEvents": [[]]}'), "event 0: not a JSON"),
    "ps worker garbage": (_ps_worker("{]"), "ps/worker0.jsonl:1: not JSON"),
    "ps worker no wait_s": (
        _ps_worker('{"step": 1, "step_time_s": 0.1, "loss": 2.0}\n'),
        "ps/worker0.jsonl:1: no 'wait_s'",
    ),
}


def _report(*argv: str, capsys) -> tuple[int, list[str], str]:
    """`shardwise report ARGV` by the command line's entry point: exit code, stderr's lines,
    stdout."""
    code = cli.main(["report", *argv])
    out, err = capsys.readouterr()
    return code, err.splitlines(), out


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_run_gets_one_line_and_exit_2(case, tmp_path, capsys):
    run = write_run(tmp_path / "run")
    breaks, says = MALFORMED[case]
    breaks(run)
    before = sorted(run.rglob("*"))
    code, err, _ = _report(str(run), capsys=capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"shardwise: report: {run}"), err[0]
    assert says in err[0], err[0]
    assert sorted(run.rglob("*")) == before  # nothing written


def test_what_is_not_a_directory_gets_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("{}")
    code, err, _ = _report(str(tmp_path / "file"), capsys=capsys)
    assert (code, err) == (
        2,
        [f"shardwise: report: {tmp_path / 'file'} is a file, not a run directory"],
    )
    code, err, _ = _report(str(tmp_path / "nowhere"), capsys=capsys)
    assert (code, err) == (
        2,
        [
            f"shardwise: report: {tmp_path / 'nowhere'} is not a finished run directory (no "
            "summary.json)"
        ],
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_a_directory_without_permission_gets_one_line(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    run.chmod(0)
    try:
        code, err, _ = _report(str(run), capsys=capsys)
    finally:
        run.chmod(0o755)
    assert code == 2 and len(err) == 1 and "Permission denied" in err[0], err


def _odd_runs(root: Path) -> dict[str, Path]:
    """Runs whose files are odd but readable, each as a page should show it."""
    runs = {
        "huge world": write_run(root / "huge", world_size=10**9, ranks=2),  # two on disk
        "stale ranks": write_run(root / "stale", ranks=4),  # rank2, rank3: an earlier run's
        "gaps": write_run(root / "gaps", world_size=4, ranks=0),
        "bare": write_run(root / "bare", strategy="$\\frac{$ money"),  # not TeX
        "nulls": write_run(root / "nulls", samples_per_s=None, eval_accuracy=None),
        "ps": write_run(root / "ps", ranks=0, strategy="parameter server", steps=None),
    }
    for rank in (1, 3):  # "gaps": the other host's ranks, 0 and 2, wrote elsewhere
        _lines(runs["gaps"] / "timing" / f"rank{rank}.jsonl", timing_lines(rank))
    trace = {"traceEvents": [{"ph": "M", "pid": 0}, TRACE_OK, {**TRACE_OK, "pid": 3}]}
    (runs["gaps"] / "trace.json").write_text(json.dumps(trace))
    for name in ("metrics.jsonl", "timing/rank0.jsonl", "timing/rank1.jsonl"):
        (runs["bare"] / name).unlink()
    nulls = [{"step": 1, "loss": None, "nonfinite": {"loss": "nan"}, "grad_norm": 0.0}]
    nulls += [{"step": s, "loss": 1.0, "t": None, "grad_norm": 0.0, "lr": None} for s in (2, 3)]
    (runs["nulls"] / "metrics.jsonl").write_text("\n\n".join(map(json.dumps, nulls)) + "\n\n")
    (runs["ps"] / "ps").mkdir()
    for worker in (0, 10, 1):  # worker10 after worker1: by number, not by name
        rows = [
            {"step": s, "t": s, "loss": 2.0, "step_time_s": 0.1, "wait_s": 0.01} for s in (1, 2)
        ]
        _lines(runs["ps"] / "ps" / f"worker{worker}.jsonl", rows)
    return runs


def test_odd_but_readable_runs_make_a_page(tmp_path, capsys):
    runs = _odd_runs(tmp_path)
    loaded = {name: load_run(path) for name, path in runs.items()}
    assert loaded["huge world"].ranks == [0, 1]  # not a billion files looked for
    assert loaded["stale ranks"].ranks == [0, 1] and len(loaded["stale ranks"].timing) == 2
    assert loaded["gaps"].ranks == [1, 3]
    assert _tick_labels(breakdown_figure([loaded["gaps"]])) == [
        "ddp (4 ranks), rank 1",
        "ddp (4 ranks), rank 3",
    ]
    assert _tick_labels(timeline_figure([loaded["gaps"]])) == [
        "ddp (4 ranks)\nrank 0",
        "ddp (4 ranks)\nrank 3",
    ]
    assert loaded["nulls"].summary.get("samples_per_s") is None
    assert [m["loss"] for m in loaded["nulls"].steps] == [None, 1.0, 1.0]
    assert math.isnan(stability(loaded["nulls"])["grad_norm_cv"])  # spread over mean 0
    assert loaded["ps"].ranks == [0, 1, 10] and loaded["ps"].summary["steps"] == 2

    page = tmp_path / "page.html"
    code, err, _ = _report(*map(str, runs.values()), "-o", str(page), capsys=capsys)
    assert (code, err) == (0, [])  # not even a warning
    cells = re.findall(r"<tr><td>([^<]*)</td>", page.read_text())
    assert cells == [
        "ddp (1000000000 ranks)",
        "ddp (2 ranks) [stale]",
        "ddp (4 ranks)",
        "$\\frac{$ money (2 ranks)",
        "ddp (2 ranks) [nulls]",
        "parameter server",
    ]
    rows = page.with_suffix(".md").read_text().splitlines()[2:]
    md_cells = [f"| {cell}".replace("\\", "\\\\") for cell in cells]  # (backslash escaped)
    assert [row.split(" | ")[0] for row in rows] == md_cells


def _tick_labels(fig) -> list[str]:
    import matplotlib.pyplot as plt

    fig.canvas.draw()
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    plt.close(fig)
    return labels


# (-o and --screenshot as given, with {tmp} and {run} filled in; what the one line says)
OUTPUTS = {
    "page named .md": (["-o", "{tmp}/x.md"], "-o {tmp}/x.md: the page is HTML; name it .html"),
    "page named .MD": (["-o", "{tmp}/x.MD"], "the page is HTML; name it .html (its Markdown"),
    "page over summary.json": (["-o", "{run}/summary.json"], "the page is HTML; name it .html"),
    "page without suffix": (["-o", "{tmp}/page"], "the page is HTML; name it .html"),
    "page a directory": (["-o", "{tmp}/pages.html"], "-o {tmp}/pages.html is a directory"),
    "screenshot over the page": (["--screenshot", "{tmp}/x.html"], "the screenshot is a PNG"),
}


@pytest.mark.parametrize("case", list(OUTPUTS))
def test_outputs_that_would_overwrite_something_are_refused(case, tmp_path, capsys):
    run = write_run(tmp_path / "run")
    (tmp_path / "pages.html").mkdir()
    flags, says = OUTPUTS[case]
    flags = [flag.format(tmp=tmp_path, run=run) for flag in flags]
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    code, err, _ = _report(str(run), *flags, capsys=capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("shardwise: report: ") and says.format(tmp=tmp_path) in err[0], err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_a_page_that_cannot_be_written_whole_is_not_written(tmp_path, capsys):
    run = write_run(tmp_path / "run")
    (tmp_path / "page.md").mkdir()
    code, err, _ = _report(str(run), "-o", str(tmp_path / "page.html"), capsys=capsys)
    assert (code, err) == (
        2,
        [f"shardwise: report: cannot write {tmp_path / 'page.md'}: it is a directory"],
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.md", "run"]  # no page, no part
    page = run / "summary.json" / "page.html"  # (its folder is a file)
    code, err, _ = _report(str(run), "-o", str(page), capsys=capsys)
    assert code == 2 and err == [
        f"shardwise: report: cannot write {page}: File exists ({run / 'summary.json'})"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.md", "run"]

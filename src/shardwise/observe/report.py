"""`shardwise report RUN_DIR [RUN_DIR ...] [-o report.html]`: one offline page comparing runs.

Everything comes from what the runs left in their directories: summary.json, metrics.jsonl
(rank 0's line per step), timing/rank{r}.jsonl (each rank's phases, blocked time, bytes by
collective, memory) and, where the run traced steps, trace.json. The page is one HTML file with
its figures embedded (PNG, base64): it opens anywhere, offline. A Markdown summary of the same
figures goes beside it (and to the terminal) for CI logs.

Every field the report reads is checked before any figure is drawn (`report_inputs`): a file
that is not what a finished run leaves gets one line naming it, its line and the field. The
numbers are `report_measures`', the figures `report_figures`'; this module puts them on the page
and writes it, and nothing is written until the page and its Markdown are whole.
"""

from __future__ import annotations

import argparse
import html
import math
import os
import sys
from pathlib import Path
from typing import Any

from shardwise.observe.report_figures import FIGURES, png_base64
from shardwise.observe.report_inputs import (
    ReportError,
    RunRecord,
    distinct_labels,
    exists_as,
    load_run,
)
from shardwise.observe.report_measures import headline_table, predicted_rows, prediction_table

PERCENT = ("eval accuracy", "most idle rank", "grad norm cv")  # columns that are fractions


def _cell(key: str, value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.1%}" if key in PERCENT else f"{value:,.4g}"
    return "-" if value is None else str(value)


def markdown(runs: list[RunRecord]) -> str:
    out = _markdown_table(headline_table(runs))
    if any(predicted_rows(run) for run in runs):
        out += "\nPredicted / measured (rank 0):\n\n" + _markdown_table(prediction_table(runs))
    return out


def _markdown_table(rows: list[dict]) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(map(_md, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md(_cell(k, row[k])) for k in header) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _md(text: str) -> str:
    """`text` as one table cell of Markdown: no HTML of its own (a run's name from its files
    shows as written), no cell or row break."""
    text = html.escape(text, quote=False).replace("\\", "\\\\").replace("|", "\\|")
    return text.replace("\n", " ")


def _html_table(rows: list[dict]) -> str:
    head = "".join(f"<th>{html.escape(k)}</th>" for k in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(k, v))}</td>" for k, v in row.items()) + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def render(runs: list[RunRecord]) -> str:
    """The whole page: the table, then every figure, embedded."""
    import matplotlib

    tables = _html_table(headline_table(runs))
    if any(predicted_rows(run) for run in runs):
        tables += "<h2>Predicted / measured (rank 0)</h2>" + _html_table(prediction_table(runs))
    sections = []
    for title, make in FIGURES.items():
        if title == "Timeline" and not any(run.trace for run in runs):
            continue
        if title == "Predicted vs measured" and not any(predicted_rows(run) for run in runs):
            continue
        # A run's name is text, not TeX: `$` in a label must not start mathtext (which can fail).
        with matplotlib.rc_context({"text.parse_math": False}):
            image = png_base64(make(runs))
        sections.append(
            f'<section><h2>{html.escape(title)}</h2><img alt="{html.escape(title)}" '
            f'src="data:image/png;base64,{image}"></section>'
        )
    sources = "".join(f"<li><code>{html.escape(str(run.path))}</code></li>" for run in runs)
    return PAGE.format(tables=tables, sections="".join(sections), runs=sources)


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>shardwise report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }}
table {{ border-collapse: collapse; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
th:first-child, td:first-child {{ text-align: left; }}
img {{ max-width: 100%; }}
section {{ margin-top: 1.5em; }}
</style></head><body>
<h1>shardwise report</h1>
{tables}
{sections}
<h2>Runs</h2><ul>{runs}</ul>
</body></html>
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise report", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories")
    parser.add_argument(
        "-o",
        "--out",
        default=None,
        help="HTML file, .html (default: report.html in the first run directory); the Markdown "
        "summary goes beside it, .md",
    )
    parser.add_argument("--screenshot", help="also a PNG of the page, by headless Chromium")
    args = parser.parse_args(argv)
    try:
        _check_outputs(args)
        runs = distinct_labels([load_run(Path(p)) for p in args.runs])
        out = Path(args.out) if args.out else runs[0].path / "report.html"
        summary = markdown(runs)
        write_whole({out: render(runs), out.with_suffix(".md"): summary})
        print(summary)
        print(f"shardwise: report in {out} (Markdown beside it)")
        if args.screenshot:
            screenshot(out, Path(args.screenshot))
            print(f"shardwise: screenshot in {args.screenshot}")
    except ReportError as e:
        print(f"shardwise: report: {e}", file=sys.stderr)
        return 2
    return 0


def _check_outputs(args: argparse.Namespace) -> None:
    """Before anything is read: the page, its Markdown beside it (same name, .md) and the
    screenshot are three files, none of them a run's own."""
    if args.out is not None:
        out = Path(args.out)
        if out.suffix.lower() not in (".html", ".htm"):
            raise ReportError(
                f"-o {out}: the page is HTML; name it .html (its Markdown goes beside it, .md)"
            )
        if exists_as(out, "dir"):
            raise ReportError(f"-o {out} is a directory; name the page's file (report.html)")
    if args.screenshot is not None and Path(args.screenshot).suffix.lower() != ".png":
        raise ReportError(f"--screenshot {args.screenshot}: the screenshot is a PNG; name it .png")


def write_whole(files: dict[Path, str]) -> None:
    """Each file whole or not at all: written under a temporary name beside it, then renamed
    over it once every one is written."""
    for path in files:
        if exists_as(path, "dir"):
            raise ReportError(f"cannot write {path}: it is a directory")
    partial: dict[Path, Path] = {}
    try:
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            partial[path] = path.with_name(f".{path.name}.partial")
            partial[path].write_text(text, encoding="utf-8")
        for path, temporary in partial.items():
            os.replace(temporary, path)
    except OSError as e:
        for temporary in partial.values():
            temporary.unlink(missing_ok=True)
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""
        raise ReportError(f"cannot write {path}: {e.strerror or e}{where}") from None


def screenshot(page: Path, png: Path, width: int = 1200, height: int = 4000) -> None:
    """The whole page as headless Chromium draws it (Debian's `chromium` package): a window
    taller each time until the page ends above its bottom, then cropped below the page."""
    import shutil
    import subprocess

    from PIL import Image, ImageOps

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise ReportError("--screenshot needs Chromium on PATH (Debian: apt-get install chromium)")
    png.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(4):
        argv = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
        argv += [f"--window-size={width},{height}", f"--screenshot={png.resolve()}"]
        try:
            done = subprocess.run(
                [*argv, page.resolve().as_uri()], capture_output=True, text=True, timeout=120
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ReportError(f"Chromium did not draw the page: {e}") from None
        if done.returncode != 0 or not png.is_file():
            raise ReportError(f"Chromium failed ({done.returncode}): {done.stderr.strip()[-300:]}")
        with Image.open(png) as image:
            drawn = ImageOps.invert(image.convert("RGB")).getbbox()  # what is not white
            bottom = drawn[3] if drawn else 0
            if bottom < height - 40:
                image.crop((0, 0, width, min(height, bottom + 40))).save(png)
                return
        height *= 2

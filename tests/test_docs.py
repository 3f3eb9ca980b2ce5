"""The README and docs/ hold what they say: every code block marked runnable runs, every relative
link (and its #anchor) resolves, the strategy table's YAML and Python forms are the same
strategy, and the README stays a front door (under 250 lines).

A block is runnable when the line right before its fence is `<!-- runnable -->` (invisible on
GitHub). Python blocks run as scripts of this interpreter (forked from the test process's
zygote, as `harness.run_cli` runs a command), shell blocks with `bash -e`, `shardwise` run
the same way and this interpreter's bin directory next on PATH; each in a fresh temporary
directory (nothing lands in the repository), one thread per process, with an empty cache (no
calibration of this machine).
Mark only examples that take seconds: the whole file must stay well under a minute.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from harness import BOOT, zygote_env

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MARK = "<!-- runnable -->"
LANGUAGES = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
README_MAX_LINES = 250
BLOCK_TIMEOUT_S = 300  # bounds a failure only; each block takes seconds

# What a launcher sets for its ranks: a block must start its own job, not join the caller's.
LAUNCH_ENV = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK"}
LAUNCH_ENV |= {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fenced(text: str) -> list[tuple[int, str, str]]:
    """(line of the opening fence, its info string, the code) of every fenced block."""
    found, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            start, info, body = i, lines[i][3:].strip(), []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            found.append((start + 1, info, "\n".join(body) + "\n"))
        i += 1
    return found


def runnable_blocks(page: Path) -> list[Block]:
    text = page.read_text()
    lines = text.splitlines()
    marks = {n + 1 for n, line in enumerate(lines) if line.strip() == MARK}  # 1-based
    blocks = []
    for line, info, code in fenced(text):
        if line - 1 in marks:
            marks.discard(line - 1)
            language = LANGUAGES.get(info)
            assert language, f"{page.name}:{line}: a runnable block of unknown language {info!r}"
            blocks.append(Block(page, line, language, code))
    assert not marks, f"{page.name}: {MARK} on lines {sorted(marks)} is not right before a fence"
    return blocks


BLOCKS = [block for page in PAGES for block in runnable_blocks(page)]


def _environment(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env = {k: v for k, v in env.items() if not k.startswith("SHARDWISE_")}
    # `shardwise` is the module run in a fork of the test process's zygote, as `harness.run_cli`
    # runs it (the console script itself: test_cli's README example, `start_entry_point`): a
    # command spared Python's start and the imports, ~3 s of CPU; the block's own environment.
    shim = tmp / ".bin"
    shim.mkdir(exist_ok=True)  # (a block run again there)
    exports = "".join(f"export {name}={value}\n" for name, value in zygote_env().items())
    (shim / "shardwise").write_text(
        f'#!/bin/sh\n{exports}exec "{sys.executable}" "{BOOT}" -m shardwise "$@"\n'
    )
    (shim / "shardwise").chmod(0o755)
    env.update(
        PATH=os.pathsep.join([str(shim), str(Path(sys.executable).parent), env.get("PATH", "")]),
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        XDG_CACHE_HOME=str(tmp / ".cache"),  # no calibration of this machine, whatever is stored
        MPLCONFIGDIR=str(tmp / ".matplotlib"),
    )
    return env


_RESULTS: dict[Block, subprocess.CompletedProcess] = {}
_RESULTS_DIRS: dict[Block, Path] = {}  # where each block ran


def run(block: Block, tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess:
    """Run `block` once in a fresh directory (later calls get the same result)."""
    if block not in _RESULTS:
        tmp = tmp_path_factory.mktemp("block")
        script = tmp / ("block.py" if block.language == "python" else "block.sh")
        script.write_text(block.code)
        _RESULTS_DIRS[block] = tmp
        _RESULTS[block] = execute(block, tmp)
    return _RESULTS[block]


def execute(block: Block, tmp: Path) -> subprocess.CompletedProcess:
    """Run `block`'s script, written in `tmp`, there."""
    env = _environment(tmp)
    if block.language == "python":  # (forked from the zygote too, as a script `BOOT` runs)
        command, env = [sys.executable, BOOT, "block.py"], {**env, **zygote_env()}
    else:
        command = ["bash", "-e", "block.sh"]
    return subprocess.run(
        command,
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


def test_runnable_blocks_are_found_in_the_readme_and_the_docs():
    readme = [b.language for b in BLOCKS if b.page == README]
    assert "python" in readme and "bash" in readme, "the README's quickstart is marked runnable"
    assert len(BLOCKS) - len(readme) >= 3, "docs/ keeps runnable examples"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_runnable_block_runs(block, tmp_path_factory):
    result = run(block, tmp_path_factory)
    output = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0, f"{block.name} exited {result.returncode}:\n{output}"
    assert result.stdout.strip(), f"{block.name} printed nothing:\n{output}"


def test_the_readme_quickstart_trains(tmp_path_factory):
    quickstart, _ = [b for b in BLOCKS if b.page == README and b.language == "python"]
    result = run(quickstart, tmp_path_factory)
    assert result.returncode == 0, result.stderr[-4000:]
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", result.stdout).groups())
    assert last < first / 2, result.stdout


def test_the_readme_own_loop_resumes_where_it_stopped(tmp_path_factory):
    """The README's own loop with the trainer's parts, run twice in one directory: the second
    run resumes from the first one's last checkpoint and goes on."""
    _, own_loop = [b for b in BLOCKS if b.page == README and b.language == "python"]
    first = run(own_loop, tmp_path_factory)  # (in a directory of its own)
    assert first.returncode == 0 and "steps 1-10:" in first.stdout, first.stderr[-4000:]
    again = execute(own_loop, _RESULTS_DIRS[own_loop])
    assert again.returncode == 0, again.stderr[-4000:]
    assert "(step 10)" in again.stdout and "steps 11-20:" in again.stdout, again.stdout


def test_the_readme_command_line_quickstart_trains_and_reports(tmp_path_factory):
    (shell,) = [b for b in BLOCKS if b.page == README and b.language == "bash"]
    result = run(shell, tmp_path_factory)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "step 20/20" in result.stdout and "zero-3" in result.stdout  # the summary table
    assert "report in report.html" in result.stdout


def test_the_readme_is_a_front_door():
    lines = README.read_text().count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; the detail goes to docs/"


# Links -------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The page without its fenced blocks and inline code (neither holds links or headings)."""
    text = re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"^```.*?^```[^\n]*$", "", page.read_text(), flags=re.M | re.S)
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in found:  # a repeated heading gets -1, -2, ...
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def links() -> list[tuple[Path, str]]:
    return [(page, target) for page in PAGES for target in LINK.findall(_prose(page.read_text()))]


def test_every_relative_link_points_to_a_file_and_its_anchor_to_a_heading():
    broken = []
    checked = 0
    for page, target in links():
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        checked += 1
        if not dest.exists():
            broken.append(f"{page.relative_to(ROOT)}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{page.relative_to(ROOT)}: {target}: no heading with that anchor")
    assert checked > 20, "the README and docs link to each other"
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme():
    readme_links = {
        (ROOT / target.partition("#")[0]).resolve()
        for page, target in links()
        if page == README and target.startswith("docs/")
    }
    missing = [p.name for p in PAGES[1:] if p.resolve() not in readme_links]
    assert not missing, f"docs pages the README does not link to: {missing}"


# Module paths ------------------------------------------------------------------------------

PY_PATH = re.compile(r"`([\w./-]+\.py)(?::\w+)?`")
SOURCES = [ROOT / d for d in ("src", "tests", "benchmarks", "examples")]
# The lead rewrites architecture.md for the new layout; its paths are checked once it is done.
PATHS_UNCHECKED: set[str] = set()


def resolves(name: str) -> bool:
    """`name` is a file of the checkout: from the root or the package (`comm/jobstore.py`), or
    the end of one's path (`datasets/packing.py`, or a bare `units.py` named beside its
    directory)."""
    if any((base / name).is_file() for base in (ROOT, ROOT / "src" / "shardwise")):
        return True
    return any(
        str(found).endswith("/" + name) for src in SOURCES for found in src.rglob(Path(name).name)
    )


def test_every_python_file_the_docs_name_exists():
    missing = []
    for page in PAGES:
        if page.name in PATHS_UNCHECKED:
            continue
        prose = re.sub(r"^```.*?^```[^\n]*$", "", page.read_text(), flags=re.M | re.S)
        missing += [f"{page.name}: {name}" for name in PY_PATH.findall(prose) if not resolves(name)]
    assert not missing, "files named that the checkout does not have:\n" + "\n".join(missing)


# The strategy table ------------------------------------------------------------------------


def strategy_rows() -> list[tuple[str, str, str]]:
    """(strategy, YAML, Python) of every row of the README's table under 'Every strategy'."""
    section = README.read_text().split("## Every strategy", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("strategy", "---"):
            rows.append((cells[0], cells[1].strip("`"), cells[2].strip("`")))
    return rows


def test_the_strategy_table_forms_are_the_same_strategy(tmp_path):
    import shardwise as sw
    from shardwise.config import validate

    rows = strategy_rows()
    assert len(rows) >= 20, rows
    for name, yaml_form, python_form in rows:
        if yaml_form == "Python only":
            assert python_form.startswith("with model."), name
            continue
        section = yaml.safe_load(yaml_form)
        built = validate({"strategy": section}).strategy.build(4, tmp_path)
        made = eval(python_form, {"sw": sw})
        assert type(made) is type(built), f"{name}: {yaml_form} is not {python_form}"
        options = {f.name for f in dataclasses.fields(made)}
        for key, value in section.items():
            if key in options:  # what the YAML sets, the Python form sets alike
                assert getattr(made, key) == getattr(built, key), f"{name}: {key} = {value}"

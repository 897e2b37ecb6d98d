"""The README's code as a reader would use it: every Python block compiles, the first loop runs.

The manual's pages (docs/*.md) are held to the same: every Python block compiles, every link
between the README and the pages leads to a file that exists, and the README stays a front door.

The custom-loop example ("Your first distributed program") is run as a script exactly as the
README shows it: MirroredStrategy with 2 CPU replicas, printing a falling loss.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_job

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


DOCS = README.parent / "docs"
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _blocks(language: str, path: Path = README) -> list[str]:
    return [body for lang, body in _BLOCK.findall(path.read_text()) if lang == language]


def test_every_python_block_of_the_manual_compiles():
    pages = sorted(DOCS.glob("*.md"))
    blocks = [(page, body) for page in pages for body in _blocks("python", page)]
    assert len(blocks) >= 16  # those the README held before the manual moved out of it
    for page, body in blocks:
        try:
            ast.parse(body)
        except SyntaxError as e:  # pragma: no cover - the failure message is the point
            pytest.fail(f"{page.name}: python block does not compile: {e}\n{body}")


def test_the_readme_is_a_front_door_that_reaches_every_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 300, len(text.splitlines())
    linked = {Path(target).name for target in _LINK.findall(text) if target.startswith("docs/")}
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages <= linked, f"pages the README does not link: {sorted(pages - linked)}"


def test_links_between_the_readme_and_the_pages_lead_somewhere():
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for target in _LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{page.name} links {target}, which does not exist"


def test_every_python_block_compiles():
    blocks = _blocks("python")
    assert len(blocks) >= 1  # the first program; the manual's examples are in docs/
    for body in blocks:
        try:
            ast.parse(body)
        except SyntaxError as e:  # pragma: no cover - the failure message is the point
            pytest.fail(f"README python block does not compile: {e}\n{body}")


def test_the_test_command_is_the_one_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]" && pytest' in ci
    assert any('pip install -e ".[test]" && pytest' in body for body in _blocks("bash"))


def test_first_program_runs_and_prints_a_falling_loss(tmp_path):
    text = README.read_text()
    section = text[text.index("## Your first distributed program") :]
    body = _blocks_in(section)[0]
    (tmp_path / "train.py").write_text(body)
    # fresh: the README's program as a user starts it (not forked from the suite's fork server)
    result = run_job([sys.executable, "train.py"], timeout=180, cwd=tmp_path, fresh=True)
    assert result.returncode == 0, result.logs()
    losses = [float(v) for v in re.findall(r"epoch \d+: loss (\d+\.\d+)", result.output)]
    assert len(losses) == 5, result.output  # printed once per epoch, by replica 0 only
    assert losses[-1] < 0.7 * losses[0], losses


def _blocks_in(text: str) -> list[str]:
    return [body for lang, body in _BLOCK.findall(text) if lang == "python"]


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_install_says_where_from_into_what_and_which_torch_build():
    """A newcomer gets the clone, a venv, and the choice of torch build (a plain `pip install torch`
    on Linux pulls gigabytes of CUDA libraries), as PyTorch's own guide gives it."""
    install = _section("Install")
    commands = "\n".join(_blocks_in_lang(install, "bash"))
    assert "git clone " in commands and "python3 -m venv " in commands, commands
    assert "--index-url https://download.pytorch.org/whl/cpu" in commands, commands
    assert "https://pytorch.org/get-started/locally/" in install
    assert "CUDA" in install and "not on PyPI" in install


_PIP_INSTALL = re.compile(r"pip install ([^\n`]*)")


def _install_commands() -> list[tuple[str, str]]:
    found = []
    for path in [README, *sorted(DOCS.rglob("*.md")), *sorted((README.parent / "examples").rglob("*"))]:
        if path.suffix in (".md", ".ipynb", ".py", ".R") and path.is_file():
            text = path.read_text(errors="replace").replace('\\"', '"')
            found += [(str(path.relative_to(README.parent)), m) for m in _PIP_INSTALL.findall(text)]
    return found


def test_phalanx_is_installed_from_its_clone_everywhere_with_extras_that_exist():
    """phalanx is on no registry: `pip install "phalanx[keras]"` (the seed notebook's cell) fails."""
    import tomllib

    extras = set(tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    commands = _install_commands()
    assert len(commands) >= 5, commands
    for where, args in commands:
        args = re.split(r"#|&&|;|\|", args)[0]  # this command's arguments, without a comment or the next command
        for token in args.split():
            token = token.strip("\"'")
            assert not re.match(r"phalanx(\[|$)", token), f"{where}: installs phalanx from a registry: {args}"
            path_extras = re.match(r"^(\.{1,2}|/[^\[]*)\[([^\]]+)\]$", token)
            if path_extras:
                named = {e.strip() for e in path_extras.group(2).split(",")}
                assert named <= extras, f"{where}: no such extra {sorted(named - extras)}: {args}"


def _blocks_in_lang(text: str, language: str) -> list[str]:
    return [body for lang, body in _BLOCK.findall(text) if lang == language]


def test_the_demo_table_and_the_test_suite_say_on_what_machine_and_how_far_they_vary():
    quickstart = _section("Quickstart")
    table = quickstart.index("MirroredStrategy              2")
    after = quickstart[table:]
    assert "2-core" in quickstart[:table], "the table's machine"
    # Other runs' figures as ranges, and what does not vary.
    assert re.search(r"\d\.\d+-\d\.\d+ s and \d\.\d+-\d\.\d+ s", after), after[:800]
    assert "accuracies do not depend on the load" in after
    suite = quickstart[quickstart.index("The test suite") :]
    assert re.search(r"2-core .{0,40}took \d+ to \d+ minutes", suite, re.S), suite[:600]
    assert re.search(r"\d+ minutes \(\d+ CPU-minutes\) when other work", suite), suite[:600]


def test_the_readme_test_count_is_true():
    """ "about N tests": within 5 % of what pytest collects (about 10 CPU-seconds to collect)."""
    stated = int(re.search(r"about ([\d,]+) tests", _section("Quickstart")).group(1).replace(",", ""))
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider"],
        cwd=README.parent,
        capture_output=True,
        text=True,
        timeout=240,
    )
    count = int(re.search(r"(\d+) tests? collected", collected.stdout).group(1))
    assert abs(stated - count) <= 0.05 * count, f"the README says about {stated} tests; pytest collects {count}"


def test_the_first_program_section_gives_the_measured_start_up_times():
    """The README's start-up figures are benchmarks/results/startup.json's (python -m benchmarks.startup)."""
    results = json.loads((README.parent / "benchmarks" / "results" / "startup.json").read_text())["results"]
    section = _section("Your first distributed program")
    for flavour in ("torch", "keras"):
        for launcher in ("self_launch", "phalanx_fork"):
            figure = f"{results[flavour][launcher]['wall_s']:.1f} s"
            assert figure in section, f"{flavour}/{launcher}: {figure} not in the README's first program section"

"""The README's code as a reader would use it: every Python block compiles, the first loop runs.

The manual's pages (docs/*.md) are held to the same: every Python block compiles, every link
between the README and the pages leads to a file that exists, and the README stays a front door.

The custom-loop example ("Your first distributed program") is run as a script exactly as the
README shows it: MirroredStrategy with 2 CPU replicas, printing a falling loss.
"""

from __future__ import annotations

import ast
import re
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

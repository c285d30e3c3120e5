"""The README stays short enough to read in ten minutes, keeps its two commands, and every figure in its results
table names the command that produces it."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_is_under_15_kb_and_keeps_the_two_commands():
    text = README.read_text()
    assert len(text.encode()) < 15_000
    assert "scripts/setup.sh && .venv/bin/python -m vlm_grpo_ma.train --task grounding" in text
    assert "scripts/setup.sh && .venv/bin/python -m pytest -q" in text
    assert "scripts/setup.sh && .venv/bin/python -m pytest -q" in (README.parent / ".ci" / "run").read_text()


def test_every_results_row_names_its_command():
    section = README.read_text().split("## Results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    assert len(rows) >= 8
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 3, row
        what, figure, command = cells
        assert figure and any(ch.isdigit() for ch in figure), row
        assert "`" in command or command in ("same", "the first command (its summary)"), row

"""The README stays short enough to read in ten minutes, keeps its two commands, and every figure in its results
table names the command that produces it; the docs pages and presets cite only files that exist and agree on
where the public data goes."""

from __future__ import annotations

import re
from pathlib import Path

from vlm_grpo_ma.run.config_files import load_config

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


# ----------------------------------------------------------------------------------------------------------
# the docs pages and presets: what they cite exists, and they agree on where the public data goes

ROOT = README.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PRESETS = sorted((ROOT / "configs").rglob("*.yaml"))
# A path into the repository, as the docs and presets write one (a trailing dot or comma ends the sentence).
REPO_PATH = re.compile(r"(?<![\w./-])((?:docs|configs|scripts|vlm_grpo_ma|tests|\.ci)/[\w./-]*[\w/])")
PAGE_NAME = re.compile(r"(?<![\w./-])([\w-]+\.md)\b")
PUBLIC_DATA = re.compile(r"data/public/[\w./-]*[\w]")


def test_every_repository_path_and_page_the_docs_and_presets_cite_exists():
    pages = {path.name for path in [README, *DOCS]} | {path.name for path in (ROOT / "docs").rglob("*.md")}
    for path in [README, *DOCS, *PRESETS]:
        text = path.read_text()
        missing = [cited for cited in REPO_PATH.findall(text) if not (ROOT / cited).exists()]
        assert not missing, f"{path.relative_to(ROOT)} cites {missing}"
        unknown = [name for name in PAGE_NAME.findall(text) if name not in pages]
        assert not unknown, f"{path.relative_to(ROOT)} cites pages that are not in the repository: {unknown}"


def test_the_readme_names_every_docs_page():
    text = README.read_text()
    assert [page.name for page in DOCS if f"docs/{page.name}" not in text] == []


def test_presets_and_the_gpu_pages_use_the_data_paths_of_docs_data_md():
    """Every public-data path a preset, the README or the GPU quickstart names is one docs/DATA.md's commands
    make, under data/public/ (which git ignores); every GPU preset trains on such a file."""
    data_page = (ROOT / "docs" / "DATA.md").read_text()
    for path in [README, ROOT / "docs" / "GPU.md", *PRESETS]:
        for cited in PUBLIC_DATA.findall(path.read_text()):
            assert cited in data_page, f"{path.relative_to(ROOT)}: {cited} is not in docs/DATA.md"
    assert "data/public/" in (ROOT / ".gitignore").read_text().splitlines()
    for preset in PRESETS:
        if preset.parent.name == "configs" and not preset.name.startswith("tiny-"):
            source = load_config(preset).data.source
            assert source.startswith("data/public/") and source in data_page, (preset.name, source)


def test_readme_commands_write_only_into_ignored_folders():
    """A README command's working or output folder lies in runs/ or evals/ (ignored) or /tmp: a fresh clone
    stays clean after running it."""
    ignored = [line for line in (ROOT / ".gitignore").read_text().splitlines() if line.endswith("/")]
    folders = re.findall(r"--(?:work-dir|output-dir|out) (\S+?)`?(?=[\s`])", README.read_text())
    assert folders
    for folder in folders:
        assert folder.startswith("/tmp/") or any(folder.startswith(prefix) for prefix in ignored), folder

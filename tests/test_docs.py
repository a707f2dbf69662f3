"""The documentation: the README stays one screen's worth, every docs page is a page's worth, the README's
links lead to files that exist, the generated reference pages (omnictl's help, the OpenAPI operations,
the metrics registry) are what the code makes, the API page names every state, event and error code, and `mkdocs build --strict` builds the site, and fails on a broken link.

mkdocs runs in a subprocess on a copy of docs/ (about 5 s a build); the rest is in-process.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from docs_pages import METRICS_PAGE, OMNICTL_PAGE, OPENAPI_PAGE, REGENERATE, metrics_page, omnictl_page, openapi_page

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))


def test_the_readme_is_at_most_12_kb_and_no_section_is_longer_than_a_screen() -> None:
    text = README.read_text()
    assert len(text.encode()) <= 12 * 1024, len(text.encode())
    sections = re.split(r"^(?=## )", text, flags=re.M)
    for section in sections:
        lines = section.rstrip("\n").count("\n") + 1
        assert lines <= 60, f"{section.splitlines()[0]!r} is {lines} lines"


def test_each_docs_page_is_under_25_kb() -> None:
    assert len(PAGES) >= 30
    big = {str(p.relative_to(ROOT)): p.stat().st_size for p in PAGES if p.stat().st_size >= 25 * 1024}
    assert big == {}


def test_the_readmes_links_lead_to_files_that_exist() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert len(local) >= 30
    missing = [link for link in local if not (ROOT / link).exists()]
    assert missing == []


@pytest.mark.parametrize("page,make", [(OMNICTL_PAGE, omnictl_page), (OPENAPI_PAGE, openapi_page),
                                       (METRICS_PAGE, metrics_page)], ids=["omnictl", "openapi", "metrics"])
def test_the_generated_reference_pages_are_what_the_code_makes(page: Path, make: object) -> None:
    assert callable(make)
    assert page.read_text() == make(), f"{page.relative_to(ROOT)} is stale: run `{REGENERATE}`"


def test_the_omnictl_page_has_every_command() -> None:
    from omnictl.cli import cli
    text = OMNICTL_PAGE.read_text()
    for name in cli.list_commands(None):          # type: ignore[arg-type]
        assert f"## `omnictl {name}`" in text, name


def build(docs: Path, mkdocs_yml: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(mkdocs_yml), "-d", str(site)],
                          capture_output=True, text=True, timeout=300, env={"NO_MKDOCS_2_WARNING": "1",
                                                                             "PATH": "/usr/bin:/bin"})


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """mkdocs.yml and docs/ copied, to build (or break) without touching the checkout."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    return tmp_path


def test_the_site_builds_strictly_and_offline(copy: Path) -> None:
    made = build(copy / "docs", copy / "mkdocs.yml", copy / "site")
    assert made.returncode == 0, made.stderr[-3000:]
    assert (copy / "site/index.html").is_file() and (copy / "site/reference/config.html").is_file()
    html = (copy / "site/concepts/index.html").read_text()
    assert 'class="mermaid"' in html                 # the diagrams are drawn, not shown as code


@pytest.mark.parametrize("breakage", ["a missing page", "a missing anchor", "a page left out of the nav"])
def test_a_broken_link_fails_the_build(copy: Path, breakage: str) -> None:
    page = copy / "docs/guides/lora.md"
    if breakage == "a missing page":
        page.write_text(page.read_text() + "\nSee [the moon](../moon.md).\n")
    elif breakage == "a missing anchor":
        page.write_text(page.read_text() + "\nSee [keys](keys.md#no-such-section).\n")
    else:
        (copy / "docs/guides/orphan.md").write_text("# An orphan\n")
    made = build(copy / "docs", copy / "mkdocs.yml", copy / "site")
    assert made.returncode != 0, made.stderr[-3000:]


def test_the_api_page_names_every_state_event_and_error_code() -> None:
    from omnid.vocabulary import ErrorCode, EventType, JobState
    api = (ROOT / "docs/api.md").read_text()
    for enum in (JobState, EventType, ErrorCode):
        missing = [m.value for m in enum if f"`{m.value}`" not in api]
        assert missing == [], f"docs/api.md does not name these {enum.__name__} values: {missing}"

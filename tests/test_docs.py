"""The README is one screen, and every link in it and in docs/ resolves: files and anchors."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "protocol" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lowercase, punctuation dropped, spaces to hyphens."""
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", heading).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            broken.append(f"{target}: no {where}")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            broken.append(f"{target}: no heading #{anchor} in {where.name}")
    assert not broken, broken


def test_the_readme_is_one_screen_and_indexes_every_doc():
    """One screen: what the project is, the two commands, the commands, where it stands, the docs;
    the rest lives in docs/."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 80 and len(readme.encode()) <= 6 * 1024
    linked = set(LINK.findall(readme))
    missing = [p.name for p in (ROOT / "docs").glob("*.md") if f"docs/{p.name}" not in linked]
    assert not missing, missing


def shown(value, unit: str) -> str:
    """How the limits table writes a setting's default."""
    if unit == "bytes":
        return f"{value >> 20}M"
    return f"{value:g} {unit}" if unit else f"{value:g}"


@pytest.mark.parametrize("daemon", ["target", "draft"])
def test_the_limits_table_says_what_each_daemons_settings_say(daemon):
    """Each limit in a daemon's settings (ServiceSettings, DraftSettings) has its row in
    docs/serving.md, naming its flag and the daemon, with the field's own default: the settings
    object is where a limit is written."""
    from dataclasses import fields

    from draft_node.settings import DraftSettings
    from target_node.serving.settings import ServiceSettings

    settings = {"target": ServiceSettings, "draft": DraftSettings}[daemon]
    rows = {}
    for line in (ROOT / "docs" / "serving.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        flag = re.match(rf"`(--[a-z-]+)` \({daemon}\)", cells[1]) if line.startswith("|") and len(cells) == 4 else None
        if flag:
            rows[flag.group(1)] = cells[2]
    for f in fields(settings):
        if not f.metadata["limit"]:
            continue
        flag = "--" + f.name.replace("_", "-")
        assert flag in rows, f"{flag} has no row in the limits table"
        if f.name == "prefix_cache_mb":  # the machine's: the docs say how it is chosen
            assert "a tenth of the machine's memory" in rows[flag]
        else:
            assert rows[flag].startswith(shown(f.default, f.metadata["unit"])), (flag, rows[flag])

"""The documentation holds together: every relative link in README.md and docs/ resolves (to a file, and to a
heading where it names one), every docs/ page is linked from the README, and the README stays a front door."""

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_layout  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _text(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def _anchors(page):
    """GitHub's anchor of each heading: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in _text(page).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


def _links(page):
    text = re.sub(r"```.*?```", "", _text(page), flags=re.DOTALL)  # code blocks hold no links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]  # http:, https:, mailto: aside


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_resolves(page):
    for target in _links(page):
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        assert os.path.exists(os.path.join(ROOT, resolved)), f"{page}: {target} (no {resolved})"
        if anchor and resolved.endswith(".md"):
            assert anchor in _anchors(resolved), f"{page}: {target} (no heading #{anchor} in {resolved})"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {os.path.normpath(t.partition("#")[0]) for t in _links("README.md")}
    assert [p for p in PAGES[1:] if p not in linked] == []


def test_the_readme_is_a_front_door():
    lines = _text("README.md").splitlines()
    assert len(lines) <= 300, len(lines)
    assert "python train.py" in _text("README.md") and "python -m pytest tests" in _text("README.md")


def test_a_long_file_says_why_it_is_one():
    """A source file past 650 lines says, in its first lines, why it is one concern rather than two files."""
    sources = test_layout.project_files()  # the folders' files too
    long = [f for f in sources if _text(f).count("\n") > 650]
    unexplained = [f for f in long if "one concern" not in "\n".join(_text(f).splitlines()[:12]).lower()]
    assert unexplained == [], unexplained

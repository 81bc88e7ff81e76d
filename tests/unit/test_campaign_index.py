"""Every test campaign a comment, test or doc cites ("(fuzz82)") has its entry in
docs/test-campaigns.md, which says what it was (fuzz94 was cited in a test and missing)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INDEX = ROOT / "docs" / "test-campaigns.md"


def test_every_cited_campaign_has_an_entry():
    tracked = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.sh", "*.toml"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    cited = {
        name
        for path in tracked
        if ROOT / path != INDEX and (ROOT / path).exists()
        for name in re.findall(r"\bfuzz\d+\b", (ROOT / path).read_text(errors="replace"))
    }
    listed = set(re.findall(r"^## (fuzz\d+)$", INDEX.read_text(), re.MULTILINE))
    assert len(cited) > 50
    assert sorted(cited - listed, key=lambda name: int(name[4:])) == []

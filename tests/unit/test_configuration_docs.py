"""Every setting is described once (its field comment) and the generated reference is current."""

from __future__ import annotations

from pathlib import Path

from server.settings import DESCRIPTIONS, FIELDS, build_parser
from server.settings_docs import configuration_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_every_setting_has_a_description():
    missing = [name for name in FIELDS if not DESCRIPTIONS.get(name)]
    assert missing == [], f"add a trailing # comment to these fields: {missing}"


def test_help_shows_the_description():
    help_text = " ".join(build_parser().format_help().split())
    assert "token budget of one engine step" in help_text


def test_configuration_doc_is_current():
    assert DOC.read_text() == configuration_markdown(), (
        "regenerate: python -m server.settings > docs/configuration.md"
    )

"""The documentation: the generated configuration reference is current, links resolve."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

from flower_shard.ux import docs_gen

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATION = ROOT / "docs" / "configuration.md"


def test_configuration_reference_is_current():
    fresh = docs_gen.generate()
    committed = CONFIGURATION.read_text() if CONFIGURATION.exists() else ""
    if committed != fresh:
        diff = "\n".join(
            list(
                difflib.unified_diff(
                    committed.splitlines(),
                    fresh.splitlines(),
                    "docs/configuration.md",
                    "generated",
                    lineterm="",
                )
            )[:40]
        )
        pytest.fail(
            f"docs/configuration.md is stale: regenerate it with `{docs_gen.COMMAND}` "
            f"(from the repository root)\n{diff}"
        )


def test_every_setting_is_in_the_reference():
    text = docs_gen.generate()
    for key in docs_gen.read_run_config():
        assert f"| `{key}` |" in text
    for flag in ("`--local-steps`", "`--superlink`", "`--nproc-per-group`"):
        assert flag in text


def test_a_run_config_key_that_fills_no_field_is_refused():
    assert docs_gen.run_config_field("num-server-rounds")[1] == "rounds"
    with pytest.raises(ValueError, match="no-such-key"):
        docs_gen.run_config_field("no-such-key")


def test_relative_links_in_readme_and_docs_resolve():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name}: broken link {target}"

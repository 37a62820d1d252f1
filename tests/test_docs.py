"""The documentation: the generated configuration reference is current, links resolve."""

from __future__ import annotations

import argparse
import difflib
import re
from pathlib import Path

import pytest

from flower_shard.ux import docs_gen
from flower_shard.ux.cli import build_parser

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


# -- every `flower-shard COMMAND --flag` and every `--run-config` key the docs write exists --------

PAGES = [ROOT / "README.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`]+)`")
# "flower-shard" as a command word: at the start, or after a space, "(" or an assignment.
INVOCATION = re.compile(r"(?:^|[\s(])flower-shard\s+(.*)")
END_OF_COMMAND = re.compile(r"\s(?:\||&&|;|>|#)(?:\s|$)")
FLAG = re.compile(r"--[A-Za-z0-9][A-Za-z0-9-]*")
RUN_CONFIG = re.compile(r"--run-config\s+\"([^\"]*)\"")
RUN_CONFIG_KEY = re.compile(r"(?:^|\s)([a-z][a-z0-9-]*)=")
PLACEHOLDER_KEYS = {"key"}  # `--run-config "key=value ..."`


def code_snippets(text: str) -> list[str]:
    """The command lines of fenced blocks (backslash continuations joined) and the inline code
    spans of a Markdown page."""
    snippets = []
    for block in FENCED.findall(text):
        snippets += block.replace("\\\n", " ").splitlines()
    prose = FENCED.sub("", text)
    snippets += [" ".join(span.split()) for span in INLINE.findall(prose)]
    return snippets


def cli_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `flower-shard` parser and its subcommands' parsers, as the CLI builds them."""
    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return top, dict(sub.choices)


def flag_problems(snippet: str, top, subcommands) -> list[str]:
    """What is wrong with the `flower-shard ...` invocations in one snippet: an unknown
    subcommand, or a flag its parser does not have (abbreviations included)."""
    problems = []
    for match in INVOCATION.finditer(snippet):
        rest = END_OF_COMMAND.split(match.group(1))[0]
        parser, name, takes_value = top, "flower-shard", False
        for token in rest.split():
            flag = FLAG.match(token.lstrip("[("))
            if flag:
                option = parser._option_string_actions.get(flag.group())
                if option is None:
                    problems.append(f"{name} has no {flag.group()}")
                takes_value = option is not None and option.nargs != 0 and "=" not in token
            elif parser is top and not takes_value:
                if not re.fullmatch(r"[a-z]+", token):  # output or prose ("node:", "node)")
                    break
                if token not in subcommands:
                    problems.append(f"flower-shard has no subcommand {token!r}")
                    break
                parser, name = subcommands[token], f"flower-shard {token}"
            else:
                takes_value = False
    return problems


def run_config_problems(snippet: str, keys: set[str]) -> list[str]:
    return [
        f"--run-config key {key!r} is not in [tool.flwr.app.config]"
        for body in RUN_CONFIG.findall(snippet)
        for key in RUN_CONFIG_KEY.findall(body)
        if key not in keys | PLACEHOLDER_KEYS
    ]


def test_every_documented_flag_and_run_config_key_exists():
    top, subcommands = cli_parsers()
    keys = set(docs_gen.read_run_config())
    problems, checked = [], 0
    for page in PAGES:
        for snippet in code_snippets(page.read_text()):
            checked += bool(INVOCATION.search(snippet))
            found = flag_problems(snippet, top, subcommands) + run_config_problems(snippet, keys)
            problems += [f"{page.relative_to(ROOT)}: {p}: {snippet.strip()[:100]}" for p in found]
    assert checked > 30, checked  # the scan sees the docs' commands
    assert not problems, "\n".join(problems)


def test_the_flag_check_catches_what_it_should():
    top, subcommands = cli_parsers()
    assert flag_problems("flower-shard train --groups 2 --no-bf16 --out x", top, subcommands) == []
    assert flag_problems("flower-shard --log-level debug report R --vs A B", top, subcommands) == []
    assert flag_problems("flower-shard node: group of 2", top, subcommands) == []
    assert flag_problems("X=1 flower-shard plan --gpu 8 | tail", top, subcommands) == [
        "flower-shard plan has no --gpu"
    ]
    assert flag_problems("flower-shard node --data d # --nope", top, subcommands) == []
    assert flag_problems("flower-shard serve --port 1", top, subcommands) == [
        "flower-shard has no subcommand 'serve'"
    ]
    assert flag_problems("flower-shard --nope train", top, subcommands) == [
        "flower-shard has no --nope"
    ]
    assert run_config_problems('flwr run . c --run-config "local-steps=2 lcoal=3"', {"local-steps"})
    joined = code_snippets("```\nflower-shard train --groups 1 \\\n    --rounds 2\n```\n")
    assert joined == ["flower-shard train --groups 1      --rounds 2"]

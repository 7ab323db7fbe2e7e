"""The docs cannot drift from the code: every command line they print parses, every recipe they name exists.

Read from README.md, CONTRIBUTING.md and docs/**/*.md: the code in fenced blocks and inline code spans; a command
line is ``... -m megatron_kd_plugin COMMAND ...`` (``python -m``, ``torchrun ... -m``; lines continued with a
backslash are one line) or one of the ``tools/`` entry points that are a command. Each ``--flag`` must be an option
of that command's parser (megatron_kd_plugin.command_reference.parsers), each recipe name (``--recipe NAME`` and
any ``*_h200_bf16_config`` / ``*_cpu_fp32_config`` in the text) a key of the recipe registry, and each override
(``section.field=value``) a field of the config section it names. No model is built. docs/reference/commands.md
must be what the generator writes today, every relative link must reach its file and heading, and no page may hold a
placeholder (TIMING, TODO, "being written") where a fact belongs.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
import shlex
import types
import typing

import pytest

from megatron_kd_plugin import command_reference as reference

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMANDS_PAGE = REPO_ROOT / "docs" / "reference" / "commands.md"
TOOL_COMMANDS = {"tools/cache_teacher_logits.py": "cache", "tools/train_kd.py": "train"}
COMMAND_LINE = re.compile(r"(?:-m\s+megatron_kd_plugin|(?P<tool>" + "|".join(map(re.escape, TOOL_COMMANDS)) +
                          r"))(?:\s+(?P<rest>.*))?")
RECIPE_NAME = re.compile(r"\b[a-z0-9_]+_(?:h200_bf16|cpu_fp32)_config\b")
OVERRIDE = re.compile(r"^(?P<path>[a-z_]+(?:\.[a-z_0-9]+)+)=")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
COMMAND_END = re.compile(r"\s(?:\||&&|;|#|>|2>|<)|`")


def doc_files() -> list[pathlib.Path]:
    pages = [REPO_ROOT / "README.md", REPO_ROOT / "CONTRIBUTING.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
    return [page for page in pages if page != COMMANDS_PAGE]


def code_spans(text: str) -> list[str]:
    """The fenced blocks (backslash-continued lines joined) and the inline code spans of a Markdown text."""
    blocks = [block.replace("\\\n", " ") for block in FENCE.findall(text)]
    return blocks + INLINE.findall(FENCE.sub("", text))


@functools.cache
def parsers():
    return reference.parsers()


@functools.cache
def recipes() -> frozenset[str]:
    from megatron_kd_plugin.recipes import RECIPES

    return frozenset(RECIPES)


@functools.cache
def section_types() -> dict[str, tuple[type, ...]]:
    """Config section name -> the dataclasses it may hold (a union's members; the plugin's dataset provider)."""
    from megatron_kd_plugin.bridge.config import KDConfigContainer
    from megatron_kd_plugin.bridge.provider import TopKCacheDatasetProvider

    hints = typing.get_type_hints(KDConfigContainer)
    out = {}
    for field in dataclasses.fields(KDConfigContainer):
        hint = hints[field.name]
        members = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
            else (hint,)
        out[field.name] = tuple(member for member in members if dataclasses.is_dataclass(member))
    out["dataset"] += (TopKCacheDatasetProvider,)
    return out


def override_problem(path: str) -> str | None:
    section, field = path.split(".")[:2]
    if section not in section_types():
        return f"override {path}: no config section {section!r}"
    if not any(field in {f.name for f in dataclasses.fields(kind)} for kind in section_types()[section]):
        return f"override {path}: {section} has no field {field!r}"
    return None


def command_problems(line: str) -> list[str]:
    """What is wrong with the command lines in one line of code (empty: nothing)."""
    problems = []
    for match in COMMAND_LINE.finditer(line):
        rest = COMMAND_END.split(match["rest"] or "")[0]
        try:
            words = shlex.split(rest)
        except ValueError:
            words = rest.split()
        if match["tool"]:
            words = [TOOL_COMMANDS[match["tool"]], *words]
        if not words or words[0].startswith("-") or words[0] == "COMMAND":
            continue
        command, args = words[0], [word.strip("[]") for word in words[1:]]
        if command == "demo":
            named = [flag for flag in reference.DEMOS if any(arg.split("=")[0] == flag for arg in args)]
            command = f"demo {named[0]}" if named else "demo"
            if named and reference.DEMOS[named[0]][1]:   # a switch the dispatcher takes off
                args = [arg for arg in args if arg != named[0]]
        if command == "plan" and "--cache" in args:
            command, args = "plan --cache", [arg for arg in args if arg != "--cache"]
        if command not in parsers():
            problems.append(f"{line.strip()!r}: no command {command!r}")
            continue
        options = parsers()[command]._option_string_actions
        for i, arg in enumerate(args):
            name = arg.split("=")[0]
            if arg.startswith("-") and arg not in ("-", "--") and name not in options:
                problems.append(f"{line.strip()!r}: {command} has no option {name}")
            if name == "--recipe":
                value = arg.partition("=")[2] or (args[i + 1] if i + 1 < len(args) else "")
                if re.fullmatch(r"[a-z0-9_]+", value) and value not in recipes():
                    problems.append(f"{line.strip()!r}: no recipe {value!r}")
            if command in ("train", "plan") and OVERRIDE.match(arg):
                problems += [f"{line.strip()!r}: {p}" for p in [override_problem(OVERRIDE.match(arg)["path"])] if p]
    return problems


def problems_of(text: str) -> list[str]:
    """Every drift in a Markdown text: command lines, recipe names anywhere, overrides in inline code."""
    problems = []
    for span in code_spans(text):
        for line in span.splitlines():
            problems += command_problems(line)
        if OVERRIDE.match(span) and span.split(".")[0] in section_types() and " " not in span:
            problems += [p for p in [override_problem(OVERRIDE.match(span)["path"])] if p]
    problems += [f"no recipe {name!r}" for name in RECIPE_NAME.findall(text) if name not in recipes()]
    return problems


@pytest.mark.parametrize("page", doc_files(), ids=lambda page: str(page.relative_to(REPO_ROOT)))
def test_doc_commands_parse(page):
    assert problems_of(page.read_text()) == []


def test_drift_is_caught():
    """A misspelt flag (on a continued line, under torchrun), an unknown recipe, demo flag or override: each found."""
    cases = {
        "```\ntorchrun --nproc_per_node 8 -m megatron_kd_plugin cache --teacher T/ \\\n    --top-k 64\n```":
            "cache has no option --top-k",
        "`python -m megatron_kd_plugin train --recipe tiny_gpt_kd_cpu_fp64_config`": "no recipe",
        "```\npython -m megatron_kd_plugin train --recipe tiny_gpt_kd_cpu_fp32_config kd.tial=8\n```":
            "kd has no field 'tial'",
        "`python -m megatron_kd_plugin demo --mixture --studnet-steps 3`": "demo --mixture has no option --studnet-steps",
        "`python -m megatron_kd_plugin inspect cache.zarr --verfy`": "inspect has no option --verfy",
        "`tools/train_kd.py --recipee X`": "train has no option --recipee",
        "set `dataset.cache_pth=x`": "dataset has no field 'cache_pth'",
    }
    for text, expected in cases.items():
        found = problems_of(text)
        assert any(expected in problem for problem in found), (text, found)
    good = ("```\ntorchrun --nproc_per_node 8 -m megatron_kd_plugin cache --teacher T/ --data D \\\n"
            "    --output c.zarr --seq-length 4096 --topk 64 --tp 8\n"
            "python -m megatron_kd_plugin train --recipe tiny_gpt_kd_cpu_fp32_config dataset.cache_path=c.zarr\n```")
    assert problems_of(good) == []


def test_command_reference_is_current():
    """docs/reference/commands.md is what `python -m megatron_kd_plugin.command_reference` writes now."""
    assert COMMANDS_PAGE.read_text() == reference.markdown(), (
        "regenerate: python -m megatron_kd_plugin.command_reference > docs/reference/commands.md")


def heading_anchors(page: pathlib.Path) -> set[str]:
    """GitHub's anchors of a page's headings (lower case, punctuation dropped, spaces as hyphens)."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in FENCE.sub("", page.read_text()).splitlines() if re.match(r"#+ ", line)}


def link_problems(page: pathlib.Path) -> list[str]:
    """Relative Markdown links of a page whose file or heading does not exist."""
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest):
            problems.append(f"{target}: no such heading")
    return problems


@pytest.mark.parametrize("page", doc_files(), ids=lambda page: str(page.relative_to(REPO_ROOT)))
def test_doc_links_resolve(page):
    assert link_problems(page) == []


def test_broken_link_is_caught(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n[ok](#a-page) [gone](b.md) [moved](a.md#no-such-part)\n")
    assert link_problems(tmp_path / "a.md") == ["b.md: no such file", "a.md#no-such-part: no such heading"]


PLACEHOLDER = re.compile(r"\bTIMING\b|\bTODO\b|\bTBD\b|\bFIXME\b|being written|<!-- *placeholder", re.I)


def placeholder_problems(text: str) -> list[str]:
    """Lines of a Markdown text that hold a placeholder instead of the fact (a timing, a section to come)."""
    return [line.strip() for line in text.splitlines() if PLACEHOLDER.search(line)]


@pytest.mark.parametrize("page", doc_files(), ids=lambda page: str(page.relative_to(REPO_ROOT)))
def test_docs_hold_no_placeholders(page):
    assert placeholder_problems(page.read_text()) == []


def test_placeholder_is_caught():
    text = "`tests/x.py`, 24 tests, TIMING (most of it)\n\n_This section is being written._\n\nA true line.\n"
    assert placeholder_problems(text) == ["`tests/x.py`, 24 tests, TIMING (most of it)", "_This section is being written._"]

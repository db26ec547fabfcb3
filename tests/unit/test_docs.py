"""The docs hold: README.md stays a front door, and what it and `docs/` point at exists.

For README.md and every page under docs/:
- every relative markdown link `[text](path)` or `[text](path#anchor)` reaches a file (relative to the page that
  links), and every `#anchor` is a heading of its target, slugged as GitHub slugs it;
- every repository path in inline code (`core/bucket/store.py`, `serve_config.yaml`, a path inside a command such
  as `make train CONFIG=configs/tiny-distill.yaml`) exists, and every dotted module name of ours
  (`core.bucket.manifest.folder_digest`, `launch.serve:build_app`) names a module, and a name that module defines;
- README.md is at most 250 lines.
Fenced code blocks are skipped (their paths are examples of use: `myenvs.py`, `/data/trl-run`), inline code is not.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 250

# Inline code that starts with one of these is a path in the repository.
PATH_ROOTS = ("app/", "core/", "contracts/", "deployments/", "launch/", "tests/", "bench/", "configs/", "ops/", "docs/")
TOP_FILES = ("cluster.yaml", "serve_config.yaml", "pyproject.toml", "Makefile", "README.md")
# Dotted names that start with one of these are modules of ours (or names in them).
PACKAGES = ("app", "core", "contracts", "deployments", "launch", "bench", "tests")
# The one exception: a path that stands for many files spells its variable part as a placeholder (`<name>`, a glob
# `*`, a brace list `{a,b}`, or a version or step number `policy-vN`, `step-S`). It names no single file, so it is
# skipped; any other path must exist as written.
PLACEHOLDER = re.compile(r"[<*{]|(?<=[/-])v?[NS](?=[/.]|$)")

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
# What separates the words of a command or an expression inside inline code.
TOKEN = re.compile(r"[^\s=,;()\[\]\"'`|]+")


def prose(page: Path) -> str:
    """The page without its fenced code blocks."""
    return FENCE.sub("", page.read_text())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup gone, lowercased, punctuation dropped but hyphens, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading)  # code and emphasis marks (an underscore is a word's, and stays)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    for match in HEADING.finditer(prose(page)):
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers a repeated heading
    return found


def links(page: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(prose(page))
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:: not ours to check
    ]


def code_tokens(page: Path) -> list[str]:
    return [token for code in INLINE_CODE.findall(prose(page)) for token in TOKEN.findall(code)]


def repo_paths(page: Path) -> list[str]:
    """The repository paths in the page's inline code, a trailing `:name` or `::name` (a name in the file) dropped."""
    paths = []
    for token in code_tokens(page):
        path = re.sub(r"::?[A-Za-z_][\w.]*$", "", token).rstrip(".:")
        if path.startswith(PATH_ROOTS) or path in TOP_FILES:
            paths.append(path)
    return paths


def module_names(page: Path) -> list[str]:
    """Dotted names of our modules in the page's inline code: `core.bucket.store`, `launch.serve:build_app`."""
    dotted = re.compile(rf"(?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?")
    return [token.rstrip(".") for token in code_tokens(page) if dotted.fullmatch(token.rstrip("."))]


def module_file(parts: list[str]) -> Path | None:
    path = REPO.joinpath(*parts)
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def defines(module: Path, name: str) -> bool:
    """Whether `module` defines or imports `name` (a function, a class, a constant, a re-export)."""
    text = module.read_text()
    return bool(
        re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b", text, re.M)
        or re.search(rf"^\s*{name}\s*(?::[^=\n]+)?=", text, re.M)
        or re.search(rf"^\s*(?:from\s+\S+\s+)?import\s+(?:\(\s*)?[^#\n]*\b{name}\b", text, re.M)
        or re.search(rf"^from\s+\S+\s+import\s+\((?:[^)]*\b{name}\b)", text, re.M)
    )


def resolve(dotted: str) -> str | None:
    """None when `dotted` names a module of ours, or a name its module defines (and, one level further, a method or
    attribute a class of it defines); else why not."""
    parts = dotted.replace(":", ".").split(".")
    for cut in range(len(parts), 0, -1):
        module = module_file(parts[:cut])
        if module is None:
            continue
        rest = parts[cut:]
        if not rest:
            return None
        if not defines(module, rest[0]):
            return f"{'.'.join(parts[:cut])} defines no {rest[0]}"
        if len(rest) > 1 and not re.search(rf"\b{rest[1]}\b", module.read_text()):
            return f"{'.'.join(parts[:cut])} has no {rest[0]}.{rest[1]}"
        return None
    return "no such module"


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_reaches_a_file_and_a_heading(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{target}: no heading #{anchor} in {page_id(file)}")
    assert not broken, f"{page_id(page)}: broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_repository_path_named_exists(page):
    missing = [p for p in repo_paths(page) if not PLACEHOLDER.search(p) and not (REPO / p).exists()]
    assert not missing, f"{page_id(page)} names paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_module_named_exists(page):
    wrong = {name: why for name in module_names(page) if (why := resolve(name))}
    assert not wrong, f"{page_id(page)} names modules that do not exist: {wrong}"


def test_the_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; move the detail to docs/ (at most {README_MAX_LINES})"
    )


def test_every_docs_page_is_listed_in_the_index():
    index = (REPO / "docs" / "README.md").read_text()
    unlisted = [p.name for p in PAGES[1:] if p.name != "README.md" and f"({p.name})" not in index]
    assert not unlisted, f"docs/README.md does not link {unlisted}"


def test_the_checks_catch_what_they_should():
    """The slug rule and the placeholder exception, on the cases the pages use."""
    assert slug("Spot notices and an elastic fleet") == "spot-notices-and-an-elastic-fleet"
    assert (
        slug("Scoring: the fleet as a teacher (`prompt_logprobs`)") == "scoring-the-fleet-as-a-teacher-prompt_logprobs"
    )
    assert slug("Pointing TRL's AsyncGRPOTrainer at the fleet") == "pointing-trls-asyncgrpotrainer-at-the-fleet"
    for variable in ("<bucket>/fleet/runs/<name>/RUN.json", "bench/results/*.json", "tests/unit/test_{a,b}.py"):
        assert PLACEHOLDER.search(variable)
    for concrete in ("core/bucket/store.py", "tests/unit/app/rollout/test_episodes.py", "ops/aws/bucket-policies.json"):
        assert not PLACEHOLDER.search(concrete)
    assert resolve("core.bucket.manifest.folder_digest") is None and resolve("launch.serve:build_app") is None
    assert resolve("core.bucket.store.folder_digest") and resolve("deployments.fleet:build_app")
    assert resolve("app.auth.check_exposure") == "app defines no auth"

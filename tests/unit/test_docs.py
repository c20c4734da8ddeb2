"""README.md and docs/*.md hold together and match the code as it lies.

- Links: every `[text](target)` outside code that is not a URL names a file or folder of the
  repository, relative to the page; an `#anchor` names a heading of the target page (GitHub's
  slug); the README links every page of docs/.
- Paths: a word in backticks (an inline span or a fenced block) that contains `/` and starts
  with an entry of the repository's root, of `src/` or of `src/remote_loader/` (`benchmarks/`,
  `.ci/`, `server/`, `protos/`, `remote_loader/`, ...) is a path, and exists, taken from the
  root, from `src/` or from `src/remote_loader/`. Words that start elsewhere are the user's
  (`mypkg/data.py`, `/dev/shm`, `~/.ray`) and are not checked.
- NOTEs: every NOTE [ title ] the pages name is written in src/, and one cited `in `path``
  is in that file.
- docs/architecture.md: its tree and its Folders section name every package folder of
  src/remote_loader and no other, each folder's paragraph names every module in it, and its
  NOTE index is every NOTE block in src/ with the file that holds it.
- docs/serving.md names every LoaderSpec option, docs/client.md every argument of
  RemoteLoader, and docs/ every ServerSettings setting.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections import Counter
from pathlib import Path

import pytest

from remote_loader.client import RemoteLoader
from remote_loader.server import LoaderSpec, ServerSettings
from tests.helpers import ROOT

DOCS = ROOT / "docs"
PACKAGE = ROOT / "src" / "remote_loader"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
# Where a path in backticks may be taken from, most specific last.
PATH_BASES = (ROOT, ROOT / "src", PACKAGE)
README_MAX_LINES = 150

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
NOTE = re.compile(r"NOTE \[\s+(.+?)\s+\]", re.S)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose(text: str) -> str:
    """`text` without its fenced code blocks (each left as blank lines)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _fenced(text: str) -> list[str]:
    return [m.group(0) for m in FENCE.finditer(text)]


def _code(text: str) -> list[str]:
    """Every piece of code in a page: its inline spans (outside fences) and its fenced blocks."""
    return [m.group(2) for m in CODE_SPAN.finditer(_prose(text))] + _fenced(text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower case, without punctuation, spaces as -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: Counter[str] = Counter()
    anchors = set()
    for match in HEADING.finditer(_prose(page.read_text())):
        slug = _slug(match.group(2))
        anchors.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
        seen[slug] += 1
    return anchors


def _links(page: Path) -> list[str]:
    prose = CODE_SPAN.sub(lambda m: "code", _prose(page.read_text()))
    return [m.group(2) for m in LINK.finditer(prose)]


def _id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_relative_link_reaches_its_file_and_heading(page: Path) -> None:
    links = _links(page)
    broken = []
    for target in links:
        if SCHEME.match(target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists() or not resolved.is_relative_to(ROOT):
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {_id(resolved)}")
    assert not broken, "\n".join(broken)


def test_the_readme_is_short_and_links_every_page() -> None:
    readme = ROOT / "README.md"
    lines = readme.read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines: a newcomer's five minutes are {README_MAX_LINES} at most;"
        " put the details in a page of docs/ and link it"
    )
    linked = {(readme.parent / link.partition("#")[0]).resolve() for link in _links(readme)}
    unlinked = [_id(page) for page in DOCS.glob("*.md") if page.resolve() not in linked]
    assert not unlinked, f"pages the README does not link: {unlinked}"


def _roots() -> set[str]:
    """The first segments a repository path may start with."""
    names = {"src", "remote_loader"}
    for base in PATH_BASES:
        names.update(p.name for p in base.iterdir() if p.name not in (".git", "__pycache__"))
    return names


def _paths(text: str, roots: set[str]) -> set[str]:
    found = set()
    for code in _code(text):
        for word in code.split():
            word = word.strip("\"'()[]{}<>,;:`").rstrip(".")
            if "/" in word and re.fullmatch(r"[\w.\-/]+", word) and word.split("/")[0] in roots:
                found.add(word)
    return found


def _exists(path: str) -> bool:
    return any((base / path).exists() for base in PATH_BASES)


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_path_in_backticks_exists(page: Path) -> None:
    missing = sorted(p for p in _paths(page.read_text(), _roots()) if not _exists(p))
    assert not missing, f"{_id(page)} names paths that do not exist: {missing}"


def test_the_path_rule_checks_what_it_should() -> None:
    roots = _roots()
    text = (
        "`server/engine/pool.py`, `src/remote_loader/protos/shm.py` and `benchmarks/`, not"
        " `mypkg/data.py` nor `/dev/shm`\n```bash\npython examples/train.py --address x\n```\n"
    )
    assert _paths(text, roots) == {
        "server/engine/pool.py",
        "src/remote_loader/protos/shm.py",
        "benchmarks/",
        "examples/train.py",
    }
    assert not _exists("server/engine/gone.py")


def _note_sites() -> dict[str, list[tuple[str, str]]]:
    """Every line of src/ that names a NOTE, by title: (file under src/remote_loader, line)."""
    sites: dict[str, list[tuple[str, str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(PACKAGE))
        for line in path.read_text().splitlines():
            for match in NOTE.finditer(line):
                sites.setdefault(match.group(1), []).append((name, line))
    return sites


def _note_blocks() -> dict[str, str]:
    """Each NOTE block's title and the file that holds it: the line that heads the block (the
    title alone on its line, in a comment or a docstring), else the line that opens with the
    title and a colon. A mention mid-line or `NOTE [ x ] in path` only cites it."""
    blocks = {}
    for title, sites in _note_sites().items():
        header = re.compile(rf'^\s*(?:#\s*|""")?NOTE \[ {re.escape(title)} \]')
        heads = [name for name, line in sites if header.fullmatch(line.rstrip())]
        opens = [
            name
            for name, line in sites
            if (m := header.match(line)) is not None and line[m.end() :].startswith(":")
        ]
        where = heads or opens
        assert where, f"NOTE [ {title} ] is cited in src/ but written nowhere: {sites}"
        blocks[title] = where[0]
    return blocks


def test_every_note_the_docs_cite_is_in_the_file_they_name() -> None:
    sites = _note_sites()
    wrong = []
    for page in PAGES:
        text = re.sub(r"\s+", " ", page.read_text())
        for match in NOTE.finditer(text):
            title = match.group(1)
            if title not in sites:
                wrong.append(f"{_id(page)}: NOTE [ {title} ] is in no file of src/")
                continue
            cited = re.match(r" in `([\w./\-]+)`", text[match.end() :])
            if cited and not any(
                f"NOTE [ {title} ]" in (base / cited.group(1)).read_text()
                for base in PATH_BASES
                if (base / cited.group(1)).is_file()
            ):
                wrong.append(f"{_id(page)}: NOTE [ {title} ] is not in {cited.group(1)}")
    assert not wrong, "\n".join(wrong)


ARCHITECTURE = DOCS / "architecture.md"


def _section(page: Path, heading: str) -> str:
    text = page.read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _package_folders() -> set[str]:
    return {str(p.parent.relative_to(PACKAGE)) for p in PACKAGE.rglob("__init__.py")} - {"."}


def test_the_architecture_index_is_every_note_block_where_it_lies() -> None:
    index = dict(
        re.findall(
            r"^\| NOTE \[ (.+?) \] \| `([\w./]+)` \|",
            _section(ARCHITECTURE, "## NOTE blocks"),
            re.M,
        )
    )
    blocks = _note_blocks()
    assert index == blocks, (
        "docs/architecture.md's NOTE index against src/ (title: file):"
        f" missing {sorted(set(blocks.items()) - set(index.items()))},"
        f" stale {sorted(set(index.items()) - set(blocks.items()))}"
    )


def test_the_architecture_tree_is_the_package_as_it_lies() -> None:
    (tree,) = _fenced(_section(ARCHITECTURE, "## The tree"))
    lines = tree.splitlines()[1:-1]
    assert lines[0].startswith("src/remote_loader/")
    stack: list[str] = []
    folders: set[str] = set()
    files: set[str] = set()
    for line in lines[1:]:
        marker = line.find("── ")
        if marker == -1:
            continue  # a role's second line
        depth = marker // 4
        name = line[marker + 3 :].split()[0]
        stack[depth:] = [name.rstrip("/")]
        path = "/".join(stack)
        (folders if name.endswith("/") else files).add(path)
    assert folders == _package_folders()
    assert all((PACKAGE / f).is_file() for f in files), files
    # The leaves of server/ are drawn: every module directly in it.
    assert {f for f in files if f.startswith("server/")} == {
        f"server/{p.name}" for p in (PACKAGE / "server").glob("*.py") if p.name != "__init__.py"
    }


def test_the_architecture_folders_name_every_module() -> None:
    section = _section(ARCHITECTURE, "## Folders")
    paragraphs = re.findall(r"^\*\*`([\w/]+)/`\*\*(.*?)(?=\n\n|\Z)", section, re.M | re.S)
    assert {folder for folder, _ in paragraphs} == _package_folders()
    for folder, text in paragraphs:
        named = set(re.findall(r"`(\w+\.py)`", text))
        modules = {p.name for p in (PACKAGE / folder).glob("*.py") if p.name != "__init__.py"}
        assert named == modules, (
            f"docs/architecture.md's paragraph on {folder}/ names {sorted(named - modules)}"
            f" that are not there and not {sorted(modules - named)} that are"
        )


def test_every_option_and_setting_is_documented() -> None:
    def spans(pages: list[Path]) -> set[str]:
        """The names written in code: `seed`, `LoaderSpec(..., autotune=True)`."""
        return {
            name
            for page in pages
            for code in _code(page.read_text())
            for name in re.findall(r"\w+", code)
        }

    serving = spans([DOCS / "serving.md"])
    options = {f.name for f in dataclasses.fields(LoaderSpec)} - {"name"}
    assert options <= serving, f"options not in docs/serving.md: {sorted(options - serving)}"
    documented = spans(PAGES)
    # The token is never a setting a user writes: it comes from REMOTE_LOADER_TOKEN.
    settings = {f.name for f in dataclasses.fields(ServerSettings)} - {"token"}
    assert "REMOTE_LOADER_TOKEN" in documented
    assert settings <= documented, f"settings not in docs/: {sorted(settings - documented)}"
    client = spans([DOCS / "client.md"])
    arguments = set(inspect.signature(RemoteLoader).parameters)
    assert arguments <= client, f"arguments not in docs/client.md: {sorted(arguments - client)}"

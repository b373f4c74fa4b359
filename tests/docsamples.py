"""The code samples of the documentation: README.md and every page under docs/.

Shared by tests/docs/test_docs.py (which runs them all) and the tests that run one sample
their own way (``find_blocks``), so a sample is found wherever a page moves it.

What counts as a block: a fenced code block (three or more backticks) at any
indentation, so the blocks inside admonitions (``!!! note``) and content tabs
(``=== "Sync"``) count; its language is the fence's first word (```` ```python
title="app.py" ```` is python). A line ``--8<-- "path"`` inside a block is replaced by
that file of the repository (pymdownx.snippets, as mkdocs.yml enables it); a page
including a whole Markdown file the same way gets that file's blocks checked too, as a
document of its own.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,})\s*(?P<lang>[\w+-]*)(?P<attrs>[^`]*)$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:(?P<options>.*?)-->\s*$")
_HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*#*\s*$")
_SNIPPET = re.compile(r'^(?P<indent>\s*)-{1,}8<-{1,}\s+"(?P<path>[^"]+)"\s*$')


@dataclass(frozen=True)
class Block:
    """One fenced code block of a documentation file."""

    path: str  # the file, relative to the repository: "README.md", "docs/how-to/x.md"
    index: int  # its position in the file
    line: int  # of the opening fence, 1-based
    heading: str  # the nearest heading above it ("(top)" before any)
    lang: str
    code: str  # dedented to the fence's indentation, snippets included
    options: dict[str, str] = field(default_factory=dict)  # from its docs-test marker

    @property
    def id(self) -> str:
        page = re.sub(r"[^a-z0-9]+", "-", self.path.lower().removesuffix(".md")).strip("-")
        slug = re.sub(r"[^a-z0-9]+", "-", self.heading.lower()).strip("-")
        return f"{page}-{self.index:02d}-{slug}-{self.lang or 'text'}"

    @property
    def where(self) -> str:
        kind = f"{self.lang} block" if self.lang else "block with no language"
        return f"{self.path}:{self.line} ({kind} under {self.heading!r})"


@dataclass
class Document:
    path: str
    blocks: list[Block]
    stray_markers: list[int]  # lines of markers not followed by a block
    includes: list[str]  # Markdown files it includes whole (snippets outside blocks)


def marker_options(text: str) -> dict[str, str]:
    options = {}
    for token in shlex.split(text):
        key, _, value = token.partition("=")
        options[key] = value
    return options


def _snippet(path: str, where: str) -> str:
    target = ROOT / path
    if not target.is_file():
        raise FileNotFoundError(f"{where}: the snippet {path!r} is not a file of the repository")
    return target.read_text(encoding="utf-8")


def parse(path: str, source: str) -> Document:
    """The fenced blocks of *source* (the file *path*), each with its heading and the
    docs-test marker just before it."""
    blocks: list[Block] = []
    stray: list[int] = []
    includes: list[str] = []
    heading = "(top)"
    marker: tuple[int, dict[str, str]] | None = None
    lines = source.splitlines()
    number = 0
    while number < len(lines):
        line = lines[number]
        number += 1
        fence = _FENCE.match(line)
        if fence:
            indent = len(fence["indent"])
            start = number
            body: list[str] = []
            closing = re.compile(rf"^ *{fence['fence']}`*\s*$")
            while number < len(lines) and not closing.match(lines[number]):
                text_line = lines[number]
                text_line = text_line[indent:] if text_line[:indent] == " " * indent else ""
                if snippet := _SNIPPET.match(text_line):
                    included = _snippet(snippet["path"], f"{path}:{number + 1}")
                    body += [snippet["indent"] + s for s in included.splitlines()]
                else:
                    body.append(text_line)
                number += 1
            number += 1  # the closing fence
            options = marker[1] if marker else {}
            marker = None
            code = "\n".join(body) + "\n"
            blocks.append(Block(path, len(blocks), start, heading, fence["lang"], code, options))
        elif match := _MARKER.match(line):
            if marker:
                stray.append(marker[0])
            marker = (number, marker_options(match["options"]))
        elif line.strip():
            if marker:
                stray.append(marker[0])
                marker = None
            if title := _HEADING.match(line):
                heading = title["title"]
            elif (snippet := _SNIPPET.match(line)) and snippet["path"].endswith(".md"):
                _snippet(snippet["path"], f"{path}:{number}")
                includes.append(snippet["path"])
    if marker:
        stray.append(marker[0])
    return Document(path, blocks, stray, includes)


def documentation_files() -> list[str]:
    """README.md, every Markdown page under docs/, and the Markdown files they include
    whole: paths relative to the repository."""
    paths = ["README.md", *(str(p.relative_to(ROOT)) for p in sorted(DOCS.rglob("*.md")))]
    for path in paths:  # grows while it is walked: included files are parsed too
        for included in load(path).includes:
            if included not in paths:
                paths.append(included)
    return paths


_LOADED: dict[str, Document] = {}


def load(path: str) -> Document:
    """The parsed file *path* (relative to the repository), parsed once."""
    if path not in _LOADED:
        _LOADED[path] = parse(path, (ROOT / path).read_text(encoding="utf-8"))
    return _LOADED[path]


def all_blocks() -> list[Block]:
    return [block for path in documentation_files() for block in load(path).blocks]


def find_blocks(lang: str, contains: str) -> list[Block]:
    """The *lang* blocks of the documentation whose code contains *contains*, wherever
    they are: a test that runs a sample its own way finds it with this."""
    return [b for b in all_blocks() if b.lang == lang and contains in b.code]

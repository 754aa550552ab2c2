"""The documentation (README.md and docs/*.md) names only what exists:

- every `--flag` written after `-m guided.serve` in a command, and every
  flag in the first column of a table in docs/server.md, is an option of
  `python -m guided.serve --help`;
- every `make TARGET` in a command or code span is a target of the Makefile;
- every `-m guided.MODULE` is a module of python/guided/;
- every relative link or image points to a file that exists (and a
  `page.md#anchor` to one of its headings);
- every path under tests/, benches/, rust/, python/, cuda/ or docs/ exists,
  resolved against the repository root.

Plain regexes over the markdown; one `--help` subprocess."""
from __future__ import annotations

import re
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")
SERVE = re.compile(r"-m\s+guided\.serve\b(.*)")
MAKE = re.compile(r"(?<![\w/.-])make[ \t]+([A-Za-z][\w.-]*)")
MODULE = re.compile(r"-m\s+(guided(?:\.\w+)+)")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
PATH = re.compile(r"(?<![\w./~-])((?:tests|benches|rust|python|cuda|docs)/[\w./-]*\w)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@cache
def _parsed(path: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(code, prose) of a markdown file, each a list of (line number, text).
    Code: a fenced block's commands (shell continuations joined, counted at
    their first line) and every inline code span; prose: the lines outside
    fenced blocks with their code spans taken out."""
    code: list[tuple[int, str]] = []
    prose: list[tuple[int, str]] = []
    in_block, pending, pending_at = False, "", 0
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            in_block = not in_block
            if pending:
                code.append((pending_at, pending))
                pending = ""
            continue
        if in_block:
            if not pending:
                pending_at = n
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            code.append((pending_at, pending + line))
            pending = ""
            continue
        code.extend((n, span) for span in INLINE_CODE.findall(line))
        prose.append((n, INLINE_CODE.sub(" ", line)))
    return code, prose


def _command_tail(text: str) -> str:
    """A command's arguments up to a shell comment or the next command."""
    return re.split(r"\s#|;|&&|\|\||\|", text, maxsplit=1)[0]


@cache
def _serve_options() -> frozenset[str]:
    """The option strings of `python -m guided.serve --help` (the
    invocation column only, not the flags its descriptions mention)."""
    done = subprocess.run([sys.executable, "-m", "guided.serve", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    options = set()
    for line in done.stdout.splitlines():
        if re.match(r"^  -", line):   # an option's line; descriptions are indented further
            invocation = re.split(r"\s{2,}", line.strip())[0]
            options.update(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", invocation))
    assert "--model" in options and "--port" in options, done.stdout[:2000]
    return frozenset(options)


def _make_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][\w.-]*(?:[ \t]+[A-Za-z0-9][\w.-]*)*)[ \t]*:(?!=)", line)
        if m:
            targets.update(m.group(1).split())
    return targets


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    _, prose = _parsed(path)
    raw = {n: line for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)}
    return {_slug(m.group(2).replace("`", "")) for n, _ in prose
            if (m := HEADING.match(raw[n]))}


def _failures(check) -> list[str]:
    found = []
    for doc in DOCS:
        found.extend(f"{_rel(doc)}:{n}: {problem}" for n, problem in check(doc))
    return found


def test_the_docs_are_found():
    assert (ROOT / "README.md") in DOCS and len(DOCS) > 1


def test_serve_flags_exist():
    options = _serve_options()
    named: list[str] = []

    def check(doc: Path):
        code, prose = _parsed(doc)
        for n, text in code:
            for m in SERVE.finditer(text):
                for flag in FLAG.findall(_command_tail(m.group(1))):
                    named.append(flag)
                    if flag not in options:
                        yield n, f"{flag} is not an option of python -m guided.serve"
        if doc == ROOT / "docs" / "server.md":
            raw = doc.read_text(encoding="utf-8").splitlines()
            for n, _ in prose:   # table rows outside code blocks
                if raw[n - 1].lstrip().startswith("|"):
                    first = raw[n - 1].strip().strip("|").split("|")[0]
                    for flag in FLAG.findall(first):
                        named.append(flag)
                        if flag not in options:
                            yield n, f"{flag} (server.md's flag table) is not an option of python -m guided.serve"

    failures = _failures(check)
    assert not failures, "\n".join(failures)
    assert len(set(named)) >= 10, f"too few flags found in the docs: {sorted(set(named))}"


def test_make_targets_exist():
    targets = _make_targets()
    named: list[str] = []

    def check(doc: Path):
        code, _ = _parsed(doc)
        for n, text in code:
            for target in MAKE.findall(text):
                named.append(target)
                if target not in targets:
                    yield n, f"make {target}: no such target in the Makefile"

    failures = _failures(check)
    assert not failures, "\n".join(failures)
    assert {"serve", "test"} <= set(named), sorted(set(named))


def test_python_modules_exist():
    def check(doc: Path):
        code, _ = _parsed(doc)
        for n, text in code:
            for module in MODULE.findall(text):
                base = ROOT / "python" / Path(*module.split("."))
                if not (base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()):
                    yield n, f"-m {module}: no such module (or package with __main__.py) under python/"

    failures = _failures(check)
    assert not failures, "\n".join(failures)


def _relative_links(doc: Path):
    """(line, target) of each link in ``doc``'s prose that is not a URL."""
    _, prose = _parsed(doc)
    for n, line in prose:
        for target in LINK.findall(line):
            if not re.match(r"^[A-Za-z][\w+.-]*:", target):   # http:, https:, mailto:
                yield n, target


def test_relative_links_resolve():
    def check(doc: Path):
        for n, target in _relative_links(doc):
            where, _, anchor = target.partition("#")
            path = (doc.parent / where).resolve() if where else doc
            if not path.exists():
                yield n, f"link to {target}: {where} does not exist"
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                yield n, f"link to {target}: no heading #{anchor} in {_rel(path)}"

    failures = _failures(check)
    assert not failures, "\n".join(failures)


def test_repository_paths_exist():
    def check(doc: Path):
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for path in PATH.findall(line):
                if not (ROOT / path).exists():
                    yield n, f"{path} does not exist"

    failures = _failures(check)
    assert not failures, "\n".join(failures)


def test_nothing_points_outside_the_repository():
    """A fresh clone has every page the docs send a reader to: no relative
    link leaves the repository, and no document outside it (a `../…md`
    path) is named as a source, in a link or in code. Test material beside
    the repository (`../shared/chat-templates`) is data, not a page."""
    outside_doc = re.compile(r"\.\./[\w./-]*\.md\b")

    def check(doc: Path):
        for n, target in _relative_links(doc):
            path = (doc.parent / target.partition("#")[0]).resolve()
            if path != ROOT and ROOT not in path.parents:
                yield n, f"link to {target} leaves the repository"
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for name in outside_doc.findall(line):
                if ROOT not in (doc.parent / name).resolve().parents:
                    yield n, f"{name} is a document outside the repository"

    failures = _failures(check)
    assert not failures, "\n".join(failures)

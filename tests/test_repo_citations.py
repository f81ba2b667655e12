"""Every ``.md`` file that a tracked file cites exists in the repository.

A citation is a path ending in ``.md`` (``docs/SEMANTICS.md §9``, ``[text](docs/DESIGN.md)``,
``kernels/README.md``); it resolves against the repository root or, for relative links, against
the citing file's folder. URLs and glob patterns are not citations.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A path of word characters, dots, dashes and slashes ending in ".md", not preceded by a path
# character (so not the tail of a longer token) and not part of a URL.
CITATION = re.compile(r"(?<![\w./:-])((?:\.\.?/)*[\w][\w./-]*\.md)(?![\w])")
URL = re.compile(r"https?://\S+")


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        # Not a git checkout (an unpacked sdist): every file under the root but the venv.
        return [p for p in ROOT.rglob("*")
                if p.is_file() and not any(part.startswith(".") for part in
                                           p.relative_to(ROOT).parts)]
    return [ROOT / name for name in out.decode().split("\0") if name]


def citations(path: Path) -> list[tuple[int, str]]:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, FileNotFoundError):
        return []  # binary files (plots), or deleted in the work tree
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in CITATION.finditer(URL.sub("", line)):
            found.append((number, match.group(1)))
    return found


def resolves(path: Path, cited: str) -> bool:
    return (ROOT / cited).is_file() or (path.parent / cited).is_file()


def test_every_cited_md_file_exists():
    missing = [f"{path.relative_to(ROOT)}:{line}: {cited}"
               for path in tracked_files() for line, cited in citations(path)
               if not resolves(path, cited)]
    assert not missing, ("cited .md files that are not in the repository (cite docs/DESIGN.md, "
                         "docs/SEMANTICS.md, CONTRIBUTING.md by their repository path):\n"
                         + "\n".join(missing))


def test_the_citation_pattern():
    md = ".md"  # built, so that this file itself cites nothing that is missing
    line = (f"see docs/SEMANTICS{md} §9, [design](DESIGN{md}), ../CONTRIBUTING{md}, "
            f"https://example.org/x/README{md}, and the glob *{md}")
    assert CITATION.findall(URL.sub("", line)) == \
        [f"docs/SEMANTICS{md}", f"DESIGN{md}", f"../CONTRIBUTING{md}"]

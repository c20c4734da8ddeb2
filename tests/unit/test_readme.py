"""What README.md tells a user to run, read rather than run: the two commands at the top, and
install commands that work from a clone of the repository.

The tests that start a server, a process or Ray: tests/integration/test_readme.py.
"""

from __future__ import annotations

import re
import tomllib

from remote_loader.protos import compression
from remote_loader.server.engine.choice import RAY_INSTALL
from tests.helpers import ROOT

README = (ROOT / "README.md").read_text()


def _extra(name: str) -> list[str]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        extras: dict[str, list[str]] = tomllib.load(f)["project"]["optional-dependencies"]
    return extras[name]


TOP_COMMANDS = [
    "python3.11 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0"
    " && pip install . && remote-loader demo",
    "python3.11 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0"
    ' && pip install ".[test]" && python -m pytest',
]


def test_the_readme_opens_with_the_two_commands() -> None:
    # A newcomer's first two commands, before any section: the demo, then the tests. They are
    # what a fresh machine with Python 3.11 runs, so they may only change on purpose (here).
    first_block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first_block is not None
    assert first_block.start() < README.index("\n## "), "the commands come before any section"
    commands = [
        line for line in first_block.group(1).splitlines() if line and not line.startswith("#")
    ]
    assert commands == TOP_COMMANDS, commands
    # CI installs the same torch and runs the same tests; the extra and the command exist.
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -q torch==2.13.0" in ci and 'pip install -q ".[test]"' in ci, ci
    assert "\npython -m pytest\n" in ci, ci
    with (ROOT / "pyproject.toml").open("rb") as f:
        project = tomllib.load(f)["project"]
    assert "remote-loader" in project["scripts"] and "test" in project["optional-dependencies"]


def test_install_commands_work_from_a_clone() -> None:
    # The project is installed from its repository: no package index has "remote-loader".
    printed = [ROOT / "README.md"]
    for folder in ("docs", "src", "examples", "docker"):
        printed.extend(p for p in (ROOT / folder).rglob("*") if p.is_file())
    for path in printed:
        if path.suffix in (".py", ".md", ".toml", ".yml", "") or path.name == "Dockerfile":
            assert "remote-loader[" not in path.read_text(errors="replace"), path
    # The hints name the packages as the extras do, and the extra as a path install.
    assert _extra("ray") == ["ray>=2.40,<3"]
    assert RAY_INSTALL.startswith('pip install "ray>=2.40,<3" '), RAY_INSTALL
    assert 'pip install ".[ray]"' in RAY_INSTALL
    for codec, requirement in zip(compression.CODECS, _extra("compression"), strict=True):
        hint = compression.install_hint(codec)
        assert hint.startswith(f'pip install "{requirement}" '), hint
        assert 'pip install ".[compression]"' in hint

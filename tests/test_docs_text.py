"""What the documentation's pages say: README.md and the guides under docs/.

- Every relative link (and #anchor) in README.md, docs/*.md and the services' and k8s/'s READMEs
  points to something that exists, and README.md stays under 220 lines.
- The shell lines of the guides quote what zsh would glob; each measurement in docs/results.md says
  when, where and how.
- The reference tables agree with the code: the defaults in docs/configuration.md, the built-in
  environments' task counts and turn limits in docs/environments.md, and docs/cli.md is what the
  parsers print.

The guides' tested command blocks, run: tests/test_docs.py.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from docs_support import DOCS, READMES, anchors, links
from support import REPO

# How long `fedse tasks` may take (as long as a guide's block).
BLOCK_TIMEOUT_S = 120


def shell_blocks(text: str) -> list[list[str]]:
    """The lines of every ```sh or ```bash block, here-documents' bodies left out (they are a
    program's text, not the shell's)."""
    blocks, block, heredoc = [], None, None
    for line in text.splitlines():
        if block is None:
            if line.strip() in ("```sh", "```bash"):
                block = []
        elif heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
        elif line.strip() == "```":
            blocks.append(block)
            block = None
        else:
            block.append(line)
            m = re.search(r"<<-?\s*['\"]?(\w+)", line)
            heredoc = m.group(1) if m else None
    return blocks


def unquoted_globs(line: str) -> list[str]:
    """The words of a shell line that hold a glob character outside quotes: zsh, the default shell on
    macOS, stops at one that matches no file ("no matches found") where bash passes it on."""
    bare = re.sub(r"'[^']*'|\"[^\"]*\"", "''", line)
    bare = re.sub(r"(^|\s)#.*$", "", bare).replace("$?", "")
    return [w for w in bare.split() if "?" in w or ("[" in w and "]" in w and not w.startswith("["))]


def test_the_guides_quote_what_zsh_would_glob():
    assert unquoted_globs("fedse run --envs maze,wordle?vocab_size=30") == ["maze,wordle?vocab_size=30"]
    assert unquoted_globs("fedse run --envs 'wordle?vocab_size=30' # why?") == []
    found = [f"{doc.name}: {word}" for doc in DOCS for block in shell_blocks(doc.read_text())
             for line in block for word in unquoted_globs(line)]
    assert not found, f"quote these words (zsh globs them): {found}"


# ---- links and length --------------------------------------------------------------------------------
def test_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) < 220, f"README.md has {len(lines)} lines; move details into docs/"
    for guide in ("running-locally", "deploy", "join-a-federation", "environments"):
        assert f"](docs/{guide}.md)" in "\n".join(lines), f"README.md links no docs/{guide}.md"
    assert re.search(r"!\[[^\]]+\]\(docs/[^)]+\.png\)", "\n".join(lines)), "README.md shows no plot"


def test_every_measurement_in_results_says_when_where_and_how():
    """docs/results.md is a reference: each section holding a table or a plot says when, on which
    machine and by which command its figures were measured."""
    sections = re.split(r"^#{2,4} ", (REPO / "docs" / "results.md").read_text(), flags=re.M)[1:]
    missing = []
    for section in sections:
        title, _, body = section.partition("\n")
        if re.search(r"^\||^!\[", body, flags=re.M):
            missing += [f"{title}: no {word}" for word in ("**When**", "**Where**", "**How**")
                        if word not in body]
    assert sections, "docs/results.md has no sections"
    assert not missing, "; ".join(missing)


@pytest.mark.parametrize("doc", DOCS + READMES, ids=lambda d: str(d.relative_to(REPO)))
def test_relative_links_point_to_what_exists(doc):
    broken = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


def test_anchors_follow_githubs_rule(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n## 4. Use a real model\n## The paper's comparison (`fedse experiment`)\n"
                    "## Title\n```sh\n# a comment, not a heading\n```\n")
    assert anchors(page) == {"title", "4-use-a-real-model", "the-papers-comparison-fedse-experiment", "title-1"}


# ---- reference tables against the code ---------------------------------------------------------------
def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of the Markdown table whose header row starts with `header`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_configuration_defaults_are_the_codes():
    from apps.launcher import RunConfig
    from services.aggregator.server import AggregatorConfig
    from services.client_agent.config import ClientConfig
    from services.env_server.server import EnvServerConfig

    classes = {"aggregator": [AggregatorConfig], "client_agent": [ClientConfig], "env_server": [EnvServerConfig],
               "`fedse run`": [RunConfig], "all": [AggregatorConfig, ClientConfig, EnvServerConfig]}
    rows = table_rows((REPO / "docs" / "configuration.md").read_text(), "| service | setting | default |")
    assert len(rows) >= 25
    for service, settings, default, _ in rows:
        flags = re.findall(r"`--([a-z-]+)`", settings)
        documented = [d.strip() for d in default.split(",")] if default != "-" else [""] * len(flags)
        if len(documented) != len(flags):  # one value for several flags, e.g. maze,wordle
            documented = [default]
        assert len(documented) == len(flags), (service, settings, default)
        for cls in classes[service]:
            fields = {f.name: f for f in dataclasses.fields(cls)}
            for flag, want in zip(flags, documented):
                name = flag.replace("-", "_")
                assert name in fields, f"{cls.__name__} has no --{flag}"
                got = fields[name].default
                if isinstance(got, tuple):
                    same = want == ",".join(got)
                elif isinstance(got, (int, float)) and not isinstance(got, bool) and want != str(got):
                    same = float(want) == float(got)  # 3e-3 is 0.003
                else:
                    same = want == str(got)
                assert same, f"docs/configuration.md: {service} --{flag} defaults to {want!r}; {cls.__name__}: {got!r}"


def test_builtin_environments_table_is_what_fedse_tasks_prints():
    rows = table_rows((REPO / "docs" / "environments.md").read_text(), "| env | train | test | max turns |")
    documented = {r[0]: (int(r[1]), int(r[2]), int(r[3])) for r in rows}
    assert set(documented) == {"maze", "wordle", "babyai", "textcraft", "webshop"}
    proc = subprocess.run([sys.executable, "-m", "apps.cli", "tasks", "--envs", ",".join(documented)],
                          cwd=REPO, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    printed = {}
    for line in proc.stdout.splitlines()[1:]:
        name, train, test, turns, *_ = line.split()
        printed[name] = (int(train), int(test), int(turns))
    assert printed == documented


def test_the_command_line_reference_is_what_the_parsers_print():
    """docs/cli.md is written from the parsers (make cli-reference); a flag added, renamed or
    reworded without rewriting it fails here."""
    from apps.reference import reference

    page = (REPO / "docs" / "cli.md").read_text()
    assert page == reference(), "docs/cli.md is out of date: run `make cli-reference` and commit it"
    for flag in ("--rounds", "--track", "--out-dir", "--ca-cert", "--guardian"):
        assert f"  {flag} " in page, flag

"""The documentation's guides, run: README.md and the guides under docs/.

- Every command block a guide marks as tested (the line `<!-- tested -->` right before a ```sh
  fence) runs, in order, as a person following the guides would run it: every guide after the
  other (README.md, its four paths' guides, the rest), in one shell (a block starts in the
  directory and with the variables the one before left), from the root of one scratch directory
  holding a copy of k8s/ (the guides edit the on-prem overlay), with the virtualenv's
  commands on PATH. Those blocks need no cluster: `kubectl apply -k DIR` builds DIR with
  `kubectl kustomize`, and any other kubectl command fails the test.
- A block marked `<!-- tested: serves -->` starts a service that runs until stopped, as a person
  starts one in a terminal of its own: the test starts it, waits for the line it logs once it
  answers (`serving`; a client agent's `joined`), runs the blocks after it, and stops it at the
  end (SIGTERM to its process group, then SIGKILL); one that exits before is a failure. The ports a
  guide's blocks name on this machine (`127.0.0.1:N`, `0.0.0.0:N`, `--metrics-port N`) become free
  ports, the same one for the same number throughout the guide, and a port a service leaves to its
  default is a free one (FEDSE_ADDRESS, FEDSE_METRICS_PORT), so guides run beside other tests.
- The certificates the guide to joining a federation makes are ones fedse accepts: an aggregator
  serving mTLS with them answers `fedse status` from the organisation's certificate.

What the pages say (links, quoting, the reference tables against the code):
tests/test_docs_text.py.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from docs_support import DOCS, MARK, SERVES, links, marked_blocks
from support import KUBECTL, REPO, free_ports

BLOCK_TIMEOUT_S = 120
SERVING_TIMEOUT_S = 60


# ---- the tested commands -----------------------------------------------------------------------------
KUBECTL_SHIM = """#!/bin/sh
# kubectl as tests/test_docs.py runs the guides: without a cluster.
if [ "$1" = apply ] && [ "$2" = -k ] && [ $# -eq 3 ]; then
    exec "{real}" kustomize "$3" >/dev/null
fi
if [ "$1" = kustomize ]; then
    exec "{real}" "$@"
fi
echo "kubectl $*: needs a cluster; a block marked as tested may only build (apply -k, kustomize)" >&2
exit 3
"""


def sandbox(root: pathlib.Path) -> dict[str, str]:
    """A scratch repository root with its own copy of k8s/; returns the environment to run blocks in."""
    shutil.copytree(REPO / "k8s", root / "k8s")
    shims = root / ".shims"
    shims.mkdir()
    if KUBECTL:
        shim = shims / "kubectl"
        shim.write_text(KUBECTL_SHIM.format(real=KUBECTL))
        shim.chmod(0o755)
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(shims), str(pathlib.Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["FEDSE_ADDRESS"] = "127.0.0.1:0"  # what a service started by a block binds where the block says nothing
    env["FEDSE_METRICS_PORT"] = "0"
    return env


class LocalPorts:
    """A free port for each port a guide's blocks name on this machine, the same one for the same
    number throughout the guide: the guide names the ports a person would use."""

    NAMED = re.compile(r"(?<=127\.0\.0\.1:)\d+|(?<=0\.0\.0\.0:)\d+|(?<=--metrics-port )\d+")

    def __init__(self) -> None:
        self.free: dict[str, str] = {}

    def __call__(self, text: str) -> str:
        return self.NAMED.sub(self._port, text)

    def _port(self, m: re.Match) -> str:
        if m.group() == "0":
            return "0"
        while m.group() not in self.free:
            port = str(free_ports(1)[0])
            if port not in self.free.values():
                self.free[m.group()] = port
        return self.free[m.group()]


def run_block(doc: pathlib.Path, line: int, block: str, root: pathlib.Path, env: dict[str, str]) -> str:
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block], cwd=root, env=env,
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert proc.returncode == 0, (f"{doc.relative_to(REPO)}:{line}: the block exited {proc.returncode}\n"
                                  f"{block}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
    return proc.stdout


class Terminals:
    """The services a guide's blocks start, each as in a terminal of its own: in a process group of
    its own, running until the guide's blocks are done, then stopped (SIGTERM, then SIGKILL)."""

    READY = ('"msg": "serving"', '"msg": "joined"')  # the servers' line, and a client agent's once it joined

    def __init__(self, doc: pathlib.Path, root: pathlib.Path, env: dict[str, str]):
        self.doc, self.root, self.env = doc, root, env
        self.running: list[tuple[int, subprocess.Popen, pathlib.Path]] = []

    def __enter__(self) -> "Terminals":
        return self

    def start(self, line: int, block: str) -> None:
        """Starts the block and returns once the service it starts says it answers."""
        log = self.root / f".terminal-{line}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", block], cwd=self.root, env=self.env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.running.append((line, proc, log))
        deadline = time.monotonic() + SERVING_TIMEOUT_S
        while not any(ready in log.read_text() for ready in self.READY):
            where = f"{self.doc.relative_to(REPO)}:{line}"
            assert proc.poll() is None, f"{where}: exited {proc.returncode} before it answered\n{block}\n" \
                                        f"{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{where}: not answering after {SERVING_TIMEOUT_S} s\n{block}\n" \
                                                f"{log.read_text()[-3000:]}"
            time.sleep(0.1)

    def __exit__(self, exc_type, exc, tb) -> None:
        exited = [(line, proc.returncode, log) for line, proc, log in self.running if proc.poll() is not None]
        for _, proc, _ in self.running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc, _ in self.running:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if exc_type is None:
            assert not exited, "; ".join(f"{self.doc.relative_to(REPO)}:{line}: exited {rc} before the guide's "
                                         f"blocks were done\n{log.read_text()[-3000:]}" for line, rc, log in exited)


GUIDES_WITH_TESTS = [d for d in DOCS if marked_blocks(d)]
# What the output of a guide's blocks shows, as the guide says it does.
SHOWN = {
    # the organisation's certificate, signed by the federation CA for its id; the on-prem overlay,
    # edited: the pair picked by one line, and the aggregator's address; its client agent requires
    # secure aggregation
    "join-a-federation.md": ["identity (first SAN, else CN): org-wordle\n", "purpose: client\n",
                             "signed by ca.pem: yes\n", "value: wordle\n",
                             "value: aggregator.federation.example.org:50060\n", 'value: "true"\n'],
    # every workload of the federation from the registry in the overlay of your own
    "deploy.md": ["11\n"],
    "environments.md": ["webshop "],
    # the services started by hand answer: the aggregator's run waits for its first client
    "running-locally.md": ["round 0 of 3, waiting_for_clients", "the adapted model writes:"],
    # the secure aggregator started by hand answers, and the component sets the aggregator's variable
    # the run tracked: a TensorBoard run directory named after the run's method and seed, MLflow's
    # database, and both read back with the run's settings and each round's mean success
    "tracking.md": ["runs/tb:\nfedse-r8-seed0-", "runs/mlflow:\nmlflow.db\n", "fedse-r8-seed0 {'run/envs': 'maze'",
                    "round 1: mean held-out success", "mean held-out success by round: {0: "],
    "secure-aggregation.md": ["round 0 of 3, waiting_for_clients", '"secureAggregation": true',
                              'value: "true"\n'],
    # a sampled round: one of three clients trained, the others sat out
    "selection.md": ["rounds where clients sat out"],
}
# README.md's four paths, each ending in its guide, in the order README.md gives them.
PATHS = ["running-locally.md", "deploy.md", "join-a-federation.md", "environments.md"]


def in_reading_order(guides: list[pathlib.Path]) -> list[pathlib.Path]:
    """README.md, its four paths' guides, then the other guides in the order README.md links them,
    then the rest by name: the order a person starting at the front door follows them in."""
    readme = REPO / "README.md"
    linked = [REPO / "docs" / name for name in PATHS]
    linked += [REPO / target for target in links(readme) if target.startswith("docs/") and target.endswith(".md")]
    order = [readme] + [d for i, d in enumerate(linked) if d not in linked[:i]]
    return sorted(guides, key=lambda d: (order.index(d) if d in order else len(order), d.name))


class Shell:
    """One shell for every block of every guide, as a person types them in one terminal: each block
    starts in the working directory and with the variables (exported or not) the previous one left."""

    # What bash sets itself, which a block's state does not carry over.
    OWN = re.compile(r"^declare -[-a-zA-Z]* (BASH[A-Z_]*|_|PIPESTATUS|FUNCNAME|GROUPS|SHELLOPTS|BASHOPTS|PPID|UID|EUID|"
                     r"SHLVL|OLDPWD|PWD|RANDOM|SRANDOM|SECONDS|LINENO|EPOCHSECONDS|EPOCHREALTIME|HISTCMD|DIRSTACK|"
                     r"OPTIND|OPTERR|COMP_WORDBREAKS|IFS)=")

    def __init__(self, root: pathlib.Path):
        self.state = root / ".shell-state"
        self.state.write_text(f"cd {shlex.quote(str(root))}\n")

    def script(self, block: str, keep: bool = True) -> str:
        """The block, started from the shell's state, saving the state it leaves (`keep`)."""
        save = (f"\n{{ declare -p | grep -v -E {shlex.quote(self.OWN.pattern)} | grep -v -E '^declare -[a-zA-Z]*r '; "
                f"echo \"cd $(printf %q \"$PWD\")\"; }} > {shlex.quote(str(self.state))}.new && "
                f"mv {shlex.quote(str(self.state))}.new {shlex.quote(str(self.state))}") if keep else ""
        return f"source {shlex.quote(str(self.state))}\nset -e -o pipefail\n{block}{save}\n"


def test_the_guides_work_in_order_in_one_shell(tmp_path):
    """Every guide's tested blocks, every guide after the other in reading order, as one person
    follows them: one shell (its directory and variables carry over), one working directory (the
    state directories the guides name are shared: a guide that reuses another's with other settings
    fails here), the ports the guides name. The services a guide starts stop at its end."""
    guides = in_reading_order(GUIDES_WITH_TESTS)
    if KUBECTL is None and any("kubectl" in b.text for d in guides for b in marked_blocks(d)):
        pytest.skip("kubectl not found (the guides' blocks build kustomizations)")
    env = sandbox(tmp_path)
    shell, ports = Shell(tmp_path), LocalPorts()
    for doc in guides:
        out = ""
        with Terminals(doc, tmp_path, env) as terminals:
            for block in marked_blocks(doc):
                if block.serves:
                    terminals.start(block.line, shell.script(ports(block.text), keep=False))
                else:
                    out += run_block(doc, block.line, shell.script(ports(block.text)), tmp_path, env)
        for shown in SHOWN.get(doc.name, []):
            assert shown in out, f"{doc.name}: its tested blocks did not print {shown!r}:\n{out[-3000:]}"


def test_the_guides_mark_what_a_test_can_run():
    names = {d.name for d in GUIDES_WITH_TESTS}
    assert {"README.md", "running-locally.md", "deploy.md", "join-a-federation.md", "environments.md",
            "configuration.md"} <= names, names
    for doc in DOCS:  # a marker that is not before a block would silently test nothing
        marks = [line for line in doc.read_text().splitlines() if line.strip() in (MARK, SERVES)]
        assert len(marks) == len(marked_blocks(doc)), doc.name


def test_kubectl_in_tested_blocks_only_builds(tmp_path):
    if KUBECTL is None:
        pytest.skip("kubectl not found")
    env = sandbox(tmp_path)
    proc = subprocess.run(["bash", "-c", "kubectl -n fedse get pods"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and "needs a cluster" in proc.stderr


def test_the_join_guides_certificates_work_with_fedse(tmp_path, capsys):
    """The `fedse certs` blocks of the join guide make a CA, an aggregator certificate and an
    organisation's certificate, and the aggregator the guide starts with them serves mTLS: `fedse status`
    with the organisation's certificate reads the run, and the identity it presents is the client id."""
    from apps.cli import status

    doc = REPO / "docs" / "join-a-federation.md"
    env = sandbox(tmp_path)
    ports = LocalPorts()
    with Terminals(doc, tmp_path, env) as terminals:
        for block in marked_blocks(doc):
            if block.serves and "fedse aggregator" in block.text:
                terminals.start(block.line, ports(block.text))
            elif "fedse certs" in block.text:
                run_block(doc, block.line, block.text, tmp_path, env)
        assert terminals.running, "the join guide starts no aggregator in a block marked as tested"
        pem = {name: str(tmp_path / name) for name in ("ca.pem", "aggregator.pem", "aggregator-key.pem",
                                                       "org-wordle.pem", "org-wordle-key.pem")}
        argv = [f"--aggregator=127.0.0.1:{ports.free['50060']}", f"--tls-ca={pem['ca.pem']}",
                "--tls-server-name=aggregator.federation.example.org", "--timeout-s=20"]
        capsys.readouterr()
        assert status([*argv, f"--tls-cert={pem['org-wordle.pem']}", f"--tls-key={pem['org-wordle-key.pem']}"]) == 0
        assert capsys.readouterr().out.startswith("run ")
        # The aggregator's own certificate is for serving: it cannot stand in for a client.
        assert status([*argv, "--timeout-s=3", f"--tls-cert={pem['aggregator.pem']}",
                       f"--tls-key={pem['aggregator-key.pem']}"]) == 1
        # fedse doctor, as the guide gives it, passes every check against the guide's aggregator and env
        # server: only the addresses (this machine's free ports) and the base model (the tiny one) differ.
        for block in marked_blocks(doc):
            if block.serves and "fedse env-server" in block.text:
                terminals.start(block.line, ports(block.text))
        assert doctor_of_guide(doc, ports, tmp_path, capsys) == 0, capsys.readouterr().out


def doctor_of_guide(doc: pathlib.Path, ports: LocalPorts, root: pathlib.Path, capsys) -> int:
    """Runs the guide's `fedse doctor` command in `root` against this machine's ports."""
    import os
    import shlex

    from apps.doctor import doctor

    text = doc.read_text()
    start = text.index("fedse doctor --client-id")
    command = text[start:text.index("```", start)].replace("\\\n", " ").split("\n")[0]  # to the command's end
    argv = shlex.split(ports(command))[2:]
    swap = {"--aggregator": f"127.0.0.1:{ports.free['50060']}", "--base-model": "fedse-tiny"}
    argv = [swap.get(argv[i - 1], a) if i else a for i, a in enumerate(argv)]
    here = os.getcwd()
    os.chdir(root)
    try:
        capsys.readouterr()
        return doctor([*argv, "--tls-server-name=aggregator.federation.example.org"])
    finally:
        os.chdir(here)


def test_one_shell_carries_the_directory_and_variables_from_block_to_block(tmp_path):
    shell, env = Shell(tmp_path), sandbox(tmp_path)
    doc = REPO / "README.md"
    run_block(doc, 1, shell.script("mkdir -p work && cd work\nRUN_DIR=$PWD/results\nexport TOKEN_FILE=t"),
              tmp_path, env)
    out = run_block(doc, 2, shell.script('echo "$RUN_DIR $TOKEN_FILE $(pwd)"'), tmp_path, env)
    assert out == f"{tmp_path}/work/results t {tmp_path}/work\n"
    with pytest.raises(AssertionError, match="exited 1"):  # a failing command stops its block, as set -e does
        run_block(doc, 3, shell.script("false\necho not reached"), tmp_path, env)

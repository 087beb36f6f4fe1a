"""docs/join-a-federation.md tells one story, from the operator's first command to the organisation's
pod, with the same host name, certificates and secure-aggregation setting throughout:

- the guide's services, run on one machine, each have a metrics port of their own;
- the guide's tested blocks, run in order in one shell: the operator's aggregator serves mTLS with
  secure aggregation and says so in its `serving` line; the organisation's pod (the on-prem overlay
  the guide edits) dials a name the aggregator's certificate holds and requires secure aggregation;
- the guide's `fedse doctor` command carries the pod's settings, and, run for real against the
  guide's aggregator and env server, says the organisation can join;
- the same command against the guide's aggregator started without `--secure-aggregation` fails with
  one line naming the fix on either side; an env server on the aggregator's metrics port stops with
  one line naming the port and `--metrics-port`.
"""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from support import KUBECTL, REPO
from test_docs import LocalPorts, Shell, Terminals, marked_blocks, run_block, sandbox

DOC = REPO / "docs" / "join-a-federation.md"
SERVICES = ("aggregator", "env-server", "client")
DEFAULT_METRICS_PORT = "9100"


def commands(text: str) -> list[list[str]]:
    """Every `fedse ...` command in the guide's sh blocks, continuation lines joined, split as a shell does."""
    out = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removesuffix("&").strip()
            if line.startswith("fedse "):
                out.append(shlex.split(line))
    return out


def flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def the_story() -> str:
    """The guide up to its variants (smaller hardware), which replace commands of the story rather than
    run beside them."""
    text = DOC.read_text()
    return text[:text.index("\n## Small hardware")]


def test_the_guides_services_on_one_machine_have_metrics_ports_of_their_own():
    used: dict[str, set[str]] = {}
    for argv in commands(the_story()):
        if argv[1] in SERVICES:
            used.setdefault(flag(argv, "--metrics-port", DEFAULT_METRICS_PORT), set()).add(argv[1])
    shared = {port: sorted(kinds) for port, kinds in used.items() if len(kinds) > 1}
    assert used and not shared, f"{DOC.name}: services share a metrics port on one machine: {shared}"


def doctor_command() -> list[str]:
    (argv,) = [a for a in commands(the_story()) if a[1] == "doctor"][:1]
    return argv[2:]


def pod_settings(root: pathlib.Path) -> dict[str, str]:
    """The FEDSE_* variables of the organisation's client agent, as the overlay the guide edited builds."""
    built = subprocess.run([KUBECTL, "kustomize", str(root / "k8s" / "overlays" / "onprem")], capture_output=True,
                           text=True, timeout=60, check=True).stdout
    for doc in yaml.safe_load_all(built):
        if doc and doc.get("kind") == "Job":
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            return {e["name"]: e.get("value", "") for e in container.get("env", [])}
    raise AssertionError("the on-prem overlay builds no client agent Job")


def serving_line(log: pathlib.Path) -> dict:
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return next(line for line in lines if line.get("msg") == "serving")


def run_doctor(root: pathlib.Path, env: dict[str, str], ports: LocalPorts,
               agg_port: str) -> subprocess.CompletedProcess:
    """The guide's doctor command, the real one in its own process, on this machine's ports: the aggregator
    dialled at 127.0.0.1 by the name the guide dials, and the embedded tiny model for the pods' base model."""
    argv = shlex.split(ports(shlex.join(doctor_command())))
    host = flag(argv, "--aggregator").rsplit(":", 1)[0]
    argv[argv.index("--aggregator") + 1] = f"127.0.0.1:{agg_port}"
    argv[argv.index("--base-model") + 1] = "fedse-tiny"
    return subprocess.run([sys.executable, "-m", "apps.cli", "doctor", *argv, f"--tls-server-name={host}"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not found (the guide's blocks build kustomizations)")
def test_the_operator_and_the_organisation_tell_one_story(tmp_path):
    from cryptography import x509

    from fedse.security import certs

    env, shell, ports = sandbox(tmp_path), Shell(tmp_path), LocalPorts()
    blocks = marked_blocks(DOC)
    aggregator = next(b for b in blocks if b.serves and "fedse aggregator" in b.text)
    with Terminals(DOC, tmp_path, env) as terminals:
        for block in blocks:
            if block.serves:
                terminals.start(block.line, shell.script(ports(block.text), keep=False))
            else:
                run_block(DOC, block.line, shell.script(ports(block.text)), tmp_path, env)
        agg_log = tmp_path / f".terminal-{aggregator.line}.log"
        started = serving_line(agg_log)
        # 5. The start-up line says how the aggregator runs.
        assert {k: started.get(k) for k in ("tls", "admits", "selector", "mode", "secure_aggregation")} == {
            "tls": "mTLS", "admits": "allowed-clients (3 ids)", "selector": "all", "mode": "sync",
            "secure_aggregation": True}, started
        # 1, 2. The pod dials a name the aggregator's certificate holds and requires secure aggregation; the
        # guide's doctor command gives the pod's settings.
        pod, doctor = pod_settings(tmp_path), doctor_command()
        host = pod["FEDSE_AGGREGATOR"].rsplit(":", 1)[0]
        names = certs.san_texts(x509.load_pem_x509_certificate((tmp_path / "aggregator.pem").read_bytes()))
        assert f"DNS:{host}" in names, f"the pod dials {host}; the aggregator's certificate names {names}"
        assert pod["FEDSE_REQUIRE_SECURE_AGGREGATION"] == "true" and "--require-secure-aggregation" in doctor, doctor
        assert flag(doctor, "--aggregator") == pod["FEDSE_AGGREGATOR"], (doctor, pod)
        assert flag(doctor, "--base-model") == pod["FEDSE_BASE_MODEL"], (doctor, pod)
        assert "--secure-aggregation" in aggregator.text
        # Doctor, run as the guide gives it against the guide's aggregator and env server, says it can join.
        done = run_doctor(tmp_path, env, ports, ports.free["50060"])
        lines = done.stdout.strip().splitlines()
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert lines[-1].startswith("org-wordle can join the run at "), lines
        assert any(line.startswith("ok   the aggregator admits this client: ")
                   and line.endswith("secure aggregation with signed keys") for line in lines), lines
        # 3. An env server on the port the aggregator's metrics hold stops with one line naming it and the flag.
        taken = str(started["metrics_port"])
        clash = subprocess.run([sys.executable, "-m", "apps.cli", "env-server", "--address", "127.0.0.1:0",
                                "--metrics-port", taken, "--envs", "wordle"], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=120)
        assert clash.returncode == 2 and len(clash.stderr.strip().splitlines()) == 1, clash.stderr
        assert f"--metrics-port {taken} cannot be served" in clash.stderr, clash.stderr
        # 1. The same aggregator without secure aggregation: doctor, as the guide gives it, fails with the fix.
        plain, plain_ports = aggregator.text.replace("--secure-aggregation", ""), LocalPorts()
        terminals.start(aggregator.line + 10_000, plain_ports(plain.replace("state/federation", "state/plain")))
        done = run_doctor(tmp_path, env, ports, plain_ports.free["50060"])
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stdout + done.stderr, (done.stdout, done.stderr)
    assert lines[-1].startswith("FAIL the aggregator admits this client: "), lines
    for fix in ("start the aggregator with --secure-aggregation", "FEDSE_REQUIRE_SECURE_AGGREGATION"):
        assert fix in lines[-1], lines[-1]
    assert all(line.startswith("ok   ") for line in lines[:-1]), lines


def test_the_story_reads_each_command_of_the_guide():
    """The helpers above find what they check: a doctor command, and each kind of service."""
    found = {argv[1] for argv in commands(the_story())}
    assert {"aggregator", "env-server", "client", "doctor", "certs"} <= found, found

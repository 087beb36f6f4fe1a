"""The Kubernetes manifests (k8s/), run as local processes: does what they say start a federation
that completes a round? The default (all five pairs), and the mtls component (two pairs).

`kubectl kustomize` renders them; every container of every Deployment and Job is started as a
process, its command `fedse NAME` from this repository with this interpreter, with the container's
args and its env exactly as rendered, except what only a cluster provides, which is emulated:

- volumes: each of a pod's volumes is a directory of its own here (emptyDir: a fresh one; a
  PersistentVolumeClaim: one per claim), and any path under a mountPath (--state-dir=/state,
  HF_HOME=/cache/huggingface, ...) is rewritten to the same path under that directory;
- ports: each container port gets a free port on 127.0.0.1; a listen address 0.0.0.0:P becomes
  127.0.0.1:<P's port>, and a setting named *port (--metrics-port) holding a containerPort P too;
- Service names: host:port where host is a Service (short or fully qualified) becomes 127.0.0.1 and
  the local port of the container port the Service's port targets (aggregator:50060,
  env-server-maze:50051);
- Secrets (mtls): each generated Secret's keys (tls.crt, tls.key, ca.crt) as files, from
  certificates made as the operator makes them offline (support.offline_certs; servers' also name
  127.0.0.1, the address dialled here).
Nothing else is changed, so a flag or FEDSE_* variable the program does not know, a wrong port, a
Service that does not exist or a path outside every volume fails here. To keep the run short on
2 cores, budget flags are added (a flag wins over its FEDSE_* variable): --rounds=1 on the
aggregator, and --expert-demos=2 --explore-tasks=2 --eval-tasks=2 --epochs=1 --torch-threads=1 on
each client agent. They change how much work a round is, not how the services are wired.

Like Kubernetes' probes, the test calls grpc.health.v1 on every probe's port (mapped) and waits for
SERVING, scrapes every metrics port, starts the client agents once the servers are ready, and
expects every client agent (a Job) to exit 0 and the aggregator to have written round 1's global
adapter.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from support import (BUDGET, KUBECTL, NAMESPACE, OWN_METRICS, REPO, free_ports, http_get, kustomize, probe_ports,
                     service_module, serving, write_scenario)

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")
RUN_TIMEOUT_S = 420.0

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(KUBECTL is None, reason="kubectl not found (needed for `kubectl kustomize`)")]


@dataclasses.dataclass
class Pod:
    """One workload's container, as it will run here."""

    name: str
    kind: str
    labels: dict
    container: dict
    root: pathlib.Path
    ports: dict[int, int] = dataclasses.field(default_factory=dict)  # containerPort -> local port
    mounts: list[tuple[str, pathlib.Path]] = dataclasses.field(default_factory=list)  # (mountPath, local dir)
    argv: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    popen: subprocess.Popen | None = None
    log: pathlib.Path | None = None
    extra: list[str] = dataclasses.field(default_factory=list)  # flags added for the run (see the tests)

    @property
    def module(self) -> str:
        return service_module(self.container["command"])

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log and self.log.exists() else ""


class Cluster:
    """The rendered objects, and the emulation of volumes, ports and Service names."""

    def __init__(self, docs: list[dict], root: pathlib.Path):
        self.docs = docs
        self.metrics: dict[str, str] = {}  # pod name -> what its metrics port served once it was ready
        self.services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
        self.pods: list[Pod] = []
        claims: dict[str, pathlib.Path] = {}
        for w in (d for d in docs if d["kind"] in WORKLOAD_KINDS):
            spec = w["spec"]["template"]["spec"]
            assert len(spec["containers"]) == 1 and not spec.get("initContainers"), w["metadata"]["name"]
            c = spec["containers"][0]
            pod = Pod(w["metadata"]["name"], w["kind"], w["spec"]["template"]["metadata"]["labels"], c,
                      root / w["metadata"]["name"])
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            for m in c.get("volumeMounts", []):
                v = volumes[m["name"]]
                if "persistentVolumeClaim" in v:
                    claim = v["persistentVolumeClaim"]["claimName"]
                    assert any(d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == claim for d in docs)
                    local = claims.setdefault(claim, root / "claims" / claim)
                elif "emptyDir" in v:
                    local = pod.root / "volumes" / m["name"]
                elif "secret" in v:
                    local = self.secret_volume(v["secret"]["secretName"], root / "secrets")
                else:
                    raise AssertionError(f"{pod.name}: volume {m['name']} of an unexpected kind")
                local.mkdir(parents=True, exist_ok=True)
                pod.mounts.append((m["mountPath"], local))
            self.pods.append(pod)
        wanted = [(pod, p["containerPort"]) for pod in self.pods for p in pod.container.get("ports", [])]
        for (pod, port), local in zip(wanted, free_ports(len(wanted))):
            pod.ports[port] = local

    def secret_volume(self, secret: str, root: pathlib.Path) -> pathlib.Path:
        """The Secret `secret` as the kubelet mounts it: each of its keys (tls.crt, tls.key, ca.crt) a
        file, from the rendered object (the mtls component generates it from certificates made offline)."""
        import base64

        (obj,) = [d for d in self.docs if d["kind"] == "Secret" and d["metadata"]["name"] == secret] or [None]
        assert obj is not None, f"Secret {secret} is made by no object of the build"
        local = root / secret
        if local.exists():
            return local
        local.mkdir(parents=True)
        for key, value in obj.get("data", {}).items():
            (local / key).write_bytes(base64.b64decode(value))
        return local

    # ---- rewriting ---------------------------------------------------------------------------------
    def local_path(self, pod: Pod, value: str) -> str | None:
        best = None
        for mount_path, local in pod.mounts:
            if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                if best is None or len(mount_path) > len(best[0]):
                    best = (mount_path, local)
        if best is None:
            return None
        return str(best[1] / value[len(best[0]):].lstrip("/"))

    def service_port(self, host: str, port: int) -> int:
        short = host.split(".")[0]
        assert host in (short, f"{short}.{NAMESPACE}", f"{short}.{NAMESPACE}.svc",
                        f"{short}.{NAMESPACE}.svc.cluster.local"), f"{host} is not a Service address in {NAMESPACE}"
        assert short in self.services, f"{host}:{port}: no Service {short}"
        svc = self.services[short]
        (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == port] or [None]
        assert sp is not None, f"{host}:{port}: Service {short} has no port {port}"
        selected = [p for p in self.pods if all(p.labels.get(k) == v for k, v in svc["spec"]["selector"].items())]
        assert len(selected) == 1, f"Service {short} selects {[p.name for p in selected]}"
        target = sp.get("targetPort", port)
        if isinstance(target, str):
            (target,) = [p["containerPort"] for p in selected[0].container["ports"] if p["name"] == target]
        assert target in selected[0].ports, f"{host}:{port} targets {target}, which {selected[0].name} does not declare"
        return selected[0].ports[target]

    def rewrite(self, pod: Pod, name: str, value: str) -> str:
        m = re.fullmatch(r"0\.0\.0\.0:(\d+)", value)
        if m:
            assert int(m[1]) in pod.ports, f"{pod.name}: {name} listens on {value}, not a declared containerPort"
            return f"127.0.0.1:{pod.ports[int(m[1])]}"
        m = re.fullmatch(r"([a-z][a-z0-9.-]*):(\d+)", value)
        if m:
            return f"127.0.0.1:{self.service_port(m[1], int(m[2]))}"
        if name.lower().replace("_", "-").endswith("port") and value.isdigit() and int(value) in pod.ports:
            return str(pod.ports[int(value)])
        if value.startswith("/"):
            local = self.local_path(pod, value)
            assert local is not None, f"{pod.name}: {name}={value} is on no volume (the root filesystem is read-only)"
            return local
        return value

    def prepare(self, pod: Pod) -> None:
        argv = []
        for a in pod.container.get("args", []):
            assert a.startswith("--") and "=" in a, f"{pod.name}: write flags as --name=value: {a!r}"
            flag, value = a.split("=", 1)
            argv.append(f"{flag}={self.rewrite(pod, flag, value)}")
        # The container's command, `fedse NAME`, as this checkout's CLI runs it.
        command = [sys.executable, "-m", "apps.cli", *pod.container["command"][1:]]
        pod.argv = [*command, *argv, *BUDGET[pod.module], *pod.extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith("FEDSE_")}
        env["PYTHONUNBUFFERED"] = "1"
        for e in pod.container.get("env", []):
            assert "value" in e, f"{pod.name}: {e['name']} has no literal value"
            env[e["name"]] = self.rewrite(pod, e["name"], str(e["value"]))
        pod.env = env

    def start(self, pod: Pod) -> None:
        self.prepare(pod)
        pod.log = pod.root / "log.jsonl"
        pod.root.mkdir(parents=True, exist_ok=True)
        with open(pod.log, "wb") as out:
            pod.popen = subprocess.Popen(pod.argv, cwd=REPO, env=pod.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def stop_all(self) -> None:
        for pod in self.pods:
            if pod.popen is not None and pod.popen.poll() is None:
                pod.popen.send_signal(signal.SIGTERM)
        for pod in self.pods:
            if pod.popen is not None:
                try:
                    pod.popen.wait(15)
                except subprocess.TimeoutExpired:
                    pod.popen.kill()
                    pod.popen.wait()


def ready(pod: Pod) -> bool:
    """Every probe of `pod` answers SERVING on the local port its container port maps to."""
    return all(serving(f"127.0.0.1:{pod.ports[p]}") for p in probe_ports(pod.container))


def watch(pods: list[Pod], seen: dict[str, str], deadline: float, until_exit: bool) -> None:
    """Polls the probes of `pods` (as the kubelet would) and scrapes each one's metrics port once it is
    SERVING; returns once every pod was seen serving (and, with until_exit, every one exited)."""
    while time.monotonic() < deadline:
        for pod in pods:
            rc = pod.popen.poll()
            if rc not in (None, 0) or (rc == 0 and pod.kind != "Job"):
                pytest.fail(f"{pod.name} exited with {rc}:\n{pod.output()}")
            if pod.name not in seen and rc is None and ready(pod):
                metrics = pod.ports[next(p["containerPort"] for p in pod.container["ports"] if p["name"] == "metrics")]
                try:
                    text = http_get(f"http://127.0.0.1:{metrics}/metrics")
                except OSError:
                    continue  # e.g. a client agent exiting right then; polled again
                # Its own metrics appear once its modules are loaded (grpc's health servicer answers
                # SERVING for "" from the start, before the service calls ready()).
                if OWN_METRICS[pod.module] in text:
                    seen[pod.name] = text
        if all(p.name in seen for p in pods) and (not until_exit or all(p.popen.poll() is not None for p in pods)):
            return
        time.sleep(0.5)
    pytest.fail(f"timed out; not yet serving: {[p.name for p in pods if p.name not in seen]}; still running: "
                f"{[p.name for p in pods if p.popen.poll() is None]}")


def run_federation(docs: list[dict], tmp_path: pathlib.Path, envs: set[str] | None = None,
                   extra: dict[str, list[str]] | None = None) -> tuple[Cluster, list[Pod], list[Pod]]:
    """Starts the servers, waits for their probes, starts the client agents, waits for them to finish;
    `envs`: only the pairs of these environments (with the aggregator)."""
    cluster = Cluster(docs, tmp_path)
    if envs is not None:
        cluster.pods = [p for p in cluster.pods if p.labels.get("fedse.io/env", "") in envs | {""}]
    for pod in cluster.pods:
        pod.extra = (extra or {}).get(pod.module, [])
    servers = [p for p in cluster.pods if p.kind != "Job"]
    clients = [p for p in cluster.pods if p.kind == "Job"]
    assert {p.module for p in servers} == {"services.aggregator", "services.env_server"}
    assert clients and {p.module for p in clients} == {"services.client_agent"}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    seen = cluster.metrics
    try:
        for pod in servers:
            cluster.start(pod)
        watch(servers, seen, deadline, until_exit=False)  # readiness before the clients start
        for pod in clients:
            cluster.start(pod)
        watch(clients, seen, deadline, until_exit=True)
        for pod in clients:
            assert pod.popen.returncode == 0, f"{pod.name}:\n{pod.output()}"
            assert "run complete" in pod.output(), pod.name
        for pod in servers:  # still serving after the run
            assert pod.popen.poll() is None and ready(pod), pod.name
    finally:
        cluster.stop_all()
    # Every service served its own metrics, and gRPC's, on the port its manifest names.
    for pod in cluster.pods:
        assert OWN_METRICS[pod.module] in seen[pod.name] and "grpc_server_handled_total" in seen[pod.name], pod.name
    return cluster, servers, clients


def check_round_completed(cluster: Cluster, servers: list[Pod], clients: list[Pod]) -> None:
    """The aggregator wrote phi_1 to its state volume, every client reported round 0 (after training) and
    round 1 (the final evaluation), and each kept its progress on its own claim."""
    (aggregator,) = [p for p in servers if p.module == "services.aggregator"]
    state = pathlib.Path(cluster.local_path(aggregator, "/state"))
    run_id = aggregator.env["FEDSE_RUN_ID"]
    final = state / run_id / "global" / "round_0001"
    assert (final / "adapter_model.safetensors").stat().st_size > 0 and (final / "adapter_config.json").exists()
    reports = [json.loads(line) for line in (state / run_id / "metrics.jsonl").read_text().splitlines() if line]
    client_ids = {p.env["FEDSE_CLIENT_ID"] for p in clients}
    assert {(r["client_id"], r["round"]) for r in reports} == {(c, r) for c in client_ids for r in (0, 1)}
    for pod in clients:
        progress = pathlib.Path(cluster.local_path(pod, "/state")) / pod.env["FEDSE_CLIENT_ID"] / "progress.json"
        p = json.loads(progress.read_text())
        assert (p["run_id"], p["round"], p["phase"]) == (run_id, 1, "reported"), pod.name


def test_default_manifests_run_a_federation_round(tmp_path):
    """All five pairs and the aggregator, as k8s/kustomization.yaml deploys them."""
    docs = kustomize(REPO / "k8s")
    cluster, servers, clients = run_federation(docs, tmp_path / "run")
    assert len(clients) == 5 and len(servers) == 6
    check_round_completed(cluster, servers, clients)


def test_mtls_manifests_run_a_federation_round(tmp_path):
    """The mtls component: every link mutual TLS with the certificates its Secrets are generated from
    (made offline by fedse certs, servers' also for 127.0.0.1), probes on the plain health ports. Two of the five pairs (maze,
    wordle), so the aggregator is also told --start-clients=2 (round 0 opens once they have joined):
    what is checked is the wiring (mounted Secrets, TLS flags, allowed client ids, health ports),
    which the other three pairs share."""
    docs = kustomize(write_scenario(tmp_path / "kustomization", ["mtls"], server_ips=("127.0.0.1",)))
    extra = {"services.aggregator": ["--start-clients=2"]}
    cluster, servers, clients = run_federation(docs, tmp_path / "run", envs={"maze", "wordle"}, extra=extra)
    for pod in servers:  # TLS on the service port, plain health on another
        assert pod.env["FEDSE_TLS_CERT"].endswith("tls.crt") and pod.env["FEDSE_HEALTH_ADDRESS"].startswith("127.0.0.1:")
        grpc_port = next(p["containerPort"] for p in pod.container["ports"] if p["name"] == "grpc")
        assert grpc_port not in probe_ports(pod.container)
    for pod in clients:
        assert pod.env["FEDSE_TLS_CERT"].endswith("tls.crt") and "FEDSE_ENV_SERVER_PLAIN" not in pod.env
    check_round_completed(cluster, servers, clients)

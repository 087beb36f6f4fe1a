"""The client-hosts component (k8s/components/client-hosts), without a cluster: BabyAI's client agent
Job becomes a StatefulSet of `fedse client-host` pods whose members together are the environment's
clients, and the aggregator waits for all of them.

Each scenario is k8s/kustomization.yaml with components added, as uncommenting them there gives,
built with `kubectl kustomize`. A host's container is read as its program reads it: its flags and
FEDSE_* variables parsed by `HostConfig`, with FEDSE_MEMBER_OFFSET, which the downward API gives
each pod, set to each pod's index in turn. The component alone; with network-policies and
monitoring (it combines with them); with mtls or gpu (it does not: the build fails, whichever is
listed first). One host's container runs as a local process (up, health, metrics, its members
started, SIGTERM); a whole round of 20 members and four client agents, as tests/test_manifests_run.py
runs the default's, is more than this file spends on 2 cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from fedse import __version__

from k8s_support import (ENVS, K8S_VERSIONS, NAMESPACE, NEEDS_KUBECTL, WORKLOAD_KINDS, by_name, containers,
                         flags_of, module_of, of_kind, pod_spec, program_config)
from support import K8S, KUBECTL, REPO

pytestmark = NEEDS_KUBECTL

COMPONENT = K8S / "components" / "client-hosts"
ENV = "babyai"  # the environment the component gives hosts
HOST = f"client-host-{ENV}"
AGENT = f"client-agent-{ENV}"  # what it replaces
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"
# Scenario -> components added to k8s/kustomization.yaml; those the component refuses, in both orders.
BUILDS = {"default": [], "hosts": ["client-hosts"], "hosts-network": ["network-policies", "client-hosts"],
          "hosts-monitoring": ["client-hosts", "monitoring"]}
REFUSED = {"mtls-first": ["mtls", "client-hosts"], "mtls-last": ["client-hosts", "mtls"],
           "gpu-first": ["gpu", "client-hosts"], "gpu-last": ["client-hosts", "gpu"]}
# The object of does-not-combine.yaml each refused component collides with.
GUARDS = {"mtls": "client-agent-babyai-tls", "gpu": "fedse-models"}


def _k8s_with_stand_in_certs(directory: pathlib.Path) -> pathlib.Path:
    """A copy of k8s/ whose mtls certificate files exist (their contents do not matter to a build)."""
    k8s = directory / "k8s"
    shutil.copytree(K8S, k8s)
    mtls = yaml.safe_load((k8s / "components" / "mtls" / "kustomization.yaml").read_text())
    for secret in mtls["secretGenerator"]:
        for entry in secret["files"]:
            (k8s / "components" / "mtls" / entry.split("=", 1)[1]).write_text("stand-in\n")
    return k8s


def _build(directory: pathlib.Path, components: list[str]) -> subprocess.CompletedProcess:
    """`kubectl kustomize` of k8s/kustomization.yaml plus `components`, written to `directory`."""
    directory.mkdir(parents=True)
    k8s = _k8s_with_stand_in_certs(directory) if "mtls" in components else K8S
    root = yaml.safe_load((k8s / "kustomization.yaml").read_text())
    root["resources"] = [os.path.relpath(k8s / p, directory) for p in root.get("resources") or []]
    root["components"] = [os.path.relpath(k8s / "components" / c, directory) for c in components]
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(root, sort_keys=False))
    return subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("k8s-hosts")
    names = {**BUILDS, **REFUSED}
    with ThreadPoolExecutor(4) as pool:
        procs = pool.map(lambda name: _build(tmp / name, names[name]), names)
    return dict(zip(names, procs))


def docs_of(builds, name: str) -> list[dict]:
    proc = builds[name]
    assert proc.returncode == 0, f"{name}: kubectl kustomize failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def the_host(docs: list[dict]) -> tuple[dict, dict]:
    (sts,) = of_kind(docs, "StatefulSet")
    (c,) = pod_spec(sts)["containers"]
    return sts, c


def host_configs(sts: dict, c: dict):
    """Each pod's HostConfig, as `fedse client-host` parses it in pod i (FEDSE_MEMBER_OFFSET: i)."""
    from fedse.config import parse
    from services.client_host.config import HostConfig
    from services.client_host.server import NOT_SHOWN
    from fedse.security.admission import shown_for

    flags = [name for name in shown_for(HostConfig, "client") if name not in NOT_SHOWN]  # `--help`'s
    environ = {}
    for e in c["env"]:
        assert e["name"] not in environ, f"{e['name']} set twice"
        if "valueFrom" in e:
            assert e["name"] == "FEDSE_MEMBER_OFFSET" and e["valueFrom"] == {"fieldRef": {"fieldPath": POD_INDEX}}, e
            environ[e["name"]] = None
        else:
            environ[e["name"]] = str(e["value"])
    for name in environ:
        if name.startswith("FEDSE_"):
            assert name[len("FEDSE_"):].lower() in flags, f"{name} is not a flag of `fedse client-host`"
    args = flags_of(c["args"])
    assert set(args) <= {f.replace("_", "-") for f in flags}, args
    argv = [f"--{k}={v}" for k, v in args.items()]
    fedse = {k: v for k, v in environ.items() if k.startswith("FEDSE_")}
    return [parse(HostConfig, argv, environ={**fedse, "FEDSE_MEMBER_OFFSET": str(i)})
            for i in range(sts["spec"]["replicas"])]


def counts() -> dict[str, int]:
    """The component's ConfigMap client-hosts: the counts, in one place."""
    config = yaml.safe_load((COMPONENT / "kustomization.yaml").read_text())
    (gen,) = [g for g in config["configMapGenerator"] if g["name"] == "client-hosts"]
    return {k: int(v) for k, v in (item.split("=", 1) for item in gen["literals"])}


def quantity(text: str) -> float:
    """A Kubernetes quantity ("2", "250m", "3Gi", "512Mi") as a number."""
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9}
    unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text))
    return float(unit.group(1)) * units.get(unit.group(2), 1)


# ---- the component alone --------------------------------------------------------------------------
def test_hosts_replace_the_environments_client_agent_and_nothing_else(builds):
    default, hosts = docs_of(builds, "default"), docs_of(builds, "hosts")
    def key(d):
        return d["kind"], d["metadata"]["name"]

    before, after = {key(d): d for d in default}, {key(d): d for d in hosts}
    assert set(before) - set(after) == {("Job", AGENT), ("PersistentVolumeClaim", AGENT), ("Service", AGENT),
                                        ("ServiceAccount", AGENT)}
    assert set(after) - set(before) == {("StatefulSet", HOST), ("Service", HOST), ("ServiceAccount", HOST)}
    # The other environments' client agents, their env servers and the rest: as they were; the aggregator
    # differs only in its clients' settings (below).
    for k in set(before) & set(after):
        if k != ("Deployment", "aggregator"):
            assert after[k] == before[k], k
    assert set(by_name(hosts, "Job")) == {f"client-agent-{e}" for e in ENVS if e != ENV}
    # The ConfigMap of counts is the build's alone (local-config), as is the guard of does-not-combine.yaml.
    assert "ConfigMap" not in {d["kind"] for d in hosts} and "Secret" not in {d["kind"] for d in hosts}
    assert "fedse-models" not in by_name(hosts, "PersistentVolumeClaim")
    for d in hosts:
        assert d["metadata"].get("namespace", NAMESPACE) == NAMESPACE, key(d)
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "fedse", key(d)


def test_the_statefulset_runs_client_hosts_holding_every_member_once(builds):
    sts, c = the_host(docs_of(builds, "hosts"))
    assert c["image"] == f"fedse:{__version__}" and c["command"] == ["fedse", "client-host"]
    assert module_of(c) == "services.client_host"
    spec = sts["spec"]
    n = counts()
    hosts = spec["replicas"]
    assert hosts == n["hosts"] > 1 and spec["podManagementPolicy"] == "Parallel"
    configs = host_configs(sts, c)
    numbers = [k for cfg in configs for k in cfg.numbers()]
    total = configs[0].members_total
    # Pod i holds members i, i+H, ...: the stride is the replica count, the total every pod's members.
    for i, cfg in enumerate(configs):
        assert cfg.member_offset == i and cfg.member_stride == hosts and cfg.members == n["members-per-host"]
        assert cfg.members_total == total
    assert total == hosts * n["members-per-host"] == n["members-total"], \
        "members-total must be hosts x members-per-host (kustomization.yaml's ConfigMap client-hosts)"
    assert sorted(numbers) == list(range(total)), "every member once, on one host"
    ids = [m.client_id for cfg in configs for m in cfg.member_configs()]
    assert sorted(ids) == [f"org-{ENV}-{k:02d}" for k in range(total)]
    assert {m.task_share for cfg in configs for m in cfg.member_configs()} == {f"{k}/{total}" for k in range(total)}


def test_the_members_are_the_environments_client_agent(builds, tmp_path):
    """Every client setting of the hosts is the one the default federation gives BabyAI's client agent:
    its id (now the members' prefix), environment, env server, aggregator, model, scoring, budget."""
    from services.client_agent.config import ClientConfig

    job = by_name(docs_of(builds, "default"), "Job")[AGENT]
    (agent,) = pod_spec(job)["containers"]
    alone = program_config(job, agent, tmp_path)
    sts, c = the_host(docs_of(builds, "hosts"))
    cfg = host_configs(sts, c)[0]
    for f in dataclasses.fields(ClientConfig):
        assert getattr(cfg, f.name) == getattr(alone, f.name), f"--{f.name.replace('_', '-')}"
    assert (cfg.client_id, cfg.env, cfg.env_server, cfg.aggregator) == \
        (f"org-{ENV}", ENV, f"env-server-{ENV}:50051", "aggregator:50060")
    # What is not a setting: the same variables for the caches; resources at least a client agent's.
    def plain(container):
        return {e["name"]: e["value"] for e in container["env"] if not e["name"].startswith("FEDSE_")}

    assert plain(c) == plain(agent)
    for kind in ("requests", "limits"):
        for r in ("cpu", "memory", "ephemeral-storage"):
            assert quantity(c["resources"][kind][r]) >= quantity(agent["resources"][kind][r]), (kind, r)
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50070, "metrics": 9100}
    assert pod_spec(sts)["securityContext"] == pod_spec(job)["securityContext"]
    assert c["securityContext"] == agent["securityContext"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe] == agent[probe], probe
        assert c[probe]["grpc"]["port"] == int(cfg.address.rsplit(":", 1)[1])
    assert sts["spec"]["template"]["metadata"]["annotations"] == job["spec"]["template"]["metadata"]["annotations"]


def test_each_host_keeps_its_members_state_on_a_claim_of_its_own(builds):
    sts, c = the_host(docs_of(builds, "hosts"))
    cfg = host_configs(sts, c)[0]
    (template,) = sts["spec"]["volumeClaimTemplates"]
    assert template["spec"]["accessModes"] == ["ReadWriteOnce"]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == cfg.state_dir]
    assert mount["name"] == template["metadata"]["name"] and not mount.get("readOnly")
    # The claim template is the pod's only volume of that name (k8s_support.mount_for knows pod volumes
    # only); /tmp and the caches are emptyDirs.
    volumes = {v["name"]: v for v in pod_spec(sts)["volumes"]}
    assert template["metadata"]["name"] not in volumes
    mounts = {m["mountPath"]: volumes.get(m["name"], {}) for m in c["volumeMounts"]}
    assert "emptyDir" in mounts["/tmp"] and "emptyDir" in mounts["/cache"]
    env = {e["name"]: e.get("value", "") for e in c["env"]}
    assert all(env[v].startswith("/cache/") for v in ("HF_HOME", "TORCH_HOME", "TRITON_CACHE_DIR", "MPLCONFIGDIR"))
    assert pod_spec(sts)["automountServiceAccountToken"] is False
    assert pod_spec(sts)["serviceAccountName"] == HOST


def test_the_governing_service_is_headless_and_selects_the_hosts_alone(builds):
    docs = docs_of(builds, "hosts")
    sts, c = the_host(docs)
    svc = by_name(docs, "Service")[sts["spec"]["serviceName"]]
    assert svc["metadata"]["name"] == HOST and svc["spec"]["clusterIP"] == "None"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for s in of_kind(docs, "Service"):
        for w in of_kind(docs, *WORKLOAD_KINDS):
            chosen = s["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
            assert chosen == (s["metadata"]["name"] == w["metadata"]["name"]), \
                (s["metadata"]["name"], w["metadata"]["name"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert {p["name"]: ports[p["targetPort"]] for p in svc["spec"]["ports"]} == ports
    # The labels that make them BabyAI's client agents to the selectors of the other components.
    assert labels["app.kubernetes.io/name"] == "client-agent" and labels["fedse.io/env"] == ENV


def test_the_aggregator_waits_for_every_member_and_samples_each_round(builds, tmp_path):
    docs = docs_of(builds, "hosts")
    (agg,) = [(w, c) for w, c in containers(docs) if module_of(c) == "services.aggregator"]
    cfg = program_config(*agg, tmp_path)
    sts, c = the_host(docs)
    members = host_configs(sts, c)[0].members_total
    clients = members + len(by_name(docs, "Job"))  # the members, and the other environments' client agents
    assert cfg.start_clients == clients == counts()["clients"], \
        "round 0 waits for every client: kustomization.yaml's `clients` must be members-total + the Jobs"
    assert cfg.min_clients < clients
    assert cfg.selector == "sample" and 2 <= cfg.clients_per_round < clients
    # Nothing else of the aggregator changes.
    default = [c for w, c in containers(docs_of(builds, "default")) if module_of(c) == "services.aggregator"][0]
    changed = {"FEDSE_START_CLIENTS", "FEDSE_SELECTOR", "FEDSE_CLIENTS_PER_ROUND"}

    def strip(container):
        kept = sorted((e for e in container["env"] if e["name"] not in changed), key=lambda e: e["name"])
        return {**container, "env": kept}

    assert strip(agg[1]) == strip(default)


def test_objects_validate_against_kubernetes_schemas(builds):
    import kubernetes_validate

    docs = docs_of(builds, "hosts")
    for d in docs:
        if d["metadata"]["name"] != HOST:
            continue  # the rest is the default's (tests/test_k8s.py)
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(d, version, strict=True)


# ---- with the other components ----------------------------------------------------------------------
def test_network_policies_let_the_hosts_do_what_the_client_agent_did(builds):
    from test_k8s_network import reachable

    docs = docs_of(builds, "hosts-network")
    expected = set()
    for e in ENVS:
        agent = HOST if e == ENV else f"client-agent-{e}"
        expected |= {(agent, f"env-server-{e}", 50051), (agent, "aggregator", 50060), (agent, "kube-dns", 53)}
    for w in of_kind(docs, *WORKLOAD_KINDS):
        expected.add(("prometheus", w["metadata"]["name"], 9100))
    got = reachable(docs)
    assert got == expected, f"links not allowed {sorted(expected - got)}, links allowed too {sorted(got - expected)}"


def test_monitoring_scrapes_the_hosts(builds):
    docs = docs_of(builds, "hosts-monitoring")
    (monitor,) = of_kind(docs, "PodMonitor")
    sts, c = the_host(docs)
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= {p["name"] for p in c["ports"]}


def test_mtls_and_gpu_are_refused_in_either_order(builds):
    for name, components in REFUSED.items():
        proc = builds[name]
        other = next(c for c in components if c != "client-hosts")
        assert proc.returncode != 0 and GUARDS[other] in proc.stderr, f"{name}: built\n{proc.stderr[-2000:]}"
        assert re.search(r"already registered id|behavior must be merge or replace", proc.stderr), proc.stderr[-2000:]
    # Why, in the component's own words.
    header = (COMPONENT / "kustomization.yaml").read_text().split("apiVersion")[0]
    assert "NOT combine" in header and "components/mtls" in header and "components/gpu" in header
    assert "--tls-cert" in header and "1.28" in header


# ---- where it is offered ------------------------------------------------------------------------------
def test_the_component_is_offered_and_documented():
    root = (K8S / "kustomization.yaml").read_text()
    assert re.search(r"^#\s+- components/client-hosts\b", root, re.M)
    assert not yaml.safe_load(root).get("components")
    assert "`client-hosts`" in (K8S / "README.md").read_text()
    guide = (REPO / "docs" / "deploy.md").read_text()
    assert re.search(r"^### .*components/client-hosts", guide, re.M), "docs/deploy.md has its section"


# ---- one host, run --------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_rendered_host_starts_its_members_and_stops_on_sigterm(builds, tmp_path):
    """Pod 1's container as a local process (as tests/test_manifests_run.py runs the default's): its
    args and env as rendered, its pod index 1 where the downward API gives it, its volumes as
    directories here, its ports free ones. No aggregator or env server answers: the host still loads
    the model once, serves health and metrics, starts its members (1, 5, 9, 13, 17 of 20), and stops
    on SIGTERM with status 0, as a pod does when Kubernetes stops it."""
    import signal
    import sys
    import time

    from support import free_ports, http_get, serving

    sts, c = the_host(docs_of(builds, "hosts"))
    health, metrics = free_ports(2)
    local = {m["mountPath"]: tmp_path / m["name"] for m in c["volumeMounts"]}

    def here(value: str) -> str:  # a path under a volume's mountPath -> the same under its directory
        for mount, directory in local.items():
            if value == mount or value.startswith(mount + "/"):
                return str(directory) + value[len(mount):]
        return value

    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDSE_")}
    env.update({e["name"]: "1" if "valueFrom" in e else here(e["value"]) for e in c["env"]})
    ports = {"0.0.0.0:50070": f"127.0.0.1:{health}", "9100": str(metrics)}
    args = []
    for a in c["args"]:
        flag, value = a.split("=", 1)
        args.append(f"{flag}={here(ports.get(value, value))}")
    assert c["startupProbe"]["grpc"]["port"] == 50070 and f"--address=127.0.0.1:{health}" in args
    log = tmp_path / "host.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "apps.cli", *c["command"][1:], *args], cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not serving(f"127.0.0.1:{health}"):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        assert "fedse_client_host_members" in http_get(f"http://127.0.0.1:{metrics}/metrics")
        started = next(json.loads(line) for line in log.read_text().splitlines() if '"started"' in line)
        assert (started["members"], started["first"], started["last"]) == (5, f"org-{ENV}-01", f"org-{ENV}-17")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0, log.read_text()[-3000:]
    # Each member's state directory, on the pod's claim (made as its agent is built, before health).
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [f"org-{ENV}-{k:02d}" for k in (1, 5, 9, 13, 17)]

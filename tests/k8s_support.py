"""What the Kubernetes manifest tests (tests/test_k8s*.py) share: the scenarios, each built with
`kubectl kustomize` once per session (the default federation, each component on top of it,
components that belong together, all components together, and the on-prem overlay for each
environment), and how a program sees a rendered container (its flags and FEDSE_* variables parsed
by its own configuration class, its mounts, the ports it listens on and serves health on).

The components' scenarios are written to a temporary directory from k8s/kustomization.yaml itself
(its namespace, labels, images and resources, plus the components), so they are exactly what
uncommenting the components there gives; the on-prem overlay's other environments are a copy of
k8s/ with the one line that picks the pair changed, as docs/join-a-federation.md tells an
organisation to do. The mtls component's scenarios build from a copy of k8s/ holding certificates
made as docs/deploy.md makes them (support.offline_certs).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import pathlib
import shutil

import pytest
import yaml

from support import K8S, KUBECTL, kustomize, service_module, write_scenario

ENVS = ("maze", "wordle", "babyai", "textcraft", "webshop")
COMPONENTS = ("gpu", "network-policies", "mtls", "monitoring", "demos", "secure-aggregation", "client-hosts")
# Components left out of the scenario of all of them: client-hosts refuses mtls and gpu
# (tests/test_k8s_hosts.py checks it and the component with the ones it combines with).
NOT_IN_ALL = ("client-hosts",)
# Scenarios of several components that belong together, besides all of them at once.
COMBINATIONS = {"secure-aggregation-over-mtls": ["mtls", "secure-aggregation"]}
NAMESPACE = "fedse"
# Schemas checked: the oldest Kubernetes release the manifests are meant for (native gRPC probes
# are GA since 1.27) and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.28", "1.37")
# Secrets the on-prem overlay expects the organisation to create by hand (never kept in git).
EXTERNAL_SECRETS = {"onprem": {"fedse-client-tls"}}
# Objects that live in no namespace (the on-prem overlay's models volume on a node).
CLUSTER_KINDS = ("Namespace", "PersistentVolume")
# The line of k8s/overlays/onprem/kustomization.yaml that picks the organisation's pair.
ONPREM_PAIR = "  - ../../base/envs/maze\n"
# Keys of the TLS Secrets the mtls component generates (and the on-prem Secret is documented to hold).
TLS_SECRET_KEYS = {"tls.crt", "tls.key", "ca.crt"}
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job", "DaemonSet")
# Every test module of the manifests: skipped where kubectl is not found.
NEEDS_KUBECTL = pytest.mark.skipif(KUBECTL is None, reason="kubectl not found (needed for `kubectl kustomize`)")


# ---- building scenarios -----------------------------------------------------------------------------
def scenario_dirs() -> dict[str, list[str]]:
    """Scenario name -> the components added to k8s/kustomization.yaml for it."""
    out: dict[str, list[str]] = {"default": []}
    for c in COMPONENTS:
        out[c] = [c]
    out.update(COMBINATIONS)
    out["all-components"] = [c for c in COMPONENTS if c not in NOT_IN_ALL]
    return out


# The on-prem overlay as it is (the maze pair), then with each other environment's pair.
ONPREM = {"onprem": "maze", **{f"onprem-{e}": e for e in ENVS if e != "maze"}}
SCENARIOS = [*scenario_dirs(), *ONPREM]


def onprem_for(env: str, directory: pathlib.Path) -> pathlib.Path:
    """A copy of k8s/ whose on-prem overlay plays `env`: the one edit an organisation makes."""
    shutil.copytree(K8S, directory / "k8s")
    overlay = directory / "k8s" / "overlays" / "onprem" / "kustomization.yaml"
    text = overlay.read_text()
    pairs = [r for r in yaml.safe_load(text)["resources"] if "base/envs/" in r]
    assert text.count(ONPREM_PAIR) == 1 and len(pairs) == 1, "one line picks the pair"
    overlay.write_text(text.replace(ONPREM_PAIR, f"  - ../../base/envs/{env}\n"))
    return overlay.parent


@functools.lru_cache(maxsize=None)
def _render(name: str, tmp: str) -> tuple[dict, ...]:
    if name == "default":
        return tuple(kustomize(K8S))
    if name == "onprem":
        return tuple(kustomize(K8S / "overlays" / "onprem"))
    if name in ONPREM:
        return tuple(kustomize(onprem_for(ONPREM[name], pathlib.Path(tmp) / name)))
    return tuple(kustomize(write_scenario(pathlib.Path(tmp) / name, scenario_dirs()[name])))


_SCENARIO_TMP: list[str] = []  # the one scenario_tmp of this session, whichever module asked first


@pytest.fixture(scope="session")
def scenario_tmp(tmp_path_factory) -> str:
    """Where the components' scenarios are written; all scenarios are built here at once, in parallel.
    Made once per session, though each test module that imports this fixture has its own copy of it."""
    from concurrent.futures import ThreadPoolExecutor

    if not _SCENARIO_TMP:
        tmp = str(tmp_path_factory.mktemp("k8s-scenarios"))
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda name: _render(name, tmp), SCENARIOS))
        _SCENARIO_TMP.append(tmp)
    return _SCENARIO_TMP[0]


@pytest.fixture(params=SCENARIOS)
def scenario(request, scenario_tmp) -> tuple[str, list[dict]]:
    return request.param, [json.loads(json.dumps(d)) for d in _render(request.param, scenario_tmp)]


def of_kind(docs: list[dict], *kinds: str) -> list[dict]:
    return [d for d in docs if d["kind"] in kinds]


def by_name(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(docs: list[dict]):
    for w in of_kind(docs, *WORKLOAD_KINDS):
        for c in pod_spec(w).get("initContainers", []) + pod_spec(w)["containers"]:
            yield w, c


# ---- the programs' view of a container -------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def config_class(module: str):
    if module == "services.aggregator":
        from services.aggregator.server import AggregatorConfig
        return AggregatorConfig
    if module == "services.env_server":
        from services.env_server.server import EnvServerConfig
        return EnvServerConfig
    if module == "services.client_agent":
        from services.client_agent.config import ClientConfig
        return ClientConfig
    if module == "services.client_host":
        from services.client_host.config import HostConfig
        return HostConfig
    raise AssertionError(f"unknown service module {module!r}")


def module_of(c: dict) -> str:
    return service_module(c.get("command", []))


# The one reference a value may come from: a StatefulSet pod's index (client hosts' first member), read
# here as the first pod's.
POD_INDEX = {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}


def env_of(c: dict) -> dict[str, str]:
    out = {}
    for e in c.get("env", []):
        assert "valueFrom" not in e or e["valueFrom"] == POD_INDEX, \
            f"{c['name']}: {e['name']} from a reference; this test reads values (and a pod's index) only"
        assert e["name"] not in out, f"{c['name']}: {e['name']} set twice"
        out[e["name"]] = "0" if "valueFrom" in e else str(e.get("value", ""))
    return out


def flags_of(args: list[str]) -> dict[str, str]:
    """--flag=value or --flag value (a bare --flag: 'true')."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        a = args[i]
        assert a.startswith("--"), f"unexpected argument {a!r} in {args}"
        if "=" in a:
            k, v = a[2:].split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            k, v = a[2:], args[i + 1]
            i += 1
        else:
            k, v = a[2:], "true"
        out[k] = v
        i += 1
    return out


def mounts_of(w: dict, c: dict) -> list[tuple[str, dict, dict]]:
    """(mountPath, volumeMount, volume) of a container."""
    vols = {v["name"]: v for v in pod_spec(w).get("volumes", [])}
    for t in w["spec"].get("volumeClaimTemplates", []):  # a StatefulSet pod's claim <template>-<pod>
        vols[t["metadata"]["name"]] = {"name": t["metadata"]["name"], "persistentVolumeClaim": {"template": t}}
    out = []
    for m in c.get("volumeMounts", []):
        assert m["name"] in vols, f"{c['name']}: volumeMount {m['name']} has no volume"
        out.append((m["mountPath"], m, vols[m["name"]]))
    return out


def mount_for(w: dict, c: dict, path: str) -> tuple[str, dict, dict] | None:
    """The mount that holds `path` (the longest mountPath that is a prefix of it)."""
    best = None
    for mp, m, v in mounts_of(w, c):
        if path == mp or path.startswith(mp.rstrip("/") + "/"):
            if best is None or len(mp) > len(best[0]):
                best = (mp, m, v)
    return best


def program_config(w: dict, c: dict, pem_dir: pathlib.Path):
    """The container's configuration as its program parses it (flags win over FEDSE_* variables).

    TLS files live on Secret volumes that exist only in a cluster: each must be a Secret mount of
    one of the keys a TLS Secret holds, and is replaced by a stand-in PEM file for parsing."""
    from fedse.config import parse

    cls = config_class(module_of(c))
    fields = {f.name for f in dataclasses.fields(cls)}
    env = env_of(c)
    for name in env:
        if name.startswith("FEDSE_"):
            assert name[len("FEDSE_"):].lower() in fields, \
                f"{w['metadata']['name']}/{c['name']}: {name} is not a setting of {module_of(c)} (a typo is ignored silently)"
    flags = flags_of(c.get("args", []))
    for k in flags:
        assert k.replace("-", "_") in fields, f"{w['metadata']['name']}/{c['name']}: unknown flag --{k}"
    environ = {k: v for k, v in env.items() if k.startswith("FEDSE_")}
    for key in ("tls_ca", "tls_cert", "tls_key", "token_file"):
        path = flags.get(key.replace("_", "-"), environ.get("FEDSE_" + key.upper()))
        if not path:
            continue
        mount = mount_for(w, c, path)
        assert mount is not None and "secret" in mount[2], \
            f"{w['metadata']['name']}: {key} {path} is not on a Secret volume"
        assert mount[1].get("readOnly") is True, f"{w['metadata']['name']}: the Secret at {mount[0]} must be readOnly"
        if key != "token_file":
            assert pathlib.PurePath(path).name in TLS_SECRET_KEYS and pathlib.PurePath(path).parent == \
                pathlib.PurePath(mount[0]), f"{w['metadata']['name']}: {path} is not a key of the Secret at {mount[0]}"
        stand_in = pem_dir / f"{key}.pem"
        stand_in.write_text("-----BEGIN CERTIFICATE-----\nstand-in\n-----END CERTIFICATE-----\n"
                            if key != "token_file" else "x" * 32)
        environ["FEDSE_" + key.upper()] = str(stand_in)
        flags.pop(key.replace("_", "-"), None)
    argv = [f"--{k}={v}" for k, v in flags.items()]
    return parse(cls, argv, environ=environ)


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def listening_ports(cfg) -> dict[str, int]:
    """What the program listens on: its gRPC port, metrics, and the plain health port if any."""
    out = {"grpc": port_of(cfg.address), "metrics": cfg.metrics_port}
    if getattr(cfg, "health_address", ""):
        out["grpc-health"] = port_of(cfg.health_address)
    return out


def health_ports(module: str, cfg) -> set[int]:
    """Ports a kubelet gRPC probe (plain, no TLS) can get grpc.health.v1 from: the plain health-only
    port if there is one; the main port unless it serves TLS (the client agent's own port, health
    only, is always plain)."""
    ports = set()
    if getattr(cfg, "health_address", ""):
        ports.add(port_of(cfg.health_address))
    if module == "services.client_agent" or not cfg.tls_cert:
        ports.add(port_of(cfg.address))
    return ports


@pytest.fixture
def configs(scenario, tmp_path):
    """(workload, container, parsed config) for every container of the scenario."""
    name, docs = scenario
    out = []
    for i, (w, c) in enumerate(containers(docs)):
        d = tmp_path / str(i)
        d.mkdir()
        out.append((w, c, program_config(w, c, d)))
    return out


def secret_files(secret: dict) -> dict[str, bytes]:
    """A Secret's keys and their bytes (kustomize writes generated Secrets' values base64 in data)."""
    return {k: base64.b64decode(v) for k, v in secret.get("data", {}).items()} | \
        {k: v.encode() for k, v in secret.get("stringData", {}).items()}


def mounted_secret(w: dict, c: dict) -> str:
    return next(v["secret"]["secretName"] for _, _, v in mounts_of(w, c) if "secret" in v)

"""The Kubernetes manifests (k8s/), without a cluster.

Every scenario is built with `kubectl kustomize`: the default federation (k8s/), each component on
top of it, components that belong together (secure aggregation over mTLS), all components together,
and the on-prem overlay for each environment. The components' scenarios are written to a temporary
directory from k8s/kustomization.yaml itself (its namespace, labels, images and resources, plus the
components), so they are exactly what uncommenting the components there gives; the on-prem
overlay's other environments are a copy of k8s/ with the one line that picks the pair changed, as
docs/join-a-federation.md tells an organisation to do.

Every rendered object of a core Kubernetes kind is validated, offline, against the Kubernetes
OpenAPI schemas that `kubernetes-validate` ships (strict: unknown fields fail). Custom resources
(the Prometheus Operator's PodMonitor) are not in those schemas: they are checked structurally here
(apiVersion, kind, the fields their controllers need). The mtls component's Secrets are generated
from certificates made offline; its scenarios build from a copy of k8s/ holding ones made as
docs/deploy.md makes them (support.offline_certs), and no object of any scenario may hold the CA's
private key, or anything that makes a CA in the cluster.

Then policy: every container runs non-root with a read-only root filesystem, no privilege
escalation and no capabilities, with requests and limits; every probe is a native gRPC probe on a
port that serves grpc.health.v1 (a plain one when the service serves TLS); Service ports are named
and point at the ports the programs listen on; every volume claim exists; the flags and FEDSE_*
variables are ones the programs know (parsed by the programs' own configuration classes); the
links (client -> its env server, client -> aggregator) resolve to Services; and the network
policies allow exactly the links the federation uses.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import ipaddress
import json
import pathlib
import re
import shutil

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fedse import __version__

from fedse.security import certs
from fedse.security.tls_files import public_bytes
from support import K8S, KUBECTL, REPO, kustomize, service_module, write_scenario
ENVS = ("maze", "wordle", "babyai", "textcraft", "webshop")
COMPONENTS = ("gpu", "network-policies", "mtls", "monitoring", "demos", "secure-aggregation")
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

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not found (needed for `kubectl kustomize`)")


# ---- building scenarios -----------------------------------------------------------------------------
def scenario_dirs() -> dict[str, list[str]]:
    """Scenario name -> the components added to k8s/kustomization.yaml for it."""
    out: dict[str, list[str]] = {"default": []}
    for c in COMPONENTS:
        out[c] = [c]
    out.update(COMBINATIONS)
    out["all-components"] = list(COMPONENTS)
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


@pytest.fixture(scope="session")
def scenario_tmp(tmp_path_factory) -> str:
    """Where the components' scenarios are written; all scenarios are built here at once, in parallel."""
    from concurrent.futures import ThreadPoolExecutor

    tmp = str(tmp_path_factory.mktemp("k8s-scenarios"))
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda name: _render(name, tmp), SCENARIOS))
    return tmp


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
    raise AssertionError(f"unknown service module {module!r}")


def module_of(c: dict) -> str:
    return service_module(c.get("command", []))


def env_of(c: dict) -> dict[str, str]:
    out = {}
    for e in c.get("env", []):
        assert "valueFrom" not in e, f"{c['name']}: {e['name']} from a reference; this test reads values only"
        assert e["name"] not in out, f"{c['name']}: {e['name']} set twice"
        out[e["name"]] = str(e.get("value", ""))
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


# ---- builds and schemas -----------------------------------------------------------------------------
def test_every_scenario_builds_into_the_namespace(scenario):
    name, docs = scenario
    assert docs, name
    for d in docs:
        if d["kind"] == "Namespace":
            assert d["metadata"]["name"] == NAMESPACE
        elif d["kind"] in CLUSTER_KINDS:
            assert "namespace" not in d["metadata"], f"{d['kind']}/{d['metadata']['name']}"
        else:
            assert d["metadata"].get("namespace") == NAMESPACE, f"{d['kind']}/{d['metadata']['name']}"
        assert d["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "fedse", \
            f"{d['kind']}/{d['metadata']['name']}"
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), "duplicate objects"
    assert of_kind(docs, "Namespace"), "the namespace itself is part of every scenario"


def test_every_component_and_overlay_is_a_scenario():
    assert {p.name for p in (K8S / "components").iterdir() if p.is_dir()} == set(COMPONENTS)
    assert {p.name for p in (K8S / "overlays").iterdir() if p.is_dir()} == {"onprem"}
    root = (K8S / "kustomization.yaml").read_text()
    assert not yaml.safe_load(root).get("components"), "the default deploys no optional component"
    for c in COMPONENTS:  # each is offered, commented out, where it is switched on
        assert re.search(rf"^#\s+- components/{c}\b", root, re.M), c


def test_default_is_the_whole_cpu_federation(scenario_tmp):
    docs = list(_render("default", scenario_tmp))
    deployments, jobs, services = by_name(docs, "Deployment"), by_name(docs, "Job"), by_name(docs, "Service")
    assert set(deployments) == {"aggregator", *(f"env-server-{e}" for e in ENVS)}
    assert set(jobs) == {f"client-agent-{e}" for e in ENVS}
    assert set(services) == set(deployments) | set(jobs), "each workload has its own Service"
    assert set(by_name(docs, "PersistentVolumeClaim")) == {"aggregator", *(f"client-agent-{e}" for e in ENVS)}
    for w, c in containers(docs):
        assert c["image"] == f"fedse:{__version__}", (w["metadata"]["name"], c["image"])
    # Each client scores actions as `fedse run` scores its environment's with the tiny model.
    from apps.planning import scoring_for
    for env in ENVS:
        (c,) = pod_spec(jobs[f"client-agent-{env}"])["containers"]
        assert env_of(c)["FEDSE_SCORING"] == scoring_for("auto", (env,)), env


# Object kinds the schemas of kubernetes-validate do not cover, and what their controllers need.
CRDS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): lambda s: isinstance(s.get("selector"), dict)
    and bool(s.get("podMetricsEndpoints")) and all(e.get("port") for e in s["podMetricsEndpoints"]),
}


@functools.lru_cache(maxsize=None)
def schema_error(doc_json: str, version: str) -> str | None:
    """Why the object is not valid Kubernetes `version` (strict: no unknown fields), None if it is.
    Cached: most objects are the same in every scenario."""
    import kubernetes_validate

    d = json.loads(doc_json)
    try:
        kubernetes_validate.validate(d, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"not valid Kubernetes {version}: {'.'.join(str(p) for p in exc.path)}: {exc.message}"
    except kubernetes_validate.SchemaNotFoundError:
        return f"{d['apiVersion']} {d['kind']} is neither core Kubernetes {version} nor a known CRD"
    return None


def test_objects_validate_against_kubernetes_schemas(scenario):
    name, docs = scenario
    for d in docs:
        what = f"{name}: {d['kind']}/{d['metadata']['name']}"
        key = (d["apiVersion"], d["kind"])
        if key in CRDS:  # structural check (not in the core schemas)
            assert set(d) <= {"apiVersion", "kind", "metadata", "spec"}, what
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", d["metadata"]["name"]), what
            assert CRDS[key](d["spec"]), f"{what}: spec misses what its controller needs: {d['spec']}"
            continue
        for version in K8S_VERSIONS:
            error = schema_error(json.dumps(d, sort_keys=True), version)
            assert error is None, f"{what}: {error}"


# ---- policy -----------------------------------------------------------------------------------------
def test_containers_are_locked_down(scenario):
    name, docs = scenario
    for w, c in containers(docs):
        who = f"{name}: {w['metadata']['name']}/{c['name']}"
        pod = pod_spec(w)
        psc, sc = pod.get("securityContext", {}), c.get("securityContext", {})
        assert sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True, who
        assert sc.get("runAsUser", psc.get("runAsUser", 0)) != 0, who
        assert sc.get("readOnlyRootFilesystem") is True, who
        assert sc.get("allowPrivilegeEscalation") is False, who
        assert sc.get("capabilities", {}).get("drop") == ["ALL"] and not sc.get("capabilities", {}).get("add"), who
        assert sc.get("privileged") is not True, who
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {}))
        assert seccomp.get("type") == "RuntimeDefault", f"{who}: the restricted profile needs RuntimeDefault seccomp"
        assert pod.get("automountServiceAccountToken") is False, f"{who}: no service needs the Kubernetes API"
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), who
        assert not any("hostPath" in v for v in pod.get("volumes", [])), who
        res = c.get("resources", {})
        for kind in ("requests", "limits"):
            for r in ("cpu", "memory"):
                assert r in res.get(kind, {}), f"{who}: no {kind}.{r}"
        assert c.get("imagePullPolicy") in ("IfNotPresent", "Always"), who
        # Everything written goes to a volume: /tmp and the caches on emptyDirs.
        tmp = mount_for(w, c, "/tmp/x")
        assert tmp and "emptyDir" in tmp[2] and tmp[0] == "/tmp", f"{who}: /tmp must be an emptyDir"
        env = env_of(c)
        for var in ("XDG_CACHE_HOME", "HF_HOME", "TORCH_HOME", "TRITON_CACHE_DIR", "MPLCONFIGDIR"):
            assert var in env, f"{who}: {var} unset"
            m = mount_for(w, c, env[var])
            assert m and "emptyDir" in m[2] and not m[1].get("readOnly"), f"{who}: {var}={env[var]} not on a writable emptyDir"


def test_flags_and_variables_are_the_programs_own(configs):
    # program_config (the fixture) parses each container's flags and FEDSE_* variables with its
    # program's own config class and fails (an error here) on an unknown flag or variable, a
    # malformed value, or a TLS file that is not a key of a mounted Secret.
    assert configs


def test_probes_are_grpc_on_a_port_serving_health(configs):
    for w, c, cfg in configs:
        who = f"{w['metadata']['name']}/{c['name']}"
        ok = health_ports(module_of(c), cfg)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = c.get(probe)
            assert p is not None, f"{who}: no {probe}"
            assert set(p) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, f"{who}: {probe} is not a gRPC probe"
            assert p["grpc"]["port"] in ok, \
                f"{who}: {probe} on {p['grpc']['port']}, but plain grpc.health.v1 is served on {sorted(ok)}"
            assert p["grpc"].get("service", "") == "", f"{who}: probe the server's overall health"


def test_container_ports_are_the_ports_the_programs_listen_on(configs):
    for w, c, cfg in configs:
        who = f"{w['metadata']['name']}/{c['name']}"
        declared = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        assert declared == listening_ports(cfg), who
        if module_of(c) != "services.client_agent":
            assert cfg.address.startswith("0.0.0.0:"), f"{who}: a server must listen on all interfaces"
        annotations = w["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", who
        assert annotations.get("prometheus.io/port") == str(cfg.metrics_port), who


def test_services_name_their_ports_and_select_one_workload(scenario, configs):
    name, docs = scenario
    for svc in of_kind(docs, "Service"):
        who = f"{name}: Service/{svc['metadata']['name']}"
        sel = svc["spec"]["selector"]
        chosen = [(w, c, cfg) for w, c, cfg in configs
                  if all(w["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in sel.items())]
        assert len({id(w) for w, _, _ in chosen}) == 1, f"{who} selects {[w['metadata']['name'] for w, _, _ in chosen]}"
        w, c, cfg = chosen[0]
        assert svc["metadata"]["name"] == w["metadata"]["name"], who
        names = {p["name"] for p in svc["spec"]["ports"]}
        assert names == {"grpc", "metrics"}, f"{who}: ports {names}"
        container_ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            target = container_ports[target] if isinstance(target, str) else target
            assert target == listening_ports(cfg)[p["name"]], f"{who}: port {p['name']} -> {target}"


def test_every_claim_exists_and_state_is_persistent(scenario, configs):
    name, docs = scenario
    claims = by_name(docs, "PersistentVolumeClaim")
    used = set()
    for w in of_kind(docs, *WORKLOAD_KINDS):
        for v in pod_spec(w).get("volumes", []):
            if "persistentVolumeClaim" in v:
                used.add(v["persistentVolumeClaim"]["claimName"])
                assert v["persistentVolumeClaim"]["claimName"] in claims, f"{name}: {v} has no claim"
        assert not w["spec"].get("volumeClaimTemplates")
    assert used == set(claims), f"{name}: unused claims {set(claims) - used}"
    for w, c, cfg in configs:
        if hasattr(cfg, "state_dir"):
            m = mount_for(w, c, cfg.state_dir)
            assert m and "persistentVolumeClaim" in m[2] and not m[1].get("readOnly"), \
                f"{name}: {w['metadata']['name']}'s state dir {cfg.state_dir} is not on a writable volume claim"
            claim = claims[m[2]["persistentVolumeClaim"]["claimName"]]
            assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
            if w["kind"] == "Deployment":  # one writer: the old pod lets go before the new one mounts
                assert w["spec"]["replicas"] == 1 and w["spec"]["strategy"]["type"] == "Recreate"


def test_secrets_are_made_in_the_build_or_documented(scenario):
    name, docs = scenario
    made = by_name(docs, "Secret")
    for secret in made.values():  # a TLS Secret each: its certificate, key and the CA's certificate
        assert set(secret.get("data", {})) == TLS_SECRET_KEYS, f"{name}: Secret {secret['metadata']['name']}"
    for w in of_kind(docs, *WORKLOAD_KINDS):
        for v in pod_spec(w).get("volumes", []):
            if "secret" in v:
                secret = v["secret"]["secretName"]
                documented = EXTERNAL_SECRETS.get("onprem" if name in ONPREM else name, set())
                assert secret in set(made) | documented, f"{name}: Secret {secret} comes from nowhere"
                assert v["secret"].get("defaultMode") == 0o440, f"{name}: {secret}: keys readable by owner and group only"


def test_links_resolve_to_services(scenario, configs):
    name, docs = scenario
    services = by_name(docs, "Service")
    servers = {w["metadata"]["name"]: cfg for w, c, cfg in configs if module_of(c) != "services.client_agent"}
    clients = [(w, cfg) for w, c, cfg in configs if module_of(c) == "services.client_agent"]
    assert clients, name
    assert len({cfg.client_id for _, cfg in clients}) == len(clients), "client ids must be unique"

    def target(address: str) -> tuple[str, dict] | None:
        host, port = address.rsplit(":", 1)
        short = host.split(".")[0]
        if host not in (short, f"{short}.{NAMESPACE}", f"{short}.{NAMESPACE}.svc",
                        f"{short}.{NAMESPACE}.svc.cluster.local") or short not in services:
            return None
        ports = {p["port"]: p["name"] for p in services[short]["spec"]["ports"]}
        assert ports.get(int(port)) == "grpc", f"{name}: {address} is not the grpc port of Service {short}"
        return short, servers[short]

    for w, cfg in clients:
        who = f"{name}: {w['metadata']['name']}"
        assert cfg.client_id == f"org-{cfg.env}" and w["metadata"]["name"] == f"client-agent-{cfg.env}", who
        env_server = target(cfg.env_server)
        assert env_server is not None, f"{who}: env server {cfg.env_server} is not a Service here"
        assert env_server[0] == f"env-server-{cfg.env}" and env_server[1].env_names == (cfg.env,), who
        agg = target(cfg.aggregator)
        if name in ONPREM:  # the federation's aggregator is someone else's
            assert agg is None and cfg.aggregator == "aggregator.federation.example.org:50060", who
            assert cfg.tls_cert and cfg.tls_ca and cfg.env_server_plain, f"{who}: mTLS to the remote aggregator"
            continue
        assert agg is not None and agg[0] == "aggregator", f"{who}: aggregator {cfg.aggregator}"
        aggregator = agg[1]
        assert (aggregator.start_clients or aggregator.min_clients) == len(clients), \
            "round 0 waits for every client of the federation"
        assert aggregator.min_clients < len(clients), "a later round goes on without a client lost for good"
        # TLS is all or nothing: a client talks TLS exactly when its servers serve it.
        assert bool(cfg.tls_cert) == bool(aggregator.tls_cert) == bool(env_server[1].tls_cert), who
        if cfg.tls_cert:
            assert not cfg.env_server_plain
            assert aggregator.allowed() == {c.client_id for _, c in clients}
            assert env_server[1].allowed() == {cfg.client_id}, f"{who}: an env server admits its own client only"


def secret_files(secret: dict) -> dict[str, bytes]:
    """A Secret's keys and their bytes (kustomize writes generated Secrets' values base64 in data)."""
    return {k: base64.b64decode(v) for k, v in secret.get("data", {}).items()} | \
        {k: v.encode() for k, v in secret.get("stringData", {}).items()}


def mounted_secret(w: dict, c: dict) -> str:
    return next(v["secret"]["secretName"] for _, _, v in mounts_of(w, c) if "secret" in v)


def test_certificates_name_what_is_dialled(scenario, configs):
    """Each workload mounts the certificate made for it: signed by the CA it is given, its key the
    certificate's, a client's naming its client id first for client authentication only, and the
    certificate of each server it dials naming the address dialled, for server authentication only."""
    name, docs = scenario
    secrets = {n: secret_files(s) for n, s in by_name(docs, "Secret").items()}
    if not secrets:
        pytest.skip(f"{name} makes no Secrets (the on-prem overlay's is created by hand)")
    by_workload = {w["metadata"]["name"]: secrets[mounted_secret(w, c)] for w, c, _ in configs}
    for w, c, cfg in configs:
        files = by_workload[w["metadata"]["name"]]
        cert = x509.load_pem_x509_certificate(files["tls.crt"])
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(files["ca.crt"]))
        key = serialization.load_pem_private_key(files["tls.key"], password=None)
        assert public_bytes(key.public_key()) == public_bytes(cert.public_key()), w["metadata"]["name"]
        assert not certs.is_ca(cert), f"{w['metadata']['name']} mounts a CA's certificate as its own"
        if module_of(c) != "services.client_agent":
            assert certs.purposes(cert) == ["server"], w["metadata"]["name"]
            continue
        assert certs.identity(cert) == cfg.client_id and certs.purposes(cert) == ["client"], w["metadata"]["name"]
        for address in (cfg.aggregator, cfg.env_server):
            host = address.rsplit(":", 1)[0]
            server = x509.load_pem_x509_certificate(by_workload[host.split(".")[0]]["tls.crt"])
            names = certs.san_texts(server)
            assert f"DNS:{host}" in names and certs.purposes(server) == ["server"], (host, names)
            assert f"DNS:{host.split('.')[0]}.{NAMESPACE}.svc.cluster.local" in names


# Secret keys that name a CA's private key file (fedse certs init's, openssl's, cert-manager's CA Secret's).
CA_KEY_NAMES = {"ca-key.pem", "ca.key", "ca-key", "ca.key.pem", "ca-private-key.pem"}
PEM_BLOCK = re.compile(rb"-----BEGIN ([A-Z0-9 ]+)-----.+?-----END \1-----", re.S)


def _texts(value, where: str):
    """(where, bytes) for every string in an object, a Secret's data decoded."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _texts(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _texts(v, f"{where}[{i}]")
    elif isinstance(value, str):
        yield where, value.encode()
        if ".data." in where:
            try:
                yield where, base64.b64decode("".join(value.split()), validate=True)  # kustomize wraps lines
            except ValueError:
                pass


def ca_key_holders(docs: list[dict]) -> list[str]:
    """Where the objects hold the CA's private key, or what would make a CA in the cluster: a private
    key whose public key is a CA certificate's (any in the objects), a Secret key named as a CA key
    file, a cert-manager CA Certificate, or a CA or self-signed Issuer."""
    cas, keys, found = set(), [], []
    for d in docs:
        what = f"{d['kind']}/{d['metadata']['name']}"
        for where, data in _texts(d, what):
            for block in PEM_BLOCK.finditer(data):
                if block[1] == b"CERTIFICATE":
                    cert = x509.load_pem_x509_certificate(block[0])
                    if certs.is_ca(cert):
                        cas.add(public_bytes(cert.public_key()))
                elif block[1].endswith(b"PRIVATE KEY"):
                    keys.append((where, block[0]))
        if d["kind"] == "Secret":
            found += [f"{what}: a key named {k}" for k in {*d.get("data", {}), *d.get("stringData", {})}
                      if k.lower() in CA_KEY_NAMES]
        spec = d.get("spec") or {}
        if (d["kind"] == "Certificate" and spec.get("isCA")) or (d["kind"] in ("Issuer", "ClusterIssuer")
                                                                   and ("ca" in spec or "selfSigned" in spec)):
            found.append(f"{what}: makes a CA in the cluster")
    for where, pem in keys:
        key = serialization.load_pem_private_key(pem, password=None)
        if public_bytes(key.public_key()) in cas:
            found.append(f"{where}: the CA's private key")
    return found


def test_no_object_holds_a_ca_private_key(scenario):
    """The CA key never sits where the aggregator runs: the cluster holds certificates made offline."""
    name, docs = scenario
    assert ca_key_holders(docs) == [], name
    secrets = [secret_files(s) for s in by_name(docs, "Secret").values()]
    if "mtls" in scenario_dirs().get(name, []):
        # Not vacuous: these hold every service's key and the CA's certificate, and nothing else.
        assert len(secrets) == 11 and all(certs.is_ca(x509.load_pem_x509_certificate(s["ca.crt"])) for s in secrets)
        assert all(b"PRIVATE KEY" not in s["ca.crt"] + s["tls.crt"] for s in secrets), name


def test_the_ca_key_check_finds_a_ca_key_put_in_the_cluster(scenario_tmp):
    """ca_key_holders is not vacuous: the CA key in place of a service's key, under a CA key's name, or
    a cert-manager CA, is each found."""
    docs = [json.loads(json.dumps(d)) for d in _render("mtls", scenario_tmp)]
    ca_key = (pathlib.Path(scenario_tmp) / "mtls" / "offline-ca" / "ca-key.pem").read_bytes()
    secret = by_name(docs, "Secret")["aggregator-tls"]
    secret["data"]["tls.key"] = base64.b64encode(ca_key).decode()
    assert ca_key_holders(docs) == ["Secret/aggregator-tls.data.tls.key: the CA's private key"]
    named = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "fedse-ca"}, "stringData": {"ca.key": "x"}}
    in_cluster = {"apiVersion": "cert-manager.io/v1", "kind": "Certificate", "metadata": {"name": "fedse-ca"},
                  "spec": {"isCA": True, "secretName": "fedse-ca"}}
    assert ca_key_holders([named, in_cluster]) == ["Secret/fedse-ca: a key named ca.key",
                                                   "Certificate/fedse-ca: makes a CA in the cluster"]


def test_jobs_finish_and_resume(scenario):
    name, docs = scenario
    for job in of_kind(docs, "Job"):
        # The agent exits 0 when the run is finished; a failed container restarts in place and
        # resumes from its state volume.
        assert pod_spec(job)["restartPolicy"] == "OnFailure"
        assert job["spec"].get("completions", 1) == 1 and job["spec"].get("parallelism", 1) == 1
        assert job["spec"]["backoffLimit"] >= 6


def test_gpu_component(scenario_tmp, tmp_path):
    docs = list(_render("gpu", scenario_tmp))
    for w, c in containers(docs):
        cfg = program_config(w, c, tmp_path)
        if module_of(c) != "services.client_agent":
            assert c["image"] == f"fedse:{__version__}"
            continue
        assert c["image"] == f"fedse-gpu:{__version__}"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert cfg.policy == "generate" and cfg.base_model.startswith("/models/") and cfg.device in ("", "cuda")
        assert cfg.scoring == "sum"  # as `fedse run --scoring auto` with a real model
        m = mount_for(w, c, cfg.base_model)
        assert m and m[1].get("readOnly") and m[2]["persistentVolumeClaim"]["claimName"] == "fedse-models"
        assert any(t.get("key") == "nvidia.com/gpu" for t in pod_spec(w).get("tolerations", []))
    assert by_name(docs, "PersistentVolumeClaim")["fedse-models"]["spec"]["accessModes"] == ["ReadOnlyMany"]


def test_demos_component_mounts_the_demonstration_file_into_every_client_agent(scenario_tmp):
    docs = list(_render("demos", scenario_tmp))
    agents = [(w, c) for w, c in containers(docs) if module_of(c) == "services.client_agent"]
    assert len(agents) == 5
    for w, c in agents:
        path = {e["name"]: e.get("value") for e in c["env"]}["FEDSE_DEMOS"]
        m = mount_for(w, c, path)
        assert m and m[1].get("readOnly") and m[2]["configMap"]["name"] == "fedse-demos", w["metadata"]["name"]


def test_monitoring_component(scenario_tmp):
    docs = list(_render("monitoring", scenario_tmp))
    (monitor,) = of_kind(docs, "PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    workloads = of_kind(docs, *WORKLOAD_KINDS)
    assert len(workloads) == 11
    for w in workloads:
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in selector.items()), f"{w['metadata']['name']} is not scraped"
        assert ports <= {p["name"] for c in pod_spec(w)["containers"] for p in c.get("ports", [])}
    dash = by_name(docs, "ConfigMap")["fedse-dashboard"]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    source = K8S / "components" / "monitoring" / "fedse-dashboard.json"
    assert json.loads(dash["data"]["fedse-dashboard.json"]) == json.loads(source.read_text())


def test_secure_aggregation_component_switches_on_the_aggregator_alone(scenario_tmp, tmp_path):
    from fedse.privacy.secagg import STRATEGIES

    def aggregator(name):
        (agg,) = [(w, c) for w, c in containers(list(_render(name, scenario_tmp)))
                  if module_of(c) == "services.aggregator"]
        return program_config(*agg, tmp_path)

    assert not aggregator("default").secure_aggregation and not aggregator("mtls").secure_aggregation
    for name in ("secure-aggregation", "secure-aggregation-over-mtls", "all-components"):
        cfg = aggregator(name)
        # What the aggregator's own configuration accepts with it: fedavg or weighted, two clients or more.
        assert cfg.secure_aggregation and cfg.strategy in STRATEGIES and cfg.min_clients >= 2, name
    # Over mTLS: the aggregator serves TLS and admits only the five client ids.
    cfg = aggregator("secure-aggregation-over-mtls")
    assert cfg.tls_cert and cfg.tls_ca and set(cfg.allowed_clients.split(",")) == {f"org-{e}" for e in ENVS}
    # Nothing else changes: the client agents follow the run's settings.
    def without_aggregator(name):  # each scenario has certificates of its own: a Secret as its keys
        return [d if d["kind"] != "Secret" else {**d, "data": sorted(d["data"])} for d in _render(name, scenario_tmp)
                if (d["kind"], d["metadata"]["name"]) != ("Deployment", "aggregator")]

    assert without_aggregator("secure-aggregation-over-mtls") == without_aggregator("mtls")
    assert without_aggregator("secure-aggregation") == without_aggregator("default")
    # Its header says mTLS is its precondition.
    header = (K8S / "components" / "secure-aggregation" / "kustomization.yaml").read_text().split("apiVersion")[0]
    assert "components/mtls" in header and "Precondition" in header


# ---- network policies -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Endpoint:
    name: str
    namespace: str
    labels: tuple  # sorted (key, value) pairs
    ns_labels: tuple
    ports: tuple  # (port, protocol, port name)
    ip: str = ""

    def label_dict(self) -> dict:
        return dict(self.labels)


def _matches(selector: dict | None, labels: dict) -> bool:
    if selector is None:
        return True
    assert set(selector) <= {"matchLabels"}, f"only matchLabels supported here: {selector}"
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _peer_matches(peer: dict, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        if other.namespace == NAMESPACE or not other.ip:
            return False  # pod traffic in the cluster is matched by selectors, not by ipBlock here
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(other.ip)
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(e) for e in block.get("except", []))
    if other.ip and not other.labels:
        return False  # not a pod
    if "namespaceSelector" in peer:
        if not _matches(peer["namespaceSelector"], dict(other.ns_labels)):
            return False
    elif other.namespace != NAMESPACE:
        return False
    return _matches(peer.get("podSelector"), other.label_dict())


def _port_matches(rule_ports: list | None, port: tuple) -> bool:
    if not rule_ports:
        return True
    number, protocol, pname = port
    for p in rule_ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        want = p.get("port")
        if want is None or want == number or (isinstance(want, str) and want == pname):
            return True
    return False


def _allowed(policies: list[dict], direction: str, subject: Endpoint, other: Endpoint, port: tuple) -> bool:
    """Whether `subject`'s policies allow traffic with `other` (ingress: from it, egress: to it) on port."""
    if subject.namespace != NAMESPACE:
        return True  # not ours to police
    kind = "Ingress" if direction == "ingress" else "Egress"
    selecting = [p for p in policies if _matches(p["spec"]["podSelector"], subject.label_dict())
                 and kind in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    peers_key = "from" if direction == "ingress" else "to"
    for p in selecting:
        for rule in p["spec"].get(direction, []) or []:
            peers = rule.get(peers_key)
            if (not peers or any(_peer_matches(peer, other) for peer in peers)) and \
                    _port_matches(rule.get("ports"), port):
                return True
    return False


def endpoints(docs: list[dict]) -> list[Endpoint]:
    ns_labels = (("kubernetes.io/metadata.name", NAMESPACE),)
    out = []
    for w in of_kind(docs, *WORKLOAD_KINDS):
        labels = tuple(sorted(w["spec"]["template"]["metadata"]["labels"].items()))
        ports = tuple((p["containerPort"], p.get("protocol", "TCP"), p["name"])
                      for c in pod_spec(w)["containers"] for p in c.get("ports", []))
        out.append(Endpoint(w["metadata"]["name"], NAMESPACE, labels, ns_labels, ports))
    out += [
        Endpoint("kube-dns", "kube-system", (("k8s-app", "kube-dns"),),
                 (("kubernetes.io/metadata.name", "kube-system"),), ((53, "UDP", "dns"), (53, "TCP", "dns-tcp"))),
        Endpoint("prometheus", "monitoring", (("app.kubernetes.io/name", "prometheus"),),
                 (("kubernetes.io/metadata.name", "monitoring"),), ((9090, "TCP", "web"),)),
        Endpoint("other-pod", "default", (("app", "other"),), (("kubernetes.io/metadata.name", "default"),),
                 ((50060, "TCP", "grpc"), (50051, "TCP", "grpc2"))),
        # An address outside the cluster (documentation range), e.g. a remote aggregator.
        Endpoint("internet", "", (), (), ((50060, "TCP", ""), (443, "TCP", "")), ip="203.0.113.7"),
    ]
    return out


def reachable(docs: list[dict]) -> set[tuple[str, str, int]]:
    policies = of_kind(docs, "NetworkPolicy")
    eps = endpoints(docs)
    out = set()
    for src in eps:
        for dst in eps:
            if src is dst or (src.namespace != NAMESPACE and dst.namespace != NAMESPACE):
                continue
            for port in dst.ports:
                if _allowed(policies, "egress", src, dst, port) and _allowed(policies, "ingress", dst, src, port):
                    out.add((src.name, dst.name, port[0]))
    return out


def test_network_policies_allow_exactly_the_federations_links(scenario_tmp):
    for name in ("network-policies", "all-components"):
        docs = list(_render(name, scenario_tmp))
        assert {"default-deny-all"} <= set(by_name(docs, "NetworkPolicy"))
        expected = set()
        for e in ENVS:
            expected |= {(f"client-agent-{e}", f"env-server-{e}", 50051), (f"client-agent-{e}", "aggregator", 50060),
                         (f"client-agent-{e}", "kube-dns", 53)}
        for w in of_kind(docs, *WORKLOAD_KINDS):
            expected.add(("prometheus", w["metadata"]["name"], 9100))
        got = reachable(docs)
        assert got == expected, f"{name}: links not allowed {sorted(expected - got)}, links allowed too {sorted(got - expected)}"


def test_onprem_network_policies(scenario_tmp):
    for name, env in ONPREM.items():
        docs = list(_render(name, scenario_tmp))
        agent = f"client-agent-{env}"
        expected = {(agent, f"env-server-{env}", 50051), (agent, "kube-dns", 53), (agent, "internet", 50060)}
        got = reachable(docs)
        assert got == expected, \
            f"{name}: links not allowed {sorted(expected - got)}, links allowed too {sorted(got - expected)}"


def test_onprem_runs_any_pair_on_a_gpu_with_the_model_from_a_node(scenario_tmp, tmp_path):
    for name, env in ONPREM.items():
        docs = list(_render(name, scenario_tmp))
        assert set(by_name(docs, "Deployment")) == {f"env-server-{env}"}, name
        (job,) = of_kind(docs, "Job")
        (c,) = pod_spec(job)["containers"]
        cfg = program_config(job, c, tmp_path)
        assert (cfg.env, cfg.client_id, cfg.env_server) == (env, f"org-{env}", f"env-server-{env}:50051"), name
        assert c["image"] == f"fedse-gpu:{__version__}" and c["resources"]["limits"]["nvidia.com/gpu"] == 1, name
        # The federation's base model, set in the overlay, from the models volume; summed scores, as
        # `fedse run --scoring auto` gives a real model in every environment.
        assert cfg.base_model == "/models/Qwen2.5-7B-Instruct" and cfg.scoring == "sum", name
        mount = mount_for(job, c, cfg.base_model)
        assert mount and mount[1].get("readOnly") and mount[2]["persistentVolumeClaim"]["claimName"] == "fedse-models"
        # That claim is bound to the directory on the labelled GPU node, not to a volume a default
        # StorageClass would provision empty.
        claim = by_name(docs, "PersistentVolumeClaim")["fedse-models"]["spec"]
        volume = by_name(docs, "PersistentVolume")[claim["volumeName"]]["spec"]
        assert claim["storageClassName"] == volume["storageClassName"] == "", name
        assert set(claim["accessModes"]) <= set(volume["accessModes"]), name
        assert volume["local"]["path"] == "/srv/fedse/models" and volume["persistentVolumeReclaimPolicy"] == "Retain"
        (term,) = volume["nodeAffinity"]["required"]["nodeSelectorTerms"]
        assert term["matchExpressions"] == [{"key": "fedse.io/models", "operator": "In", "values": ["true"]}]


def test_onprem_requires_secure_aggregation_and_the_base_leaves_it_to_the_run(scenario_tmp, tmp_path):
    """An organisation's protection is its own setting: its client agent refuses a run that is not
    secure. The federation one operator runs (the base, with or without the secure-aggregation
    component, which switches on the aggregator alone) leaves its clients to follow the run."""
    for name in ONPREM:
        (job,) = of_kind(list(_render(name, scenario_tmp)), "Job")
        (c,) = pod_spec(job)["containers"]
        assert env_of(c).get("FEDSE_REQUIRE_SECURE_AGGREGATION") == "true", name
        assert program_config(job, c, tmp_path).require_secure_aggregation, name
    for name in ("default", "secure-aggregation", "secure-aggregation-over-mtls", "all-components"):
        agents = [(w, c) for w, c in containers(list(_render(name, scenario_tmp)))
                  if module_of(c) == "services.client_agent"]
        assert agents and not any(program_config(w, c, tmp_path).require_secure_aggregation for w, c in agents), name


def test_without_network_policies_everything_is_open(scenario_tmp):
    # The evaluator above is not vacuous: with no policies every pair of endpoints connects.
    docs = list(_render("default", scenario_tmp))
    assert ("other-pod", "aggregator", 50060) in reachable(docs)
    assert ("aggregator", "internet", 443) in reachable(docs)


# ---- images -----------------------------------------------------------------------------------------
def test_dockerfile_multi_stage_non_root_and_pinned(scenario_tmp):
    text = (REPO / "docker" / "Dockerfile").read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2, "multi-stage"
    user = re.findall(r"^USER (\d+)(?::(\d+))?$", text, re.M)
    assert user and user[-1][0] != "0", "runs as a numeric non-root user"
    assert "-r requirements.txt" in text and "grep -E '^torch==' requirements.txt" in text
    assert any(line.startswith("torch==") for line in (REPO / "requirements.txt").read_text().splitlines())
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    ignore = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert ignore[0] == "*" and {"!fedse/", "!services/", "!requirements.txt"} <= set(ignore), "send only what is built"
    # The pods run as the image's user.
    uid = int(user[-1][0])
    for w, c in containers(list(_render("default", scenario_tmp))):
        assert pod_spec(w)["securityContext"]["runAsUser"] == uid
    makefile = (REPO / "Makefile").read_text()
    # Docker where a daemon answers, else podman; the machine's particulars are settings, not edits.
    assert re.search(r"^images:", makefile, re.M) and "scripts/build-image.sh" in makefile
    script = (REPO / "scripts" / "build-image.sh").read_text()
    assert "docker info" in script and "podman" in script
    assert "RUN python3 -m venv" in text and "py312_intrinsics" in text, "builds on a base without `python`"
    assert "--mount=type=secret,id=pip.conf" in text and "COPY --from=build /opt/fedse /opt/fedse" in text


def test_the_environments_guide_runs_an_own_env_server_image_with_demos_on_prem(tmp_path):
    """docs/environments.md's patch, added to a copy of the on-prem overlay with the demos component,
    runs the organisation's image and spec in the env server; the client gets the demos file."""
    guide = (REPO / "docs" / "environments.md").read_text()
    block = re.search(r"```yaml\n# k8s/overlays/onprem/kustomization.yaml, under patches:\n(.*?)```", guide, re.S)
    shutil.copytree(K8S, tmp_path / "k8s")
    overlay = tmp_path / "k8s" / "overlays" / "onprem" / "kustomization.yaml"
    config = yaml.safe_load(overlay.read_text())
    config["patches"] += yaml.safe_load(block.group(1))
    config["components"] = [*config.get("components", []), "../../components/demos"]
    overlay.write_text(yaml.safe_dump(config, sort_keys=False))
    docs = kustomize(overlay.parent)
    env_server = by_name(docs, "Deployment")["env-server-maze"]["spec"]["template"]["spec"]["containers"][0]
    assert env_server["image"] == "registry.example.org/my-env-server:1.0"
    assert {e["name"]: e.get("value") for e in env_server["env"]}["FEDSE_ENVS"] == "countdown?largest=20"
    agent = by_name(docs, "Job")["client-agent-maze"]["spec"]["template"]["spec"]["containers"][0]
    assert {e["name"]: e.get("value") for e in agent["env"]}["FEDSE_DEMOS"] == "/etc/fedse/demos/demos.jsonl"

"""The Kubernetes manifests (k8s/), without a cluster: every scenario builds, and its objects are
valid Kubernetes; the default is the whole CPU federation; the image the pods run.

Every scenario is built with `kubectl kustomize` (k8s_support: the default federation, each
component on top of it, components that belong together, all components together, and the on-prem
overlay for each environment). Every rendered object of a core Kubernetes kind is validated,
offline, against the Kubernetes OpenAPI schemas that `kubernetes-validate` ships (strict: unknown
fields fail). Custom resources (the Prometheus Operator's PodMonitor) are not in those schemas: they
are checked structurally here (apiVersion, kind, the fields their controllers need).

The rest of the manifests' checks: tests/test_k8s_policy.py (containers, probes, ports, claims,
Secrets, links), tests/test_k8s_certificates.py (the mtls component's certificates, no CA key in the
cluster), tests/test_k8s_components.py (each component and the on-prem overlay) and
tests/test_k8s_network.py (the network policies).
"""

from __future__ import annotations

import functools
import json
import re
import shutil

import yaml

from fedse import __version__

from k8s_support import (CLUSTER_KINDS, COMPONENTS, ENVS, K8S_VERSIONS, NAMESPACE, NEEDS_KUBECTL, _render, by_name,
                         containers, env_of, of_kind, pod_spec, scenario, scenario_tmp)  # noqa: F401 - fixtures
from support import K8S, REPO, kustomize

pytestmark = NEEDS_KUBECTL


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

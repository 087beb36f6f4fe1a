"""The Kubernetes manifests' optional components and the on-prem overlay, without a cluster: the
gpu, demos, monitoring and secure-aggregation components each change what they are for; the on-prem
overlay runs any environment's pair on a GPU with the model from a node, and requires secure
aggregation where the federation's own base leaves it to the run.
"""

from __future__ import annotations

import json

from fedse import __version__

from k8s_support import (ENVS, NEEDS_KUBECTL, ONPREM, WORKLOAD_KINDS, _render, by_name, containers, env_of,
                         module_of, mount_for, of_kind, pod_spec, program_config,
                         scenario_tmp)  # noqa: F401 - fixtures
from support import K8S

pytestmark = NEEDS_KUBECTL


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

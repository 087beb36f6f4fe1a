"""The Kubernetes manifests' policy, in every scenario (k8s_support), without a cluster.

Every container runs non-root with a read-only root filesystem, no privilege escalation and no
capabilities, with requests and limits; every probe is a native gRPC probe on a port that serves
grpc.health.v1 (a plain one when the service serves TLS); Service ports are named and point at the
ports the programs listen on; every volume claim exists; the flags and FEDSE_* variables are ones
the programs know (parsed by the programs' own configuration classes); every Secret is made in the
build or documented; the links (client -> its env server, client -> aggregator) resolve to
Services; and the Jobs finish and resume.
"""

from __future__ import annotations

from k8s_support import (EXTERNAL_SECRETS, NAMESPACE, NEEDS_KUBECTL, ONPREM, TLS_SECRET_KEYS, WORKLOAD_KINDS,
                         by_name, configs, containers, env_of, health_ports, listening_ports, module_of,
                         mount_for, of_kind, pod_spec, scenario, scenario_tmp)  # noqa: F401 - fixtures

pytestmark = NEEDS_KUBECTL


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
        # A StatefulSet's pods each get a claim of their own (client hosts); no other workload makes claims.
        assert w["kind"] == "StatefulSet" or not w["spec"].get("volumeClaimTemplates")
    assert used == set(claims), f"{name}: unused claims {set(claims) - used}"
    for w, c, cfg in configs:
        if hasattr(cfg, "state_dir"):
            m = mount_for(w, c, cfg.state_dir)
            assert m and "persistentVolumeClaim" in m[2] and not m[1].get("readOnly"), \
                f"{name}: {w['metadata']['name']}'s state dir {cfg.state_dir} is not on a writable volume claim"
            pvc = m[2]["persistentVolumeClaim"]
            claim = pvc["template"] if "template" in pvc else claims[pvc["claimName"]]
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
    clients = [(w, cfg) for w, c, cfg in configs if module_of(c) in ("services.client_agent", "services.client_host")]
    assert clients, name
    assert len({cfg.client_id for _, cfg in clients}) == len(clients), "client ids must be unique"
    # A client host's members are clients too (tests/test_k8s_hosts.py checks them).
    joining = sum(cfg.members_total if hasattr(cfg, "members_total") else 1 for _, cfg in clients)

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
        kind = "client-host" if w["kind"] == "StatefulSet" else "client-agent"
        assert cfg.client_id == f"org-{cfg.env}" and w["metadata"]["name"] == f"{kind}-{cfg.env}", who
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
        assert (aggregator.start_clients or aggregator.min_clients) == joining, \
            "round 0 waits for every client of the federation"
        assert aggregator.min_clients < joining, "a later round goes on without a client lost for good"
        # TLS is all or nothing: a client talks TLS exactly when its servers serve it.
        assert bool(cfg.tls_cert) == bool(aggregator.tls_cert) == bool(env_server[1].tls_cert), who
        if cfg.tls_cert:
            assert not cfg.env_server_plain
            assert aggregator.allowed() == {c.client_id for _, c in clients}
            assert env_server[1].allowed() == {cfg.client_id}, f"{who}: an env server admits its own client only"


def test_jobs_finish_and_resume(scenario):
    name, docs = scenario
    for job in of_kind(docs, "Job"):
        # The agent exits 0 when the run is finished; a failed container restarts in place and
        # resumes from its state volume.
        assert pod_spec(job)["restartPolicy"] == "OnFailure"
        assert job["spec"].get("completions", 1) == 1 and job["spec"].get("parallelism", 1) == 1
        assert job["spec"]["backoffLimit"] >= 6

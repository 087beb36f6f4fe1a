"""The container image, built from docker/Dockerfile here and run the way k8s/ runs it: does the
image hold a federation that completes a round?

Built with podman (`scripts/build-image.sh`, as `make images` builds without a Docker daemon) on a
base made from Debian's packages (`scripts/debian-base-image.sh`, kept for later runs), the CPU image
as the manifests deploy it. This machine's particulars are the build's parameters, never the
Dockerfile's: the OCI runtime (runc, which also runs on kernels mixing cgroup v1 and v2), resource
limits no higher than this process holds, the CA bundle this machine's pip trusts (a build secret,
in no layer), and torch's CPU wheel from a local index where this machine's pip has one (else
PyTorch's CPU index, the Dockerfile's default). FEDSE_IMAGE_RUNTIME, FEDSE_IMAGE_ULIMITS,
FEDSE_IMAGE_CA_BUNDLE and FEDSE_IMAGE_TORCH_INDEX_URL override them; FEDSE_IMAGE names an image
built before (`make images`) to test instead of building one.

Then the maze pair and the aggregator of `kubectl kustomize k8s/` each run in a container of their
own, from the rendered Deployment or Job, with nothing of the manifests changed but what only a
cluster provides:
- command, args and env exactly as rendered (plus the budget flags of tests/support.py's BUDGET, and
  --start-clients=1 --min-clients=1 on the aggregator since one of the five pairs runs: a round's
  size, not its wiring);
- the pod's securityContext merged with the container's: runAsUser/runAsGroup as --user, fsGroup as a
  supplementary group, readOnlyRootFilesystem as --read-only (and no tmpfs podman would add itself),
  allowPrivilegeEscalation: false as no-new-privileges, capabilities dropped and added, the
  RuntimeDefault seccomp profile as podman's default one; resources.limits as --cpus and --memory;
- volumes: an emptyDir as a tmpfs of its sizeLimit, a PersistentVolumeClaim as a directory here
  owned by the pod's user and fsGroup;
- each pod has a network namespace and an address of its own on a podman bridge network, so every
  container listens on the ports its manifest names (0.0.0.0:50060, metrics 9100 in each); a
  Service's names (aggregator, aggregator.fedse.svc.cluster.local, ...) resolve, in the pods that
  dial them, to the address of the one pod the Service selects;
- probes: grpc.health.v1 on each probe's port of the pod's address, until SERVING, before the client
  agent starts (as a rollout would); every metrics port is scraped.
The client agent explores, trains its LoRA adapter and uploads it; the aggregator aggregates; the
test downloads round 1's global adapter from the aggregator over gRPC and reads its state volume,
expects the Job's container to exit 0, then stops the servers with SIGTERM as a pod deletion does
and expects a clean exit 0 within the grace period.

The build goes to podman storage of the test's own, in memory where there is room (/dev/shm), so
the machine's images and build cache are neither used nor touched; it is removed at the end with
the containers and the network. Only the base image stays, in the machine's storage, for later
runs. Skips only where podman cannot be had (no apt-get, or not root: scripts/install-podman.sh,
which `make test` runs, installs it).
"""

from __future__ import annotations

import json
import os
import pathlib
import resource
import shutil
import subprocess
import tempfile
import time
import uuid

import pytest

from support import (BUDGET, KUBECTL, NAMESPACE, OWN_METRICS, REPO, http_get, kustomize, probe_ports, service_module,
                     serving)

BASE_IMAGE = os.environ.get("FEDSE_IMAGE_BASE", "localhost/fedse-base:bookworm")
PAIR = "maze"
RUN_TIMEOUT_S = 420.0
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")
KUBERNETES_GRACE_S = 30  # terminationGracePeriodSeconds' default; the manifests set none

pytestmark = [
    pytest.mark.slow,
    # The build (a few minutes on 2 cores) is part of the first test's setup.
    pytest.mark.timeout(1500),
    pytest.mark.skipif(KUBECTL is None, reason="kubectl not found (needed for `kubectl kustomize`)"),
]


def why_no_podman() -> str | None:
    if shutil.which("podman") is None:
        return ("podman is not installed (scripts/install-podman.sh installs Debian's podman, runc and "
                "mmdebstrap; it needs apt-get and root)")
    if os.geteuid() != 0:
        return "not root: the image test runs rootful podman (bridge networking, base image by mmdebstrap)"
    return None


def runtime() -> str:
    return os.environ.get("FEDSE_IMAGE_RUNTIME", "runc")


def ulimits() -> list[str]:
    """Limits every machine can grant its containers: open files at this process's own hard limit
    (podman's default, 1048576, cannot be set where that is lower, as in a sandbox), processes at
    podman's usual 32768."""
    if "FEDSE_IMAGE_ULIMITS" in os.environ:
        return os.environ["FEDSE_IMAGE_ULIMITS"].split()
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = 1048576 if nofile == resource.RLIM_INFINITY else min(nofile, 1048576)
    return [f"nofile={nofile}:{nofile}", "nproc=32768:32768"]


def pip_ca_bundle() -> str:
    """The CA bundle this machine's pip trusts (PIP_CERT or pip's `cert` setting), if any."""
    if "FEDSE_IMAGE_CA_BUNDLE" in os.environ:
        return os.environ["FEDSE_IMAGE_CA_BUNDLE"]
    if os.environ.get("PIP_CERT"):
        return os.environ["PIP_CERT"]
    out = subprocess.run([shutil.which("python3") or "python3", "-m", "pip", "config", "list"],
                         capture_output=True, text=True).stdout
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".cert"):
            return value.strip().strip("'\"")
    return ""


# The test's own podman storage (see scratch_store), for every podman call once the fixture made it.
STORE_ENV: dict[str, str] = {}
SCRATCH_PREFIX = "fedse-image-test-"
BUILD_PEAK_BYTES = 6 << 30  # the build holds about 3.5 GB at its peak; the running services ~2 GB more


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["podman", "--runtime", runtime(), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **STORE_ENV})
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:3])} ... failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def scratch_parent() -> pathlib.Path:
    """/dev/shm where it has room: image layers commit much faster in memory than on this disk (a
    build of 150 s instead of 200-250 s) and are gone in a second, where deleting them from disk took
    a minute; else /var/tmp."""
    shm = pathlib.Path("/dev/shm")
    try:
        st = os.statvfs(shm)
        meminfo = dict(line.split(":", 1) for line in pathlib.Path("/proc/meminfo").read_text().splitlines())
        available = int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return pathlib.Path("/var/tmp")
    if st.f_bavail * st.f_frsize >= BUILD_PEAK_BYTES and available >= BUILD_PEAK_BYTES:
        return shm
    return pathlib.Path("/var/tmp")


def remove_scratch(root: pathlib.Path) -> None:
    """A scratch store and whatever is still mounted below it."""
    mounts = [line.split()[1] for line in pathlib.Path("/proc/self/mounts").read_text().splitlines()]
    for target in sorted((m for m in mounts if m.startswith(f"{root}/")), key=len, reverse=True):
        subprocess.run(["umount", "--lazy", target], capture_output=True)
    shutil.rmtree(root, ignore_errors=True)


def remove_stale_scratch() -> None:
    """Scratch stores of earlier runs that were killed before their cleanup (the pid in the name)."""
    for parent in {pathlib.Path("/dev/shm"), pathlib.Path("/var/tmp")}:
        for old in parent.glob(f"{SCRATCH_PREFIX}*"):
            pid = old.name[len(SCRATCH_PREFIX):].split("-")[0]
            if pid.isdigit() and not pathlib.Path(f"/proc/{pid}").exists():
                remove_scratch(old)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """The CPU image, built here into podman storage of the test's own (the machine's images and
    build cache are neither used nor touched), all of it removed at the end; only the base image,
    made once from Debian's packages, stays in the machine's storage for later runs."""
    reason = why_no_podman()
    if reason:
        pytest.skip(reason)
    if os.environ.get("FEDSE_IMAGE"):  # an image built before (make images): tested as it is, kept
        yield os.environ["FEDSE_IMAGE"]
        return
    base = subprocess.run(["sh", str(REPO / "scripts/debian-base-image.sh")], capture_output=True, text=True,
                          env={**os.environ, "BUILDER": "podman", "BASE_IMAGE": BASE_IMAGE}, timeout=900)
    assert base.returncode == 0, f"scripts/debian-base-image.sh failed:\n{base.stderr[-3000:]}"

    remove_stale_scratch()
    root = pathlib.Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-", dir=scratch_parent()))
    tag = "localhost/fedse:test"
    log = tmp_path_factory.mktemp("image") / "build.log"
    try:
        (root / "storage.conf").write_text(
            f'[storage]\ndriver = "overlay"\ngraphroot = "{root}/graph"\nrunroot = "{root}/run"\n')
        podman("save", "--output", str(root / "base.tar"), BASE_IMAGE, timeout=300)
        STORE_ENV["CONTAINERS_STORAGE_CONF"] = str(root / "storage.conf")
        podman("load", "--quiet", "--input", str(root / "base.tar"), timeout=300)
        (root / "base.tar").unlink()

        settings = {"BUILDER": "podman", "PYTHON_IMAGE": BASE_IMAGE, "RUNTIME": runtime(),
                    "ULIMITS": " ".join(ulimits()), "CA_BUNDLE": pip_ca_bundle(),
                    "TORCH_INDEX_URL": os.environ.get("FEDSE_IMAGE_TORCH_INDEX_URL", "local"), "TMPDIR": str(root),
                    # A fresh store has no cache to reuse: no layer per step (a third faster, half the storage).
                    "BUILD_FLAGS": "--layers=false"}
        start = time.monotonic()

        def build() -> int:
            with open(log, "a") as out:
                return subprocess.run(["sh", str(REPO / "scripts/build-image.sh"), tag, "cpu"], stdout=out,
                                      stderr=subprocess.STDOUT, env={**os.environ, **STORE_ENV, **settings},
                                      timeout=1200).returncode

        rc = build()
        if rc == 3 and settings["TORCH_INDEX_URL"] == "local":  # this machine's pip has no CPU wheel
            settings["TORCH_INDEX_URL"] = ""  # the Dockerfile's default: PyTorch's CPU index
            rc = build()
        build_s = time.monotonic() - start
        assert rc == 0, f"the image build failed ({rc}):\n{log.read_text()[-6000:]}"
        # The build stage's layers are not part of the image: freed before the services run.
        podman("image", "prune", "--force", timeout=300)
        size = json.loads(podman("image", "inspect", tag).stdout)[0]["Size"]
        print(f"\nimage {tag}: built in {build_s:.0f} s, {size / 1e9:.2f} GB")
        yield tag
    finally:
        if STORE_ENV:
            podman("rm", "--all", "--force", "--time", "0", check=False)
            podman("rmi", "--all", "--force", check=False, timeout=300)
        STORE_ENV.clear()
        remove_scratch(root)


# ---- the test federation ---------------------------------------------------------------------------

class Pod:
    """One rendered workload's container, run by podman in a network namespace of its own."""

    def __init__(self, doc: dict, root: pathlib.Path, prefix: str):
        self.name = doc["metadata"]["name"]
        self.kind = doc["kind"]
        self.labels = doc["spec"]["template"]["metadata"]["labels"]
        self.spec = doc["spec"]["template"]["spec"]
        assert len(self.spec["containers"]) == 1 and not self.spec.get("initContainers"), self.name
        self.container = self.spec["containers"][0]
        self.root = root / self.name
        self.container_name = f"{prefix}-{self.name}"
        self.ip: str | None = None
        self.extra: list[str] = []
        self.claims: dict[str, pathlib.Path] = {}  # mountPath -> directory here

    @property
    def module(self) -> str:
        return service_module(self.container["command"])

    def port(self, name: str) -> int:
        return next(p["containerPort"] for p in self.container["ports"] if p["name"] == name)

    def env(self, name: str) -> str:
        return next(e["value"] for e in self.container["env"] if e["name"] == name)

    def run_args(self, image: str, network: str, hosts: dict[str, str]) -> list[str]:
        """`podman run` for this container as the kubelet would run it (see the module docstring)."""
        c, spec = self.container, self.spec
        sc = {**spec.get("securityContext", {}), **c.get("securityContext", {})}
        user = sc.get("runAsUser")
        assert sc.get("runAsNonRoot") and user not in (None, 0), f"{self.name}: runs as root"
        args = ["run", "--detach", "--name", self.container_name, "--network", network, "--hostname", self.name,
                "--user", f"{user}:{sc.get('runAsGroup', user)}"]
        if "fsGroup" in sc:
            args += ["--group-add", str(sc["fsGroup"])]
        if sc.get("readOnlyRootFilesystem"):
            args += ["--read-only", "--read-only-tmpfs=false"]
        if sc.get("allowPrivilegeEscalation") is False:
            args += ["--security-opt", "no-new-privileges"]
        for cap in sc.get("capabilities", {}).get("drop", []):
            args += ["--cap-drop", cap]
        for cap in sc.get("capabilities", {}).get("add", []):
            args += ["--cap-add", cap]
        assert sc.get("seccompProfile", {}).get("type", "RuntimeDefault") == "RuntimeDefault", self.name
        for u in ulimits():
            args += ["--ulimit", u]
        limits = c.get("resources", {}).get("limits", {})
        if "cpu" in limits:
            cpu = str(limits["cpu"])
            args += ["--cpus", str(int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu))]
        if "memory" in limits:
            args += ["--memory", str(limits["memory"]).replace("Gi", "g").replace("Mi", "m")]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for m in c.get("volumeMounts", []):
            v = volumes[m["name"]]
            if "emptyDir" in v:
                size = v["emptyDir"].get("sizeLimit", "")
                opts = "rw,exec,nosuid,nodev,mode=1777" + (f",size={size.replace('Gi', 'g').replace('Mi', 'm')}"
                                                           if size else "")
                args += ["--tmpfs", f"{m['mountPath']}:{opts}"]
            elif "persistentVolumeClaim" in v:
                local = self.root / "claims" / v["persistentVolumeClaim"]["claimName"]
                local.mkdir(parents=True)
                os.chown(local, user, sc.get("fsGroup", sc.get("runAsGroup", user)))
                self.claims[m["mountPath"]] = local
                args += ["--volume", f"{local}:{m['mountPath']}:rw"]
            else:
                raise AssertionError(f"{self.name}: volume {m['name']} of a kind this test does not emulate")
        for e in c.get("env", []):
            assert "value" in e, f"{self.name}: {e['name']} has no literal value"
            args += ["--env", f"{e['name']}={e['value']}"]
        for host, ip in sorted(hosts.items()):
            args += ["--add-host", f"{host}:{ip}"]
        args += ["--entrypoint", json.dumps(c["command"]), image, *c.get("args", []), *BUDGET[self.module],
                 *self.extra]
        return args

    def state(self) -> tuple[str, int | None]:
        out = podman("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", self.container_name).stdout.split()
        return out[0], (int(out[1]) if out[0] == "exited" else None)

    def logs(self) -> str:
        proc = podman("logs", self.container_name, check=False)
        return (proc.stdout + proc.stderr)[-4000:]


def service_hosts(docs: list[dict], pods: list[Pod]) -> dict[str, str]:
    """Every name of every Service that selects one of `pods`, mapped to that pod's address. A name
    stands in for the Service's port only where it equals the container port it targets."""
    hosts = {}
    for svc in (d for d in docs if d["kind"] == "Service"):
        selected = [p for p in pods if all(p.labels.get(k) == v for k, v in svc["spec"]["selector"].items())]
        if not selected:
            continue
        assert len(selected) == 1, f"Service {svc['metadata']['name']} selects {[p.name for p in selected]}"
        (pod,) = selected
        for sp in svc["spec"]["ports"]:
            target = sp.get("targetPort", sp["port"])
            if isinstance(target, str):
                target = pod.port(target)
            assert target == sp["port"], f"Service {svc['metadata']['name']}: port {sp['port']} -> {target}"
        name = svc["metadata"]["name"]
        for host in (name, f"{name}.{NAMESPACE}", f"{name}.{NAMESPACE}.svc", f"{name}.{NAMESPACE}.svc.cluster.local"):
            hosts[host] = pod.ip
    return hosts


def watch(pods: list[Pod], seen: dict[str, str], deadline: float, until_exit: bool) -> None:
    """Polls each pod's probes on its address (as the kubelet does) and scrapes its metrics once it is
    SERVING; returns once every pod was seen serving (and, with until_exit, every one exited)."""
    while time.monotonic() < deadline:
        exited = True
        for pod in pods:
            status, rc = pod.state()
            if rc not in (None, 0) or (rc == 0 and pod.kind != "Job"):
                pytest.fail(f"{pod.name} exited with {rc}:\n{pod.logs()}")
            exited = exited and rc is not None
            if pod.name not in seen and status == "running" and \
                    all(serving(f"{pod.ip}:{p}") for p in probe_ports(pod.container)):
                try:
                    text = http_get(f"http://{pod.ip}:{pod.port('metrics')}/metrics")
                except OSError:
                    continue  # e.g. the client agent exiting right then; polled again
                # Its own metrics appear once its modules are loaded (health answers SERVING for ""
                # from the start).
                if OWN_METRICS[pod.module] in text:
                    seen[pod.name] = text
        if all(p.name in seen for p in pods) and (exited or not until_exit):
            return
        time.sleep(0.5)
    pytest.fail(f"timed out; not yet serving: {[p.name for p in pods if p.name not in seen]}:\n"
                + "\n".join(f"--- {p.name}\n{p.logs()}" for p in pods))


def test_image_runs_a_federation_round_as_the_manifests_do(image, tmp_path):
    """The aggregator and the maze pair of k8s/, each in a container of the image, complete a round."""
    docs = kustomize(REPO / "k8s")
    prefix = f"fedse-test-{uuid.uuid4().hex[:8]}"
    pods = [Pod(d, tmp_path, prefix) for d in docs if d["kind"] in WORKLOAD_KINDS]
    pods = [p for p in pods if p.labels.get("fedse.io/env", "") in (PAIR, "")]
    servers = [p for p in pods if p.kind != "Job"]
    clients = [p for p in pods if p.kind == "Job"]
    assert sorted(p.module for p in pods) == ["services.aggregator", "services.client_agent", "services.env_server"]
    for pod in pods:  # the CPU image, which this test built, is what every one of them runs
        assert pod.container["image"].rsplit(":", 1)[0] == "fedse", pod.container["image"]
    (aggregator,) = [p for p in servers if p.module == "services.aggregator"]
    aggregator.extra = ["--start-clients=1", "--min-clients=1"]

    network = prefix
    podman("network", "create", network)
    seen: dict[str, str] = {}
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for pod in servers:
            podman(*pod.run_args(image, network, {}))
            pod.ip = podman("inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                            pod.container_name).stdout.strip()
            assert pod.ip, pod.name
        watch(servers, seen, deadline, until_exit=False)  # ready before the client agent starts
        hosts = service_hosts(docs, servers)
        assert {"aggregator", f"env-server-{PAIR}"} <= hosts.keys()
        for pod in clients:
            podman(*pod.run_args(image, network, hosts))
            pod.ip = podman("inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                            pod.container_name).stdout.strip()
        watch(clients, seen, deadline, until_exit=True)
        for pod in clients:
            assert pod.state() == ("exited", 0) and "run complete" in pod.logs(), pod.logs()
        for pod in pods:  # each served its own metrics and gRPC's on the port its manifest names
            assert OWN_METRICS[pod.module] in seen[pod.name] and "grpc_server_handled_total" in seen[pod.name]

        # Round 0's aggregate (the global adapter of round 1), downloadable from the aggregator in the
        # image, and on its state volume.
        from services.client_agent.federation.link import FederationClient

        fed = FederationClient(f"{aggregator.ip}:{aggregator.port('grpc')}", "image-test", retries=2, timeout_s=60)
        try:
            global_adapter = fed.download(1)
        finally:
            fed.close()
        assert global_adapter.round == 1 and len(global_adapter.adapter()) > 0
        metrics = http_get(f"http://{aggregator.ip}:{aggregator.port('metrics')}/metrics")
        assert 'fedse_aggregator_uploads_total{outcome="accepted"} 1.0' in metrics
        run_id = aggregator.env("FEDSE_RUN_ID")
        state = aggregator.claims["/state"] / run_id
        final = state / "global" / "round_0001"
        assert (final / "adapter_model.safetensors").stat().st_size > 0 and (final / "adapter_config.json").exists()
        (client,) = clients
        client_id = client.env("FEDSE_CLIENT_ID")
        reports = [json.loads(line) for line in (state / "metrics.jsonl").read_text().splitlines() if line]
        assert {(r["client_id"], r["round"]) for r in reports} == {(client_id, 0), (client_id, 1)}
        progress = json.loads((client.claims["/state"] / client_id / "progress.json").read_text())
        assert (progress["run_id"], progress["round"], progress["phase"]) == (run_id, 1, "reported")
        # Written by the pod's user: the claims' files belong to it, not to root.
        assert (final / "adapter_model.safetensors").stat().st_uid == aggregator.spec["securityContext"]["runAsUser"]

        # A pod deletion: SIGTERM, then a clean exit well within the grace period.
        for pod in servers:
            start = time.monotonic()
            podman("stop", "--time", str(KUBERNETES_GRACE_S), pod.container_name, timeout=KUBERNETES_GRACE_S + 30)
            took = time.monotonic() - start
            assert pod.state() == ("exited", 0) and took < 10, (pod.name, took, pod.logs())
            print(f"{pod.name}: stopped by SIGTERM in {took:.1f} s")
    finally:
        for pod in pods:
            podman("rm", "--force", "--time", "0", pod.container_name, check=False)
        podman("network", "rm", "--force", network, check=False)


def test_image_holds_no_build_secret_and_runs_as_its_user(image):
    """The build's pip.conf and CA bundle (build secrets) are in no layer; the image runs as 10001 by
    default, has the CPU build of the pinned torch, and no pip configuration or compiler."""
    script = ("import os, pathlib, shutil, torch; "
              "print(os.getuid(), os.getgid(), torch.__version__, torch.cuda.is_available(), "
              "[p for p in ('/etc/pip.conf', '/run/secrets/ca.crt', '/run/secrets/pip.conf', "
              "'/etc/xdg/pip/pip.conf', '/home/fedse/.config/pip') if pathlib.Path(p).exists()], "
              "shutil.which('gcc'), shutil.which('cc'))")
    out = podman("run", "--rm", *[f"--ulimit={u}" for u in ulimits()], "--read-only", "--entrypoint", "python",
                 image, "-c", script).stdout.split(maxsplit=4)
    pin = next(line for line in (REPO / "requirements.txt").read_text().splitlines() if line.startswith("torch=="))
    assert out[:2] == ["10001", "10001"]
    assert out[2] == pin.split("==")[1] + "+cpu" and out[3] == "False", out
    assert out[4].strip() == "[] None None", out
    history = podman("history", "--no-trunc", "--format", "{{.CreatedBy}}", image).stdout
    assert "ca-certificates.crt" not in history and "cert =" not in history

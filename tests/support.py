"""Helpers several test modules share: waiting on real processes, free ports and HTTP GETs, an
in-process aggregator, `kubectl kustomize` of the repository's scenarios, a test PKI, and a fake
aggregator speaking the resumable transfer protocol over real gRPC (with breaks on purpose)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import socket
import subprocess
import time
import urllib.request
from concurrent import futures
from typing import Iterator

import grpc
import trustme
import yaml

from fedse.model import adapter as ad
from fedse.transport import serde
from apps.cli import SERVICES
from apps.processes import Proc
from fedse.transport.serving import GRPC_OPTIONS
from fedse.v1 import federation_pb2 as fpb
from fedse.v1 import federation_pb2_grpc as fpb_grpc
from services.aggregator.adapter_files import fresh
from services.aggregator.server import Aggregator, AggregatorConfig, create_server

REPO = pathlib.Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
KUBECTL = os.environ.get("KUBECTL") or shutil.which("kubectl")
NAMESPACE = "fedse"  # k8s/kustomization.yaml's
# Flags the tests that run the manifests' containers add to shrink a run (a flag wins over its FEDSE_*
# variable): how much work a round is, never ports, paths or names.
BUDGET = {
    "services.aggregator": ["--rounds=1"],
    "services.client_agent": ["--expert-demos=2", "--explore-tasks=2", "--eval-tasks=2", "--epochs=1",
                              "--torch-threads=1"],
    "services.env_server": [],
}
# What each service's own metrics are called (docs/metrics.md).
OWN_METRICS = {"services.aggregator": "fedse_aggregator_", "services.env_server": "fedse_env_",
               "services.client_agent": "fedse_client_"}


def service_module(command: list[str]) -> str:
    """The service a container's command starts, as its module: `fedse NAME` runs SERVICES[NAME]."""
    assert len(command) == 2 and command[0] == "fedse" and command[1] in SERVICES, \
        f"the command must be fedse and one of {', '.join(SERVICES)}: {command}"
    return SERVICES[command[1]]


def wait_for(what: str, check, timeout: float = 180.0, procs: list[Proc] = ()):
    """check()'s first truthy result; fails with a process's log if one of `procs` exits non-zero."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        for p in procs:
            if p.popen.poll() not in (None, 0):
                raise AssertionError(f"{p.name} exited with {p.popen.returncode}:\n{p.log_path.read_text()[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def children_of(parent: int) -> list[int]:
    """Live (not zombie) processes whose parent is `parent`, from /proc."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent and fields[0] != "Z":
                out.append(int(pid))
    return out


def child_running(parent: int, *args: str) -> int | None:
    """The pid of a live child of `parent` whose command line holds `args` in a row, if any."""
    for pid in children_of(parent):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(argv[i:i + len(args)] == list(args) for i in range(len(argv))):
            return pid
    return None


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (all bound at once, so no two are the same)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def serving(target: str) -> bool:
    """Whether grpc.health.v1 at host:port answers SERVING, as a Kubernetes gRPC probe asks."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def probe_ports(container: dict) -> set[int]:
    """The ports of a rendered container's gRPC probes."""
    return {container[probe]["grpc"]["port"] for probe in ("startupProbe", "readinessProbe", "livenessProbe")}


@contextlib.contextmanager
def aggregator_in_process(state_dir: pathlib.Path, **settings) -> Iterator[tuple[Aggregator, int, pathlib.Path]]:
    """A real aggregator on a free port (run "t", 2 rounds, 2 clients unless `settings` say
    otherwise): (aggregator, port, the run's state folder)."""
    cfg = AggregatorConfig(**{"address": "127.0.0.1:0", "metrics_port": -1, "state_dir": str(state_dir),
                              "run_id": "t", "rounds": 2, "min_clients": 2, "torch_threads": 0, **settings})
    agg, port = create_server(cfg)
    agg.start()
    try:
        yield agg, port, pathlib.Path(state_dir) / cfg.run_id
    finally:
        agg.stop(0)


@contextlib.contextmanager
def env_server_in_process(envs: str = "maze") -> Iterator[str]:
    """A real env server for `envs` on a free port: its target address."""
    from services.env_server.server import EnvServerConfig, create_server as create_env_server

    server, port = create_env_server(EnvServerConfig(address="127.0.0.1:0", envs=envs, metrics_port=-1))
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def kustomize(path: pathlib.Path) -> list[dict]:
    """The objects `kubectl kustomize path` renders."""
    proc = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def write_scenario(directory: pathlib.Path, components: list[str], server_ips: tuple[str, ...] = ()) -> pathlib.Path:
    """k8s/kustomization.yaml with its paths made relative to `directory`, plus `components`. With
    mtls among them, the paths lead to a copy of k8s/ in `directory` whose mtls certificates are made
    as the operator makes them offline (offline_certs; servers also for `server_ips`)."""
    k8s = K8S
    directory.mkdir(parents=True, exist_ok=True)
    if "mtls" in components:
        k8s = directory / "k8s"
        shutil.copytree(K8S, k8s)
        offline_certs(k8s, directory / "offline-ca", server_ips)
    root = yaml.safe_load((k8s / "kustomization.yaml").read_text())

    def rel(p: str) -> str:
        return os.path.relpath(k8s / p, directory)

    root["resources"] = [rel(p) for p in root.get("resources") or []]
    root["components"] = [rel(p) for p in (root.get("components") or [])] + \
        [rel(f"components/{c}") for c in components]
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(root, sort_keys=False))
    return directory


def offline_certs(k8s: pathlib.Path, ca_dir: pathlib.Path, server_ips: tuple[str, ...] = ()) -> pathlib.Path:
    """Fills k8s/components/mtls/certs as docs/deploy.md has the operator do it on an offline machine:
    the CA in `ca_dir`, outside the manifests (its key never goes near them); a server certificate for
    each server whose files the component's secretGenerator reads (its Service's names in the
    namespace, and `server_ips`); a client certificate, request then sign, for each client (org-*);
    and ca.pem alone of the CA's files."""
    from fedse.security import certs

    component = k8s / "components" / "mtls"
    out = component / "certs"
    certs.init_ca(ca_dir, force=True)
    generators = yaml.safe_load((component / "kustomization.yaml").read_text())["secretGenerator"]
    files = {pathlib.PurePath(f.split("=", 1)[1]).name for g in generators for f in g["files"]}
    for name in sorted(f[:-len(".pem")] for f in files if not f.endswith("-key.pem") and f != certs.CA_CERT):
        if name.startswith("org-"):
            certs.request(name, out, force=True)
            certs.sign(ca_dir, out / f"{name}.csr", out / f"{name}.pem", force=True)
            (out / f"{name}.csr").unlink()
        else:
            dns = [name, f"{name}.{NAMESPACE}", f"{name}.{NAMESPACE}.svc", f"{name}.{NAMESPACE}.svc.cluster.local"]
            certs.issue(ca_dir, name, dns, list(server_ips), out, force=True)
    shutil.copyfile(ca_dir / certs.CA_CERT, out / certs.CA_CERT)
    return out


class Pki:
    """PEM files of a federation CA, a stranger CA, a server and some clients."""

    def __init__(self, root):
        self.root = root
        self.ca = trustme.CA(organization_name="fedse federation")
        self.other_ca = trustme.CA(organization_name="not the federation")
        self.ca_pem = self._write("ca.pem", self.ca.cert_pem.bytes())
        self.server = self.issue(self.ca, "server", "localhost", "127.0.0.1")
        self.named_server = self.issue(self.ca, "named-server", "aggregator.fedse.internal")
        # The SAN is the identity; the CN is there to show it does not win over the SAN.
        self.org_a = self.issue(self.ca, "org-a", "org-a", common_name="org-a-common-name")
        self.org_b = self.issue(self.ca, "org-b", "org-b")
        self.stranger = self.issue(self.other_ca, "stranger", "org-a")

    def _write(self, name: str, data: bytes) -> str:
        path = self.root / name
        path.write_bytes(data)
        return str(path)

    def issue(self, ca: trustme.CA, name: str, *identities: str, common_name: str | None = None) -> tuple[str, str]:
        cert = ca.issue_cert(*identities, common_name=common_name)
        chain = b"".join(pem.bytes() for pem in cert.cert_chain_pems)
        return self._write(f"{name}.pem", chain), self._write(f"{name}-key.pem", cert.private_key_pem.bytes())


class FakeAggregator(fpb_grpc.FederationServiceServicer):
    """Just enough of the aggregator's new protocol for one client, with breaks injected on purpose.
    Its refusals do not name where to resume: a client learns that from GetUploadState alone.
    With `advance=True` an accepted upload closes the round: its adapter becomes the next global."""

    def __init__(self, global_adapter: bytes | None = None, round_: int = 1, num_rounds: int = 3,
                 advance: bool = False):
        self.round, self.nonce, self.state = round_, f"nonce-{round_}", fpb.ROUND_STATE_OPEN
        self.num_rounds, self.advance = num_rounds, advance
        self.globals: dict[int, bytes] = {round_: global_adapter} if global_adapter else {}
        self.held: dict[tuple[str, int, str], bytearray] = {}
        self.accepted: dict[tuple[str, int], bytes] = {}
        self.received = 0  # data bytes received over all upload streams
        self.break_upload_after: list[int] = []  # per stream: abort UNAVAILABLE after this many bytes
        self.end_upload_after: list[int] = []  # per stream: stop reading (incomplete) after this many
        self.break_download_after: list[int] = []
        self.corrupt_downloads = 0
        self.download_requests: list[fpb.DownloadRequest] = []
        self.reports: list[tuple[int, dict[str, float]]] = []
        self.heartbeats: list[tuple[int, str]] = []

    @property
    def global_fp32(self) -> bytes:
        return self.globals[self.round]

    def status(self):
        return fpb.RoundStatus(run_id="run-a", round=self.round, state=self.state, num_rounds=self.num_rounds,
                               round_nonce=self.nonce)

    def open(self, round_: int, data: bytes) -> None:
        self.globals[round_] = data
        self.round, self.nonce = round_, f"nonce-{round_}"
        self.state = fpb.ROUND_STATE_FINISHED if round_ >= self.num_rounds else fpb.ROUND_STATE_OPEN

    def Join(self, request, context):
        if not self.globals:
            self.globals[self.round] = bytes(fresh(serde.schema_from_proto(request.schema), seed=0)[0])
        return fpb.JoinResponse(config=fpb.RunConfig(run_id="run-a", num_rounds=self.num_rounds, min_clients=1,
                                                     max_chunk_bytes=64 * 1024, heartbeat_interval_s=0.2),
                                current_round=self.round)

    def GetRoundStatus(self, request, context):
        return self.status()

    def WatchRound(self, request, context):
        last = None
        while context.is_active():
            st = self.status()
            if st != last:
                yield st
                last = st
                if st.state == fpb.ROUND_STATE_FINISHED:
                    return
            time.sleep(0.02)

    def Heartbeat(self, request, context):
        self.heartbeats.append((request.round, request.phase))
        return fpb.HeartbeatAck(status=self.status())

    def ReportMetrics(self, request, context):
        self.reports.append((request.round, dict(request.metrics)))
        return fpb.MetricsAck()

    def GetUploadState(self, request, context):
        key = (request.client_id, request.round, request.sha256)
        done = (request.client_id, request.round) in self.accepted
        return fpb.UploadState(received_bytes=len(self.held.get(key, b"")), complete=done)

    def UploadAdapter(self, request_iterator, context):
        h = next(request_iterator).header
        if h.round != self.round or h.round_nonce != self.nonce or self.state != fpb.ROUND_STATE_OPEN:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"upload for round {h.round} refused: "
                                                               f"round {self.round} is open")
        buf = self.held.setdefault((h.client_id, h.round, h.sha256), bytearray())
        if h.offset != len(buf):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"offset {h.offset} differs from the bytes held: ask GetUploadState")
        limit = self.break_upload_after.pop(0) if self.break_upload_after else None
        stop = self.end_upload_after.pop(0) if self.end_upload_after else None
        got = 0
        for chunk in request_iterator:
            buf += chunk.data
            got += len(chunk.data)
            self.received += len(chunk.data)
            if limit is not None and got >= limit:
                context.abort(grpc.StatusCode.UNAVAILABLE, "stream broke")
            if stop is not None and got >= stop:
                break
        if len(buf) < h.size:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "upload incomplete: ask GetUploadState")
        if ad.sha256_hex(bytes(buf)) != h.sha256:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sha256 mismatch")
        self.accepted[(h.client_id, h.round)] = bytes(buf)
        if self.advance:
            self.open(h.round + 1, ad.encode(ad.decode_transport(bytes(buf))))
        return fpb.UploadAck(round=h.round, sha256=h.sha256, size=h.size)

    def DownloadAdapter(self, request, context):
        self.download_requests.append(request)
        round_ = request.round if request.round >= 0 else self.round
        data = self.globals[round_]
        if request.transport_dtype == "bfloat16":
            data = ad.encode_transport(ad.decode_transport(data), "bfloat16")
        sha = ad.sha256_hex(data)
        if request.sha256 and request.sha256 != sha:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the adapter changed; download again from 0")
        yield fpb.AdapterChunk(header=fpb.AdapterHeader(run_id="run-a", round=round_, sha256=sha,
                                                        size=len(data), offset=request.offset))
        body = data
        if self.corrupt_downloads:
            self.corrupt_downloads -= 1
            body = data[:-1] + bytes([data[-1] ^ 1])
        limit = self.break_download_after.pop(0) if self.break_download_after else None
        sent = 0
        for start in range(request.offset, len(body), 1000):
            part = body[start:start + 1000]
            yield fpb.AdapterChunk(data=part)
            sent += len(part)
            if limit is not None and sent >= limit:
                context.abort(grpc.StatusCode.UNAVAILABLE, "stream broke")


def serve_fake(agg: FakeAggregator):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=GRPC_OPTIONS)
    fpb_grpc.add_FederationServiceServicer_to_server(agg, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def join_with_phi0(client, env: str, base_model: str, timeout: float = 30.0):
    """Joins `client` (a FederationClient) to a run another client joined first, with that run's adapter
    schema as phi_0 shows it; returns phi_0 (services.client_agent.federation.link.GlobalAdapter)."""
    from fedse.model import adapter as ad

    deadline = time.monotonic() + timeout
    while True:
        try:
            phi0 = client.download(0)
            break
        except Exception:  # noqa: BLE001 - no adapter yet: the first client has not joined
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    client.join(env, base_model, ad.Schema.of(ad.decode(phi0.data), phi0.adapter_config_json))
    return phi0


# ---- reading back what --track wrote, with TensorBoard's and MLflow's own readers -------------------
def tensorboard_scalars(run_dir: pathlib.Path) -> tuple[dict[str, dict[int, float]], str]:
    """{tag: {step: value}} and the settings text of a TensorBoard run directory, read by TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    text = "".join(e.tensor_proto.string_val[0].decode() for e in acc.Tensors("settings/text_summary"))
    return scalars, text


def mlflow_run(store: pathlib.Path, run_name: str = ""):
    """(client, run) of the named run (or the only one) that --track mlflow:STORE wrote: in the SQLite
    database STORE/mlflow.db, read by MLflow."""
    from mlflow.tracking import MlflowClient

    assert (store / "mlflow.db").is_file(), f"{store}/mlflow.db: no MLflow database"
    client = MlflowClient(tracking_uri=f"sqlite:///{store.resolve() / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("fedse")
    runs = [r for r in client.search_runs([experiment.experiment_id]) if r.info.run_name == run_name or not run_name]
    assert len(runs) == 1, runs
    return client, runs[0]


def history(client, run, name: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}

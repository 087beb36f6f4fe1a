"""The version is written once (fedse/__init__.py): the package, `fedse --version`, every service's logs
and /metrics, and the image tags follow it."""

import importlib.metadata
import json
import logging
import pathlib
import re
from concurrent import futures

import prometheus_client
import pytest

from apps.cli import main
from fedse import __version__
from fedse.transport.serving import setup_logging

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_fedse_version_prints_the_packages_version_and_the_metadata_says_its_licence(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"fedse {__version__}\n"
    assert importlib.metadata.version("fedse") == __version__
    assert importlib.metadata.metadata("fedse")["License-Expression"] == "Apache-2.0"
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)


def test_every_service_says_its_version_in_its_first_log_line_and_on_metrics(capsys):
    setup_logging("aggregator")
    first = json.loads(capsys.readouterr().out.splitlines()[0])
    assert (first["service"], first["msg"], first["version"]) == ("aggregator", "starting", __version__)
    logging.getLogger().handlers[:] = []
    exposed = prometheus_client.generate_latest().decode()
    assert f'fedse_build_info{{version="{__version__}"}} 1.0' in exposed


def test_the_image_tags_follow_the_version():
    for path in ("k8s/kustomization.yaml", "k8s/overlays/onprem/kustomization.yaml"):
        tags = re.findall(r"newTag: (\S+)", (REPO / path).read_text())
        assert tags and set(tags) == {__version__}, path
    assert "IMAGE_TAG ?= $(shell sed" in (REPO / "Makefile").read_text()  # read from fedse/__init__.py
    assert 'VERSION=$(sed -n' in (REPO / "scripts" / "build-image.sh").read_text()
    # The guides name the images the version's tag (fedse:X.Y.Z, fedse-gpu:X.Y.Z, newTag: X.Y.Z).
    for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        named = re.findall(r"(?:fedse(?:-gpu)?:|newTag: |IMAGE_TAG=)(\d+\.\d+\.\d+)", doc.read_text())
        assert set(named) <= {__version__}, (doc.name, named)


def test_the_package_declares_its_pinned_dependencies_and_a_test_extra():
    def pins(name):
        return {line.strip() for line in (REPO / name).read_text().splitlines()
                if line.strip() and not line.startswith(("#", "-"))}
    requires = importlib.metadata.requires("fedse") or []
    plain = {r for r in requires if "extra ==" not in r}
    test = {r.split(";")[0].strip() for r in requires if 'extra == "test"' in r}
    assert plain == pins("requirements.txt") and test == pins("requirements-test.txt")
    for extra in ("track", "gpu"):
        assert {r.split(";")[0].strip() for r in requires if f'extra == "{extra}"' in r} == \
            pins(f"requirements-{extra}.txt"), extra
    assert "torch==2.13.0" in plain  # pinned: a looser torch pulls a CUDA build of several GB


def test_a_second_service_on_a_taken_metrics_port_stops_with_one_line():
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "apps.cli", "env-server", "--address", "127.0.0.1:0",
                               "--metrics-port", str(port), "--envs", "maze"],
                              capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]  # one line, no traceback
    assert f"--metrics-port {port} cannot be served" in done.stderr and "0 to pick a free one" in done.stderr


@pytest.mark.parametrize("service", ["env-server", "aggregator", "client"])
def test_a_service_on_a_taken_grpc_address_stops_with_one_line(service, tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        state = ["--state-dir", str(tmp_path)] if service != "env-server" else []
        done = subprocess.run([sys.executable, "-m", "apps.cli", service, "--address", address, "--metrics-port", "-1",
                               *state], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr  # one line, no traceback
    assert f"--address {address} cannot be served" in done.stderr and "port 0" in done.stderr


def test_a_second_grpc_server_never_shares_a_port_with_the_first():
    """gRPC sets SO_REUSEPORT by default on Linux, with which a second server binds a taken port and
    the kernel splits the connections between the two; fedse's services refuse to start instead."""
    from fedse.config import ConfigError
    from fedse.transport.serving import Service

    first = Service("first", "127.0.0.1:0", max_workers=1)
    first.start()
    try:
        with pytest.raises(ConfigError, match=f"--address 127.0.0.1:{first.port} cannot be served"):
            Service("second", f"127.0.0.1:{first.port}", max_workers=1)
        import grpc

        from fedse.transport.serving import GRPC_OPTIONS
        bare = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=GRPC_OPTIONS)
        with pytest.raises(RuntimeError):  # and gRPC itself, without fedse's check first, refuses it
            bare.add_insecure_port(f"127.0.0.1:{first.port}")
    finally:
        first.stop(0)


@pytest.mark.parametrize("separate_port", [False, True], ids=["on-the-service-port", "on-a-health-port"])
def test_health_watch_streams_hold_no_server_thread(separate_port):
    """grpc.health.v1's Watch answers through a callback: held open, many of them leave a two-thread
    server (the client agent's, a --health-address one) answering Check, and follow a status change."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from fedse.transport.serving import Service

    svc = Service("probe", "127.0.0.1:0", max_workers=2, health_address="127.0.0.1:0" if separate_port else "")
    svc.start()
    port = svc.health_port if separate_port else svc.port
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            watches = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(6)]
            for w in watches:
                assert next(w).status == health_pb2.HealthCheckResponse.NOT_SERVING
            # With every thread held by a Watch this waited out its deadline.
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=3).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
            svc.ready([])
            assert all(next(w).status == health_pb2.HealthCheckResponse.SERVING for w in watches)
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=3).status == \
                health_pb2.HealthCheckResponse.SERVING
            for w in watches:
                w.cancel()
    finally:
        svc.stop(0)


def test_a_server_stops_while_its_health_watches_end():
    """Clients cancelling their Watch streams as the server stops (a probe going away with the pod):
    the stop sends every stream NOT_SERVING while their ends run on the server's event thread. With
    grpcio-health-checking's own servicer one stop in four here waited for ever (each side held what
    the other needed); twenty stops in a row each finish within seconds."""
    import threading

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from fedse.transport.serving import Service

    for attempt in range(20):
        svc = Service("probe", "127.0.0.1:0", max_workers=2, health_address="127.0.0.1:0")
        svc.start()
        svc.ready([])
        with grpc.insecure_channel(f"127.0.0.1:{svc.health_port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            watches = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(6)]
            for w in watches:
                assert next(w).status == health_pb2.HealthCheckResponse.SERVING
            for w in watches:
                w.cancel()
            stopping = threading.Thread(target=svc.stop, args=(0,), daemon=True)
            stopping.start()
            stopping.join(10)
            assert not stopping.is_alive(), f"stop {attempt} hung"


def test_a_service_stops_on_a_sigterm_that_another_thread_took(tmp_path):
    """A process-wide SIGTERM may be taken by any of the process's threads; Python runs its handler
    in the main thread, which waits for the server to stop. Sent here to a worker thread only
    (pthread_kill), as the kernel may hand it: the service still stops, gracefully, within seconds
    (with one untimed wait the main thread slept on and the process was deaf until SIGKILL)."""
    import subprocess
    import sys

    script = tmp_path / "serve.py"
    script.write_text(
        "import signal, threading, time\n"
        "from fedse.transport.serving import Service\n"
        "svc = Service('probe', '127.0.0.1:0', max_workers=2)\n"
        "svc.start(); svc.ready([]); svc.stop_on_signals(grace=0)\n"
        "worker = threading.Thread(target=time.sleep, args=(3,), daemon=True); worker.start()\n"
        "signal.pthread_kill(worker.ident, signal.SIGTERM)\n"
        "svc.wait_for_termination()\n"
        "print('stopped', flush=True)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=20,
                          cwd=pathlib.Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and done.stdout == "stopped\n", done.stderr  # only the handler stops it

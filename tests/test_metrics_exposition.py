"""Every metric docs/metrics.md documents is really exposed, in valid Prometheus text format, and every
metric the services expose is documented there."""

import pathlib
import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

import services.aggregator.servicer  # noqa: F401 - registers the aggregator's metrics
import services.client_agent.metrics  # noqa: F401 - registers the client agent's metrics
import services.env_server.metrics  # noqa: F401 - registers the env server's metrics
from fedse.transport.serving import insecure_channel, start_metrics
from fedse.v1 import federation_pb2 as fpb
from fedse.v1.federation_pb2_grpc import FederationServiceStub
from services.aggregator.server import AggregatorConfig, create_server
from services.env_server.envs.maze import MazeEnv
from services.env_server.sessions import SessionManager

METRICS_DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def test_documented_metrics_are_served(tmp_path):
    # One real call through a real server, so the interceptor's series exist; and one env server's
    # session manager, so its per-environment series exist.
    agg, agg_port = create_server(AggregatorConfig(address="127.0.0.1:0", metrics_port=-1, state_dir=str(tmp_path)))
    agg.start()
    with insecure_channel(f"127.0.0.1:{agg_port}") as channel:
        FederationServiceStub(channel).GetRoundStatus(fpb.RoundStatusRequest(), timeout=5)
    agg.stop(0)
    SessionManager({"maze": MazeEnv()})
    port = start_metrics(0, "127.0.0.1")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    families = list(text_string_to_metric_families(text))
    served = {f.name for f in families} | {s.name for f in families for s in f.samples}
    documented = set(re.findall(r"`((?:fedse|grpc_server)_[a-z_]+)", METRICS_DOC.read_text()))
    assert len(documented) >= 15
    missing = sorted(documented - served)
    assert not missing, f"docs/metrics.md documents metrics nobody serves: {missing}"
    # The other way: each metric served under its exposed name (a counter's with _total), the
    # timestamps prometheus_client adds to counters and histograms (_created) aside.
    exposed = {f.name + "_total" if f.type == "counter" else f.name for f in families
               if f.name.startswith(("fedse_", "grpc_server_")) and not f.name.endswith("_created")}
    undocumented = sorted(exposed - documented)
    assert not undocumented, f"served but not in docs/metrics.md: {undocumented}"

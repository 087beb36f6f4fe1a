"""Observability: the Grafana dashboard asks only for metrics the services export, every service's
/metrics passes `promtool check metrics`, and a real Prometheus server scraping a real federation
answers the questions the dashboard asks (round number, success rate per environment, ...).

promtool and prometheus come from Debian's prometheus package: scripts/install-prometheus.sh.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

import fedse.transport.serving  # noqa: F401 - registers the gRPC interceptor's metrics
import services.aggregator.metrics  # noqa: F401 - registers the aggregator's metrics
import services.client_agent.metrics  # noqa: F401 - registers the client agent's metrics
import services.env_server.metrics  # noqa: F401 - registers the env server's metrics
from apps.processes import Proc
from support import free_ports, http_get

ROOT = pathlib.Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "k8s" / "components" / "monitoring" / "fedse-dashboard.json"
INSTALL_HINT = "run scripts/install-prometheus.sh (it installs Debian's prometheus package: prometheus, promtool)"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found on PATH: {INSTALL_HINT}")
    return path


def promtool_problems(text: str) -> str:
    """`promtool check metrics` on an exposition text: "" when it passes, else what it says."""
    out = subprocess.run([tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True,
                         timeout=60)
    return "" if out.returncode == 0 else (out.stdout + out.stderr).strip() or f"exit status {out.returncode}"


# ---- PromQL: which metrics does an expression name? ---------------------------------------------------
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan", "atan2"}
LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression (or a Grafana label_values(...) variable query) selects."""
    m = re.fullmatch(r"\s*label_values\((.*)\)\s*", expr, re.S)
    if m:  # label_values(selector, label) or label_values(label)
        args = m.group(1).rsplit(",", 1)
        return promql_metric_names(args[0]) if len(args) == 2 else set()
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # string literals
    s = re.sub(r"\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*", "", s)  # Grafana variables
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges and subqueries
    s = LABEL_LIST.sub(" ", s)  # grouping and matching label lists
    s = re.sub(r"\boffset\s+-?\w+", " ", s)
    s = re.sub(r"(?<![A-Za-z0-9_:.])[0-9][0-9A-Za-z_.+]*", " ", s)  # numbers, durations (1e3, 0x1f, 5m)
    names = set()
    for ident in IDENT.finditer(s):
        rest = s[ident.end():].lstrip()
        if rest.startswith("(") or ident.group().lower() in PROMQL_WORDS:
            continue  # a function or aggregation, or a keyword
        names.add(ident.group())
    return names


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, query) for every panel target (rows' nested panels included) and variable query."""
    out = []

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(dashboard.get("panels", [])):
        for t in p.get("targets", []):
            if t.get("expr"):
                out.append((f"panel {p.get('title')!r} {t.get('refId')}", t["expr"]))
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            q = q.get("query", "") if isinstance(q, dict) else q or ""
            if q:
                out.append((f"variable {v['name']!r}", q))
    return out


def unknown_metrics(dashboard: dict, exported: set[str]) -> dict[str, set[str]]:
    """where -> the metric names it asks for that nobody exports."""
    out = {}
    for where, expr in dashboard_queries(dashboard):
        missing = promql_metric_names(expr) - exported
        if missing:
            out[where] = missing
    return out


def registry_metric_names(registry=prometheus_client.REGISTRY) -> set[str]:
    """Every series name the registry serves, or would serve once a labelled metric has a child."""
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",), "info": ("_info",), "stateset": ("",),
                "enum": ("",), "unknown": ("",), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "gaugehistogram": ("_bucket", "_gsum", "_gcount"), "summary": ("", "_sum", "_count", "_created")}
    names = set()
    for family in registry.collect():
        names |= {family.name + s for s in suffixes[family.type]}
        names |= {s.name for s in family.samples}
    return names


def exposition_names(text: str) -> set[str]:
    families = list(text_string_to_metric_families(text))
    return {f.name for f in families} | {s.name for f in families for s in f.samples}


# ---- fast tests ---------------------------------------------------------------------------------------
def test_promql_metric_names():
    assert promql_metric_names(
        'histogram_quantile(0.95, sum by (le, grpc_method) (rate(grpc_server_handling_seconds_bucket'
        '{grpc_service=~"$svc", x="a{b}"}[$__rate_interval])))') == {"grpc_server_handling_seconds_bucket"}
    assert promql_metric_names(
        'fedse_client_test_success_ratio{env=~"$env"} * on (job, instance) group_left (client_id) '
        'fedse_client_info') == {"fedse_client_test_success_ratio", "fedse_client_info"}
    assert promql_metric_names("sum(increase(a_total[5m] offset 1h)) / (sum(increase(b_count[${window}])) > 0)"
                               " and 1e3 < c") == {"a_total", "b_count", "c"}
    assert promql_metric_names("label_values(fedse_client_info{job='x'}, env)") == {"fedse_client_info"}
    assert promql_metric_names("label_values(env)") == set()


def test_dashboard_references_only_exported_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 20
    exported = registry_metric_names()
    assert {"fedse_client_phase_seconds_bucket", "fedse_client_info", "grpc_server_handled_total",
            "fedse_aggregator_uploads_total", "fedse_env_steps_total"} <= exported
    assert unknown_metrics(dashboard, exported) == {}
    # The checker really fails on a panel that names a metric nobody exports.
    bad = {"panels": [{"type": "row", "panels": [{"title": "typo", "targets": [
        {"refId": "A", "expr": "rate(fedse_aggregator_round_total[5m]) + fedse_aggregator_round"}]}]}]}
    assert unknown_metrics(bad, exported) == {"panel 'typo' A": {"fedse_aggregator_round_total"}}


def test_dashboard_covers_the_federation_and_uses_the_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
    used = {m for _, q in dashboard_queries(dashboard) for m in promql_metric_names(q)}
    # What the issue asks the dashboard to show.
    wanted = {
        "success rate per environment": "fedse_client_test_success_ratio",
        "round duration": "fedse_aggregator_round_duration_seconds_sum",
        "round duration's parts": "fedse_client_phase_seconds_sum",
        "aggregation time": "fedse_aggregator_aggregation_seconds_sum",
        "bytes received": "fedse_aggregator_received_bytes_total",
        "bytes sent": "fedse_aggregator_sent_bytes_total",
        "refused uploads by reason": "fedse_aggregator_uploads_total",
        "RPC latency": "grpc_server_handling_seconds_bucket",
        "clients alive": "fedse_aggregator_clients_alive",
        "clients joined": "fedse_aggregator_clients_joined",
        "round number": "fedse_aggregator_round",
        "secure aggregation's stage durations": "fedse_aggregator_secure_stage_seconds_bucket",
        "secure aggregation's dropouts recovered": "fedse_aggregator_secure_dropouts_recovered_total",
        "secure aggregation's attempts aborted": "fedse_aggregator_secure_attempts_aborted_total",
    }
    assert {k: v for k, v in wanted.items() if v not in used} == {}
    exprs = [q for _, q in dashboard_queries(dashboard)]
    assert any("histogram_quantile(0.95" in e and "grpc_method" in e for e in exprs)
    assert any("histogram_quantile(0.5" in e and "grpc_method" in e for e in exprs)
    assert any("avg by (env)" in e and "fedse_client_test_success_ratio" in e for e in exprs)
    assert any('outcome!="accepted"' in e and "by (outcome)" in e for e in exprs)
    assert any("histogram_quantile(0.95" in e and "by (le, stage)" in e for e in exprs)


EXPOSITION_SCRIPT = """
import sys
import prometheus_client
import fedse.transport.serving as s
s.RPC_SECONDS.labels("fedse.v1.X", "Y", "OK").observe(0.01)
s.RPC_HANDLED.labels("fedse.v1.X", "Y", "OK").inc()
if sys.argv[1] == "env_server":
    from services.env_server import metrics as m
    m.init_env("maze", ("success", "failure", "truncated"))
elif sys.argv[1] == "aggregator":
    import services.aggregator.servicer  # noqa: F401 - creates the upload outcome series
    from services.aggregator import metrics as m
    m.ROUND_SECONDS.observe(3.0)
    m.AGGREGATE_SECONDS.observe(0.2)
    m.SECURE_STAGE_SECONDS.labels("sharing").observe(0.5)
    m.SECURE_DROPOUTS_RECOVERED.inc()
    m.SECURE_ATTEMPTS_ABORTED.labels("uploading").inc()
else:
    from services.client_agent import metrics as m
    m.init_client("org-a", "maze")
    m.TEST_SUCCESS.labels("maze").set(0.5)
    for phase in m.PHASES:
        m.PHASE_SECONDS.labels(phase).observe(1.0)
sys.stdout.write(prometheus_client.generate_latest().decode())
"""


@pytest.mark.parametrize("service", ["env_server", "aggregator", "client_agent"])
def test_promtool_accepts_each_services_metrics(service):
    # Each service's metric modules alone in a fresh process, every series populated; the federation
    # test below also checks what real running services serve.
    out = subprocess.run([sys.executable, "-c", EXPOSITION_SCRIPT, service], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert f"fedse_{service.split('_')[0]}" in out.stdout
    assert promtool_problems(out.stdout) == ""


def test_promtool_check_can_fail():
    assert "_total" in promtool_problems("# HELP foo_things x\n# TYPE foo_things counter\nfoo_things 1\n")


def test_no_label_can_hold_trajectory_text():
    # Labels are fixed words or operator-chosen names; none is free text from an episode.
    allowed = {"env", "outcome", "phase", "source", "stage", "kind", "client_id", "grpc_service", "grpc_method",
               "grpc_code"}
    metrics = [(name, obj) for module in (fedse.transport.serving, services.aggregator.metrics, services.client_agent.metrics,
                                          services.env_server.metrics)
               for name, obj in vars(module).items() if isinstance(obj, prometheus_client.metrics.MetricWrapperBase)]
    assert len(metrics) >= 25
    for name, obj in metrics:
        assert set(obj._labelnames) <= allowed, name
    services.client_agent.metrics.init_client("org-a", "maze")
    info = [s for f in prometheus_client.REGISTRY.collect() if f.name == "fedse_client" for s in f.samples]
    assert info and all(set(s.labels) == {"client_id", "env"} for s in info)  # no unlabelled series


# ---- a real Prometheus server scraping a real federation ---------------------------------------------------
class Prometheus:
    def __init__(self, root: pathlib.Path, jobs: dict[str, list[int]]):
        self.port = free_ports(1)[0]
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "scrape_configs": [{"job_name": job, "scrape_interval": "1s", "scrape_timeout": "1s",
                                      "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}]}
                                     for job, ports in jobs.items()]}
        (root / "prometheus.yml").write_text(json.dumps(config, indent=1))  # JSON is YAML
        self.log = open(root / "prometheus.log", "wb")
        self.popen = subprocess.Popen(
            [tool("prometheus"), f"--config.file={root / 'prometheus.yml'}",
             f"--storage.tsdb.path={root / 'prometheus-data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.log_path = root / "prometheus.log"
        deadline = time.monotonic() + 60
        while True:
            try:
                http_get(self.url("/-/ready"), timeout=1)
                return
            except (urllib.error.URLError, OSError):
                if self.popen.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError(f"prometheus did not start:\n{self.log_path.read_text()[-3000:]}")
                time.sleep(0.2)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def query(self, promql: str, at: float | None = None) -> list[dict]:
        params = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        try:
            body = json.loads(http_get(self.url("/api/v1/query?" + urllib.parse.urlencode(params))))
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"query {promql!r} failed: {exc.read().decode()}") from None
        assert body["status"] == "success", body
        return body["data"]["result"]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self.log.close()


CLIENTS = {"org-maze": "maze", "org-wordle": "wordle"}
ROUNDS = 3  # round 1 and 2 leave time for Prometheus to see both clients up in round >= 1
GRAFANA_VARIABLES = {"$__rate_interval": "30s", "$__range": "10m", "$window": "10m", "${window}": "10m",
                     "$env": ".*", "${env}": ".*"}


def grafana_to_promql(expr: str) -> str:
    for var, value in sorted(GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted Grafana variable in {expr!r}"
    return expr


def start_federation(tmp_path, logs, ports: dict[str, int], procs: list) -> dict[str, Proc]:
    """An env server, an aggregator of ROUNDS rounds and the CLIENTS, each serving /metrics on its
    port of `ports`, added to `procs` as they start; returns the clients."""
    env = Proc("env_server", ["services.env_server", "--address", "127.0.0.1:0", "--envs",
                              "maze,wordle?vocab_size=30", "--metrics-port", str(ports["env_server"])], logs)
    procs.append(env)
    agg = Proc("aggregator", ["services.aggregator", "--address", "127.0.0.1:0", "--metrics-port",
                              str(ports["aggregator"]), "--state-dir", str(tmp_path / "aggregator"),
                              "--run-id", "r", "--rounds", str(ROUNDS), "--min-clients", str(len(CLIENTS)),
                              "--round-deadline-s", "600"], logs)
    procs.append(agg)
    env_port, agg_port = env.port(), agg.port()
    clients = {}
    for cid, env_name in CLIENTS.items():
        clients[cid] = Proc(cid, [
            "services.client_agent", "--client-id", cid, "--env", env_name,
            "--env-server", f"127.0.0.1:{env_port}", "--aggregator", f"127.0.0.1:{agg_port}",
            "--address", "127.0.0.1:0", "--metrics-port", str(ports[cid]),
            "--state-dir", str(tmp_path / "clients"), "--expert-demos", "4", "--explore-tasks", "2",
            "--eval-tasks", "3", "--epochs", "1", "--torch-threads", "1", "--heartbeat-interval-s", "0.5"], logs)
        procs.append(clients[cid])
    return clients


def scrape_until_done(procs: list, clients: dict[str, Proc], ports: dict[str, int]) -> tuple[dict[str, str], float]:
    """Each service's latest /metrics, scraped until the clients finish, and the moment to evaluate
    the dashboard's queries at."""
    # Scrape every service ourselves while the run goes, keeping each one's latest /metrics, and
    # note the last moment every client was up with round 0 closed: the dashboard queries below
    # are evaluated then (clients exit at the end, and Prometheus marks their series stale).
    latest: dict[str, str] = {}
    round1_seen = query_at = None
    deadline = time.monotonic() + 300
    while not all(c.popen.poll() == 0 for c in clients.values()):
        for p in procs:
            if p.popen.poll() not in (None, 0):
                raise AssertionError(f"{p.name} exited with {p.popen.returncode}:\n"
                                     f"{p.log_path.read_text()[-3000:]}")
        assert time.monotonic() < deadline, "the federation did not finish in time"
        now, up = time.time(), 0
        for name, port in ports.items():
            try:
                latest[name] = http_get(f"http://127.0.0.1:{port}/metrics", timeout=2)
                up += name in CLIENTS
            except (urllib.error.URLError, OSError):
                pass
        m = re.search(r"^fedse_aggregator_round (\S+)$", latest.get("aggregator", ""), re.M)
        if round1_seen is None and m and float(m.group(1)) >= 1:
            round1_seen = time.time()
        if up == len(CLIENTS) and round1_seen is not None and now > round1_seen + 2:
            query_at = now  # Prometheus (1 s scrapes) has seen round 1 open, and both clients still up
        time.sleep(0.3)
    assert query_at is not None, "never saw both clients up in round 1 or later"
    return latest, query_at


def check_what_prometheus_saw(prom, dashboard: dict, tmp_path, query_at: float) -> None:
    """What Prometheus scraped of the run: the last round, every upload accepted, each environment's
    held-out success as its client reported it, and data for every dashboard query."""
    # Prometheus: the aggregator reached the last round, and still serves.
    def agg_round() -> float:
        r = prom.query("fedse_aggregator_round")
        return float(r[0]["value"][1]) if r else -1.0
    deadline = time.monotonic() + 20
    while agg_round() < ROUNDS and time.monotonic() < deadline:
        time.sleep(0.5)
    assert agg_round() == ROUNDS
    accepted = prom.query('sum(fedse_aggregator_uploads_total{outcome="accepted"})')
    assert float(accepted[0]["value"][1]) == ROUNDS * len(CLIENTS)

    # The held-out success rate per environment: what the clients reported to the aggregator.
    reports = [json.loads(line) for line in (tmp_path / "aggregator" / "r" / "metrics.jsonl").read_text()
               .splitlines()]
    reported = {cid: {r["metrics"]["test_success"] for r in reports if r["client_id"] == cid} for cid in CLIENTS}
    success = prom.query("last_over_time(fedse_client_test_success_ratio[10m]) * on (job, instance) "
                         "group_left (client_id) last_over_time(fedse_client_info[10m])")
    by_env = {s["metric"]["env"]: (s["metric"]["client_id"], float(s["value"][1])) for s in success}
    assert set(by_env) == set(CLIENTS.values())
    for env_name, (cid, value) in by_env.items():
        assert CLIENTS[cid] == env_name
        assert 0.0 <= value <= 1.0 and any(abs(value - v) < 1e-9 for v in reported[cid]), (cid, value)
    rounds = prom.query("max_over_time(fedse_client_round[10m])")
    assert len(rounds) == len(CLIENTS) and all(float(r["value"][1]) >= 1 for r in rounds)

    # Every dashboard query is valid PromQL and has data from this run.
    empty = [where for where, q in dashboard_queries(dashboard)
             if not q.startswith("label_values") and not prom.query(grafana_to_promql(q), at=query_at)]
    assert empty == []
    parts = prom.query(grafana_to_promql(
        "sum by (phase) (increase(fedse_client_phase_seconds_count[$window]))"), at=query_at)
    assert {s["metric"]["phase"] for s in parts if float(s["value"][1]) > 0} >= {
        "download", "eval", "explore", "train", "upload", "wait"}


@pytest.mark.slow
def test_prometheus_scrapes_a_federation(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    ports = dict(zip(["env_server", "aggregator", *CLIENTS], free_ports(2 + len(CLIENTS))))
    prom = Prometheus(tmp_path, {"env_server": [ports["env_server"]], "aggregator": [ports["aggregator"]],
                                 "client_agent": [ports[cid] for cid in CLIENTS]})
    procs: list[Proc] = []
    try:
        clients = start_federation(tmp_path, logs, ports, procs)
        latest, query_at = scrape_until_done(procs, clients, ports)

        # promtool accepts what every real service served.
        for name, text in latest.items():
            assert promtool_problems(text) == "", name

        # The dashboard asks only for names the running services served.
        dashboard = json.loads(DASHBOARD.read_text())
        served = set().union(*(exposition_names(t) for t in latest.values()))
        assert unknown_metrics(dashboard, served) == {}

        check_what_prometheus_saw(prom, dashboard, tmp_path, query_at)
    finally:
        for p in reversed(procs):
            p.stop()
        prom.stop()

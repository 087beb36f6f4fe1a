"""The Kubernetes manifests' network policies, without a cluster: an evaluator of NetworkPolicy
objects over the federation's pods and a few outside endpoints (kube-dns, Prometheus, another pod,
an address on the internet) finds that they allow exactly the links the federation uses, in the
network-policies component and in the on-prem overlay, and everything without them.
"""

from __future__ import annotations

import dataclasses
import ipaddress

from k8s_support import (ENVS, NAMESPACE, NEEDS_KUBECTL, ONPREM, WORKLOAD_KINDS, _render, by_name, of_kind,
                         pod_spec, scenario_tmp)  # noqa: F401 - fixtures

pytestmark = NEEDS_KUBECTL


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


def test_without_network_policies_everything_is_open(scenario_tmp):
    # The evaluator above is not vacuous: with no policies every pair of endpoints connects.
    docs = list(_render("default", scenario_tmp))
    assert ("other-pod", "aggregator", 50060) in reachable(docs)
    assert ("aggregator", "internet", 443) in reachable(docs)

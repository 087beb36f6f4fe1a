"""A run's results: the rounds each client reported, per environment and as a mean over test
tasks (collect, results.json), the table and plot of them, and the clients that failed."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Sequence

import grpc

from fedse.transport.serving import insecure_channel
from fedse.v1 import federation_pb2 as fpb
from fedse.v1 import federation_pb2_grpc as fpb_grpc
from apps.logs import log_summary
from apps.planning import Client, RunConfig
from apps.processes import Proc, exit_reason

# How often the launcher asks each aggregator for its run's status. A status shows each client's
# latest report only, so each report must be seen before the client's next one, which comes after
# at least one more download and evaluation (0.7 s for 2 test tasks of the tiny model on 2 cores).
POLL_S = 0.1
STATUS_TIMEOUT_S = 5.0


class RunWatch:
    """The aggregators' runs as their GetRunStatus shows them: each one's last status, and every
    report (a client's metrics of a round) seen in any of them, as collect() takes reports."""

    def __init__(self, addresses: dict[str, str]):
        self._channels = {name: insecure_channel(address) for name, address in addresses.items()}
        self._stubs = {name: fpb_grpc.FederationServiceStub(ch) for name, ch in self._channels.items()}
        self.status: dict[str, fpb.RunStatus] = {}  # by aggregator name; absent until it first answered
        self._reports: dict[tuple[str, int], dict[str, float]] = {}

    def refresh(self) -> None:
        """Asks every aggregator for its run's status; one that does not answer keeps its last."""
        for name, stub in self._stubs.items():
            try:
                st = stub.GetRunStatus(fpb.RunStatusRequest(), timeout=STATUS_TIMEOUT_S)
            except grpc.RpcError:
                continue
            self.status[name] = st
            for c in st.clients:
                if c.metrics_round >= 0:
                    self._reports[c.client_id, c.metrics_round] = dict(sorted(c.metrics.items()))

    def add(self, recorded: list[tuple[str, int, dict[str, float]]]) -> None:
        """Adds reports an aggregator recorded before, as (client_id, round, metrics): a resumed run's
        from before its interruption, which no status shows again."""
        for cid, rnd, metrics in recorded:
            self._reports[cid, rnd] = dict(sorted(metrics.items()))

    def reports(self) -> list[dict[str, Any]]:
        """Every report seen, as {"client_id", "round", "metrics"}."""
        return [{"client_id": cid, "round": rnd, "metrics": m} for (cid, rnd), m in self._reports.items()]

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()


@dataclasses.dataclass(frozen=True)
class Failure:
    """A client agent that exited non-zero: who, how, and what its log said last (results.json's
    failed_clients)."""

    client_id: str
    process: str  # its process and log name, e.g. client_agent-wordle
    envs: tuple[str, ...]  # the environments it held
    exit_code: int  # the process's return code; negative: killed by that signal
    reason: str  # "killed by SIGKILL (out of memory?)", "exited with status 1"
    last_round: int | None  # the last round it reported (None: none)
    error: str  # the last error or exception in its log ("" if none)
    last_lines: tuple[str, ...]  # its log's last meaningful lines
    log: str  # its log's path


# A round's metrics that add up over an environment's members (its data); the others are averaged.
MEMBERS_SUM = ("kept", "buffer", "explored", "examples", "sequences", "train_trajectories", "train_tasks")


def env_rows(reports: list[dict[str, Any]],
             client_envs: dict[str, tuple[str, ...]]) -> dict[str, list[dict[str, Any]]]:
    """Per environment, one row per round its client reported (the last report of a round counts):
    that environment's test_success and test_tasks (from test_success/<env>, test_tasks/<env>) and
    the client's other metrics (upload_bytes, train_loss, ...), which a Centralized client's
    environments share. Where several members of an environment reported a round, one row for them
    all (merge_members)."""
    latest = {(r["client_id"], r["round"]): r["metrics"] for r in reports if r["client_id"] in client_envs}
    rounds: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for (cid, rnd), m in sorted(latest.items()):
        shared = {k: v for k, v in m.items() if not k.startswith(("test_success", "test_tasks/", "train_tasks/"))}
        for env in client_envs[cid]:
            row = {"round": rnd, **shared, "test_success": m[f"test_success/{env}"], "test_tasks": m[f"test_tasks/{env}"]}
            if f"train_tasks/{env}" in m:  # the training tasks this client holds (a member: its share)
                row["train_tasks"] = m[f"train_tasks/{env}"]
            rounds.setdefault((env, rnd), []).append(row)
    envs: dict[str, list[dict[str, Any]]] = {}
    for (env, _), rows in sorted(rounds.items()):
        envs.setdefault(env, []).append(rows[0] if len(rows) == 1 else merge_members(rows))
    return envs


def merge_members(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One environment's round as its members reported it: held-out success over every test episode
    they played (in synchronous rounds each evaluated the same adapter on the same test tasks), the
    test tasks of one member, their data added up (MEMBERS_SUM), their other metrics averaged, and
    how many reported (`members`)."""
    episodes = sum(r["test_tasks"] for r in rows)
    merged: dict[str, Any] = {"round": rows[0]["round"], "members": len(rows),
                              "test_success": sum(r["test_success"] * r["test_tasks"] for r in rows) / max(1, episodes),
                              "test_tasks": episodes / len(rows)}
    for key in sorted({k for r in rows for k in r} - set(merged)):
        values = [r[key] for r in rows if key in r and isinstance(r[key], (int, float))]
        if values:
            merged[key] = sum(values) if key in MEMBERS_SUM else sum(values) / len(values)
    return merged


def round_mean(rows: dict[str, list[dict[str, Any]]], envs: list[str], rnd: int) -> float | None:
    """Round `rnd`'s success micro-averaged over the test tasks of every environment (successes over
    tasks, as the paper averages); None until every environment has reported the round."""
    found = [row for env in envs for row in rows.get(env, []) if row["round"] == rnd]
    if len(found) < len(envs):
        return None
    tasks = sum(row["test_tasks"] for row in found)
    return sum(row["test_success"] * row["test_tasks"] for row in found) / max(1.0, tasks)


def table_lines(rows: dict[str, list[dict[str, Any]]], envs: list[str], rounds: int) -> tuple[list[str], list[str]]:
    """The success table as (its head: column names and rule; one row per round from 0, an
    environment's cell "-" until it reported the round, the mean's until all of them did)."""
    envs = sorted(envs)
    by = {(env, row["round"]): row["test_success"] for env in envs for row in rows.get(env, [])}
    width = max(8, *(len(e) for e in envs))
    head = "round | " + " | ".join(f"{e:>{width}}" for e in envs) + " | " + f"{'mean':>{width}}"
    lines = []
    for rnd in range(rounds + 1):
        cells = [f"{100 * by[e, rnd]:>{width - 1}.1f}%" if (e, rnd) in by else f"{'-':>{width}}" for e in envs]
        mean = round_mean(rows, envs, rnd)
        cells.append(f"{100 * mean:>{width - 1}.1f}%" if mean is not None else f"{'-':>{width}}")
        lines.append(f"{rnd:>5} | " + " | ".join(cells))
    return [head, "-" * len(head)], lines


def plot(results: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lost = {env for f in results["failed_clients"] for env in f["envs"]}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for env, rows in sorted(results["envs"].items()):
        xs = [r["round"] for r in rows if "test_success" in r]
        ys = [100 * r["test_success"] for r in rows if "test_success" in r]
        ax.plot(xs, ys, marker="o", label=f"{env} (client failed)" if env in lost else env)
    mean = results.get("mean_test_success", [])
    if mean:
        ax.plot(range(len(mean)), [100 * m for m in mean], color="black", linestyle="--", marker="s", label="mean")
    ax.set_xlabel("round (0 = base model, before any training)")
    ax.set_ylabel("held-out success (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(f"Fed-SE, {pathlib.Path(results['base_model']).name}, {results['topology']}, "
                 f"{len(results['envs'])} environments, {results['strategy']}")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def collect(reports: list[dict[str, Any]], client_envs: dict[str, tuple[str, ...]], cfg: RunConfig,
            wall_s: float, failed: Sequence[Failure] = (), stopped: str = "") -> dict[str, Any]:
    """The run's results (results.json), what `fedse run` and the experiment driver read:

    {"config": the RunConfig as a dict (less --replace), "topology", "base_model", "strategy", "rounds", "wall_s",
     "envs": {env: [{"round", "test_success" (that environment's held-out success), "test_tasks"
              (its test tasks evaluated), "upload_bytes" (bytes of the adapter its client uploaded
              that round; absent in the final, evaluation-only round), and its client's other
              metrics: "train_loss", "buffer", "kept", "eval_s", ...}, one per round its client
              reported: 0..rounds, fewer if the client failed (an environment whose client reported
              nothing is absent)]},
     "mean_test_success": [per round from 0, micro-averaged over all test tasks, while every
                           environment has reported: a round that a failed client did not report
                           has no mean, as it would average fewer environments than round 0's],
     "final_test_success": the same micro-average for the last global adapter phi_T (null if an
                           environment did not report it); with a selector, rounds where clients sat
                           out have no mean, but every client evaluates phi_T,
     "complete": every client finished every round (no client failed, the run was not stopped),
     "failed_clients": [Failure as a dict: client_id, process, envs, exit_code, reason, last_round
                        (the last round it reported, null if none), error, last_lines, log],
     "stopped": why the run was ended before its clients finished ("" if it was not)}
    """
    envs = env_rows(reports, client_envs)
    mean: list[float] = []
    for rnd in range(cfg.rounds + 1):
        m = round_mean(envs, cfg.env_list(), rnd)
        if m is None:
            break
        mean.append(m)
    config = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "replace"}  # how, not what, it ran
    return {"config": config, "topology": cfg.topology, "base_model": cfg.base_model,
            "strategy": cfg.strategy, "rounds": cfg.rounds, "wall_s": round(wall_s, 1), "envs": envs,
            "mean_test_success": mean, "final_test_success": round_mean(envs, cfg.env_list(), cfg.rounds),
            "complete": not failed and not stopped,
            "failed_clients": [dataclasses.asdict(f) for f in failed], "stopped": stopped}


def shortfall(results: dict[str, Any]) -> str:
    """Why a run did not finish, in one line ("" if it did)."""
    why = [f"{f['client_id']} failed ({f['reason']})" for f in results["failed_clients"]]
    return "; ".join(why + ([results["stopped"]] if results["stopped"] else []))


def describe_failure(client: Client, proc: Proc, reports: list[dict[str, Any]]) -> Failure:
    """The Failure of a client agent whose process exited non-zero."""
    code = proc.popen.returncode
    lines, error = log_summary(proc.log_path)
    last = max((r["round"] for r in reports if r["client_id"] == client.client_id), default=None)
    return Failure(client.client_id, proc.name, client.envs, code, exit_reason(code), last, error, lines,
                   str(proc.log_path))


def reported(f: Failure) -> str:
    """Which round a failed client reported last, as words."""
    return f"reported round {f.last_round} last" if f.last_round is not None else "reported no round"


def failure_text(f: Failure) -> str:
    """What `fedse run` says when a client fails: who, how, and how its log ends."""
    lines = [f"client {f.client_id} ({'+'.join(f.envs)}) failed: {f.reason}, exit code {f.exit_code}; it "
             f"{reported(f)}", f"  last error: {f.error or '(none logged)'}", f"  its log {f.log} ends with:"]
    return "\n".join(lines + [f"    {line}" for line in f.last_lines])


def closing_words(results: dict[str, Any]) -> list[str]:
    """What `fedse run` says of its results at the end: the mean before and after training, and why
    the run did not finish."""
    mean, lines = results["mean_test_success"], []
    if len(mean) > 1:
        lines.append(f"\nmean held-out success: {100 * mean[0]:.1f}% before round 1 -> {100 * mean[-1]:.1f}% after "
                     f"round {len(mean) - 1}")
    elif mean:
        lines.append(f"\nmean held-out success before round 1: {100 * mean[0]:.1f}%")
    final = results.get("final_test_success")
    if len(mean) <= results["rounds"] and final is not None:  # clients sat rounds out (a selector)
        lines.append(f"\nmean held-out success after round {results['rounds']}: {100 * final:.1f}% (rounds where "
                     "clients sat out have no mean)")
    elif mean and len(mean) <= results["rounds"]:
        lines.append(f"no mean after round {len(mean) - 1}: an environment did not report it")
    if not results["complete"]:
        lines.append(f"\nthe run did not finish: {shortfall(results)}")
    return lines

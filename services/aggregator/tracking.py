"""The run, tracked where researchers compare runs: TensorBoard, MLflow and Weights & Biases.

`--track KIND:WHERE` (repeatable) names each destination:

  tensorboard:DIR   event files under DIR/<run name>-<start time> (torch.utils.tensorboard's writer)
  mlflow:URI        a run in the MLflow experiment "fedse" at URI: a tracking server (http://...,
                    databricks) or a database (sqlite:///...); a local path is an SQLite database that
                    works offline: PATH itself where it ends in .db, else PATH/mlflow.db (mlflow_uri)
  wandb:PROJECT     a W&B run in PROJECT (wandb's own login or WANDB_API_KEY; WANDB_MODE=offline works)

Each is named by --run-name (the run id where it is empty): the MLflow and W&B run's name, the
TensorBoard folder's.

Only the aggregator tracks, so only it holds tracking credentials; clients send nothing more than
the metrics they already report. What goes out:
  - the run's settings, once: the aggregator's and those --run-settings names, typed, secrets and
    key paths left out (tracked_settings.py);
  - every client's report of round r as `<metric>/<client id>` at step r, as it arrives;
  - when round r closes, the mean over the clients that reported it as `<metric>/mean`, with
    `round/uploads`, `round/seconds` and `round/aggregate_seconds`; the final round (the clients'
    evaluation of the last adapter) has its mean once every member reported it, or when the
    aggregator stops.

A destination that fails never stops the run: the failure is logged and counted
(fedse_aggregator_tracking_errors_total), and the run goes on. Events are written by one
background thread, so a slow tracking server never holds up a round. A restarted aggregator
resumes the same TensorBoard directory, MLflow run and W&B run (their names are kept in
tracking.json beside the run's state).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib.util
import json
import logging
import os
import pathlib
import queue
import re
import threading
import time
from typing import Any, Iterator, Protocol

import prometheus_client

from fedse.files import atomic_write
from fedse.transport.serving import log_fields

from .tracked_settings import Value, path_name, public_settings, read_run_settings, recorded_settings

__all__ = ["ERRORS", "KINDS", "STATE_NAME", "Target", "Tracker", "check_installed", "mlflow_uri", "public_settings",
           "read_run_settings"]

log = logging.getLogger("aggregator.tracking")

KINDS = {
    "tensorboard": "tensorboard:DIR, event files under DIR (needs the tensorboard package)",
    "mlflow": "mlflow:URI, a tracking server, a database or a local path (needs mlflow or mlflow-skinny)",
    "wandb": "wandb:PROJECT, a Weights & Biases project (needs wandb)",
}
EXPERIMENT = "fedse"  # the MLflow experiment every run goes to; runs are named by --run-name
MLFLOW_DB = "mlflow.db"  # the SQLite database that mlflow:DIR keeps in DIR
STATE_NAME = "tracking.json"
CLOSE_TIMEOUT_S = 30.0

ERRORS = prometheus_client.Counter("fedse_aggregator_tracking_errors", "Events a tracking destination failed to "
                                   "take (logged; the run goes on).", ["backend"])
for _kind in KINDS:  # every backend's series exists from the start, at 0
    ERRORS.labels(_kind)


@dataclasses.dataclass(frozen=True)
class Target:
    kind: str
    where: str

    @classmethod
    def parse(cls, spec: str) -> "Target":
        kind, sep, where = spec.partition(":")
        if not sep or kind not in KINDS or not where.strip():
            raise ValueError(f"--track {spec!r}: give KIND:WHERE, one of " + "; ".join(KINDS.values()))
        return cls(kind, where.strip())


class Destination(Protocol):
    kind: str

    def settings(self, values: dict[str, Value]) -> None: ...

    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoard:
    kind = "tensorboard"

    def __init__(self, log_dir: pathlib.Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def settings(self, values: dict[str, Value]) -> None:
        from tensorboard.plugins.hparams import summary_v2 as hp  # typed, unlike torch's hparams()

        table = "| setting | value |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in values.items())
        self.writer.add_text("settings", table, 0)
        # The HParams dashboard's view of the run: its settings, against the mean held-out success.
        self.writer.file_writer.add_summary(hp.hparams_config_pb(
            hparams=[hp.HParam(k) for k in values], metrics=[hp.Metric("test_success/mean")]))
        self.writer.file_writer.add_summary(hp.hparams_pb(values))
        self.writer.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


MLFLOW_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")  # what MLflow allows in a metric or parameter name


def mlflow_uri(where: str) -> str:
    """The tracking URI of --track mlflow:WHERE: a URI (http(s)://, sqlite://, databricks, file:) as
    it is; a local path as an SQLite database, the store MLflow maintains: PATH where it ends in .db,
    else PATH/mlflow.db."""
    if "://" in where or where.startswith(("file:", "databricks")):
        return where
    path = pathlib.Path(where).expanduser().resolve()
    return f"sqlite:///{path if path.suffix == '.db' else path / MLFLOW_DB}"


@contextlib.contextmanager
def one_at_a_time(uri: str) -> Iterator[None]:
    """Holds an SQLite store's lock file (DB.lock) while a process opens the store: aggregators that
    start together (fedse run --topology local) would each make the database's tables at once,
    which fails. Makes the database's folder; other stores need no lock."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = pathlib.Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # let go when the file closes
        yield


class MLflow:
    kind = "mlflow"

    def __init__(self, where: str, run_name: str, run_id: str | None):
        uri = mlflow_uri(where)
        if uri.startswith("file:"):  # MLflow's file store, which MLflow 3 asks to opt in to
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        with one_at_a_time(uri):
            self.client = MlflowClient(tracking_uri=uri)
            if run_id is None:
                experiment = self._experiment()
                run_id = self.client.create_run(experiment, run_name=run_name).info.run_id
        self.run_id = run_id

    def _experiment(self) -> str:
        """The experiment's id, made if missing; another aggregator (fedse run --topology local
        starts several) may make it at the same moment, so a refused creation reads it again."""
        found = self.client.get_experiment_by_name(EXPERIMENT)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(EXPERIMENT)
        except Exception:  # noqa: BLE001 - it exists now (MLflow's error type differs by store)
            found = self.client.get_experiment_by_name(EXPERIMENT)
            if found is None:
                raise
            return found.experiment_id

    def settings(self, values: dict[str, Value]) -> None:
        from mlflow.entities import Param  # a parameter's value is text, whatever its type

        params = [Param(MLFLOW_KEY.sub("_", k), str(v)[:6000]) for k, v in values.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(MLFLOW_KEY.sub("_", k), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandB:
    kind = "wandb"

    def __init__(self, project: str, run_name: str, run_id: str | None, directory: pathlib.Path):
        import wandb

        self.run = wandb.init(project=project, name=run_name, id=run_id, resume="allow", dir=str(directory),
                              reinit="create_new")
        self.run_id = self.run.id

    def settings(self, values: dict[str, Value]) -> None:
        self.run.config.update(values, allow_val_change=True)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def check_installed(targets: list[Target]) -> None:
    """Raises ValueError, saying what to install, for a destination whose library is missing."""
    for t in targets:
        # Each kind is its library's module name; MLflow's SQLite store needs SQLAlchemy and Alembic besides.
        sqlite = t.kind == "mlflow" and mlflow_uri(t.where).startswith("sqlite:")
        missing = [m for m in (t.kind, *(("sqlalchemy", "alembic") if sqlite else ()))
                   if importlib.util.find_spec(m) is None]
        if missing:
            package = "wandb" if t.kind == "wandb" else \
                "fedse[track] (tensorboard, mlflow-skinny, and sqlalchemy and alembic for its database)"
            raise ValueError(f"--track {t.kind}:{t.where} needs the {missing[0]} package, which is not "
                             f"installed: pip install {package}")


class Tracker:
    """The run's destinations and the thread that writes to them. report(), round_closed() and
    close() are quick: they queue events (called under the round keeper's lock). The destinations
    are opened by that thread too, so an unreachable tracking server never delays the start.
    `settings` are the aggregator's (its config's fields): its run_name names the run (else
    `run_id`), and its run_settings file adds the run's and its clients' (tracked_settings.py)."""

    def __init__(self, targets: list[Target], root: pathlib.Path, run_id: str, num_rounds: int,
                 settings: dict[str, Any], reports: list[tuple[str, int, dict[str, float]]] = ()):
        check_installed(targets)
        try:
            recorded = recorded_settings(settings)
        except ValueError as exc:  # checked at start; a file changed since is no reason to stop the run
            log.error("the run's settings file could not be read; the aggregator's settings alone are recorded",
                      extra=log_fields(error=str(exc)[:300]))
            recorded = public_settings({k: v for k, v in settings.items() if k != "run_settings"})
        self.num_rounds = num_rounds
        self._rounds: dict[int, dict[str, dict[str, float]]] = {}  # round -> client -> its report
        for cid, r, values in reports:  # a restarted aggregator's means count what came before
            self._rounds.setdefault(r, {})[cid] = values
        self._final_logged = False
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue()
        self.destinations: list[Destination] = []
        self._thread = threading.Thread(target=self._write, args=(targets, root, settings.get("run_name") or run_id),
                                        name="tracking", daemon=True)
        self._thread.start()
        self._queue.put(("settings", recorded))

    def _open(self, targets: list[Target], root: pathlib.Path, name: str) -> None:
        """Each destination, resuming the one a previous start of this run opened, else a new one
        called `name`; one that fails to open is logged, counted and left out."""
        path = root / STATE_NAME
        kept: dict[str, str] = json.loads(path.read_text()) if path.exists() else {}
        started = time.strftime("%Y%m%d-%H%M%S")
        for t in targets:
            key = f"{t.kind}:{t.where}"
            try:
                if t.kind == "tensorboard":
                    folder = kept.get(key, f"{path_name(name)}-{started}")
                    d: Any = TensorBoard(pathlib.Path(t.where) / folder)
                    kept[key] = folder
                elif t.kind == "mlflow":
                    d = MLflow(t.where, name, kept.get(key))
                    kept[key] = d.run_id
                else:
                    d = WandB(t.where, name, kept.get(key), root)
                    kept[key] = d.run_id
            except Exception as exc:  # noqa: BLE001 - the run goes on without it
                ERRORS.labels(t.kind).inc()
                log.error("tracking destination could not be opened; the run goes on without it",
                          extra=log_fields(backend=t.kind, where=t.where, error=f"{type(exc).__name__}: {exc}"[:300]))
                continue
            self.destinations.append(d)
            log.info("tracking the run", extra=log_fields(backend=t.kind, where=t.where, name=kept[key]))
        atomic_write(path, json.dumps(kept, indent=1, sort_keys=True).encode())

    def report(self, client_id: str, round_: int, values: dict[str, float], members: int) -> None:
        """A client's report of a round (each recorded once, as the round keeper records it)."""
        self._rounds.setdefault(round_, {})[client_id] = dict(values)
        self._queue.put(("scalars", (round_, {f"{name}/{client_id}": v for name, v in values.items()})))
        if round_ == self.num_rounds and len(self._rounds[round_]) >= members and not self._final_logged:
            self._final_logged = True
            self._queue.put(("scalars", (round_, self._means(round_))))

    def round_closed(self, round_: int, uploads: int, seconds: float, aggregate_seconds: float) -> None:
        self._queue.put(("scalars", (round_, {**self._means(round_), "round/uploads": float(uploads),
                                              "round/seconds": seconds, "round/aggregate_seconds": aggregate_seconds})))

    def _means(self, round_: int) -> dict[str, float]:
        reports = list(self._rounds.get(round_, {}).values())
        names = sorted({name for values in reports for name in values})
        return {f"{name}/mean": sum(v[name] for v in reports if name in v) / sum(name in v for v in reports)
                for name in names}

    def close(self) -> None:
        """Writes what is queued (the final round's mean as it stands), then closes each destination."""
        if not self._final_logged and self._rounds.get(self.num_rounds):
            self._final_logged = True
            self._queue.put(("scalars", (self.num_rounds, self._means(self.num_rounds))))
        self._queue.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)

    def _write(self, targets: list[Target], root: pathlib.Path, name: str) -> None:
        self._open(targets, root, name)
        while (event := self._queue.get()) is not None:
            kind, payload = event
            for d in self.destinations:
                try:
                    if kind == "settings":
                        d.settings(payload)
                    else:
                        d.scalars(*payload)
                except Exception as exc:  # noqa: BLE001 - a tracking server's failure never stops the run
                    ERRORS.labels(d.kind).inc()
                    log.warning("tracking destination failed; the run goes on",
                                extra=log_fields(backend=d.kind, error=f"{type(exc).__name__}: {exc}"[:300]))
        for d in self.destinations:
            try:
                d.close()
            except Exception as exc:  # noqa: BLE001
                ERRORS.labels(d.kind).inc()
                log.warning("tracking destination failed to close",
                            extra=log_fields(backend=d.kind, error=f"{type(exc).__name__}: {exc}"[:300]))

"""The Fed-SE client loop: download phi_t, evaluate it, explore, keep successes, train, upload.

Round t (the README's "One round"): load the global adapter phi_t; evaluate it greedily on
held-out test tasks (only scalars leave the client); explore training tasks at temperature 1.0;
keep the successful trajectories; add them to the cumulative buffer D_t = D_{t-1} ∪ D_succ (D_0 =
the seed demonstrations: the expert's, and those of --demos files); fine-tune the LoRA on the whole
buffer; upload phi_{t,k}. After the last round the final global adapter is evaluated too, so the
metrics cover phi_0 (the untrained base) to phi_T.

Environments differ in what they offer (ListEnvironments): one without an expert is never asked for
expert actions (its D_0 comes from files, or it explores from nothing); in one that lists no
admissible actions the agent writes its action as ReAct text (prompts' ReAct variant), whatever
--policy says, and the action parsed from the text is sent (generation.ActionWriter.write_actions);
the text is kept and trained on. The round metrics then give the share of written turns whose text
named an action (`parseable_action_rate`, and per phase `eval_...` and `explore_...`).

The methods the paper compares change only parts of this loop (buffer.py defines the selections):
`--keep all` keeps failed explorations too ("no filter"); `--history round` trains round t on D_0
plus round t's kept trajectories only ("no history"); `--explore-tasks 0` never explores, so every
round trains on D_0 (FedIT, Local, Centralized); `--env a,b` holds several environments (the
Centralized client): D_0, exploration and evaluation cover each, training pools them, and the
metrics give each environment's success (`test_success/<env>`, `test_tasks/<env>`) beside their
micro-average (`test_success`).

Every step that matters is recorded before the next begins, so a client killed at any point and
started again continues where it was: `progress.json` (written atomically) names the run, the
round and the last phase finished ("explored", "trained", "uploaded", "reported"); the trained
adapter is saved to `upload.safetensors` before it is uploaded. `decide_resume` (resume.py) turns the
recorded progress and the aggregator's status into where to start. Exploration and training are
seeded from (seed, round), so a resumed round gives the adapter an uninterrupted one would have;
each environment of a client is seeded as a client holding it alone is, so a Centralized client
draws the demonstrations and exploration tasks the federated clients draw.

The agent is built of parts, each a module: rounds.RoundLoop (which rounds it plays), phases.RoundPhases
(a round's phases) and federation.exchange.AdapterExchange (downloads and uploads); the guardian's
choice of rank, micro-batch and precision is training.sizing's. This module holds what they share:
the model, the environments, the state directory, joining the run and resuming.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import resource
from typing import Any, Iterator

import grpc
import torch

from fedse.model import adapter as ad
from fedse.machine import available_cores, available_memory_bytes, matmul_peak, resident_bytes
from fedse.progress import PhaseProgress
from fedse.transport.serving import log_fields
from fedse.v1 import federation_pb2 as fpb

from services.client_agent.training import demos as demo_files
from services.client_agent.training import guardian
from services.client_agent.model import loading as mdl
from services.client_agent.model.shared import SharedModel, shared_settings
from services.client_agent.training.buffer import Buffer, Trajectory
from services.client_agent.config import ClientConfig
from services.client_agent.playing.envclient import EnvClient, EnvInfo
from services.client_agent.federation.exchange import AdapterExchange
from services.client_agent.federation.link import FederationClient, refuse_insecure
from services.client_agent.federation.heartbeat import DEFAULT_HEARTBEAT_INTERVAL_S, Heartbeat, RoundPhase
from services.client_agent.metrics import (FLOPS, LORA_RANK, MFU, PEAK_FLOPS, PRIVACY_EPSILON, TOKENS, TRAIN_BATCH_TOKENS,
                                           init_client)
from services.client_agent.phases import RoundPhases
from services.client_agent.playing.episodes import Player
from services.client_agent.playing.prompts import is_tiny
from services.client_agent.resume import Progress, Resume, decide_resume
from services.client_agent.playing.rollout import expert_policy
from services.client_agent.rounds import RoundLoop
from services.client_agent.training.seeding import seed_buffer
from services.client_agent.training.sizing import choose_sizing, sizing_metrics, with_choice
from services.client_agent.state import StateDir
from services.client_agent.playing.tasks import EnvTasks, capabilities, env_tasks, writing
from services.client_agent.training.trainer import ActivationCost, Checkpointing

log = logging.getLogger("client_agent")


def count_work(phase: str, kind: str | None, tokens: int, flops: float) -> None:
    """The model's work (work.Work) on the Prometheus counters, as it is counted."""
    if kind is not None and tokens:
        TOKENS.labels(phase, kind).inc(tokens)
    if flops:
        FLOPS.labels(phase).inc(flops)


class ClientAgent(RoundLoop, RoundPhases, AdapterExchange):
    """One organisation's Fed-SE client: `run` joins the run and plays it to the end."""

    def __init__(self, config: ClientConfig, demos: dict[str, list[Trajectory]] | None = None,
                 shared: SharedModel | None = None):
        """`demos`: the --demos files' demonstrations by environment (demos.load_demos), where the
        caller read them already; else they are read here, first, so that a malformed file stops the
        client (demos.DemoError, a ConfigError) before it loads a model or joins a run. `shared`: the
        model, where a client host lends it (model.shared; its settings must be this config's, and the
        host has set torch's threads); else the agent loads its own."""
        self.cfg = config
        self.demos = demos if demos is not None else demo_files.load_demos(config.demos, config.env_list())
        init_client(config.client_id, config.env)
        if shared is None:
            torch.set_num_threads(config.torch_threads or available_cores())
        self.state = StateDir(pathlib.Path(config.state_dir) / config.client_id)
        names = config.env_list()
        env_server = EnvClient(config.env_server, names[0], security=None if config.env_server_plain else config,
                               retry_s=config.env_retry_s)
        self.envs = [env_server.with_env(name) for name in names]  # one channel to the env server
        self.fed = FederationClient(config.aggregator, config.client_id, transport_dtype=config.transport_dtype,
                                    security=config)
        self.heartbeat = Heartbeat(self.fed, config.heartbeat_interval_s or DEFAULT_HEARTBEAT_INTERVAL_S)
        self.sizing: guardian.Sizing | None = None
        if shared is None:
            with PhaseProgress(log, "loading the model", None, "", base_model=config.base_model):
                base, tokenizer = mdl.load_base(config.base_model, config.device or None, seed=config.seed)
                if config.guardian:  # before Join: the rank it joins with is the guardian's choice
                    config = self.cfg = self.sized(base, config)
            shared = SharedModel(config, base, tokenizer)
        elif shared.settings != shared_settings(config):
            raise ValueError(f"the shared model was built for {shared.settings}, not {shared_settings(config)}")
        LORA_RANK.set(config.lora_r)
        TRAIN_BATCH_TOKENS.set(config.train_batch_tokens)
        self.shared = shared
        self.model, self.tokenizer, self.device = shared.model, shared.tokenizer, shared.device
        self.precision, self.max_prompt_tokens = shared.precision, shared.max_prompt_tokens
        self.tokenize, self.fmt, self.react_fmt = shared.tokenize, shared.fmt, shared.react_fmt
        self.writes: set[str] = set()  # the environments that list no actions (run() asks the env server)
        self.player = Player(config, self.model, self.tokenizer, self.precision, self.max_prompt_tokens, self.fmt,
                             self.react_fmt, self.tokenize)
        self.work = self.player.scorer.work
        self.work.watch(count_work)
        self._peak_flops: float | None = None
        self._activation_cost: ActivationCost | None = None  # measured at the first training
        log.info("model ready", extra=log_fields(base_model=config.base_model, device=str(self.device),
                                                 precision=self.precision, threads=torch.get_num_threads(),
                                                 prompt_format=type(self.fmt).__name__,
                                                 scoring=self.player.scorer.layout.name, action_scores=config.scoring,
                                                 concurrency=self.player.concurrency))
        self.buffer = Buffer(self.state.buffer_path)
        self.budget = guardian.PrivacyBudget(config.privacy_epsilon, config.privacy_delta,
                                             self.state.path / "privacy.json")
        self.history: list[dict[str, float]] = []
        self.run_id = ""
        self.run_config = fpb.RunConfig()  # the run's settings, from Join
        self.schema: ad.Schema | None = None
        self.progress: Progress | None = None
        self.loaded_round: int | None = None  # the global adapter the model holds unchanged, if any

    @contextlib.contextmanager
    def model_use(self) -> Iterator[None]:
        """Exclusive use of the model for the block (SharedModel.use): a round's phases from loading the
        global adapter to the trained adapter saved. Where another member of a client host used the model
        since, its LoRA weights are not the ones this agent loaded: the global adapter is loaded again
        (`loaded_round` forgotten) and the scorer's caches, computed under those weights, go."""
        with self.shared.use(self) as changed:
            if changed:
                self.loaded_round = None
                self.player.scorer.forget()
            yield

    def sized(self, base, config: ClientConfig) -> ClientConfig:
        """The config with the guardian's rank, micro-batch and precision (sizing.choose_sizing): the largest
        that fit this machine, up to the run's maximum rank where the run takes mixed ranks, at the run's
        rank where it takes one (the rank its clients joined with; 8 before any did)."""
        self.sizing = choose_sizing(base, config, self.fed, self.state.path / "guardian.json")
        return with_choice(config, self.sizing.chosen)

    def guardian_metrics(self) -> dict[str, float]:
        """The guardian's choices and the privacy budget, as a round's report carries them."""
        return sizing_metrics(self.sizing, self.budget, self.cfg)

    # ---- environments ----------------------------------------------------------------------
    def env_tasks(self, env: EnvClient, info: EnvInfo | None = None) -> EnvTasks:
        """The environment's training tasks (this member's share, with --task-share), the test tasks
        evaluated (the first --eval-tasks) and its capabilities (`info`, from ListEnvironments; an
        expert and listed actions if not given)."""
        return env_tasks(env, self.cfg.eval_tasks, info, self.cfg.task_share, self.cfg.task_split, self.cfg.seed)

    def capabilities(self) -> dict[str, EnvInfo]:
        """What each of this client's environments offers (tasks.capabilities); records the
        environments where the agent writes its actions (`writes`)."""
        infos = capabilities(self.envs, self.cfg.env_server, self.player.write_tokens, is_tiny(self.model),
                             self.cfg.base_model)
        self.writes = writing(infos)
        return infos

    # ---- state on disk -----------------------------------------------------------------------
    def record(self, progress: Progress) -> None:
        self.state.write_progress(progress)
        self.progress = progress

    def seed_buffer(self, tasks: list[EnvTasks]) -> None:
        """Adds the seed demonstrations D_0 that the buffer lacks (seeding.seed_buffer): the --demos
        files' and, where an environment has an expert, its successes on --expert-demos tasks."""
        seed_buffer(self.buffer, tasks, self.demos, self.cfg.expert_demos, self.cfg.seed,
                    lambda task, ids: self.player.episodes(task.env, ids, lambda: expert_policy(task.env), -1,
                                                           "expert"))

    def resume(self, plan: Resume, tasks: list[EnvTasks]) -> None:
        """Brings the state directory to where `plan` starts."""
        old = self.progress
        if plan.action == "fresh":
            if old is not None or self.state.buffer_path.exists():
                log.warning("starting fresh", extra=log_fields(reason=plan.reason))
            if self.state.set_aside(old):
                self.buffer = Buffer(self.state.buffer_path)
            self.progress = None
            self.seed_buffer(tasks)
            self.record(Progress(self.run_id, -1, "seeded"))
            return
        log.info("resuming", extra=log_fields(action=plan.action, round=plan.round, after=plan.phase or None,
                                              reason=plan.reason))
        dropped = self.buffer.drop_rounds_from(plan.drop_from)
        if dropped:
            log.warning("dropped trajectories of an unfinished exploration",
                        extra=log_fields(from_round=plan.drop_from, trajectories=dropped))
        self.seed_buffer(tasks)
        if plan.missed is not None and old is not None:
            try:
                self.fed.report(old.round, old.metrics)
                self.history.append({"round": float(old.round), **old.metrics})
            except grpc.RpcError as exc:
                log.warning("late metrics report refused", extra=log_fields(round=old.round, code=exc.code().name))

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> list[dict[str, float]]:
        cfg = self.cfg
        state = mdl.get_adapter_state(self.model)
        schema = ad.Schema.of(state, mdl.adapter_config_json(self.model))
        self.envs[0].ready()  # a connection that cannot be made ends the run here, with its reason
        joined = self.fed.join(cfg.env, cfg.base_model, schema)
        self.run_config, self.schema = joined.config, schema
        # Before anything is trained or uploaded: a client that requires secure aggregation ends here,
        # with one line (InsecureRun), when the run has none, and one with mTLS files when its keys
        # would not be signed.
        refuse_insecure(cfg.require_secure_aggregation, joined.config, cfg.signs_keys)
        self.budget.start(joined.config)  # a privacy budget needs noise this client adds itself
        num_rounds = joined.config.num_rounds
        self.heartbeat.interval_s = (cfg.heartbeat_interval_s or joined.config.heartbeat_interval_s
                                     or DEFAULT_HEARTBEAT_INTERVAL_S)
        self.heartbeat.set(RoundPhase.JOINING, joined.current_round)
        self.heartbeat.start()
        try:
            infos = self.capabilities()
            tasks = [self.env_tasks(env, infos[env.env]) for env in self.envs]
            log.info("joined", extra=log_fields(run_id=joined.config.run_id, rounds=num_rounds,
                                                round=joined.current_round, envs=[t.name for t in tasks],
                                                train_tasks=sum(len(t.train_ids) for t in tasks),
                                                test_tasks=sum(len(t.test_ids) for t in tasks)))
            self.heartbeat.set(RoundPhase.WAITING)
            st = self.fed.wait_until(lambda s: s.state in (fpb.ROUND_STATE_OPEN, fpb.ROUND_STATE_FINISHED),
                                     timeout_s=cfg.round_timeout_s)
            self.run_id = st.run_id or joined.config.run_id
            self.progress = self.state.read_progress()
            plan = decide_resume(self.progress, self.run_id, st.round)
            self.resume(plan, tasks)
            round_, done = plan.round, plan.phase
            if joined.config.mode == "async":
                self.fed.max_staleness = joined.config.async_max_staleness
                self.run_async(round_, done, tasks)
            else:
                self.run_rounds(round_, done, st, tasks)
        except BaseException:
            self.heartbeat.stop(timeout_s=1.0)
            raise
        self.heartbeat.set(RoundPhase.DONE)
        self.heartbeat.stop()
        return self.history

    # ---- the machine and the report -------------------------------------------------------
    def checkpointing(self) -> bool | Checkpointing:
        """Which layers of a real model recompute their activations in training: the fewest that keep a
        micro-batch's activations within a quarter of the memory this client has left (--memory-limit-mb,
        else the machine's or container's), so that several clients of one machine training at once stay
        within it; none where the whole micro-batch fits (the tiny model never needs it)."""
        if is_tiny(self.model):
            return False
        if self._activation_cost is None:
            self._activation_cost = ActivationCost.measure(self.model, self.precision, self.device)
            log.info("training activations measured", extra=log_fields(
                kb_per_token=round(self._activation_cost.per_token / 1e3),
                kb_per_token_checkpointed=round(self._activation_cost.checkpointed_per_token / 1e3)))
        return Checkpointing(self._activation_cost, self.memory_left() / 4)

    def memory_left(self) -> int:
        """What this client may still hold, in bytes: --memory-limit-mb (else what the GPU has free plus
        what this client holds there, or the container's limit or the machine's available memory)
        less what it holds now."""
        limit = self.cfg.memory_limit_mb * 1_000_000 or available_memory_bytes(self.device)
        return max(0, limit - resident_bytes(self.device))

    def work_done(self, before, phase: str, seconds: float) -> dict[str, float]:
        """The model's work in one phase since `before` (Work.snapshot), as round metrics, with its
        MFU against this machine's matmul peak at the model's precision (measured once, at the first
        phase that ran the model, and again where a phase ran faster than it) also on the MFU gauge."""
        if self._peak_flops is None and self.work.tokens != before[0]:
            self._peak_flops = matmul_peak(self.precision, self.device)
            PEAK_FLOPS.set(self._peak_flops)
        done = self.work.since(before, phase, seconds, self._peak_flops)
        if done.get(f"{phase}_mfu", 0.0) > 1.0:  # the peak was measured while other processes held the cores
            self._peak_flops = matmul_peak(self.precision, self.device, again=True)
            PEAK_FLOPS.set(self._peak_flops)
            done = self.work.since(before, phase, seconds, self._peak_flops)
        if f"{phase}_mfu" in done:
            MFU.labels(phase).set(done[f"{phase}_mfu"])
        return done

    def finish_round(self, round_: int, metrics: dict[str, Any]) -> None:
        # The most memory this process has held so far (Linux reports kB), for sizing its pod.
        metrics["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if self._peak_flops:  # what its MFU figures are measured against
            metrics["peak_flops"] = self._peak_flops
        metrics.update(self.guardian_metrics())
        PRIVACY_EPSILON.set(self.budget.spent() if self.budget.active else 0.0)
        metrics = {k: float(v) for k, v in metrics.items()}
        self.fed.report(round_, metrics)
        self.history.append({"round": float(round_), **metrics})
        log.info("round done", extra=log_fields(round=round_, **{k: round(v, 4) for k, v in metrics.items()}))

    def close(self) -> None:
        self.heartbeat.stop()
        self.envs[0].close_channel()
        self.fed.close()

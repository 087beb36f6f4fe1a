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
"""

from __future__ import annotations

import dataclasses
import logging
import math
import pathlib
import resource
import time
from typing import Any

import grpc
import torch

from fedse.model import adapter as ad
from fedse.model import ranks
from fedse.privacy import secagg
from fedse.agents.asking import Asker
from fedse.privacy.secagg import SecureError
from fedse.machine import available_cores, available_memory_bytes, matmul_peak, release_free_memory, resident_bytes
from fedse.progress import PhaseProgress
from fedse.transport.serving import log_fields
from fedse.v1 import federation_pb2 as fpb

from services.client_agent.training import demos as demo_files
from services.client_agent.training import guardian
from services.client_agent.model import loading as mdl
from services.client_agent.training.buffer import Buffer, Trajectory, to_keep, training_set
from services.client_agent.config import ClientConfig
from services.client_agent.playing.envclient import EnvClient, EnvInfo
from services.client_agent.federation.link import FederationClient, InsecureRun, StaleRound, refuse_insecure, selected
from services.client_agent.federation.heartbeat import DEFAULT_HEARTBEAT_INTERVAL_S, Heartbeat, RoundPhase
from services.client_agent.metrics import (BUFFER, FLOPS, KEPT, LORA_RANK, LOSS, MFU, PEAK_FLOPS, PHASE_SECONDS, PRIVACY_EPSILON, ROUND,
                      ROUNDS_DECLINED, TOKENS, TRAIN_BATCH_TOKENS, TRAIN_SECONDS, init_client)
from services.client_agent.playing.episodes import Player
from services.client_agent.playing.prompts import TokenCache, default_max_prompt_tokens, is_tiny, make_format
from services.client_agent.resume import Phase, Progress, Resume, decide_resume
from services.client_agent.playing.rollout import expert_policy
from services.client_agent.federation.secure import Contribution, SecureRound, client_protection
from services.client_agent.training.seeding import count_demos, seed_buffer
from services.client_agent.state import StateDir
from services.client_agent.playing.tasks import EnvTasks, capabilities, env_tasks, writing
from services.client_agent.training.trainer import ActivationCost, Checkpointing, train_lora, training_examples

log = logging.getLogger("client_agent")


def count_work(phase: str, kind: str | None, tokens: int, flops: float) -> None:
    """The model's work (work.Work) on the Prometheus counters, as it is counted."""
    if kind is not None and tokens:
        TOKENS.labels(phase, kind).inc(tokens)
    if flops:
        FLOPS.labels(phase).inc(flops)


@dataclasses.dataclass
class _Round:
    """The round a client is playing: what its phases share."""

    round: int
    final: bool  # after the last round: only evaluate phi_T and report
    tasks: list[EnvTasks]
    progress: Progress | None  # the latest record of this round
    metrics: dict[str, float]


class ClientAgent:
    def __init__(self, config: ClientConfig, demos: dict[str, list[Trajectory]] | None = None):
        """`demos`: the --demos files' demonstrations by environment (demos.load_demos), where the
        caller read them already; else they are read here, first, so that a malformed file stops the
        client (demos.DemoError, a ConfigError) before it loads a model or joins a run."""
        self.cfg = config
        self.demos = demos if demos is not None else demo_files.load_demos(config.demos, config.env_list())
        init_client(config.client_id, config.env)
        torch.set_num_threads(config.torch_threads or available_cores())
        self.state = StateDir(pathlib.Path(config.state_dir) / config.client_id)
        names = config.env_list()
        env_server = EnvClient(config.env_server, names[0], security=None if config.env_server_plain else config,
                               retry_s=config.env_retry_s)
        self.envs = [env_server.with_env(name) for name in names]  # one channel to the env server
        self.fed = FederationClient(config.aggregator, config.client_id, transport_dtype=config.transport_dtype,
                                    security=config)
        self.heartbeat = Heartbeat(self.fed, config.heartbeat_interval_s or DEFAULT_HEARTBEAT_INTERVAL_S)
        with PhaseProgress(log, "loading the model", None, "", base_model=config.base_model):
            base, self.tokenizer = mdl.load_base(config.base_model, config.device or None, seed=config.seed)
            self.sizing: guardian.Sizing | None = None
            if config.guardian:  # before Join: the rank it joins with is the guardian's choice
                config = self.cfg = self.sized(base, config)
        LORA_RANK.set(config.lora_r)
        TRAIN_BATCH_TOKENS.set(config.train_batch_tokens)
        self.model = mdl.add_lora(base, r=config.lora_r, alpha=config.lora_alpha, dropout=config.lora_dropout,
                                  target_modules=config.lora_targets(), seed=config.seed)
        self.device = next(self.model.parameters()).device
        self.precision = mdl.run_in(config.precision, self.model, self.device)
        self.max_prompt_tokens = default_max_prompt_tokens(self.model)
        # One tokenizer cache for the prompt format's window checks, the scorer and training: the
        # prompt a window check tokenized is the one the scorer then scores.
        self.tokenize = TokenCache(self.tokenizer)
        self.fmt = make_format(self.model, self.tokenizer, config.max_history, self.max_prompt_tokens, self.tokenize)
        # The format where the agent writes its own ReAct text (environments that list no actions).
        self.react_fmt = self.fmt.as_react()
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

    def sized(self, base, config: ClientConfig) -> ClientConfig:
        """The config with the guardian's rank, micro-batch and precision (guardian.size): the largest that
        fit this machine, up to the run's maximum rank where the run takes mixed ranks, at the run's
        rank where it takes one (the rank its clients joined with; 8 before any did)."""
        top, fixed = guardian.DEFAULT_TOP_RANK, 0
        try:
            run = self.fed.run_status()
            ranks_seen = {c.lora_rank for c in run.clients if c.lora_rank}
            if run.config.max_lora_rank:
                top = run.config.max_lora_rank
            else:
                fixed = ranks_seen.pop() if len(ranks_seen) == 1 else 8
        except grpc.RpcError as exc:
            fixed = 8
            log.warning("the run's ranks are unknown; the guardian sizes for rank 8",
                        extra=log_fields(code=exc.code().name))
        context = {"base_model": config.base_model, "top_rank": top, "fixed_rank": fixed,
                   "pins": [config.lora_r, config.train_batch_tokens, config.precision, config.memory_limit_mb]}
        kept = guardian.load_sizing(self.state.path / "guardian.json", context)
        if kept is not None:  # a restart: the rank this client joined (and uploads) with
            log.info("guardian keeps its earlier choice", extra=log_fields(reason=kept.reason()))
            self.sizing = kept
            return self.apply(config, kept.chosen)
        device, width = next(base.parameters()).device, default_max_prompt_tokens(base)
        extra = 0 if is_tiny(base) else config.score_cache_mb * 1_000_000
        sizing = guardian.size(base, config, device, width, top, fixed,
                               config.memory_limit_mb * 1_000_000, extra,
                               on_try=lambda c: log.info("guardian measured", extra=log_fields(
                                   lora_r=c.lora_r, train_batch_tokens=c.batch_tokens, precision=c.precision,
                                   step_mb=round(c.step_bytes / 1e6), need_mb=round(c.need_bytes / 1e6))))
        if config.guardian_model:
            options = guardian.alternatives(base, config, sizing, device, width, extra, fixed)
            asker = Asker(max_new_tokens=48, max_seconds=30.0)
            name = config.base_model if config.guardian_model == "base" else config.guardian_model
            sizing = guardian.advise(sizing, options, lambda prompt: asker.answer(name, prompt), config.guardian_notes)
        guardian.log_sizing(sizing)
        guardian.save_sizing(self.state.path / "guardian.json", sizing, context)
        self.sizing = sizing
        return self.apply(config, sizing.chosen)

    @staticmethod
    def apply(config: ClientConfig, c: guardian.Candidate) -> ClientConfig:
        """The config with the guardian's choice (guardian.alpha_for: alpha keeps its ratio where it chose the rank)."""
        return dataclasses.replace(config, lora_r=c.lora_r, train_batch_tokens=c.batch_tokens, precision=c.precision,
                                   lora_alpha=guardian.alpha_for(config, c.lora_r))

    def guardian_metrics(self) -> dict[str, float]:
        """The guardian's choices and the privacy budget, as a round's report carries them."""
        out = self.budget.metrics()
        if self.sizing is not None:
            c = self.sizing.chosen
            out.update(guardian_rank=float(c.lora_r), guardian_batch_tokens=float(c.batch_tokens),
                       guardian_bf16=float(c.precision == "bf16"), guardian_need_mb=c.need_bytes / 1e6)
            if self.cfg.guardian_model:
                out["guardian_fallback"] = float(bool(self.sizing.fallback))
        return out

    # ---- environments ----------------------------------------------------------------------
    def env_tasks(self, env: EnvClient, info: EnvInfo | None = None) -> EnvTasks:
        """The environment's training tasks, the test tasks evaluated (the first --eval-tasks) and
        its capabilities (`info`, from ListEnvironments; an expert and listed actions if not given)."""
        return env_tasks(env, self.cfg.eval_tasks, info)

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

    def load_global(self, round_: int) -> None:
        with PHASE_SECONDS.labels("download").time():
            g = self.fed.download(round_)
        mdl.set_adapter_state(self.model, self.own_rank(g.adapter()))
        self.loaded_round = round_

    def own_rank(self, adapter: ad.Adapter) -> ad.Adapter:
        """A global adapter as this client trains from it: in a mixed-rank run (RunConfig.max_lora_rank),
        brought from the run's rank to this client's rank and scaling, after checking that it is at the
        rank the run says (what the aggregator sends is checked, not trusted)."""
        top = self.run_config.max_lora_rank
        if not top:
            return adapter
        try:
            ad.check_tensors(ranks.run_schema(self.schema, top), adapter, dtypes=False,
                             expected_by=f"a run of maximum LoRA rank {top}")
        except ad.AdapterError as exc:
            raise mdl.AdapterMismatch(f"the global adapter does not fit this run: {exc}") from None
        if not all(torch.isfinite(t).all() for t in adapter.values()):
            raise mdl.AdapterMismatch("the global adapter holds NaN or infinite values")
        own = ranks.scaling(self.schema.adapter_config_json)
        return ranks.to_own_rank(adapter, self.run_config.strategy, self.cfg.lora_r, own)

    def run_rank_adapter(self, adapter: ad.Adapter) -> ad.Adapter:
        """This client's adapter as the run's rank-R adapter (zero-padded, B scaled; fedse.model.ranks.padded): what
        it masks under secure aggregation in a mixed-rank run. As it is in a run of one rank."""
        top = self.run_config.max_lora_rank
        if not top:
            return adapter
        return ranks.padded(adapter, top, ranks.scaling(self.schema.adapter_config_json) / ranks.RUN_SCALING)

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

    def run_rounds(self, round_: int, done: str, st: fpb.RoundStatus, tasks: list[EnvTasks]) -> None:
        """Synchronous rounds: plays each round from `round_` (after phase `done`) to the final evaluation,
        sitting out a round the aggregator chose other clients for (RoundStatus.selected) unless it is
        chosen while that round is still open (topped up in place of a chosen client that died)."""
        me, sat_out = self.cfg.client_id, False
        while True:
            ROUND.set(round_)
            final = st.state == fpb.ROUND_STATE_FINISHED or round_ >= self.run_config.num_rounds
            taking = final or done or selected(st, me)
            sat_out = not taking
            if taking and not final and not self.take_release(round_):
                pass  # declined: the organisation's privacy budget allows no more releases of its data
            elif taking:
                self.play_round(round_, done, final, tasks)
            else:  # the aggregator chose other clients for this round: wait for the next
                log.info("not selected for this round; waiting for the next",
                         extra=log_fields(round=round_, selected=len(st.selected), joined=len(st.joined)))
                self.heartbeat.set(RoundPhase.NOT_SELECTED, round_)
            if final:
                break
            if self.heartbeat.phase[1] not in (RoundPhase.NOT_SELECTED.value, RoundPhase.DECLINED.value):
                self.heartbeat.set(RoundPhase.WAITING, round_)
            with PHASE_SECONDS.labels("wait").time():
                st = self.fed.wait_until(
                    lambda s, r=round_, out=sat_out: (s.round > r and s.state in (fpb.ROUND_STATE_OPEN,
                                                                                 fpb.ROUND_STATE_FINISHED))
                    or (out and s.round == r and s.state == fpb.ROUND_STATE_OPEN and selected(s, me)),
                    timeout_s=self.cfg.round_timeout_s)
            if st.round == round_:
                log.info("chosen for this round in place of a client that dropped out", extra=log_fields(round=round_))
            elif st.round > round_ + 1 and st.state == fpb.ROUND_STATE_OPEN:
                log.warning("catching up", extra=log_fields(last_round=round_, open_round=st.round))
            round_, done = st.round, ""

    def run_async(self, round_: int, done: str, tasks: list[EnvTasks]) -> None:
        """Asynchronous rounds (RunConfig.mode "async"): whenever the aggregator gives this client a
        training slot (RoundStatus.selected) on a version newer than the last it trained from, it plays
        that version as a round (download, evaluate, explore, train, upload); once the run finished, it
        evaluates the final version. `round_`, `done`: where the resumed progress stands.

        Each version it would upload to takes a release from the privacy budget first (`take_release`),
        as a synchronous round does. Once the budget declines one, every later one would be declined
        too (a run's releases all cost the same), so the client trains no more: its heartbeat says
        "declined", the aggregator frees its slot and gives it none (a held slot would keep the buffer
        from folding), and it follows the versions until the run finishes, then evaluates the final one."""
        me, last, declined = self.cfg.client_id, -1, False
        if done:  # a version under way before a restart: finish it (an upload may still be taken)
            final = round_ >= self.run_config.num_rounds
            declined = not final and not self.take_release(round_)
            if not declined:
                self.play_round(round_, done, final, tasks)
            if final:
                return
            last = round_
        while True:
            if not declined:
                self.heartbeat.set(RoundPhase.WAITING, last)
            with PHASE_SECONDS.labels("wait").time():
                st = self.fed.wait_until(lambda s: s.round > last and (declined or (
                    s.state == fpb.ROUND_STATE_OPEN and selected(s, me))), timeout_s=self.cfg.round_timeout_s)
            ROUND.set(st.round)
            if st.state == fpb.ROUND_STATE_FINISHED:
                self.play_round(st.round, "", True, tasks)
                return
            declined = declined or not self.take_release(st.round)
            if not declined:
                self.play_round(st.round, "", False, tasks)
            last = st.round

    def take_release(self, round_: int) -> bool:
        """Books round `round_`'s release of this organisation's data in its privacy budget, before anything
        is trained or uploaded (guardian.PrivacyBudget.take); False where the budget declines it: logged,
        the heartbeat says "declined" (the aggregator does not wait for this client) and counted."""
        declined = self.budget.take(round_)
        if declined is None:
            return True
        log.warning("declining this round: the privacy budget is spent",
                    extra=log_fields(round=round_, reason=declined))
        self.heartbeat.set(RoundPhase.DECLINED, round_)
        ROUNDS_DECLINED.inc()
        return False

    def play_round(self, round_: int, done: str, final: bool, tasks: list[EnvTasks]) -> None:
        """Runs round `round_` on from the phase after `done` ("" = from the start) to "reported":
        one method per phase, each recording where it ended before the next begins."""
        p = self.progress if done else None
        r = _Round(round_, final, tasks, p, dict(p.metrics) if p else {})
        steps = {Phase.START: self._evaluate_and_explore, Phase.EXPLORED: self._train_and_save,
                 Phase.TRAINED: self._upload_saved, Phase.UPLOADED: self._report}
        phase = Phase(done)
        while phase is not Phase.REPORTED:
            phase = steps[phase](r)

    def _evaluate_and_explore(self, r: _Round) -> Phase:
        self.heartbeat.set(RoundPhase.EVALUATING, r.round)
        self.load_global(r.round)
        started = time.perf_counter()
        since = self.player.written_so_far()
        before = self.work.snapshot()
        # Acting only, until training: each LoRA layer runs as one merged matmul (model.merged_lora),
        # where a merged copy of the weights takes at most half the memory left.
        with mdl.merged_lora(self.model, max_bytes=self.memory_left() // 2):
            with self.work.phase("eval"):
                r.metrics = self.player.evaluate(r.tasks, r.round)
            r.metrics["eval_s"] = time.perf_counter() - started
            r.metrics.update(self.work_done(before, "eval", r.metrics["eval_s"]))
            PHASE_SECONDS.labels("eval").observe(r.metrics["eval_s"])
            if r.final:  # after the last round: only evaluate phi_T and report
                r.metrics["buffer"] = float(len(self.buffer))
                r.metrics.update(count_demos(self.buffer, r.tasks))
                self.player.parseable_since(since, r.metrics, "parseable_action_rate")
                self.finish_round(r.round, r.metrics)
                self.record(Progress(self.run_id, r.round, Phase.REPORTED.value, metrics=r.metrics))
                return Phase.REPORTED
            self.heartbeat.set(RoundPhase.EXPLORING, r.round)
            successes, explored = self.explore(r.round, r.tasks)
        r.metrics.update(explored)
        self.player.parseable_since(since, r.metrics, "parseable_action_rate")
        r.progress = Progress(self.run_id, r.round, Phase.EXPLORED.value, num_successes=successes, metrics=r.metrics)
        self.record(r.progress)
        return Phase.EXPLORED

    def _train_and_save(self, r: _Round) -> Phase:
        assert r.progress is not None
        self.heartbeat.set(RoundPhase.TRAINING, r.round)
        if self.loaded_round != r.round:
            self.load_global(r.round)
        data, num_examples, trained = self.train(r.round)
        self.state.save_upload(data)
        r.metrics.update(trained)
        r.progress = dataclasses.replace(r.progress, phase=Phase.TRAINED.value, sha256=ad.sha256_hex(data),
                                         num_examples=num_examples, transport_dtype=self.cfg.transport_dtype,
                                         metrics=r.metrics)
        self.record(r.progress)
        return Phase.TRAINED

    def _upload_saved(self, r: _Round) -> Phase:
        assert r.progress is not None
        data = self.state.saved_upload(r.progress)
        if data is None:
            return Phase.EXPLORED  # train again
        self.heartbeat.set(RoundPhase.UPLOADING, r.round)
        if self.upload(r.progress, data, r.metrics):
            r.progress = dataclasses.replace(r.progress, phase=Phase.UPLOADED.value, metrics=r.metrics)
            self.record(r.progress)
        return Phase.UPLOADED  # acknowledged, or the round closed without it: report either way

    def _report(self, r: _Round) -> Phase:
        assert r.progress is not None
        self.finish_round(r.round, r.metrics)
        self.record(dataclasses.replace(r.progress, phase=Phase.REPORTED.value, metrics=r.metrics))
        return Phase.REPORTED

    def explore(self, round_: int, tasks: list[EnvTasks]) -> tuple[int, dict[str, float]]:
        """Explores this round's training tasks of every environment and appends what --keep keeps
        to the buffer. Returns the successes (what --strategy weighted weighs) and the metrics: kept
        trajectories, the buffer and its seed demonstrations by source (`demos_expert`, `demos_file`:
        D_0, apart from what exploration kept), `explore_success` (none with --explore-tasks 0) and,
        where the agent writes its actions, `explore_parseable_action_rate`."""
        t0 = time.perf_counter()
        since = self.player.written_so_far()
        before = self.work.snapshot()
        with self.work.phase("explore"):
            trajs = self.player.explore(tasks, round_, self.cfg.seed * 100_003 + round_)
        kept = to_keep(trajs, self.cfg.keep)
        self.buffer.extend(kept)
        successes = sum(t.success for t in trajs)
        KEPT.inc(sum(t.success for t in kept))
        BUFFER.set(len(self.buffer))
        PHASE_SECONDS.labels("explore").observe(time.perf_counter() - t0)
        metrics = {"kept": float(len(kept)), "buffer": float(len(self.buffer)), **count_demos(self.buffer, tasks),
                   "explore_s": time.perf_counter() - t0}
        metrics.update(self.work_done(before, "explore", metrics["explore_s"]))
        if trajs:
            metrics["explore_success"] = successes / len(trajs)
        self.player.parseable_since(since, metrics, "explore_parseable_action_rate")
        return successes, metrics

    def train(self, round_: int) -> tuple[bytes, int, dict[str, float]]:
        """Trains the LoRA (from the loaded phi_round) on the round's training set (--history); the
        adapter's bytes in the transport dtype. Seeded from (seed, round), dropout included, so a
        retrained round matches."""
        cfg = self.cfg
        seed = cfg.seed * 100_003 + round_
        t1 = time.perf_counter()
        trajectories = training_set(self.buffer.trajectories, cfg.history, round_)
        examples = training_examples(trajectories, self.fmt, self.tokenize, self.max_prompt_tokens, self.react_fmt,
                                     self.writes)
        if not examples:
            log.warning("nothing to train on this round: no demonstration and no kept exploration yet; the "
                        "adapter goes back as it came", extra=log_fields(round=round_, history=cfg.history))
        turns = sum(e.turns for e in examples)
        devices = [] if self.device.type != "cuda" else \
            [self.device.index if self.device.index is not None else torch.cuda.current_device()]
        before = self.work.snapshot()
        with torch.random.fork_rng(devices=devices), self.work.phase("train"), PhaseProgress(  # steps: at the first
                log, RoundPhase.TRAINING.value, None, "steps", round=round_, tokens=self.work.totals) as progress:
            torch.manual_seed(seed)
            result = train_lora(self.model, self.tokenizer, examples, epochs=cfg.epochs, lr=cfg.lr,
                                batch_size=cfg.batch_size, seed=seed, max_batch_tokens=cfg.train_batch_tokens or None,
                                checkpointing=self.checkpointing(), precision=self.precision,
                                release_memory=not is_tiny(self.model), work=self.work,
                                progress=lambda step: progress.advance(total=step["steps"]))
        self.loaded_round = None
        release_free_memory()
        t2 = time.perf_counter()
        TRAIN_SECONDS.inc(t2 - t1)
        PHASE_SECONDS.labels("train").observe(t2 - t1)
        data = ad.encode_transport(mdl.get_adapter_state(self.model), cfg.transport_dtype)
        metrics = {"examples": float(turns), "sequences": float(len(examples)), "train_s": t2 - t1,
                   "upload_bytes": float(len(data)), "train_recomputed": result["recomputed"],
                   **self.work_done(before, "train", t2 - t1)}
        if math.isfinite(result["loss"]):  # no loss where nothing was trained (metrics are finite values)
            LOSS.set(result["loss"])
            metrics["train_loss"] = result["loss"]
        return data, turns, metrics

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

    def upload(self, p: Progress, data: bytes, metrics: dict[str, float]) -> bool:
        """Uploads the saved adapter; True once the aggregator acknowledged it. False when the round
        closed without it (StaleRound: logged, the metrics say so, the agent catches up with the
        open round) or when the aggregator holds a different adapter of ours for the round. Never a
        plain upload from a client that requires secure aggregation, whatever the run's settings became
        since the check at Join (a re-join): InsecureRun ends the client instead."""
        if self.cfg.require_secure_aggregation and not self.run_config.secure_aggregation:
            log.error("refusing a plain upload: this client requires secure aggregation",
                      extra=log_fields(round=p.round, run_id=self.run_config.run_id))
            raise InsecureRun(self.run_config.run_id)
        try:
            with PHASE_SECONDS.labels("upload").time():
                if self.run_config.secure_aggregation:
                    if not self.secure_upload(p, data):
                        metrics["upload_stale"] = 1.0
                        return False
                    return True
                self.fed.upload(p.round, data, num_examples=p.num_examples, num_successes=p.num_successes,
                                adapter_config_json=mdl.adapter_config_json(self.model),
                                transport_dtype=p.transport_dtype, sha256=p.sha256)  # checked by saved_upload
        except SecureError as exc:  # an adapter a masked vector cannot carry, or an aggregator asking for what
            # this client's protection refuses: the round goes on without it
            log.error("this client sits this round out of secure aggregation",
                      extra=log_fields(round=p.round, reason=str(exc)))
            metrics["upload_refused"] = 1.0
            return False
        except StaleRound as exc:
            log.warning("round closed before our upload; catching up with the next round",
                        extra=log_fields(round=p.round, open_round=exc.open_round, detail=str(exc)))
            metrics["upload_stale"] = 1.0
            return False
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
            # Only after a retrain that gave other bytes (a nondeterministic device): the aggregator
            # counts the adapter it accepted first.
            log.error("the aggregator holds a different adapter of ours for this round; it counts that one",
                      extra=log_fields(round=p.round, detail=exc.details()))
            metrics["upload_duplicate"] = 1.0
            return False
        return True

    def secure_upload(self, p: Progress, data: bytes) -> bool:
        """Takes part in the round's secure stages with the saved adapter (secure.SecureRound); True once
        the round closed with it in the sum."""
        cfg = self.run_config
        previous = self.fed.download(p.round).adapter() if cfg.clip_norm > 0 else None
        contribution = Contribution(self.run_rank_adapter(ad.decode_transport(data)), previous,
                                    p.num_successes if cfg.strategy == "weighted" else 1,
                                    rank=ranks.rank_of(self.schema) if cfg.max_lora_rank else 0)  # as it joined
        schema = ranks.run_schema(self.schema, cfg.max_lora_rank) if cfg.max_lora_rank else self.schema
        layout = secagg.Layout.of(schema, cfg.strategy)
        protection = client_protection(self.cfg, self.state.path)
        secure = SecureRound(self.fed, self.run_id, cfg, layout, self.cfg.round_timeout_s, protection)
        return secure.take_part(p.round, contribution, lambda step: log.info(
            "secure aggregation", extra=log_fields(round=p.round, step=step)))

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

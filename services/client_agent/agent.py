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
import os
import pathlib
import random
import re
import resource
import time
from typing import Any, Callable

import grpc
import torch

from fedse import adapter as ad
from fedse.files import atomic_write, fsync_dir
from fedse.machine import available_cores, release_free_memory
from fedse.progress import PhaseProgress
from fedse.serving import log_fields
from fedse.v1 import federation_pb2 as fpb

from . import demos as demo_files
from . import model as mdl
from .buffer import DEMO_SOURCES, Buffer, Trajectory, to_keep, training_set
from .config import ClientConfig
from .envclient import EnvClient, EnvInfo, SessionLost
from .federation import FederationClient, StaleRound
from .heartbeat import DEFAULT_HEARTBEAT_INTERVAL_S, Heartbeat, RoundPhase
from .metrics import (BUFFER, DEMOS, EPISODES, KEPT, LOSS, PHASE_SECONDS, ROUND, STEPS, TEST_SUCCESS, TRAIN_SECONDS,
                      WRITTEN, init_client)
from .generation import ActionWriter
from .policy import ActionScorer
from .prompts import (Encoded, PromptFormat, TokenCache, default_max_prompt_tokens, encode_trajectory, inner_model,
                      is_tiny, make_format)
from .resume import (PROGRESS_NAME, Phase, Progress, ProgressError, Resume, decide_resume, read_progress,
                     write_progress)
from .rollout import Live, Policy, expert_policy, run_episodes
from .trainer import train_lora

log = logging.getLogger("client_agent")

UPLOAD_NAME = "upload.safetensors"
BUFFER_NAME = "buffer.jsonl"
# How the progress lines name the phases whose episodes they count.
PHASE_WORDS = {"eval": RoundPhase.EVALUATING.value, "explore": RoundPhase.EXPLORING.value,
               "expert": "expert demonstrations"}
# How many times in a row one phase's episodes start over because the env server lost their sessions.
MAX_EPISODE_RESTARTS = 10


def training_examples(trajectories: list[Trajectory], fmt: PromptFormat, tokenize: TokenCache,
                      max_prompt_tokens: int, react_fmt: PromptFormat | None = None,
                      writes: frozenset[str] | set[str] = frozenset()) -> list[Encoded]:
    """The training sequences of every turn of every trajectory, each turn's prompt as the agent
    saw it (prompts.encode_trajectory); the loss covers only the agent's text.

    In the environments of `writes` (they list no actions) the agent writes its text: their
    trajectories train in `react_fmt` on each turn's whole written text (thought and action). In the
    others it picks among listed actions, by scoring "Action: <action>" (or generating just that
    line), so they train on exactly that, even where a demonstration file gave the turn a thought:
    learning to write thoughts first would teach nothing scoring uses."""
    out: list[Encoded] = []
    for t in trajectories:
        if t.env in writes and react_fmt is not None:
            out += encode_trajectory(react_fmt, tokenize, t.instruction, t.turns, max_prompt_tokens, t.texts)
        else:
            out += encode_trajectory(fmt, tokenize, t.instruction, t.turns, max_prompt_tokens)
    return out


@dataclasses.dataclass(frozen=True)
class EnvTasks:
    """One environment this client holds: its env server client, its training tasks, the test
    tasks it evaluates, and what it offers (an expert; listed actions, else the agent writes them)."""

    env: EnvClient
    train_ids: list[int]
    test_ids: list[int]
    has_expert: bool = True
    lists_actions: bool = True

    @property
    def name(self) -> str:
        return self.env.env


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:64] or "unknown"


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
        self.dir = pathlib.Path(config.state_dir) / config.client_id
        self.dir.mkdir(parents=True, exist_ok=True)
        names = config.env_list()
        env_server = EnvClient(config.env_server, names[0], security=None if config.env_server_plain else config,
                               retry_s=config.env_retry_s)
        self.envs = [env_server.with_env(name) for name in names]  # one channel to the env server
        self.fed = FederationClient(config.aggregator, config.client_id, transport_dtype=config.transport_dtype,
                                    security=config)
        self.heartbeat = Heartbeat(self.fed, config.heartbeat_interval_s or DEFAULT_HEARTBEAT_INTERVAL_S)
        base, self.tokenizer = mdl.load_base(config.base_model, config.device or None, seed=config.seed)
        self.model = mdl.add_lora(base, r=config.lora_r, alpha=config.lora_alpha, dropout=config.lora_dropout,
                                  target_modules=config.lora_targets(), seed=config.seed)
        self.device = next(self.model.parameters()).device
        self.precision = mdl.pick_precision(config.precision, self.model, self.device)
        if self.precision == "bf16" and self.device.type == "cpu":
            mdl.store_frozen_linears_in_bf16(self.model)
        self.max_prompt_tokens = default_max_prompt_tokens(self.model)
        # One tokenizer cache for the prompt format's window checks, the scorer and training: the
        # prompt a window check tokenized is the one the scorer then scores.
        self.tokenize = TokenCache(self.tokenizer)
        self.fmt = make_format(self.model, self.tokenizer, config.max_history, self.max_prompt_tokens, self.tokenize)
        # The format where the agent writes its own ReAct text (environments that list no actions).
        self.react_fmt = self.fmt.as_react()
        self.write_tokens = self._write_tokens(config.max_new_tokens)
        self.writes: set[str] = set()  # the environments that list no actions (run() asks the env server)
        self.scorer = ActionScorer(self.model, self.tokenizer, self.device, max_prompt_tokens=self.max_prompt_tokens,
                                   fmt=self.fmt, precision=self.precision, cache_bytes=config.score_cache_mb << 20,
                                   tokenize=self.tokenize, scoring=config.scoring)
        self.writer = ActionWriter(self.scorer)
        self.concurrency = config.concurrency or (16 if self.scorer.layout.batches_prompts else 4)
        log.info("model ready", extra=log_fields(base_model=config.base_model, device=str(self.device),
                                                 precision=self.precision, threads=torch.get_num_threads(),
                                                 prompt_format=type(self.fmt).__name__,
                                                 scoring=self.scorer.layout.name, action_scores=config.scoring,
                                                 concurrency=self.concurrency))
        self.buffer = Buffer(self.dir / BUFFER_NAME)
        self.history: list[dict[str, float]] = []
        self.run_id = ""
        self.progress: Progress | None = None
        self.loaded_round: int | None = None  # the global adapter the model holds unchanged, if any

    def _write_tokens(self, wanted: int) -> int:
        """--max-new-tokens, less what would run past the model's positions after a full prompt."""
        limit = getattr(getattr(inner_model(self.model), "config", None), "max_position_embeddings", None)
        if isinstance(limit, int) and self.max_prompt_tokens + wanted > limit:
            cut = max(limit - self.max_prompt_tokens, 1)
            log.warning("--max-new-tokens cut to fit the model's positions after a full prompt", extra=log_fields(
                asked=wanted, used=cut, max_prompt_tokens=self.max_prompt_tokens, max_positions=limit))
            return cut
        return wanted

    # ---- policies --------------------------------------------------------------------------
    def model_policy(self, greedy: bool, generator: torch.Generator, writes: bool = False,
                     phase: str = "eval") -> Policy:
        """The model's policy: in an environment that lists actions, --policy's choice among them; in
        one that does not (`writes`), the ReAct text it writes (greedy, or sampled at --temperature)
        and the action parsed from it, counted by `phase` in fedse_client_written_actions."""
        def write(states: list[Live]) -> list:
            prompts = [self.react_fmt.prompt(s.session.instruction, s.turns, s.observation.text, s.texts)
                       for s in states]
            written = self.writer.write_actions(prompts, self.write_tokens, greedy=greedy,
                                                temperature=self.cfg.temperature, generator=generator,
                                                opening=self.react_fmt.opening)
            parsed = sum(w.parsed for w in written)
            WRITTEN.labels(phase, "parsed").inc(parsed)
            WRITTEN.labels(phase, "unparsed").inc(len(written) - parsed)
            return written

        def choose(states: list[Live]) -> list[str]:
            prompts = [self.fmt.prompt(s.session.instruction, s.turns, s.observation.text) for s in states]
            candidates = [s.observation.actions for s in states]
            if self.cfg.policy == "generate":
                return self.writer.generate_actions(prompts, candidates)
            picks = self.scorer.choose(prompts, candidates, greedy=greedy, generator=generator,
                                       temperature=self.cfg.temperature)
            return [c[i] for c, i in zip(candidates, picks)]
        return write if writes else choose

    def episodes(self, env: EnvClient, task_ids: list[int], make_policy: Callable[[], Policy], round_: int,
                 phase: str) -> list[Trajectory]:
        """The episodes of `task_ids` under a policy from make_policy(). If the env server loses their
        sessions (it restarted), they are all played again from the start under a fresh policy: the
        partial trajectories are dropped, and the draws of a seeded policy repeat, so the phase gives
        what an uninterrupted one gives (episodes finished before the loss are played again too: their
        draws came from the same generator)."""
        def count(t: Trajectory) -> None:
            STEPS.labels(phase).inc(len(t.turns))
            EPISODES.labels(phase, "success" if t.success else "failure").inc()
            progress.advance()
        restarts = 0
        while True:
            self.scorer.forget()  # the weights may have changed since the cached prompts were run
            progress = PhaseProgress(log, PHASE_WORDS.get(phase, phase), len(task_ids), "episodes", env=env.env,
                                     round=round_)
            try:
                return run_episodes(env, task_ids, make_policy(), self.concurrency, round_, phase, on_episode=count,
                                    on_turns=progress.steps)
            except SessionLost as exc:
                restarts += 1
                if restarts > MAX_EPISODE_RESTARTS:
                    raise
                log.warning("env server lost our sessions; the episodes start again", extra=log_fields(
                    env=env.env, phase=phase, round=round_, episodes=len(task_ids), restart=restarts,
                    reason=str(exc)))
            finally:
                self.scorer.forget()  # its memory is the trainer's now
                release_free_memory()

    def env_tasks(self, env: EnvClient, info: EnvInfo | None = None) -> EnvTasks:
        """The environment's training tasks, the test tasks evaluated (the first --eval-tasks) and
        its capabilities (`info`, from ListEnvironments; an expert and listed actions if not given)."""
        info = info or EnvInfo(env.env)
        train_ids, _ = env.tasks("train")
        test_ids, _ = env.tasks("test")
        return EnvTasks(env, train_ids, test_ids[: self.cfg.eval_tasks] if self.cfg.eval_tasks else test_ids,
                        has_expert=info.has_expert, lists_actions=info.lists_actions)

    def capabilities(self) -> dict[str, EnvInfo]:
        """What each of this client's environments offers (ListEnvironments), logged; records the
        environments where the agent writes its actions (`writes`)."""
        hosted = self.envs[0].environments()
        missing = [e.env for e in self.envs if e.env not in hosted]
        if missing:
            raise RuntimeError(f"the env server at {self.cfg.env_server} hosts {', '.join(hosted) or 'nothing'}, "
                               f"not {', '.join(missing)}: fix --env or the env server's --envs")
        infos = {e.env: hosted[e.env] for e in self.envs}
        self.writes = {name for name, info in infos.items() if not info.lists_actions}
        for name, info in infos.items():
            log.info("environment", extra=log_fields(env=name, has_expert=info.has_expert,
                                                     lists_actions=info.lists_actions, max_turns=info.max_turns))
            if not info.lists_actions:
                log.info("the environment lists no actions: the agent writes each action as ReAct text "
                         "(\"Thought: ... Action: ...\"), whatever --policy says, and the action parsed from it is "
                         "sent", extra=log_fields(env=name, max_new_tokens=self.write_tokens))
        if self.writes and is_tiny(self.model):
            log.warning("the embedded tiny model cannot learn where it must write its actions: a byte-level model "
                        "built in code from random weights does not write valid actions without a list to choose "
                        "from, so this run will learn nothing in these environments (it runs, and "
                        "parseable_action_rate shows how rarely its text names an action); use a real model, e.g. "
                        "--base-model models/smollm2-135m-instruct (`make model`)",
                        extra=log_fields(envs=sorted(self.writes), base_model=self.cfg.base_model))
        return infos

    def evaluate(self, tasks: list[EnvTasks], round_: int) -> dict[str, float]:
        """Greedy success of the loaded adapter on each environment's test tasks (`test_success/<env>`
        over `test_tasks/<env>` tasks) and over all of them (`test_success`); with --policy generate, also
        the share of steps whose text named no admissible action (`eval_fallback_rate`); where the
        agent writes its actions, the share of written turns that named one (`eval_parseable_action_rate`)."""
        metrics: dict[str, float] = {}
        successes = episodes = 0
        generated, fallbacks = self.writer.generated, self.writer.fallbacks
        since = self.written_so_far()
        for task in tasks:
            trajs = self.episodes(task.env, task.test_ids,
                                  lambda t=task: self.model_policy(True, torch.Generator().manual_seed(0),
                                                                   writes=not t.lists_actions, phase="eval"),
                                  round_, "eval")
            ok = sum(t.success for t in trajs)
            metrics[f"test_success/{task.name}"] = ok / max(1, len(trajs))
            metrics[f"test_tasks/{task.name}"] = float(len(trajs))
            TEST_SUCCESS.labels(task.name).set(metrics[f"test_success/{task.name}"])
            successes, episodes = successes + ok, episodes + len(trajs)
        metrics["test_success"] = successes / max(1, episodes)
        if self.writer.generated > generated:  # --policy generate: how often the text named no admissible action
            metrics["eval_fallback_rate"] = (self.writer.fallbacks - fallbacks) / (self.writer.generated - generated)
        self.parseable_since(since, metrics, "eval_parseable_action_rate")  # environments without listed actions
        return metrics

    # ---- state on disk -----------------------------------------------------------------------
    def record(self, progress: Progress) -> None:
        write_progress(self.dir / PROGRESS_NAME, progress)
        self.progress = progress

    def load_progress(self) -> Progress | None:
        try:
            return read_progress(self.dir / PROGRESS_NAME)
        except ProgressError as exc:
            log.warning("progress file unreadable; starting this run afresh",
                        extra=log_fields(path=str(self.dir / PROGRESS_NAME), error=str(exc)))
            return None

    def set_aside(self, old: Progress | None) -> None:
        """Moves the state directory aside (never deletes it) and starts an empty one."""
        names = (BUFFER_NAME, PROGRESS_NAME, UPLOAD_NAME)
        if not any((self.dir / n).exists() and (self.dir / n).stat().st_size for n in names):
            return
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        base = f"{self.dir.name}.aside-{_slug(old.run_id if old else 'unknown')}-{stamp}"
        target = self.dir.with_name(base)
        n = 1
        while target.exists():
            target, n = self.dir.with_name(f"{base}-{n}"), n + 1
        os.replace(self.dir, target)
        fsync_dir(self.dir.parent)
        self.dir.mkdir(parents=True)
        self.buffer = Buffer(self.dir / BUFFER_NAME)
        log.warning("previous client state set aside", extra=log_fields(moved_to=str(target)))

    def saved_upload(self, p: Progress) -> bytes | None:
        try:
            data = (self.dir / UPLOAD_NAME).read_bytes()
        except FileNotFoundError:
            data = b""
        if ad.sha256_hex(data) != p.sha256:
            log.error("saved adapter missing or damaged; training the round again",
                      extra=log_fields(round=p.round, path=str(self.dir / UPLOAD_NAME)))
            return None
        return data

    # ---- the loop ----------------------------------------------------------------------------
    def seed_buffer(self, tasks: list[EnvTasks]) -> None:
        """Adds the seed demonstrations D_0 of every environment, each source once (what the buffer
        holds already is never added again, so a resumed client does not seed twice): the --demos
        files' demonstrations, and where the environment has an expert, its successful demonstrations
        of --expert-demos tasks sampled from --seed alone, per environment. An environment without an
        expert is never asked for one: it is seeded from files, or not at all (it explores alone)."""
        have = {(t.env, t.source) for t in self.buffer.trajectories if t.round < 0}
        for task in tasks:
            files = self.demos.get(task.name, [])
            if files and (task.name, "file") not in have:
                self.buffer.extend(files)
                log.info("buffer seeded with demonstrations from files",
                         extra=log_fields(env=task.name, demos=len(files), turns=sum(len(t.turns) for t in files)))
            if not task.has_expert:
                if files:
                    log.info("the environment has no expert: its seed demonstrations are the files' only",
                             extra=log_fields(env=task.name, demos=len(files)))
                else:
                    log.warning("the environment has no expert and no demonstration files (--demos): the agent "
                                "explores it alone, and trains on nothing there until an exploration succeeds",
                                extra=log_fields(env=task.name))
                continue
            if self.cfg.expert_demos == 0 or (task.name, "expert") in have:
                continue
            rng = random.Random(self.cfg.seed)
            ids = rng.sample(task.train_ids, min(self.cfg.expert_demos, len(task.train_ids)))
            demos = self.episodes(task.env, ids, lambda env=task.env: expert_policy(env), -1, "expert")
            kept = [t for t in demos if t.success]
            self.buffer.extend(kept)
            log.info("buffer seeded with expert demonstrations",
                     extra=log_fields(env=task.name, demos=len(demos), successful=len(kept)))
        self.count_demos(tasks)

    def count_demos(self, tasks: list[EnvTasks]) -> dict[str, float]:
        """The seed demonstrations in the buffer by source, over all environments (`demos_expert`,
        `demos_file`: round metrics), and per environment in fedse_client_demonstrations."""
        totals = {source: 0 for source in DEMO_SOURCES}
        for task in tasks:
            for source in DEMO_SOURCES:
                n = sum(t.env == task.name and t.source == source for t in self.buffer.trajectories)
                DEMOS.labels(task.name, source).set(n)
                totals[source] += n
        BUFFER.set(len(self.buffer))
        return {f"demos_{source}": float(n) for source, n in totals.items()}

    def load_global(self, round_: int) -> None:
        with PHASE_SECONDS.labels("download").time():
            g = self.fed.download(round_)
        mdl.set_adapter_state(self.model, g.adapter())
        self.loaded_round = round_

    def resume(self, plan: Resume, tasks: list[EnvTasks]) -> None:
        """Brings the state directory to where `plan` starts."""
        old = self.progress
        if plan.action == "fresh":
            if old is not None or (self.dir / BUFFER_NAME).exists():
                log.warning("starting fresh", extra=log_fields(reason=plan.reason))
            self.set_aside(old)
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

    def run(self) -> list[dict[str, float]]:
        cfg = self.cfg
        state = mdl.get_adapter_state(self.model)
        schema = ad.Schema.of(state, mdl.adapter_config_json(self.model))
        joined = self.fed.join(cfg.env, cfg.base_model, schema)
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
            self.progress = self.load_progress()
            plan = decide_resume(self.progress, self.run_id, st.round)
            self.resume(plan, tasks)
            round_, done = plan.round, plan.phase
            while True:
                ROUND.set(round_)
                final = st.state == fpb.ROUND_STATE_FINISHED or round_ >= num_rounds
                self.play_round(round_, done, final, tasks)
                if final:
                    break
                self.heartbeat.set(RoundPhase.WAITING, round_)
                with PHASE_SECONDS.labels("wait").time():
                    st = self.fed.wait_until(
                        lambda s, r=round_: s.round > r and s.state in (fpb.ROUND_STATE_OPEN, fpb.ROUND_STATE_FINISHED),
                        timeout_s=cfg.round_timeout_s)
                if st.round > round_ + 1 and st.state == fpb.ROUND_STATE_OPEN:
                    log.warning("catching up", extra=log_fields(last_round=round_, open_round=st.round))
                round_, done = st.round, ""
        except BaseException:
            self.heartbeat.stop(timeout_s=1.0)
            raise
        self.heartbeat.set(RoundPhase.DONE)
        self.heartbeat.stop()
        return self.history

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

    def written_so_far(self) -> tuple[int, int]:
        """The writer's count of turns written and of those that named no action, for parseable_since."""
        return self.writer.written, self.writer.unparsed

    def parseable_since(self, since: tuple[int, int], metrics: dict[str, float], key: str) -> None:
        """Sets metrics[key]: of the turns written since `since` (written_so_far), the share whose text
        named an action; nothing where none were written."""
        written, unparsed = self.writer.written - since[0], self.writer.unparsed - since[1]
        if written:
            metrics[key] = 1 - unparsed / written

    def _evaluate_and_explore(self, r: _Round) -> Phase:
        self.heartbeat.set(RoundPhase.EVALUATING, r.round)
        self.load_global(r.round)
        started = time.perf_counter()
        since = self.written_so_far()
        r.metrics = self.evaluate(r.tasks, r.round)
        r.metrics["eval_s"] = time.perf_counter() - started
        PHASE_SECONDS.labels("eval").observe(r.metrics["eval_s"])
        if r.final:  # after the last round: only evaluate phi_T and report
            r.metrics["buffer"] = float(len(self.buffer))
            r.metrics.update(self.count_demos(r.tasks))
            self.parseable_since(since, r.metrics, "parseable_action_rate")
            self.finish_round(r.round, r.metrics)
            self.record(Progress(self.run_id, r.round, Phase.REPORTED.value, metrics=r.metrics))
            return Phase.REPORTED
        self.heartbeat.set(RoundPhase.EXPLORING, r.round)
        successes, explored = self.explore(r.round, r.tasks)
        r.metrics.update(explored)
        self.parseable_since(since, r.metrics, "parseable_action_rate")
        r.progress = Progress(self.run_id, r.round, Phase.EXPLORED.value, num_successes=successes, metrics=r.metrics)
        self.record(r.progress)
        return Phase.EXPLORED

    def _train_and_save(self, r: _Round) -> Phase:
        assert r.progress is not None
        self.heartbeat.set(RoundPhase.TRAINING, r.round)
        if self.loaded_round != r.round:
            self.load_global(r.round)
        data, num_examples, trained = self.train(r.round)
        atomic_write(self.dir / UPLOAD_NAME, data)
        r.metrics.update(trained)
        r.progress = dataclasses.replace(r.progress, phase=Phase.TRAINED.value, sha256=ad.sha256_hex(data),
                                         num_examples=num_examples, transport_dtype=self.cfg.transport_dtype,
                                         metrics=r.metrics)
        self.record(r.progress)
        return Phase.TRAINED

    def _upload_saved(self, r: _Round) -> Phase:
        assert r.progress is not None
        data = self.saved_upload(r.progress)
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
        cfg = self.cfg
        seed = cfg.seed * 100_003 + round_
        t0 = time.perf_counter()
        trajs: list[Trajectory] = []
        since = self.written_so_far()
        for task in tasks:
            ids = random.Random(seed).sample(task.train_ids, min(cfg.explore_tasks, len(task.train_ids)))
            trajs += self.episodes(task.env, ids,
                                   lambda t=task: self.model_policy(False, torch.Generator().manual_seed(seed),
                                                                    writes=not t.lists_actions, phase="explore"),
                                   round_, "explore")
        kept = to_keep(trajs, cfg.keep)
        self.buffer.extend(kept)
        successes = sum(t.success for t in trajs)
        KEPT.inc(sum(t.success for t in kept))
        BUFFER.set(len(self.buffer))
        PHASE_SECONDS.labels("explore").observe(time.perf_counter() - t0)
        metrics = {"kept": float(len(kept)), "buffer": float(len(self.buffer)), **self.count_demos(tasks),
                   "explore_s": time.perf_counter() - t0}
        if trajs:
            metrics["explore_success"] = successes / len(trajs)
        self.parseable_since(since, metrics, "explore_parseable_action_rate")
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
        progress: list[PhaseProgress] = []  # made at the first step, which knows how many there are

        def on_step(step: dict) -> None:
            if not progress:
                progress.append(PhaseProgress(log, RoundPhase.TRAINING.value, step["steps"], "steps", round=round_))
            progress[0].advance()
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            result = train_lora(self.model, self.tokenizer, examples, epochs=cfg.epochs, lr=cfg.lr,
                                batch_size=cfg.batch_size, seed=seed, max_batch_tokens=cfg.train_batch_tokens or None,
                                checkpointing=not is_tiny(self.model), precision=self.precision,
                                release_memory=not is_tiny(self.model), progress=on_step)
        self.loaded_round = None
        release_free_memory()
        t2 = time.perf_counter()
        TRAIN_SECONDS.inc(t2 - t1)
        PHASE_SECONDS.labels("train").observe(t2 - t1)
        data = ad.encode_transport(mdl.get_adapter_state(self.model), cfg.transport_dtype)
        metrics = {"examples": float(turns), "sequences": float(len(examples)), "train_s": t2 - t1,
                   "upload_bytes": float(len(data))}
        if math.isfinite(result["loss"]):  # no loss where nothing was trained (metrics are finite values)
            LOSS.set(result["loss"])
            metrics["train_loss"] = result["loss"]
        return data, turns, metrics

    def upload(self, p: Progress, data: bytes, metrics: dict[str, float]) -> bool:
        """Uploads the saved adapter; True once the aggregator acknowledged it. False when the round
        closed without it (StaleRound: logged, the metrics say so, the agent catches up with the
        open round) or when the aggregator holds a different adapter of ours for the round."""
        try:
            with PHASE_SECONDS.labels("upload").time():
                self.fed.upload(p.round, data, num_examples=p.num_examples, num_successes=p.num_successes,
                                adapter_config_json=mdl.adapter_config_json(self.model),
                                transport_dtype=p.transport_dtype, sha256=p.sha256)  # checked by saved_upload
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

    def finish_round(self, round_: int, metrics: dict[str, Any]) -> None:
        # The most memory this process has held so far (Linux reports kB), for sizing its pod.
        metrics["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        metrics = {k: float(v) for k, v in metrics.items()}
        self.fed.report(round_, metrics)
        self.history.append({"round": float(round_), **metrics})
        log.info("round done", extra=log_fields(round=round_, **{k: round(v, 4) for k, v in metrics.items()}))

    def close(self) -> None:
        self.heartbeat.stop()
        self.envs[0].close_channel()
        self.fed.close()

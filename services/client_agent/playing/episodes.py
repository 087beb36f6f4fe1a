"""Playing a client's episodes with its model: the model's policy (--policy's choice among listed
actions, or the ReAct text it writes where an environment lists none), episodes played again from
the start when the env server loses their sessions, and the evaluation and exploration phases'
episodes and metrics."""

from __future__ import annotations

import logging
import random
from typing import Callable

import torch

from fedse.machine import release_free_memory
from fedse.progress import PhaseProgress
from fedse.transport.serving import log_fields

from services.client_agent.training.buffer import Trajectory
from services.client_agent.config import ClientConfig
from services.client_agent.playing.envclient import EnvClient, SessionLost
from services.client_agent.playing.generation import ActionWriter
from services.client_agent.federation.heartbeat import RoundPhase
from services.client_agent.metrics import EPISODES, STEPS, TEST_SUCCESS, WRITTEN
from services.client_agent.playing.policy import ActionScorer
from services.client_agent.playing.prompts import PromptFormat, TokenCache, inner_model
from services.client_agent.playing.rollout import Live, Policy, run_episodes
from services.client_agent.playing.tasks import EnvTasks

log = logging.getLogger("client_agent")

# How the progress lines name the phases whose episodes they count.
PHASE_WORDS = {"eval": RoundPhase.EVALUATING.value, "explore": RoundPhase.EXPLORING.value,
               "expert": "expert demonstrations"}
# How many times in a row one phase's episodes start over because the env server lost their sessions.
MAX_EPISODE_RESTARTS = 10


def write_tokens(model, max_prompt_tokens: int, wanted: int) -> int:
    """--max-new-tokens, less what would run past the model's positions after a full prompt."""
    limit = getattr(getattr(inner_model(model), "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and max_prompt_tokens + wanted > limit:
        cut = max(limit - max_prompt_tokens, 1)
        log.warning("--max-new-tokens cut to fit the model's positions after a full prompt", extra=log_fields(
            asked=wanted, used=cut, max_prompt_tokens=max_prompt_tokens, max_positions=limit))
        return cut
    return wanted


class Player:
    """Plays episodes with the model in `fmt` (in `react_fmt` where it writes its actions)."""

    def __init__(self, cfg: ClientConfig, model, tokenizer, precision: str, max_prompt_tokens: int,
                 fmt: PromptFormat, react_fmt: PromptFormat, tokenize: TokenCache):
        self.cfg = cfg
        self.fmt, self.react_fmt = fmt, react_fmt
        self.write_tokens = write_tokens(model, max_prompt_tokens, cfg.max_new_tokens)
        self.scorer = ActionScorer(model, tokenizer, next(model.parameters()).device,
                                   max_prompt_tokens=max_prompt_tokens, fmt=fmt, precision=precision,
                                   cache_bytes=cfg.score_cache_mb << 20, tokenize=tokenize, scoring=cfg.scoring_of(""))
        self.writer = ActionWriter(self.scorer)
        self.concurrency = cfg.concurrency or self.scorer.layout.concurrency

    def model_policy(self, greedy: bool, generator: torch.Generator, writes: bool = False,
                     phase: str = "eval", env: str = "") -> Policy:
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
                                       temperature=self.cfg.temperature, scoring=self.cfg.scoring_of(env))
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
                                     round=round_, tokens=self.scorer.work.totals)
            try:
                with progress:  # its ticker stops with the episodes, however they end
                    return run_episodes(env, task_ids, make_policy(), self.concurrency, round_, phase,
                                        on_episode=count, on_turns=progress.steps)
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

    def evaluate(self, tasks: list[EnvTasks], round_: int) -> dict[str, float]:
        """Greedy success of the loaded adapter on each environment's test tasks (`test_success/<env>`
        over `test_tasks/<env>` tasks; beside it the training tasks this client holds, `train_tasks/<env>`)
        and over all of them (`test_success`); with --policy generate, also the share of steps whose text
        named no admissible action (`eval_fallback_rate`); where the agent writes its actions, the share
        of written turns that named one (`eval_parseable_action_rate`)."""
        metrics: dict[str, float] = {}
        successes = episodes = 0
        generated, fallbacks = self.writer.generated, self.writer.fallbacks
        since = self.written_so_far()
        for task in tasks:
            trajs = self.episodes(task.env, task.test_ids,
                                  lambda t=task: self.model_policy(True, torch.Generator().manual_seed(0),
                                                                   writes=not t.lists_actions, phase="eval",
                                                                   env=t.name),
                                  round_, "eval")
            ok = sum(t.success for t in trajs)
            metrics[f"test_success/{task.name}"] = ok / max(1, len(trajs))
            metrics[f"test_tasks/{task.name}"] = float(len(trajs))
            metrics[f"train_tasks/{task.name}"] = float(len(task.train_ids))  # this member's share (--task-share)
            TEST_SUCCESS.labels(task.name).set(metrics[f"test_success/{task.name}"])
            successes, episodes = successes + ok, episodes + len(trajs)
        metrics["test_success"] = successes / max(1, episodes)
        if self.writer.generated > generated:  # --policy generate: how often the text named no admissible action
            metrics["eval_fallback_rate"] = (self.writer.fallbacks - fallbacks) / (self.writer.generated - generated)
        self.parseable_since(since, metrics, "eval_parseable_action_rate")  # environments without listed actions
        return metrics

    def explore(self, tasks: list[EnvTasks], round_: int, seed: int) -> list[Trajectory]:
        """Episodes of --explore-tasks training tasks of every environment, sampled from `seed`, each
        tried --explore-tries times, each environment's actions drawn from the model at --temperature
        by a generator seeded from it."""
        trajs: list[Trajectory] = []
        for task in tasks:
            ids = random.Random(seed).sample(task.train_ids, min(self.cfg.explore_tasks, len(task.train_ids)))
            trajs += self.episodes(task.env, ids * self.cfg.explore_tries,
                                   lambda t=task: self.model_policy(False, torch.Generator().manual_seed(seed),
                                                                    writes=not t.lists_actions, phase="explore",
                                                                    env=t.name),
                                   round_, "explore")
        return trajs

    def written_so_far(self) -> tuple[int, int]:
        """The writer's count of turns written and of those that named no action, for parseable_since."""
        return self.writer.written, self.writer.unparsed

    def parseable_since(self, since: tuple[int, int], metrics: dict[str, float], key: str) -> None:
        """Sets metrics[key]: of the turns written since `since` (written_so_far), the share whose text
        named an action; nothing where none were written."""
        written, unparsed = self.writer.written - since[0], self.writer.unparsed - since[1]
        if written:
            metrics[key] = 1 - unparsed / written

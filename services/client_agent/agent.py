"""The Fed-SE client loop: download phi_t, evaluate it, explore, keep successes, train, upload.

Round t (DESIGN.md): load the global adapter phi_t; evaluate it greedily on held-out test tasks
(only scalars leave the client); explore training tasks at temperature 1.0; keep the successful
trajectories; add them to the cumulative buffer D_t = D_{t-1} ∪ D_succ (D_0 = expert demos);
fine-tune the LoRA on the whole buffer; upload phi_{t,k}. After the last round the final global
adapter is evaluated too, so the metrics cover phi_0 (the untrained base) to phi_T.
"""

from __future__ import annotations

import logging
import pathlib
import random
import time

import prometheus_client
import torch

from fedse import adapter as ad
from fedse.serving import log_fields
from fedse.v1 import federation_pb2 as fpb

from . import model as mdl
from .buffer import Buffer, Trajectory
from .config import ClientConfig
from .envclient import EnvClient
from .federation import FederationClient
from .policy import ActionScorer, format_prompt
from .rollout import Live, Policy, expert_policy, run_episodes
from .trainer import train_lora

log = logging.getLogger("client_agent")

ROUND = prometheus_client.Gauge("fedse_client_round", "The round the client is working on.")
STEPS = prometheus_client.Counter("fedse_client_rollout_steps", "Environment steps taken, by phase.", ["phase"])
EPISODES = prometheus_client.Counter("fedse_client_episodes", "Episodes finished, by phase and outcome.",
                                     ["phase", "outcome"])
KEPT = prometheus_client.Counter("fedse_client_successes_kept", "Successful trajectories added to the buffer.")
BUFFER = prometheus_client.Gauge("fedse_client_buffer_trajectories", "Trajectories in the buffer.")
LOSS = prometheus_client.Gauge("fedse_client_train_loss", "Mean training loss of the last round.")
TRAIN_SECONDS = prometheus_client.Counter("fedse_client_train_seconds", "Seconds spent training the LoRA.")
TEST_SUCCESS = prometheus_client.Gauge("fedse_client_test_success_ratio",
                                       "Held-out success rate of the latest global adapter.")
for _phase in ("expert", "explore", "eval"):
    STEPS.labels(_phase)
    for _outcome in ("success", "failure"):
        EPISODES.labels(_phase, _outcome)


def training_examples(trajectories: list[Trajectory], max_history: int) -> list[tuple[str, str]]:
    """(prompt, action) for every turn of every trajectory; the loss covers only the action."""
    out: list[tuple[str, str]] = []
    for t in trajectories:
        for i, (obs, action) in enumerate(t.turns):
            out.append((format_prompt(t.instruction, list(t.turns[:i]), obs, max_history), action))
    return out


class ClientAgent:
    def __init__(self, config: ClientConfig):
        self.cfg = config
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.dir = pathlib.Path(config.state_dir) / config.client_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.env = EnvClient(config.env_server, config.env)
        self.fed = FederationClient(config.aggregator, config.client_id)
        base, self.tokenizer = mdl.load_base(config.base_model, config.device or None, seed=config.seed)
        self.model = mdl.add_lora(base, r=config.lora_r, alpha=config.lora_alpha, dropout=config.lora_dropout,
                                  target_modules=config.lora_targets(), seed=config.seed)
        self.device = next(self.model.parameters()).device
        self.scorer = ActionScorer(self.model, self.tokenizer, self.device)
        self.buffer = Buffer(self.dir / "buffer.jsonl")
        self.history: list[dict[str, float]] = []

    # ---- policies --------------------------------------------------------------------------
    def model_policy(self, greedy: bool, generator: torch.Generator) -> Policy:
        def choose(states: list[Live]) -> list[str]:
            prompts = [format_prompt(s.session.instruction, s.turns, s.observation.text, self.cfg.max_history)
                       for s in states]
            candidates = [s.observation.actions for s in states]
            if self.cfg.policy == "generate":
                return self.scorer.generate_actions(prompts, candidates)
            picks = self.scorer.choose(prompts, candidates, greedy=greedy, generator=generator,
                                       temperature=self.cfg.temperature)
            return [c[i] for c, i in zip(candidates, picks)]
        return choose

    def episodes(self, task_ids: list[int], policy: Policy, round_: int, phase: str) -> list[Trajectory]:
        def count(t: Trajectory) -> None:
            STEPS.labels(phase).inc(len(t.turns))
            EPISODES.labels(phase, "success" if t.success else "failure").inc()
        return run_episodes(self.env, task_ids, policy, self.cfg.concurrency, round_, phase, on_episode=count)

    def evaluate(self, test_ids: list[int], round_: int) -> float:
        trajs = self.episodes(test_ids, self.model_policy(True, torch.Generator().manual_seed(0)), round_, "eval")
        return sum(t.success for t in trajs) / max(1, len(trajs))

    # ---- the loop ----------------------------------------------------------------------------
    def seed_buffer(self, train_ids: list[int]) -> None:
        if any(t.source == "expert" for t in self.buffer.trajectories) or self.cfg.expert_demos == 0:
            return
        rng = random.Random(self.cfg.seed)
        ids = rng.sample(train_ids, min(self.cfg.expert_demos, len(train_ids)))
        demos = self.episodes(ids, expert_policy(self.env), -1, "expert")
        kept = [t for t in demos if t.success]
        self.buffer.extend(kept)
        log.info("buffer seeded with expert demonstrations",
                 extra=log_fields(demos=len(demos), successful=len(kept)))

    def load_global(self, round_: int) -> None:
        g = self.fed.download(round_)
        mdl.set_adapter_state(self.model, ad.decode(g.data))

    def run(self) -> list[dict[str, float]]:
        cfg = self.cfg
        state = mdl.get_adapter_state(self.model)
        schema = ad.Schema.of(state, mdl.adapter_config_json(self.model))
        joined = self.fed.join(cfg.env, cfg.base_model, schema)
        num_rounds = joined.config.num_rounds
        train_ids, _ = self.env.tasks("train")
        test_ids, _ = self.env.tasks("test")
        if cfg.eval_tasks:
            test_ids = test_ids[: cfg.eval_tasks]
        log.info("joined", extra=log_fields(run_id=joined.config.run_id, rounds=num_rounds, round=joined.current_round,
                                            train_tasks=len(train_ids), test_tasks=len(test_ids)))
        self.seed_buffer(train_ids)
        st = self.fed.wait_until(lambda s: s.state in (fpb.ROUND_STATE_OPEN, fpb.ROUND_STATE_FINISHED),
                                 timeout_s=cfg.round_timeout_s)
        round_ = st.round
        while True:
            ROUND.set(round_)
            self.load_global(round_)
            started = time.perf_counter()
            success = self.evaluate(test_ids, round_)
            TEST_SUCCESS.set(success)
            metrics = {"test_success": success, "eval_s": time.perf_counter() - started}
            if st.state == fpb.ROUND_STATE_FINISHED or round_ >= num_rounds:
                metrics["buffer"] = float(len(self.buffer))
                self.finish_round(round_, metrics)
                break
            metrics.update(self.train_round(round_, train_ids))
            self.finish_round(round_, metrics)
            st = self.fed.wait_until(lambda s: s.round > round_ or s.state == fpb.ROUND_STATE_FINISHED,
                                     timeout_s=cfg.round_timeout_s)
            round_ = st.round
        return self.history

    def train_round(self, round_: int, train_ids: list[int]) -> dict[str, float]:
        cfg = self.cfg
        rng = random.Random(cfg.seed * 100_003 + round_)
        ids = rng.sample(train_ids, min(cfg.explore_tasks, len(train_ids)))
        gen = torch.Generator().manual_seed(cfg.seed * 100_003 + round_)
        t0 = time.perf_counter()
        trajs = self.episodes(ids, self.model_policy(False, gen), round_, "explore")
        kept = [t for t in trajs if t.success]
        self.buffer.extend(kept)
        KEPT.inc(len(kept))
        BUFFER.set(len(self.buffer))
        t1 = time.perf_counter()
        examples = training_examples(self.buffer.trajectories, cfg.max_history)
        result = train_lora(self.model, self.tokenizer, examples, epochs=cfg.epochs, lr=cfg.lr,
                            batch_size=cfg.batch_size, seed=cfg.seed * 100_003 + round_)
        t2 = time.perf_counter()
        LOSS.set(result["loss"])
        TRAIN_SECONDS.inc(t2 - t1)
        data = ad.encode(mdl.get_adapter_state(self.model))
        self.fed.upload(round_, data, num_examples=len(examples), num_successes=len(kept),
                        adapter_config_json=mdl.adapter_config_json(self.model))
        return {"explore_success": len(kept) / max(1, len(trajs)), "kept": float(len(kept)),
                "buffer": float(len(self.buffer)), "examples": float(len(examples)), "train_loss": result["loss"],
                "explore_s": t1 - t0, "train_s": t2 - t1, "upload_bytes": float(len(data))}

    def finish_round(self, round_: int, metrics: dict[str, float]) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        self.fed.report(round_, metrics)
        self.history.append({"round": float(round_), **metrics})
        log.info("round done", extra=log_fields(round=round_, **{k: round(v, 4) for k, v in metrics.items()}))

    def close(self) -> None:
        self.env.close_channel()
        self.fed.close()

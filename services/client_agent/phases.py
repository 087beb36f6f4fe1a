"""The phases of one round (`RoundPhases`, a part of agent.ClientAgent), one method each, each
recording where it ended (`progress.json`) before the next begins: download and evaluate phi_t, and
explore (`_evaluate_and_explore`: after the last round only the evaluation and the report), train
and save the adapter (`_train_and_save`), upload it (`_upload_saved`) and report the round
(`_report`); `explore` and `train` are the work of the two phases that change the buffer and the
adapter. Which rounds are played: rounds.RoundLoop."""

from __future__ import annotations

import dataclasses
import logging
import math
import time

import torch

from fedse.machine import release_free_memory
from fedse.model import adapter as ad
from fedse.progress import PhaseProgress
from fedse.transport.serving import log_fields

from services.client_agent.federation.heartbeat import RoundPhase
from services.client_agent.metrics import BUFFER, KEPT, LOSS, PHASE_SECONDS, TRAIN_SECONDS
from services.client_agent.model import loading as mdl
from services.client_agent.playing.prompts import is_tiny
from services.client_agent.playing.tasks import EnvTasks
from services.client_agent.resume import Phase, Progress
from services.client_agent.training.buffer import capped, to_keep, training_set, with_expert_share
from services.client_agent.training.round_lr import round_lr_for
from services.client_agent.training.seeding import count_demos
from services.client_agent.training.trainer import train_lora, training_examples

log = logging.getLogger("client_agent")

# The phases that start from these use the model (evaluate and explore; train and save): they run
# under the agent's `model_use`, which a client host's members take in turn.
MODEL_PHASES = (Phase.START, Phase.EXPLORED)


@dataclasses.dataclass
class _Round:
    """The round a client is playing: what its phases share."""

    round: int
    final: bool  # after the last round: only evaluate phi_T and report
    tasks: list[EnvTasks]
    progress: Progress | None  # the latest record of this round
    metrics: dict[str, float]


class RoundPhases:
    """A round from the phase after the one recorded to "reported". Of the agent it uses the model (with
    its tokenizer, prompt formats and precision), its player, buffer, state and heartbeat, and its
    `record`, `load_global`, `upload`, `finish_round`, `work_done`, `memory_left`, `checkpointing` and
    `model_use`."""

    def play_round(self, round_: int, done: str, final: bool, tasks: list[EnvTasks]) -> None:
        """Runs round `round_` on from the phase after `done` ("" = from the start) to "reported":
        one method per phase, each recording where it ended before the next begins."""
        p = self.progress if done else None
        r = _Round(round_, final, tasks, p, dict(p.metrics) if p else {})
        steps = {Phase.START: self._evaluate_and_explore, Phase.EXPLORED: self._train_and_save,
                 Phase.TRAINED: self._upload_saved, Phase.UPLOADED: self._report}
        phase = Phase(done)
        while phase is not Phase.REPORTED:
            if phase in MODEL_PHASES:  # the model is this client's alone from loading phi_t to the saved adapter
                with self.model_use():
                    while phase in MODEL_PHASES:
                        phase = steps[phase](r)
            else:
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
        metrics = {"explored": float(len(trajs)), "kept": float(len(kept)), "buffer": float(len(self.buffer)),
                   **count_demos(self.buffer, tasks),
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
        chosen = capped(training_set(self.buffer.trajectories, cfg.history, round_), cfg.round_trajectories, seed)
        trajectories = with_expert_share(chosen, cfg.expert_share)
        lr = round_lr_for(cfg.round_lr).rate(cfg.lr, round_, self.run_config.num_rounds)
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
            result = train_lora(self.model, self.tokenizer, examples, epochs=cfg.epochs, lr=lr,
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
        metrics = {"examples": float(turns), "sequences": float(len(examples)),
                   "train_trajectories": float(len(trajectories)), "train_s": t2 - t1, "train_lr": lr,
                   "upload_bytes": float(len(data)), "train_recomputed": result["recomputed"],
                   **self.work_done(before, "train", t2 - t1)}
        if math.isfinite(result["loss"]):  # no loss where nothing was trained (metrics are finite values)
            LOSS.set(result["loss"])
            metrics["train_loss"] = result["loss"]
        return data, turns, metrics

"""The guardian's choice for one client (guardian.size, guardian.advise): the LoRA rank, micro-batch
and precision it joins with, sized once for this machine and the run's ranks, kept in
`<state-dir>/<client-id>/guardian.json` so that a restarted client joins (and uploads) as before,
and the figures of it a round's report carries."""

from __future__ import annotations

import dataclasses
import logging
import pathlib

import grpc

from fedse.agents.asking import Asker
from fedse.transport.serving import log_fields

from services.client_agent.config import ClientConfig
from services.client_agent.federation.link import FederationClient
from services.client_agent.playing.prompts import default_max_prompt_tokens, is_tiny
from services.client_agent.training import guardian

log = logging.getLogger("client_agent")


def choose_sizing(base, config: ClientConfig, fed: FederationClient, path: pathlib.Path) -> guardian.Sizing:
    """The guardian's sizing of `base` for this client (`path`: its guardian.json): the largest rank,
    micro-batch and precision that fit this machine, up to the run's maximum rank where the run takes
    mixed ranks, at the run's rank where it takes one (the rank its clients joined with; 8 before any
    did); the earlier choice where one was made under the same settings."""
    top, fixed = guardian.DEFAULT_TOP_RANK, 0
    try:
        run = fed.run_status()
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
    kept = guardian.load_sizing(path, context)
    if kept is not None:  # a restart: the rank this client joined (and uploads) with
        log.info("guardian keeps its earlier choice", extra=log_fields(reason=kept.reason()))
        return kept
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
    guardian.save_sizing(path, sizing, context)
    return sizing


def with_choice(config: ClientConfig, c: guardian.Candidate) -> ClientConfig:
    """The config with the guardian's choice (guardian.alpha_for: alpha keeps its ratio where it chose the rank)."""
    return dataclasses.replace(config, lora_r=c.lora_r, train_batch_tokens=c.batch_tokens, precision=c.precision,
                               lora_alpha=guardian.alpha_for(config, c.lora_r))


def sizing_metrics(sizing: guardian.Sizing | None, budget: guardian.PrivacyBudget,
                   config: ClientConfig) -> dict[str, float]:
    """The guardian's choices and the privacy budget, as a round's report carries them."""
    out = budget.metrics()
    if sizing is not None:
        c = sizing.chosen
        out.update(guardian_rank=float(c.lora_r), guardian_batch_tokens=float(c.batch_tokens),
                   guardian_bf16=float(c.precision == "bf16"), guardian_need_mb=c.need_bytes / 1e6)
        if config.guardian_model:
            out["guardian_fallback"] = float(bool(sizing.fallback))
    return out

"""The adapters a client exchanges with the aggregator (`AdapterExchange`, a part of
agent.ClientAgent): the global adapter phi_t, downloaded into the model at this client's rank, and
the adapter it trained, uploaded plain or through the round's secure stages (secure.SecureRound) at
the run's rank; an upload the round no longer takes (stale, refused, or another adapter of ours
already held) is recorded in the round's metrics, never retried."""

from __future__ import annotations

import logging

import grpc
import torch

from fedse.model import adapter as ad
from fedse.model import ranks
from fedse.privacy import secagg
from fedse.privacy.secagg import SecureError
from fedse.transport.serving import log_fields

from services.client_agent.federation.link import InsecureRun, StaleRound
from services.client_agent.federation.secure import Contribution, SecureRound, client_protection
from services.client_agent.metrics import PHASE_SECONDS
from services.client_agent.model import loading as mdl
from services.client_agent.resume import Progress

log = logging.getLogger("client_agent")


class AdapterExchange:
    """Downloads and uploads of a client's adapters. Of the agent it uses `cfg`, `fed`, `model`,
    `run_id`, `run_config` and `schema` (what it joined with) and `state`, and sets `loaded_round`."""

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

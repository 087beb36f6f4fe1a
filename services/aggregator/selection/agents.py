"""Selector agents: policies that read the federation's history and decide, each round, how many
clients take part and which (--selector agent-tools, agent-llm). Their reasoning and their memory are
kept with each round's Selection (the run state, selections.jsonl, `fedse status`), so every choice is
auditable and the memory survives an aggregator restart.

agent-tools is a planner over deterministic tools, each a pure function of the round's input:

- availability: alive clients whose heartbeat is on time, and the late ones;
- stragglers: clients whose mean round time is more than `straggler_factor` times the median;
- dropouts: the share of chosen clients that did not upload, learnt round after round (memory);
- ranking: Oort's utility (success gain, else loss, times a speed factor), as `Utility` computes it.

Its plan: candidates are the available clients; K is the count asked (--clients-per-round or
--selection-fraction of the candidates) raised by the learnt dropout rate so that K clients are
expected to upload, or, when no count is asked, every candidate that is not a straggler; the
places go to clients never tried (a fifth, as Oort explores, and at least one while any is untried),
then to the tried non-stragglers by utility, and stragglers last.

agent-llm asks a language model (the run's base model, or --selector-model: any local Hugging Face
model, or the embedded tiny one) with the history and the tools' findings as JSON, for an answer of
the form {"clients": [...], "reason": "..."}. The answer is parsed and checked (`check_answer`) against
the policy, not only its form: a known, alive, distinct client id each, at least one, at most the
candidates, exactly the places the tools' plan takes where a count is set (--clients-per-round or
--selection-fraction), and every client the fairness floor requires. An answer that fails
the check, or a model that cannot be loaded or run, falls back to agent-tools' plan; the Selection
says why (fallback_reason), and the round keeper counts it.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from typing import Any, Mapping

from fedse.agents.asking import AnswerError, json_object
from fedse.agents.constrained import BoundedAsker
from fedse.transport.serving import log_fields

from .base import ClientHistory, Choice, Policy, SelectionInput, _Count, _draw, _number
from .utility import Utility

log = logging.getLogger("aggregator.selection")

EXPLORE_SHARE = 0.2  # the share of places for clients never tried (Oort's epsilon)
DROPOUT_MEMORY = 0.3  # the weight of the latest round in the learnt dropout rate
MAX_MARGIN = 0.5  # the learnt dropout rate raises K by at most 1 / (1 - MAX_MARGIN)
MAX_REASON_CHARS = 300  # of the model's reason, as kept


class ToolAgent(Policy):
    name = "agent-tools"
    description = ("a planner over deterministic tools (availability, stragglers, learnt dropouts, utility): "
                   "decides K and the clients")

    def __init__(self, clients_per_round: int | None = None, fraction: float | None = None,
                 late_after_s: float = 15.0, straggler_factor: float = 2.0) -> None:
        self.count = None if clients_per_round is None and fraction is None else \
            _Count(self.name, clients_per_round, fraction)
        for label, value in (("late_after_s", late_after_s), ("straggler_factor", straggler_factor)):
            if not _number(value) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"{label} must be a finite number > 0, got {value!r}")
        if straggler_factor <= 1:
            raise ValueError(f"straggler_factor must be above 1 (a straggler is that many times slower than the "
                             f"median), got {straggler_factor!r}; use e.g. 2")
        self.late_after_s, self.straggler_factor = float(late_after_s), float(straggler_factor)

    def config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "late_after_s": self.late_after_s,
                               "straggler_factor": self.straggler_factor}
        return {**out, **(self.count.config() if self.count is not None else {})}

    # ---- the tools ---------------------------------------------------------------------------
    def availability(self, inp: SelectionInput) -> tuple[list[ClientHistory], list[ClientHistory]]:
        """(on time, late) among the alive clients; every alive client is on time when none is."""
        alive = inp.alive()
        on_time = [c for c in alive if c.heartbeat_age_s < self.late_after_s]
        if not on_time:
            return alive, []
        return on_time, [c for c in alive if c.heartbeat_age_s >= self.late_after_s]

    def stragglers(self, clients: list[ClientHistory]) -> dict[str, str]:
        """The clients slower than straggler_factor times the median mean round time, and how slow."""
        times = [c.mean_round_s for c in clients if c.mean_round_s is not None]
        if len(times) < 2:
            return {}
        median = statistics.median(times)
        return {c.client_id: f"{c.mean_round_s:.0f} s a round, median {median:.0f} s" for c in clients
                if c.mean_round_s is not None and c.mean_round_s > self.straggler_factor * median}

    @staticmethod
    def dropout_rate(inp: SelectionInput) -> tuple[float, str]:
        """The learnt share of chosen clients that do not upload (memory: the last round's choice against
        what uploaded), and what the latest round showed."""
        memory = inp.memory
        rate = float(memory.get("dropout_rate", 0.0))
        last = memory.get("chosen", [])
        last_round = int(memory.get("round", -1))
        if not last or last_round != inp.round - 1:
            return rate, "no choice of the previous round to learn from"
        uploaded = {c.client_id for c in inp.clients if last_round in c.rounds_uploaded}
        dropped = sum(cid not in uploaded for cid in last)
        observed = dropped / len(last)
        rate = (1 - DROPOUT_MEMORY) * rate + DROPOUT_MEMORY * observed
        return rate, f"round {last_round}: {dropped} of {len(last)} chosen did not upload"

    # ---- the plan ----------------------------------------------------------------------------
    def _choose(self, inp: SelectionInput) -> Choice:
        steps: list[str] = []
        on_time, late = self.availability(inp)
        steps.append(f"availability: {len(on_time)} of {len(inp.alive())} alive clients on time"
                     + (f"; late: {', '.join(c.client_id for c in late)}" if late else ""))
        slow = self.stragglers(on_time)
        if slow:
            steps.append("stragglers: " + "; ".join(f"{cid} ({why})" for cid, why in sorted(slow.items())))
        rate, seen = self.dropout_rate(inp)
        steps.append(f"dropouts: learnt rate {rate:.2f} ({seen})")
        if self.count is not None:
            asked = self.count.of(len(on_time))
            k = min(len(on_time), math.ceil(asked / (1 - min(rate, MAX_MARGIN)) - 1e-9))
            steps.append(f"K: {asked} asked, {k} with the dropout margin")
        else:
            k = max(1, len(on_time) - len(slow))
            steps.append(f"K: {k}, every candidate that is not a straggler")
        order, explored = self.ranked(inp, on_time, slow, k)
        due = [cid for cid in order if cid in inp.must]
        if due:
            steps.append(f"fairness floor: {', '.join(due)} due, placed first")
        chosen = set(order[:max(k, len(due))])
        if chosen:
            steps.append(f"chosen: {', '.join(sorted(chosen))}")
        utility = Utility(clients_per_round=1).utilities(inp)
        reasons = {}
        for c in inp.clients:
            cid = c.client_id
            if not c.alive:
                reasons[cid] = f"not alive (heard {c.heartbeat_age_s:.0f} s ago)"
                continue
            if cid in inp.must:
                what = "fairness floor: due"
            elif cid in explored:
                what = "never tried: exploring"
            elif cid in slow:
                what = f"straggler ({slow[cid]})"
            elif any(c is x for x in late):
                what = f"heartbeat late ({c.heartbeat_age_s:.0f} s)"
            else:
                value = utility.get(cid, (None, ""))[0]
                what = "utility unknown" if value is None else f"utility {value:.2f}"
            rank = f", rank {order.index(cid) + 1} of {len(order)}" if cid in order else ""
            reasons[cid] = f"{what}{rank}; {'chosen' if cid in chosen else f'top {k} taken'}"
        memory = {"dropout_rate": round(rate, 4), "round": inp.round, "chosen": sorted(chosen),
                  "stragglers": _count_up(inp.memory.get("stragglers", {}), slow, inp)}
        return Choice(chosen, reasons, tuple(steps), memory)

    def ranked(self, inp: SelectionInput, candidates: list[ClientHistory], slow: Mapping[str, str],
               k: int) -> tuple[list[str], set[str]]:
        """The candidates in the order places go (the alive clients the fairness floor requires, even late
        or slow ones; untried explorers; tried by utility; stragglers) and the explorers."""
        alive = {c.client_id for c in inp.alive()}
        due = [cid for cid in inp.must if cid in alive]
        candidates = [c for c in candidates if c.client_id not in due]
        slow = {cid: why for cid, why in slow.items() if cid not in due}
        utility = Utility(clients_per_round=1).utilities(inp)
        ties = {c.client_id: i for i, c in enumerate(_draw(inp, "agent-ties", candidates))}
        fresh = [c.client_id for c in _draw(inp, "agent-explore", [c for c in candidates if not c.tried])
                 if c.client_id not in slow]
        # At least one place explores while anyone is untried: with few places a fifth rounds to none, and
        # a client never tried would never be.
        explore = fresh[:min(len(fresh), max(1, math.floor(EXPLORE_SHARE * k + 0.5)))]
        tried = sorted((c.client_id for c in candidates if c.client_id not in slow and c.client_id not in explore),
                       key=lambda cid: (utility.get(cid, (None, ""))[0] is None,
                                        -(utility.get(cid, (None, ""))[0] or 0.0), ties[cid]))
        stragglers = sorted(slow, key=lambda cid: ties.get(cid, 0))
        return due + explore + tried + stragglers, set(explore)


def _count_up(before: Mapping[str, Any], slow: Mapping[str, str], inp: SelectionInput) -> dict[str, int]:
    """The rounds each client was found a straggler in, members only (what the agent remembers)."""
    members = {c.client_id for c in inp.clients}
    out = {cid: int(n) for cid, n in before.items() if cid in members}
    for cid in slow:
        out[cid] = out.get(cid, 0) + 1
    return out



def check_answer(text: str, inp: SelectionInput, most: int, exactly: int | None = None) -> tuple[set[str], str]:
    """(clients, reason) from a model's answer: the first JSON object in `text`, of the form
    {"clients": [client ids], "reason": "..."}. Each id must be a client of this run, alive, and
    named once; at least one and at most `most`, or `exactly` that many where the round's count is
    set; and every alive client the fairness floor requires (inp.must) must be named. The answer must
    satisfy the policy, not just the form: AnswerError says what failed."""
    answer = json_object(text)
    clients = answer.get("clients")
    if not isinstance(clients, list) or not all(isinstance(c, str) for c in clients):
        raise AnswerError('"clients" is not a list of client ids')
    if not clients:
        raise AnswerError('"clients" is empty')
    if len(set(clients)) != len(clients):
        raise AnswerError('"clients" names a client twice')
    known = {c.client_id: c for c in inp.clients}
    unknown = [c for c in clients if c not in known]
    if unknown:
        raise AnswerError(f"names {', '.join(repr(c[:40]) for c in unknown[:3])}, not a client of this run")
    dead = [c for c in clients if not known[c].alive]
    if dead:
        raise AnswerError(f"names {', '.join(dead)}, not alive")
    if len(clients) > most:
        raise AnswerError(f"names {len(clients)} clients, more than the {most} this round may take")
    if exactly is not None and len(clients) != exactly:
        raise AnswerError(f"names {len(clients)} client(s); this round takes exactly {exactly}")
    left_out = [c for c in inp.must if c in known and known[c].alive and c not in clients]
    if left_out:
        raise AnswerError(f"leaves out {', '.join(left_out)}, due under the fairness floor")
    reason = answer.get("reason", "")
    return set(clients), (reason if isinstance(reason, str) else json.dumps(reason))[:MAX_REASON_CHARS]


class LLMAgent(Policy):
    name = "agent-llm"
    description = ("a language model reads the history as JSON and answers which clients take part; its answer is "
                   "checked, and agent-tools decides where it fails")

    def __init__(self, clients_per_round: int | None = None, fraction: float | None = None, model: str = "",
                 max_new_tokens: int = 96, max_seconds: float = 10.0, constrained: bool = True) -> None:
        self.tools = ToolAgent(clients_per_round, fraction)
        # The round opens once the model answered: past max_seconds (its load, the prompt and the answer
        # together) the tools' plan is taken. Constrained, the answer is held to the answer's JSON schema.
        self.asker = BoundedAsker(str(model), max_new_tokens, max_seconds, bool(constrained))
        self.model = str(model)
        self._askers: dict[str, BoundedAsker] = {}  # one per model name (the run's base model, if not given)

    def config(self) -> dict[str, Any]:
        count = self.tools.count.config() if self.tools.count is not None else {}
        out = {"name": self.name, **count, "model": self.model, "max_new_tokens": self.asker.max_new_tokens,
               "max_seconds": self.asker.max_seconds}
        return out if self.asker.constrained else {**out, "constrained": False}

    def asker_for(self, name: str) -> BoundedAsker:
        """The asker of model `name` (made once; it loads the model once)."""
        if name == self.model:
            return self.asker
        return self._askers.setdefault(name, BoundedAsker(name, self.asker.max_new_tokens, self.asker.max_seconds,
                                                          self.asker.constrained))

    def load(self, name: str = "") -> None:
        """Loads the model (--selector-model, else `name`, the run's base model) now: the aggregator calls
        it at start, so a model that cannot load stops it there rather than failing each round."""
        if self.model or name:
            self.asker_for(self.model or name).load()

    def schema(self, inp: SelectionInput, most: int, exactly: int | None) -> dict[str, Any]:
        """The answer's JSON schema (constrained decoding holds the model to it): the alive clients' ids,
        as many as the round takes, and a reason that fits max_new_tokens."""
        ids = [c.client_id for c in inp.alive()]
        count = {"minItems": exactly, "maxItems": exactly} if exactly is not None else {"minItems": 1, "maxItems": most}
        reason = {"type": "string", "maxLength": max(8, min(MAX_REASON_CHARS, self.asker.max_new_tokens - 16))}
        return {"type": "object", "properties": {"clients": {"type": "array", "items": {"type": "string", "enum": ids},
                                                             **count}, "reason": reason},
                "required": ["clients", "reason"], "additionalProperties": False}

    def prompt(self, inp: SelectionInput, plan: Choice) -> str:
        """The question: the run's history and the tools' findings, as JSON, and the answer's form."""
        history = [{"client": c.client_id, "alive": c.alive, "heartbeat_age_s": round(c.heartbeat_age_s, 1),
                    "rounds_selected": list(c.rounds_selected[-5:]), "rounds_uploaded": list(c.rounds_uploaded[-5:]),
                    "success": c.last_success, "success_gain": c.success_gain, "loss": c.last_loss,
                    "mean_round_s": c.mean_round_s, "dropouts": c.dropouts, "buffer": c.buffer_size}
                   for c in inp.clients]
        return ("You choose which clients take part in round {r} of a federated training run. Prefer clients "
                "that are alive, quick and still learning; give clients never tried a chance; avoid clients "
                "that often drop out.\nClients: {h}\nTool findings: {f}\nAnswer with one JSON object and "
                'nothing else: {{"clients": [client ids], "reason": "one sentence"}}\nAnswer: ').format(
                    r=inp.round, h=json.dumps(history, separators=(",", ":")), f=json.dumps(list(plan.reasoning)))

    def generate(self, name: str, prompt: str, schema: dict[str, Any] | None = None) -> str:
        """The model's greedy answer to `prompt`, held to `schema` (fedse.agents.constrained.BoundedAsker: loaded
        once, on the CPU; AnswerError past max_seconds)."""
        ids = schema["properties"]["clients"] if schema else {}
        longest = sorted((len(i) for i in ids.get("enum", [])), reverse=True)[:ids.get("maxItems", 0)]
        # Room for the ids (quotes, a comma and spaces each) and the JSON around them; a token is a character or more.
        return self.asker_for(name).answer(prompt, schema, budget=sum(n + 6 for n in longest) + 48 if schema else 0)

    def _choose(self, inp: SelectionInput) -> Choice:
        plan = self.tools._choose(inp)
        name = self.model or inp.base_model
        most = len(self.tools.availability(inp)[0])
        try:
            if not name:
                raise AnswerError("no model: the run has no base model yet and --selector-model is not set")
            exactly = len(plan.chosen) if self.tools.count is not None else None
            most = max(most, len(plan.chosen), 1)
            answer = self.generate(name, self.prompt(inp, plan), self.schema(inp, most, exactly))
        except Exception as exc:  # noqa: BLE001 - a model that cannot run falls back to the tools' plan
            log.warning("the selector's model failed; agent-tools chooses",
                        extra=log_fields(round=inp.round, model=name, error=str(exc)[:300]))
            return Choice(plan.chosen, plan.reasons, plan.reasoning, plan.memory,
                          f"the model could not answer: {str(exc)[:200]}")
        shown = " ".join(answer.split())[:200]
        try:
            # With a count set, the answer takes exactly the places the tools' plan takes (the count, its
            # dropout margin and the floor's clients; all alive when fewer).
            chosen, why = check_answer(answer, inp, most, exactly)
        except AnswerError as exc:
            return Choice(plan.chosen, plan.reasons, (*plan.reasoning, f"model answered: {shown!r}"), plan.memory,
                          f"the model's answer was refused: {exc}")
        reasons = {cid: (f"chosen by the model: {why}" if cid in chosen else f"left out by the model; the tools "
                         f"said: {plan.reasons[cid]}") for cid in plan.reasons}
        memory = {**plan.memory, "chosen": sorted(chosen)}
        return Choice(chosen, reasons, (*plan.reasoning, f"model answered: {shown!r}"), memory)


AGENTS: tuple[type[Policy], ...] = (ToolAgent, LLMAgent)

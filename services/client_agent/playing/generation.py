"""Actions the model writes (policy.py's docstring lists the ways to act):
- generation (`--policy generate`): generate the agent's text and match the action to an admissible
  one (actions.parse_action); a row stops at the end of the action line or the chat template's end
  of turn, or after a token limit set from the longest candidate; when nothing matches, fall back to
  the scoring choice;
- writing (environments that list no actions, whatever the policy): generate the agent's ReAct text,
  "Thought:\\n...\\n\\nAction:\\n<action>", greedily (evaluation) or sampled at the temperature
  (exploration), and send the action parsed from it (prompts.parse_react); the whole text is kept
  for training. Where the text names no action, its thought's first paragraph is kept,
  prompts.ACTION_CUE follows it and the model writes the action line after the cue
  (`Written.parsed` False, counted): every turn sends an action the model wrote, and the text kept
  has the format the model is asked for. Only where that line is empty is the thought's last line
  sent (prompts.fallback_action), so the episode goes on.
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

from services.client_agent.playing.actions import ACTION_LINE, CUED_ACTION_LINE, Written, cut_after_action, has_action_line, parse_action
from services.client_agent.model.kvcache import generation_cache
from services.client_agent.model.loading import autocast
from services.client_agent.playing.policy import ActionScorer
from services.client_agent.playing.prompts import ACTION_CUE, fallback_action, inner_model, parse_react, thought_before_cue
from services.client_agent.model.work import Work, causal_context

# The most tokens of an action line written after ACTION_CUE (an action is at most
# prompts.MAX_WRITTEN_ACTION_CHARS characters).
CUED_ACTION_TOKENS = 64


class ActionLineDone:
    """Stopping criterion: every row has produced a complete action line ending in a newline:
    "Action: <action>\\n", or AgentGym's "Action:\\n<action>\\n" (`line`: as in
    actions.has_action_line)."""

    def __init__(self, tokenizer, prompt_len: int, line: re.Pattern = ACTION_LINE):
        self.tokenizer = tokenizer
        self.prompt_len = prompt_len
        self.line = line

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_len:], skip_special_tokens=True)
        return torch.tensor([has_action_line(t, self.line) for t in texts], dtype=torch.bool,
                            device=input_ids.device)


def count_generation(work: Work, prompt_lengths: list[int], new: torch.Tensor, eos: list[int], pad_id: int) -> None:
    """Counts a generation's passes in `work`: the prompts read (left-padded to the longest), then
    one position per row and step, of which a row's tokens up to its end (its first end-of-turn
    token, kept, or the padding generate writes once a stopping criterion finished the row) are
    generated tokens and the rest padding."""
    rows, steps = new.shape
    width = max(prompt_lengths)
    work.forward(sum(prompt_lengths), causal_context(prompt_lengths), padded=rows * width - sum(prompt_lengths))
    ends, pads = set(eos), new.cpu().tolist()
    written = []
    for n, row in zip(prompt_lengths, pads):
        k = next((i + 1 for i, t in enumerate(row) if t in ends), None)
        if k is None:
            k = next((i for i, t in enumerate(row) if t == pad_id), steps)
        written.append(k)
        work.forward(k, causal_context([k], n), kind="generated")
    work.forward(0, 0, padded=rows * steps - sum(written))
    work.head(sum(written))


class ActionWriter:
    """Generates the agent's text with the scorer's model, prompt format and tokenizer, and falls
    back to the scorer's choice where a generated text names no admissible action. Counts what the
    round metrics report: actions generated and those scoring chose (`generated`, `fallbacks`:
    eval_fallback_rate), turns written and those that named no action (`written`, `unparsed`:
    parseable_action_rate)."""

    def __init__(self, scorer: ActionScorer):
        self.scorer = scorer
        self.generated = self.fallbacks = 0
        self.written = self.unparsed = 0

    @torch.no_grad()
    def generate_texts(self, prompts: Sequence[str], max_new_tokens: int = 128, greedy: bool = True,
                       temperature: float = 1.0, generator: torch.Generator | None = None,
                       line: re.Pattern = ACTION_LINE) -> list[str]:
        """Continuations of the prompts, cut after the first complete action line ("Action: ..." or
        "Action:\\n..."; `line`: as in actions.has_action_line); a row stops at the end of that line,
        at the format's end of turn (a chat model's end-of-message token) or after max_new_tokens.
        Greedy, or sampled from the whole softmax at `temperature` with torch's generator seeded from
        `generator` (so a seeded generator gives the same texts again)."""
        if not greedy and temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
        sc = self.scorer
        pad_id, device = sc.runner.pad_id, sc.device
        eos = inner_model(sc.model).config.eos_token_id
        eos = list(eos) if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []
        end = getattr(sc.fmt, "end_of_turn", "")
        if end:
            eos += [t for t in sc.tokenize(end) if t not in eos]
        encoded = [sc.tokenize.prompt(p, sc.max_prompt_tokens) for p in prompts]
        L = max(len(e) for e in encoded)
        ids = torch.full((len(encoded), L), pad_id, dtype=torch.long)
        att = torch.zeros((len(encoded), L), dtype=torch.long)
        for b, e in enumerate(encoded):
            ids[b, L - len(e):] = torch.tensor(e, dtype=torch.long)
            att[b, L - len(e):] = 1
        sampling = {} if greedy else {"temperature": temperature, "top_k": 0, "top_p": 1.0}
        seed = None if greedy else int(torch.randint(0, 2 ** 62, (1,), generator=generator))
        devices = [] if device.type != "cuda" else \
            [device.index if device.index is not None else torch.cuda.current_device()]
        with torch.random.fork_rng(devices=devices, enabled=seed is not None), autocast(sc.precision, device):
            if seed is not None:
                torch.manual_seed(seed)
            gen = sc.model.generate(input_ids=ids.to(device), attention_mask=att.to(device),
                                    past_key_values=generation_cache(inner_model(sc.model).config, max_new_tokens),
                                    max_new_tokens=max_new_tokens, do_sample=not greedy, **sampling,
                                    pad_token_id=pad_id, eos_token_id=eos or None,
                                    stopping_criteria=[ActionLineDone(sc.tokenizer, L, line)])
        count_generation(sc.work, [len(e) for e in encoded], gen[:, L:], eos, pad_id)
        texts = sc.tokenizer.batch_decode(gen[:, L:], skip_special_tokens=True)
        return [cut_after_action(t, line) for t in texts]

    def write_actions(self, prompts: Sequence[str], max_new_tokens: int, greedy: bool = True,
                      temperature: float = 1.0, generator: torch.Generator | None = None,
                      opening: str = "") -> list[Written]:
        """Writing mode (an environment that lists no actions): the agent's ReAct text for each
        prompt (`opening`, the start of it the prompts end with, then what the model wrote) and the
        action parsed from it (parse_react). Where it names none, the text is its thought's first
        paragraph and ACTION_CUE, then the line the model writes after them (at most
        CUED_ACTION_TOKENS tokens, sampled as the first pass was), and the action that line holds
        (fallback_action's where it is empty). Counted in `written`, and in `unparsed` where the
        model needed the cue."""
        sampling = {"greedy": greedy, "temperature": temperature, "generator": generator}
        texts = self.generate_texts(prompts, max_new_tokens, **sampling)
        out: list[Written | None] = []
        for text in texts:
            action = parse_react(opening + text)
            out.append(Written(action, opening + text, True) if action else None)
        cued = [i for i, w in enumerate(out) if w is None]
        if cued:
            thoughts = [thought_before_cue(texts[i]) for i in cued]
            lines = self.generate_texts([prompts[i] + thought + ACTION_CUE for i, thought in zip(cued, thoughts)],
                                        min(CUED_ACTION_TOKENS, max_new_tokens), line=CUED_ACTION_LINE, **sampling)
            for i, thought, line in zip(cued, thoughts, lines):
                text = opening + thought + ACTION_CUE + line
                out[i] = Written(parse_react(text) or fallback_action(text), text, False)
        self.written += len(out)
        self.unparsed += len(cued)
        return out  # type: ignore[return-value]

    def generate_actions(self, prompts: Sequence[str], candidates: Sequence[Sequence[str]],
                         max_new_tokens: int | None = None) -> list[str]:
        """Generation mode: the admissible action each prompt's generated text names; where it names
        none (parse_action gives None), the greedy scoring choice among the candidates; counted in
        `generated` and `fallbacks`. max_new_tokens None: the longest candidate's text (format
        target) plus 8 tokens, so a model that rambles stops soon after any action it could have
        meant."""
        sc = self.scorer
        if max_new_tokens is None:
            max_new_tokens = 8 + max(len(sc.tokenize(sc.fmt.target(c))) for cands in candidates for c in cands)
        texts = self.generate_texts(prompts, max_new_tokens)
        actions: list[str | None] = [parse_action(t, c) for t, c in zip(texts, candidates)]
        missing = [i for i, a in enumerate(actions) if a is None]
        if missing:
            picks = sc.choose([prompts[i] for i in missing], [candidates[i] for i in missing], greedy=True)
            for i, k in zip(missing, picks):
                actions[i] = candidates[i][k]
        self.generated += len(texts)
        self.fallbacks += len(missing)
        return actions  # type: ignore[return-value]

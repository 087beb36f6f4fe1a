"""The agent's action policy: choosing among admissible actions with the model.

Three ways to act:
- Scoring (the default, and the only one the tiny model can use; ActionScorer): every admissible
  action is scored by log p(target(action) | prompt), summed over its tokens, where prompt and target
  come from the client's prompts.PromptFormat; exploration samples from the softmax over candidates
  (temperature 1.0), evaluation takes the argmax. Tokens shared by all candidates of a prompt
  ("Action: ", and "move " in the maze) are appended to the prompt and scored once; the candidates'
  later tokens run as a prefix tree (prefixes.PrefixTree), so a start several of them share ("craft
  1 iron ") is computed once too; the output layer runs only where a scored token is predicted, in
  the weights' dtype. How the passes are laid out (layouts.py):
  - real models (Reuse): a prompt starts from the KV cache of the longest recent prompt it begins
    with (prefixes.PrefixCache: the same episode's previous turn, whose prompt it extends in the
    chat format, or another episode with the same instruction), so a step computes only the new
    observation's tokens; its candidates then run packed in rows on that cache, each seeing the
    prompt and its own earlier tokens (a 4D mask), without copying the cache;
  - the tiny model, where a call costs more than its arithmetic, batches prompts: with few
    candidates (maze) each row holds the prompt followed by its candidates' prefix tree (Packed);
    with many (Wordle's 100 words, TextCraft's 19-40 commands) the prompts run first and the
    candidates then run in groups on copies of their prompt's KV cache (Cached).
  With `scoring="calibrated"` the agent acts on each action's log-likelihood less its log-likelihood
  after the content-free prompt (see ActionScorer.score).
- Generation (generation.ActionWriter.generate_actions): generate the agent's text and match the
  action to an admissible one (actions.parse_action); when nothing matches, fall back to the
  scoring choice.
- Writing (environments that list no actions, whatever the policy; ActionWriter.write_actions):
  generate the agent's ReAct text and send the action parsed from it.

Prompts are truncated on the left to `max_prompt_tokens` tokens, both here and in training
(prompts.encode_trajectory), so the model is trained on exactly what it sees when acting.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from fedse.config import SCORINGS

from services.client_agent.model.layouts import Batch, Prepared, Runner, make_layout
from services.client_agent.model.loading import autocast, micro_batches, pads_to_buckets
from services.client_agent.model.prefixes import PrefixCache
from services.client_agent.playing.prompts import PlainFormat, PromptFormat, TokenCache, default_max_prompt_tokens, is_tiny
from services.client_agent.model.work import Work

BASELINE_CACHE_SIZE = 200_000  # candidate texts whose content-free log-likelihood is remembered


class ActionScorer:
    """Scores and chooses admissible actions with a causal LM (a PeftModel or a plain model)."""

    def __init__(self, model, tokenizer, device: str | torch.device | None = None,
                 max_prompt_tokens: int | None = None, max_batch_tokens: int | None = None,
                 method: str = "auto", packed_max_candidates: int = 16, group_size: int = 10,
                 fmt: PromptFormat | None = None, precision: str = "fp32", cache_bytes: int = 512 << 20,
                 tokenize: TokenCache | None = None, bucket: bool | None = None, scoring: str = "sum",
                 work: Work | None = None):
        """`method` names the layout of the passes (layouts.make_layout): "packed", "cached",
        "reuse" or "auto" (Reuse for real models on CPU, else Packed up to `packed_max_candidates`
        candidates and Cached in rows of `group_size` above). `max_batch_tokens` bounds (rows x row
        length) per forward pass; larger inputs are split. `cache_bytes` bounds the prompts' KV
        caches Reuse keeps. `work` counts the passes' tokens and FLOPs (work.Work; a new one by
        default)."""
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.max_prompt_tokens = max_prompt_tokens or default_max_prompt_tokens(model)
        self.fmt = fmt or PlainFormat()
        self.precision = precision
        self.tokenize = tokenize or TokenCache(tokenizer)  # shared with the prompt format and training
        pad = tokenizer.pad_token_id
        self.work = work or Work.of(model)
        self.runner = Runner(
            model, self.device, pad if pad is not None else (tokenizer.eos_token_id or 0),
            # On one CPU thread 4096 was fastest (cache-sized activations); GPUs want much larger passes.
            max_batch_tokens or (4096 if self.device.type == "cpu" else 65536),
            # Passes padded to bucket lengths (model.bucket_length) where oneDNN would otherwise keep a
            # compiled kernel for every prompt length it meets: bf16 on a CPU, unless told otherwise.
            pads_to_buckets(precision, self.device) if bucket is None else bucket, self.work)
        self.cache = PrefixCache(cache_bytes)
        self.layout = make_layout(method, self.device.type == "cpu" and not is_tiny(model), packed_max_candidates,
                                  group_size, self.cache)
        if scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {', '.join(SCORINGS)}, got {scoring!r}")
        self.scoring = scoring
        self._baseline: OrderedDict[str, float] = OrderedDict()  # candidate text -> log p(it | no context)

    def forget(self) -> None:
        """Drops cached prompts and baselines: call whenever the model's weights change."""
        self.cache.clear()
        self._baseline.clear()

    # ---- scoring -------------------------------------------------------------------------------

    def baseline(self, candidates: Sequence[str]) -> torch.Tensor:
        """log p(target(c) | the content-free prompt) for each candidate c, under the current weights
        (adapter included); remembered per candidate text until `forget`. The content-free prompt is
        scored like any other (the prefix cache is keyed by token ids, so sharing it is exact)."""
        todo = [c for c in dict.fromkeys(candidates) if c not in self._baseline]
        if todo:
            (got,) = self.loglik([self.fmt.prompt("", [], "")], [todo])
            self._baseline.update(zip(todo, got.tolist()))
            while len(self._baseline) > BASELINE_CACHE_SIZE:
                self._baseline.popitem(last=False)
        return torch.tensor([self._baseline[c] for c in candidates], dtype=torch.float32)

    @torch.no_grad()
    def score(self, prompts: Sequence[str], candidates: Sequence[Sequence[str]],
              scoring: str | None = None) -> list[torch.Tensor]:
        """What the agent acts on, for every candidate c of every prompt (CPU fp32 tensors):
        - "sum": log p(target(c) | prompt), summed over the target's tokens;
        - "calibrated": that less log p(target(c) | the content-free prompt) under the same weights
          (contextual calibration, Zhao et al. 2021): what the prompt adds to each action's likelihood.
          An untrained model's sum prefers short actions and those its random weights happen to like
          (the tiny model: about 7 nats per byte, so BabyAI's "turn left" beats "go to red ball 1" by
          ~50 nats wherever it is); calibration removes what does not depend on the prompt, and with
          it what training taught regardless of the prompt (the Maze's "mostly right and down").
        `scoring`: this call's rule (an environment's, for a client of several), else the scorer's."""
        out = self.loglik(prompts, candidates)
        if (scoring or self.scoring) == "sum":
            return out
        return [s - self.baseline(cands) for s, cands in zip(out, candidates)]

    @torch.no_grad()
    def loglik(self, prompts: Sequence[str], candidates: Sequence[Sequence[str]]) -> list[torch.Tensor]:
        """log p(format_target(c) | prompt) for every candidate c of every prompt (CPU fp32 tensors)."""
        if len(prompts) != len(candidates):
            raise ValueError(f"{len(prompts)} prompts but {len(candidates)} candidate lists")
        for i, cands in enumerate(candidates):
            if len(cands) == 0:
                raise ValueError(f"prompt {i} has no candidate actions")
        items = [Prepared.of(self.tokenize.prompt(p, self.max_prompt_tokens),
                             [self.tokenize(self.fmt.target(c)) for c in cands])
                 for p, cands in zip(prompts, candidates)]
        out: list[torch.Tensor | None] = [None] * len(items)
        # Group prompts, shortest first, into forward passes of bounded size (rows are padded to the longest).
        order = sorted(range(len(items)), key=lambda i: items[i].length)
        for run in micro_batches([items[i].length for i in order], self.runner.max_batch_tokens):
            where = [order[k] for k in run]
            with autocast(self.precision, self.device):
                self.layout.run(self.runner, Batch([items[i] for i in where], where, out))
        return out  # type: ignore[return-value]

    # ---- choosing ------------------------------------------------------------------------------

    def choose(self, prompts: Sequence[str], candidates: Sequence[Sequence[str]], greedy: bool,
               generator: torch.Generator | None = None, temperature: float = 1.0,
               scoring: str | None = None) -> list[int]:
        """Index of the chosen candidate for each prompt: argmax of the score (first on ties) when
        greedy, else a sample from softmax(score / temperature); `scoring` as score's."""
        if not greedy and temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
        picks = []
        for s in self.score(prompts, candidates, scoring):
            if greedy:
                picks.append(int(torch.argmax(s)))
            else:
                probs = torch.softmax(s.double() / temperature, dim=0)
                picks.append(int(torch.multinomial(probs, 1, generator=generator)))
        return picks

"""What every layout's passes are made of (`layouts` runs them): a prompt prepared for scoring, its
tokens followed by the target tokens all its candidates share and its candidates' prefix tree
(Prepared); one token a pass scores and where its prediction sits (Target); and what runs the passes
(Runner: the model, its device, the pad token, the size of a pass, the work counted).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from services.client_agent.model.prefixes import PrefixTree
from services.client_agent.model.work import Work
from services.client_agent.playing.prompts import inner_model


@dataclasses.dataclass(frozen=True)
class Target:
    """One scored token: the batch's prompt it counts for, where the hidden state that predicts it
    sits in the pass's (flattened) hidden states, the token, and the candidate it belongs to (-1:
    shared by all the prompt's candidates)."""

    item: int
    at: int
    token: int
    cand: int


@dataclasses.dataclass(frozen=True)
class Prepared:
    """One prompt ready to score: `prompt` holds its `n_prompt` tokens followed by the `shared` first
    target tokens all its candidates have in common ("Action: ", scored once as part of the prompt);
    `suffixes` are every candidate's remaining target tokens (at least one each), and `tree` their
    prefix tree."""

    prompt: list[int]
    n_prompt: int
    shared: int
    suffixes: list[list[int]]
    tree: PrefixTree

    @classmethod
    def of(cls, prompt: list[int], targets: list[list[int]]) -> Prepared:
        """The prompt's tokens and its candidates' target tokens, prepared."""
        shared = min(len(t) for t in targets) - 1  # keep >= 1 token per suffix
        first = targets[0]
        for t in targets[1:]:
            k = 0
            while k < shared and t[k] == first[k]:
                k += 1
            shared = k
        shared = max(shared, 0)
        suffixes = [t[shared:] for t in targets]
        return cls(prompt + first[:shared], len(prompt), shared, suffixes, PrefixTree(list(enumerate(suffixes))))

    @property
    def length(self) -> int:
        """Its row's width in a packed pass."""
        return len(self.prompt) + self.tree.width

    def first_targets(self, b: int, last: int) -> list[Target]:
        """The targets the prompt's own pass predicts, for the batch's prompt b: the tokens all
        candidates share (the last `shared` tokens of `prompt`) and every candidate's first token;
        `last` is where the prompt's last token sits in the pass's hidden states."""
        n, k_sh = len(self.prompt), self.shared
        out = [Target(b, last - k_sh + k, self.prompt[n - k_sh + k], -1) for k in range(k_sh)]
        return out + [Target(b, last, suf[0], j) for j, suf in enumerate(self.suffixes)]


@dataclasses.dataclass(frozen=True)
class Runner:
    """What every layout's passes need: the model (a PeftModel or a plain causal LM), its device,
    the pad token, the most (rows x row length) tokens of one pass, whether passes are padded to
    bucket lengths (model.bucket_length), and where the passes' tokens are counted."""

    model: Any
    device: torch.device
    pad_id: int
    max_batch_tokens: int
    bucket: bool
    work: Work

    @property
    def lm(self):
        return inner_model(self.model)

    def additive_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """The attention mask, in the weights' dtype, of a boolean [rows, queries, keys] one."""
        dtype = next(self.model.parameters()).dtype
        mask = torch.zeros((allowed.shape[0], 1, *allowed.shape[1:]), dtype=dtype)
        return mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(dtype).min)

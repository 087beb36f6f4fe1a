"""The agent's action policy: choosing among admissible actions with the model.

Three ways to act:
- Scoring (the default, and the only one the tiny model can use): every admissible action is scored
  by log p(target(action) | prompt), summed over its tokens, where prompt and target come from the
  client's prompts.PromptFormat; exploration samples from the softmax over candidates (temperature
  1.0), evaluation takes the argmax. Tokens shared by all candidates of a prompt ("Action: ", and
  "move " in the maze) are appended to the prompt and scored once; the candidates' later tokens
  run as a prefix tree (PrefixTree), so a start several of them share ("craft 1 iron ") is
  computed once too; the output layer runs only where a scored token is predicted, in the
  weights' dtype. How the passes are laid out:
  - real models ("reuse"): a prompt starts from the KV cache of the longest recent prompt it
    begins with (PrefixCache: the same episode's previous turn, whose prompt it extends in the chat
    format, or another episode with the same instruction), so a step computes only the new
    observation's tokens; its candidates then run packed in rows on that cache, each seeing the
    prompt and its own earlier tokens (a 4D mask), without copying the cache;
  - the tiny model, where a call costs more than its arithmetic, batches prompts: with few
    candidates (maze) each row holds the prompt followed by its candidates' prefix tree
    ("packed"); with many (Wordle's 100 words, TextCraft's 19-40 commands) the prompts run first
    and the candidates then run in groups on copies of their prompt's KV cache ("cached").
  With `scoring="calibrated"` the agent acts on each action's log-likelihood less its log-likelihood
  after the content-free prompt (see ActionScorer.score).
- Generation: generate the agent's text and match the action to an admissible one (see
  parse_action); a row stops at the end of the action line or the chat template's end of turn, or
  after a token limit set from the longest candidate; when nothing matches, fall back to the
  scoring choice.
- Writing (environments that list no actions, whatever the policy): generate the agent's ReAct
  text, "Thought:\n...\n\nAction:\n<action>", greedily (evaluation) or sampled at the temperature
  (exploration), and send the action parsed from it (parse_react); the whole text is kept for
  training. Where no action can be parsed, the text's last non-empty line is sent (`Written.parsed`
  False, counted), so the episode goes on and the environment answers what it makes of it.

Prompts are truncated on the left to `max_prompt_tokens` tokens, both here and in training
(prompts.encode_trajectory), so the model is trained on exactly what it sees when acting.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch

from fedse.config import SCORINGS
from fedse.machine import release_free_memory

from .model import autocast, bucket_length, pads_to_buckets
from .prompts import (PlainFormat, PromptFormat, TokenCache, default_max_prompt_tokens, fallback_action, inner_model,
                      is_tiny, parse_react)

BASELINE_CACHE_SIZE = 200_000  # candidate texts whose content-free log-likelihood is remembered

_ACTION_RE = re.compile(r"Action\s*:\s*(.+)", re.IGNORECASE)
# A complete action line: "Action: <action>\n" or AgentGym's "Action:\n<action>\n".
_ACTION_LINE = re.compile(r"(?<![A-Za-z])Action\s*:[ \t]*\n?[ \t]*\S[^\n]*\n", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Written:
    """One turn the agent wrote: the action sent, the whole text it came from, and whether the
    action was parsed from the text (else fallback_action's guess)."""

    action: str
    text: str
    parsed: bool


def _normalise(text: str) -> str:
    return " ".join(text.strip().strip("`'\"[]().").lower().split())


def parse_action(text: str, candidates: Sequence[str]) -> str | None:
    """The admissible action a generated ReAct text names, or None.

    Takes the first line after "Action:" (the whole text when there is none), then tries in order:
    an exact match ignoring case, quotes, brackets and a final period; the longest candidate that the
    line contains as whole words; a close spelling (difflib ratio >= 0.85).
    """
    if not candidates:
        return None
    m = _ACTION_RE.search(text)
    line = m.group(1).splitlines()[0] if m else text.strip().splitlines()[0] if text.strip() else ""
    said = _normalise(line)
    if not said:
        return None
    by_norm = {}
    for c in candidates:
        by_norm.setdefault(_normalise(c), c)
    if said in by_norm:
        return by_norm[said]
    contained = [c for n, c in by_norm.items() if n and re.search(r"(?<!\w)" + re.escape(n) + r"(?!\w)", said)]
    if contained:
        return max(contained, key=len)
    close = difflib.get_close_matches(said, list(by_norm), n=1, cutoff=0.85)
    return by_norm[close[0]] if close else None


class PrefixCache:
    """KV caches of recent prompts, reused by later prompts that begin with the same tokens: the
    next turn of an episode (its prompt extends the previous one) and other episodes' prompts with
    the same instruction. Bounded by `max_bytes` of cached tensors (least recently used go first)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: list[tuple[np.ndarray, list[tuple[torch.Tensor, torch.Tensor]], int]] = []  # oldest first
        self.bytes = 0
        self.hits = self.reused = self.computed = 0  # lookups that reused something; tokens reused, computed

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def lookup(self, ids: Sequence[int], limit: int) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """(L, kv): the longest cached prefix of ids[:limit] and the cache it is the start of."""
        query = np.asarray(ids[:limit], dtype=np.int64)
        best, best_i = 0, -1
        for i, (key, _, _) in enumerate(self._entries):
            m = min(len(key), len(query))
            if m <= best:
                continue
            diff = np.flatnonzero(key[:m] != query[:m])
            common = int(diff[0]) if len(diff) else m
            if common > best:
                best, best_i = common, i
        if best_i < 0:
            return 0, None
        entry = self._entries.pop(best_i)
        self._entries.append(entry)  # most recently used
        return best, entry[1]

    def store(self, ids: Sequence[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Caches the KV of `ids`; entries that are a prefix of ids go (the new one holds them)."""
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        key = np.asarray(ids, dtype=np.int64)
        kept = []
        for entry in self._entries:
            old = entry[0]
            if len(old) <= len(key) and np.array_equal(old, key[:len(old)]):
                self.bytes -= entry[2]
            else:
                kept.append(entry)
        self._entries = kept
        if size > self.max_bytes:
            return
        self._entries.append((key, kv, size))
        self.bytes += size
        while self.bytes > self.max_bytes:
            self.bytes -= self._entries.pop(0)[2]


class PrefixTree:
    """The later tokens of candidates (j, suffix) laid out as a prefix tree: one column for each
    distinct start suffix[:k + 1] with k < len(suffix) - 1, holding its last token, at depth k.
    Candidates that begin alike (TextCraft's "craft 1 iron ...", "get 4 iron ingot" and "get 6 iron
    ingot") share the columns of their common start, so a pass computes it once: on the first three
    steps of 20 test tasks the columns are 63% of the candidates' tokens in TextCraft, 56% in BabyAI,
    55% in WebShop and 42% in Wordle (all 100 words in one tree).
    `paths[i]`: the columns of part[i]'s suffix[:1], suffix[:2], ..., suffix[:-1], in order."""

    def __init__(self, part: Sequence[tuple[int, Sequence[int]]] = ()):
        self.tokens: list[int] = []
        self.depths: list[int] = []
        self.part: list[tuple[int, Sequence[int]]] = []
        self.paths: list[list[int]] = []
        self._column: dict[tuple[int, int], int] = {}  # (parent column or -1, token) -> column
        for j, suf in part:
            self.add(j, suf)

    def _known(self, suf: Sequence[int]) -> list[int]:
        """The columns of suf's starts that the tree already has (its longest known start's path)."""
        path: list[int] = []
        for k in range(len(suf) - 1):
            c = self._column.get((path[-1] if path else -1, suf[k]))
            if c is None:
                break
            path.append(c)
        return path

    def added_width(self, suf: Sequence[int]) -> int:
        """The columns add(_, suf) would add."""
        return max(len(suf) - 1, 0) - len(self._known(suf))

    def add(self, j: int, suf: Sequence[int]) -> None:
        path = self._known(suf)
        for k in range(len(path), len(suf) - 1):
            c = self._column[(path[-1] if path else -1, suf[k])] = len(self.tokens)
            self.tokens.append(suf[k])
            self.depths.append(k)
            path.append(c)
        self.part.append((j, suf))
        self.paths.append(path)

    @property
    def width(self) -> int:
        return len(self.tokens)

    def pack(self, n: int, ids_row: torch.Tensor, pos_row: torch.Tensor,
             among: torch.Tensor) -> list[tuple[int, int, int]]:
        """Writes the tree from column 0 of one row that follows an n-token prompt: its tokens, their
        positions (n + depth) and, in `among` (the row's mask block over its own columns), each
        column seeing itself and the columns of its shorter starts. Returns (column whose hidden
        state predicts it, target token, j) for every suffix token after the first."""
        w = self.width
        ids_row[:w] = torch.tensor(self.tokens, dtype=torch.long)
        pos_row[:w] = n + torch.tensor(self.depths, dtype=torch.long)
        scored = []
        for (j, suf), path in zip(self.part, self.paths):
            if path:
                cols = torch.tensor(path)
                r, c = torch.tril_indices(len(path), len(path))
                among[cols[r], cols[c]] = True
            scored += [(path[k - 1], suf[k], j) for k in range(1, len(suf))]
        return scored


class ActionScorer:
    """Scores and chooses admissible actions with a causal LM (a PeftModel or a plain model)."""

    def __init__(self, model, tokenizer, device: str | torch.device | None = None,
                 max_prompt_tokens: int | None = None, max_batch_tokens: int | None = None,
                 method: str = "auto", packed_max_candidates: int = 16, group_size: int = 10,
                 fmt: PromptFormat | None = None, precision: str = "fp32", cache_bytes: int = 512 << 20,
                 tokenize: TokenCache | None = None, bucket: bool | None = None, scoring: str = "sum"):
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.max_prompt_tokens = max_prompt_tokens or default_max_prompt_tokens(model)
        # Upper bound on (rows x row length) per forward pass; larger inputs are split. On one CPU
        # thread 4096 was fastest (cache-sized activations); GPUs want much larger passes.
        self.max_batch_tokens = max_batch_tokens or (4096 if self.device.type == "cpu" else 65536)
        if method not in ("auto", "packed", "cached", "reuse"):
            raise ValueError(f"method must be 'auto', 'packed', 'cached' or 'reuse', got {method!r}")
        # "packed": one pass, all candidates in the prompt's row (best for a few short candidates);
        # "cached": a prompt pass keeping the KV cache, then rows of up to `group_size` candidates
        # packed on a copy of their prompt's cache: attention and copy costs grow linearly, not
        # quadratically, with the number of candidates (100 Wordle words: ~1.7x faster than packed).
        # "reuse" (real models): one prompt at a time, starting from the KV cache of the longest
        # cached prompt it begins with (PrefixCache: the previous turn, the shared instruction),
        # then its candidates packed in rows on that prompt's cache.
        # "auto": "reuse" for real models on CPU, where arithmetic is dear; elsewhere (the tiny model,
        # GPUs: passes are cheap, calls are not) batched across prompts: packed up to
        # `packed_max_candidates` candidates, else cached.
        self.method = ("reuse" if self.device.type == "cpu" and not is_tiny(model) else "auto") \
            if method == "auto" else method
        self.packed_max_candidates = packed_max_candidates
        self.group_size = max(1, group_size)
        self.fmt = fmt or PlainFormat()
        self.precision = precision
        self.cache = PrefixCache(cache_bytes)
        self.generated = self.fallbacks = 0  # generation mode: actions generated, and those scoring chose
        self.written = self.unparsed = 0  # writing mode: turns written, and those that named no action
        self.tokenize = tokenize or TokenCache(tokenizer)  # shared with the prompt format and training
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)
        # Passes padded to bucket lengths (model.bucket_length) where oneDNN would otherwise keep a
        # compiled kernel for every prompt length it meets: bf16 on a CPU, unless told otherwise.
        self.bucket = pads_to_buckets(precision, self.device) if bucket is None else bucket
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
    def score(self, prompts: Sequence[str], candidates: Sequence[Sequence[str]]) -> list[torch.Tensor]:
        """What the agent acts on, for every candidate c of every prompt (CPU fp32 tensors):
        - "sum": log p(target(c) | prompt), summed over the target's tokens;
        - "calibrated": that less log p(target(c) | the content-free prompt) under the same weights
          (contextual calibration, Zhao et al. 2021): what the prompt adds to each action's likelihood.
          An untrained model's sum prefers short actions and those its random weights happen to like
          (the tiny model: about 7 nats per byte, so BabyAI's "turn left" beats "go to red ball 1" by
          ~50 nats wherever it is); calibration removes what does not depend on the prompt, and with
          it what training taught regardless of the prompt (the Maze's "mostly right and down")."""
        out = self.loglik(prompts, candidates)
        if self.scoring == "sum":
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
        items = [self._prepare(p, c) for p, c in zip(prompts, candidates)]
        out: list[torch.Tensor | None] = [None] * len(items)
        # Group prompts into forward passes of bounded size (rows are padded to the longest).
        order = sorted(range(len(items)), key=lambda i: items[i]["length"])
        batch: list[int] = []
        longest = 0
        for i in order:
            longest_if = max(longest, items[i]["length"])
            if batch and longest_if * (len(batch) + 1) > self.max_batch_tokens:
                self._score_batch([items[j] for j in batch], out, batch)
                batch, longest_if = [], items[i]["length"]
            batch.append(i)
            longest = longest_if
        if batch:
            self._score_batch([items[j] for j in batch], out, batch)
        return out  # type: ignore[return-value]

    def _prepare(self, prompt: str, cands: Sequence[str]) -> dict:
        p = self.tokenize.prompt(prompt, self.max_prompt_tokens)
        targets = [self.tokenize(self.fmt.target(c)) for c in cands]
        # Tokens all candidates share are scored once as part of the prompt; keep >= 1 token per suffix.
        shared = min(len(t) for t in targets) - 1
        first = targets[0]
        for t in targets[1:]:
            k = 0
            while k < shared and t[k] == first[k]:
                k += 1
            shared = k
        shared = max(shared, 0)
        suffixes = [t[shared:] for t in targets]
        tree = PrefixTree(list(enumerate(suffixes)))
        return {"prompt": p + first[:shared], "n_prompt": len(p), "shared": shared, "suffixes": suffixes,
                "tree": tree, "length": len(p) + shared + tree.width}

    def _score_batch(self, items: list[dict], out: list, where: list[int]) -> None:
        with autocast(self.precision, self.device):
            return self._score_batch_as(items, out, where)

    def _score_batch_as(self, items: list[dict], out: list, where: list[int]) -> None:
        if self.method == "reuse":
            return self._score_reuse(items, out, where)
        if self.method == "packed" or (self.method == "auto" and
                                       max(len(it["suffixes"]) for it in items) <= self.packed_max_candidates):
            return self._score_packed(items, out, where)
        return self._score_cached(items, out, where)

    def _score_packed(self, items: list[dict], out: list, where: list[int]) -> None:
        """One forward pass: each row is [prompt | its candidates' prefix tree] with a 4D mask."""
        dev = self.device
        P = max(len(it["prompt"]) for it in items)  # prompt block width (left padded)
        T = P + max(it["tree"].width for it in items)
        B = len(items)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
        pos = torch.zeros((B, T), dtype=torch.long)
        allowed = torch.zeros((B, T, T), dtype=torch.bool)
        # (row, predicting position, target token, candidate index or -1 for the shared prefix)
        rows, src, tgt, cand = [], [], [], []
        causal = torch.ones((P, P), dtype=torch.bool).tril()
        for b, it in enumerate(items):
            prompt = it["prompt"]
            n = len(prompt)
            start = P - n
            ids[b, start:P] = torch.tensor(prompt, dtype=torch.long)
            pos[b, start:P] = torch.arange(n)
            allowed[b, start:P, start:P] = causal[:n, :n]
            # The shared tokens and every candidate's first are predicted in the prompt block.
            self._first_tokens(it, b, P - 1, rows, src, tgt, cand)
            tree = it["tree"]
            for col, token, j in tree.pack(n, ids[b, P:], pos[b, P:], allowed[b, P:, P:]):
                rows.append(b); src.append(P + col); tgt.append(token); cand.append(j)
            used = P + tree.width
            allowed[b, P:used, start:P] = True
            # Padding positions attend to themselves only (keeps softmax finite; never read).
            idle = torch.ones(T, dtype=torch.bool)
            idle[start:used] = False
            idle_pos = idle.nonzero().squeeze(1)
            allowed[b, idle_pos, idle_pos] = True
        param_dtype = next(self.model.parameters()).dtype
        mask = torch.zeros((B, 1, T, T), dtype=param_dtype)
        mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(param_dtype).min)
        lm = inner_model(self.model)
        hidden = lm.get_decoder()(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                                  use_cache=False).last_hidden_state
        self._collect(items, out, where, lm, hidden.flatten(0, 1), [r * T + c for r, c in zip(rows, src)],
                      rows, tgt, cand)

    def _score_cached(self, items: list[dict], out: list, where: list[int]) -> None:
        """The prompts once (keeping their KV cache), then the candidates' later tokens in rows of up to
        `group_size` candidates of one prompt, each row on top of a copy of its prompt's cache."""
        dev = self.device
        lm = inner_model(self.model)
        decoder = lm.get_decoder()
        P = max(len(it["prompt"]) for it in items)
        B = len(items)
        ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        att = torch.zeros((B, P), dtype=torch.long)
        pos = torch.zeros((B, P), dtype=torch.long)
        for b, it in enumerate(items):
            n = len(it["prompt"])
            ids[b, P - n:] = torch.tensor(it["prompt"], dtype=torch.long)
            att[b, P - n:] = 1
            pos[b, P - n:] = torch.arange(n)
        first = decoder(input_ids=ids.to(dev), attention_mask=att.to(dev), position_ids=pos.to(dev), use_cache=True)
        cache, prompt_hidden = first.past_key_values, first.last_hidden_state
        layers = [(layer.keys, layer.values) for layer in cache.layers]
        # Shared-prefix tokens and every suffix's first token are predicted from the prompt pass.
        rows, src, tgt, cand = [], [], [], []
        for b, it in enumerate(items):
            self._first_tokens(it, b, P - 1, rows, src, tgt, cand)
        pairs = [(b, j, suf) for b, it in enumerate(items) for j, suf in enumerate(it["suffixes"]) if len(suf) > 1]
        self._collect(items, out, where, lm, prompt_hidden.flatten(0, 1), [r * P + c for r, c in zip(rows, src)],
                      rows, tgt, cand)
        if not pairs:
            return
        # Later suffix tokens: rows of up to `group_size` candidates of one prompt (in token order, so
        # that those beginning alike share a row), each row the prefix tree of its candidates
        # (PrefixTree) after a copy of that prompt's cache, each column seeing the prompt and its
        # own start only.
        by_prompt: dict[int, list[tuple[int, int, list[int]]]] = {}
        for pr in sorted(pairs, key=lambda pr: (pr[0], pr[2])):
            by_prompt.setdefault(pr[0], []).append(pr)
        groups = [mine[g:g + self.group_size] for mine in by_prompt.values()
                  for g in range(0, len(mine), self.group_size)]
        trees = [PrefixTree([(j, suf) for _, j, suf in grp]) for grp in groups]
        widths = [tree.width for tree in trees]
        order = sorted(range(len(groups)), key=lambda g: widths[g])
        param_dtype = next(self.model.parameters()).dtype
        from transformers import DynamicCache

        c0 = 0
        while c0 < len(order):
            # As many rows as fit in max_batch_tokens (rows are sorted by width; the last is widest).
            c1 = c0 + 1
            while c1 < len(order) and (c1 + 1 - c0) * (P + widths[order[c1]]) <= self.max_batch_tokens:
                c1 += 1
            part = [groups[g] for g in order[c0:c1]]
            part_trees = [trees[g] for g in order[c0:c1]]
            W = max(widths[g] for g in order[c0:c1])
            c0 = c1
            R = len(part)
            sel = torch.tensor([grp[0][0] for grp in part])
            s_ids = torch.full((R, W), self.pad_id, dtype=torch.long)
            s_pos = torch.zeros((R, W), dtype=torch.long)
            allowed = torch.zeros((R, W, P + W), dtype=torch.bool)
            allowed[:, :, :P] = att.index_select(0, sel).bool().unsqueeze(1)
            rows, src, tgt, cand, owner = [], [], [], [], []
            for r, (grp, tree) in enumerate(zip(part, part_trees)):
                b = grp[0][0]
                for col, token, j in tree.pack(len(items[b]["prompt"]), s_ids[r], s_pos[r], allowed[r, :, P:]):
                    rows.append(r); src.append(col); tgt.append(token); cand.append(j); owner.append(b)
                pad = torch.arange(tree.width, W)
                allowed[r, pad, P + pad] = True  # padding attends to itself only (finite, never read)
            mask = torch.zeros((R, 1, W, P + W), dtype=param_dtype)
            mask.masked_fill_(~allowed.unsqueeze(1), torch.finfo(param_dtype).min)
            sel_d = sel.to(dev)
            past = DynamicCache(ddp_cache_data=[(k.index_select(0, sel_d), v.index_select(0, sel_d)) for k, v in layers])
            hidden = decoder(input_ids=s_ids.to(dev), attention_mask=mask.to(dev), position_ids=s_pos.to(dev),
                             past_key_values=past, use_cache=True).last_hidden_state
            self._collect(items, out, where, lm, hidden.flatten(0, 1), [r * W + c for r, c in zip(rows, src)],
                          owner, tgt, cand)

    def _score_reuse(self, items: list[dict], out: list, where: list[int]) -> None:
        """One prompt at a time: its tokens after the longest cached prefix run on that prefix's KV
        cache (the result is cached in turn), then its candidates' later tokens in rows of at most
        max_batch_tokens / 4 tokens on top of the prompt's cache, each candidate seeing the prompt
        and its own earlier tokens only. No copies of a cache are made (every row has batch 1)."""
        from transformers import DynamicCache

        dev = self.device
        lm = inner_model(self.model)
        decoder = lm.get_decoder()
        for b, it in enumerate(items):
            ids, n_prompt = it["prompt"], it["n_prompt"]
            # Reuse at most up to the token before the prompt's end: its hidden state predicts the
            # first scored token.
            start, kv = self.cache.lookup(ids, n_prompt - 1)
            past = DynamicCache(ddp_cache_data=[(k[:, :, :start], v[:, :, :start]) for k, v in kv]) \
                if kv is not None and start > 0 else DynamicCache()
            self.cache.hits += start > 0
            self.cache.reused += start
            self.cache.computed += len(ids) - start
            # With buckets the pass runs pad tokens after the prompt's: no prompt token sees them
            # (causal), and their keys and values are cut off below.
            n_new = len(ids) - start
            width = bucket_length(n_new) if self.bucket else n_new
            run = decoder(input_ids=torch.tensor([ids[start:] + [self.pad_id] * (width - n_new)], device=dev),
                          position_ids=torch.arange(start, start + width, device=dev).unsqueeze(0),
                          past_key_values=past, use_cache=True)
            # Keys in the values' dtype: under bf16 autocast rotary embeddings leave keys in fp32, but
            # attention reads them in bf16, so bf16 keys halve the cache and change no score.
            # All layers' keys and values in one block: one allocation per cached prompt (a large one is
            # mapped and unmapped whole) rather than 60 that interleave with the passes' (six BabyAI
            # evaluation episodes: peak 1.92 GB instead of 2.02).
            kv = run.past_key_values.layers
            block = torch.stack([torch.stack((layer.keys[:, :, :len(ids)].to(layer.values.dtype),
                                              layer.values[:, :, :len(ids)])) for layer in kv])
            kv = past = run.past_key_values = None  # the per-layer tensors go now that the block holds them
            layers = [(block[i, 0], block[i, 1]) for i in range(block.shape[0])]
            self.cache.store(ids, layers)
            hidden = run.last_hidden_state[0]  # positions start .. len(ids) - 1
            n = len(ids)
            rows, src, tgt, cand = [], [], [], []
            self._first_tokens(it, b, n - 1 - start, rows, src, tgt, cand)
            self._collect(items, out, where, lm, hidden, src, rows, tgt, cand)
            # Rows of candidates in token order (those beginning alike share a row's prefix tree).
            later = sorted(((j, suf) for j, suf in enumerate(it["suffixes"]) if len(suf) > 1), key=lambda c: c[1])
            row_cap = max(16, self.max_batch_tokens // 4)
            while later:
                tree = PrefixTree()
                while later and (not tree.part or tree.width + tree.added_width(later[0][1]) <= row_cap):
                    tree.add(*later.pop(0))
                # Columns past the tree's (bucket padding) see only the prompt; no candidate sees them.
                padded = bucket_length(tree.width) if self.bucket else tree.width
                s_ids = torch.full((1, padded), self.pad_id, dtype=torch.long)
                s_pos = torch.full((1, padded), n, dtype=torch.long)
                allowed = torch.zeros((1, 1, padded, n + padded), dtype=torch.bool)
                allowed[..., :n] = True
                scored = tree.pack(n, s_ids[0], s_pos[0], allowed[0, 0, :, n:])
                src = [col for col, _, _ in scored]
                tgt = [token for _, token, _ in scored]
                cand = [j for _, _, j in scored]
                rows = [b] * len(scored)
                past = DynamicCache(ddp_cache_data=layers)
                h = decoder(input_ids=s_ids.to(dev), attention_mask=allowed.to(dev), position_ids=s_pos.to(dev),
                            past_key_values=past, use_cache=True).last_hidden_state[0]
                self._collect(items, out, where, lm, h, src, rows, tgt, cand)
            del run, hidden
            # A prompt's passes free tensors of many sizes; glibc would keep most of them resident
            # (measured: a WebShop evaluation held 3.9 GB with the cache at 441 MB; 2.1 GB returned so).
            release_free_memory()

    @staticmethod
    def _first_tokens(it: dict, b: int, last: int, rows: list, src: list, tgt: list, cand: list) -> None:
        """Adds the targets a prompt's own pass predicts: the tokens all candidates share (the last
        it["shared"] tokens of the prompt) and every candidate's first token; `last` is where the
        prompt's last token sits in the pass's hidden states."""
        ids, k_sh = it["prompt"], it["shared"]
        for k in range(k_sh):
            rows.append(b); src.append(last - k_sh + k); tgt.append(ids[len(ids) - k_sh + k]); cand.append(-1)
        for j, suf in enumerate(it["suffixes"]):
            rows.append(b); src.append(last); tgt.append(suf[0]); cand.append(j)

    @staticmethod
    def _collect(items, out, where, lm, hidden, at, rows, tgt, cand) -> None:
        """Adds log p(tgt) to out for each scored token, predicted from hidden[at] (hidden: [N, d]), by
        prompt row and candidate (-1 = shared by all). The output layer runs once per distinct state:
        a start several candidates share predicts all their next tokens from one (so its logits never
        outnumber a pass's columns)."""
        states, which = torch.unique(torch.tensor(at), return_inverse=True)
        h = hidden[states.to(hidden.device)]
        head = lm.get_output_embeddings()
        with torch.autocast(h.device.type, enabled=False):  # the output layer in the weights' dtype, not bf16
            logits = head(h.to(head.weight.dtype)).float()
        logp = torch.log_softmax(logits, dim=-1)[which.to(h.device), torch.tensor(tgt, device=h.device)]
        del logits
        logp = logp.cpu()
        rows_c, cand_c = torch.tensor(rows), torch.tensor(cand)
        for b in set(rows):
            in_row = rows_c == b
            n_c = len(items[b]["suffixes"])
            shared = logp[in_row & (cand_c == -1)].sum()
            per = torch.zeros(n_c).index_add_(0, cand_c[in_row & (cand_c >= 0)], logp[in_row & (cand_c >= 0)])
            if out[where[b]] is None:
                out[where[b]] = torch.zeros(n_c)
            out[where[b]] += per + shared

    # ---- choosing ------------------------------------------------------------------------------

    def choose(self, prompts: Sequence[str], candidates: Sequence[Sequence[str]], greedy: bool,
               generator: torch.Generator | None = None, temperature: float = 1.0) -> list[int]:
        """Index of the chosen candidate for each prompt: argmax of the score (first on ties) when
        greedy, else a sample from softmax(score / temperature)."""
        if not greedy and temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
        picks = []
        for s in self.score(prompts, candidates):
            if greedy:
                picks.append(int(torch.argmax(s)))
            else:
                probs = torch.softmax(s.double() / temperature, dim=0)
                picks.append(int(torch.multinomial(probs, 1, generator=generator)))
        return picks

    # ---- generation (real LLMs) ----------------------------------------------------------------

    @torch.no_grad()
    def generate_texts(self, prompts: Sequence[str], max_new_tokens: int = 128, greedy: bool = True,
                       temperature: float = 1.0, generator: torch.Generator | None = None) -> list[str]:
        """Continuations of the prompts, cut after the first complete action line ("Action: ..." or
        "Action:\n..."); a row stops at the end of that line, at the format's end of turn (a chat
        model's end-of-message token) or after max_new_tokens. Greedy, or sampled from the whole
        softmax at `temperature` with torch's generator seeded from `generator` (so a seeded
        generator gives the same texts again)."""
        if not greedy and temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
        lm = inner_model(self.model)
        eos = lm.config.eos_token_id
        eos = list(eos) if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []
        end = getattr(self.fmt, "end_of_turn", "")
        if end:
            eos += [t for t in self.tokenize(end) if t not in eos]
        encoded = []
        for p in prompts:
            encoded.append(self.tokenize.prompt(p, self.max_prompt_tokens))
        L = max(len(e) for e in encoded)
        ids = torch.full((len(encoded), L), self.pad_id, dtype=torch.long)
        att = torch.zeros((len(encoded), L), dtype=torch.long)
        for b, e in enumerate(encoded):
            ids[b, L - len(e):] = torch.tensor(e, dtype=torch.long)
            att[b, L - len(e):] = 1
        sampling = {} if greedy else {"temperature": temperature, "top_k": 0, "top_p": 1.0}
        seed = None if greedy else int(torch.randint(0, 2 ** 62, (1,), generator=generator))
        devices = [] if self.device.type != "cuda" else \
            [self.device.index if self.device.index is not None else torch.cuda.current_device()]
        with torch.random.fork_rng(devices=devices, enabled=seed is not None), autocast(self.precision, self.device):
            if seed is not None:
                torch.manual_seed(seed)
            gen = self.model.generate(input_ids=ids.to(self.device), attention_mask=att.to(self.device),
                                      max_new_tokens=max_new_tokens, do_sample=not greedy, **sampling,
                                      pad_token_id=self.pad_id, eos_token_id=eos or None,
                                      stopping_criteria=[_ActionLineDone(self.tokenizer, L)])
        texts = self.tokenizer.batch_decode(gen[:, L:], skip_special_tokens=True)
        return [_cut_after_action(t) for t in texts]

    def write_actions(self, prompts: Sequence[str], max_new_tokens: int, greedy: bool = True,
                      temperature: float = 1.0, generator: torch.Generator | None = None,
                      opening: str = "") -> list[Written]:
        """Writing mode (an environment that lists no actions): the agent's ReAct text for each
        prompt (`opening`, the start of it the prompts end with, then what the model wrote) and the
        action parsed from it (parse_react), or fallback_action's where it names none; counted in
        `written` and `unparsed`."""
        texts = [opening + t for t in self.generate_texts(prompts, max_new_tokens, greedy=greedy,
                                                           temperature=temperature, generator=generator)]
        out = []
        for text in texts:
            action = parse_react(text)
            out.append(Written(action, text, True) if action else Written(fallback_action(text), text, False))
        self.written += len(out)
        self.unparsed += sum(not w.parsed for w in out)
        return out

    def generate_actions(self, prompts: Sequence[str], candidates: Sequence[Sequence[str]],
                         max_new_tokens: int | None = None) -> list[str]:
        """Generation mode: the admissible action each prompt's generated text names; where it names
        none (parse_action gives None), the greedy scoring choice among the candidates.
        max_new_tokens None: the longest candidate's text (format target) plus 8 tokens, so a model
        that rambles stops soon after any action it could have meant."""
        if max_new_tokens is None:
            max_new_tokens = 8 + max(len(self.tokenize(self.fmt.target(c))) for cands in candidates for c in cands)
        texts = self.generate_texts(prompts, max_new_tokens)
        actions: list[str | None] = [parse_action(t, c) for t, c in zip(texts, candidates)]
        missing = [i for i, a in enumerate(actions) if a is None]
        if missing:
            picks = self.choose([prompts[i] for i in missing], [candidates[i] for i in missing], greedy=True)
            for i, k in zip(missing, picks):
                actions[i] = candidates[i][k]
        self.last_generated = texts
        self.last_fallbacks = len(missing)
        self.generated += len(texts)
        self.fallbacks += len(missing)
        return actions  # type: ignore[return-value]


def _cut_after_action(text: str) -> str:
    """The text up to and with the end of its first complete action line ("Action: x\n" or
    "Action:\nx\n"); all of it where it has none."""
    m = _ACTION_LINE.search(text)
    return text[:m.end()] if m else text


class _ActionLineDone:
    """Stopping criterion: every row has produced a complete action line ending in a newline:
    "Action: <action>\n", or AgentGym's "Action:\n<action>\n"."""

    def __init__(self, tokenizer, prompt_len: int):
        self.tokenizer = tokenizer
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_len:], skip_special_tokens=True)
        done = [bool(_ACTION_LINE.search(t)) for t in texts]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

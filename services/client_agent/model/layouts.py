"""How the scorer lays out its forward passes over prompts and their candidates' target tokens.

A prompt is prepared once (passes.Prepared): the target tokens all its candidates share are appended
to it and scored once, and the candidates' later tokens form a prefix tree (prefixes.PrefixTree). A
layout then runs a batch of prepared prompts (Batch) through the model and adds, for every scored
token (passes.Target), log p(token | what precedes it) to its prompt's candidate totals:
- Packed: one pass, each row the prompt followed by its candidates' prefix tree, with a 4D mask
  (best for a few short candidates);
- Cached: a prompt pass keeping the KV cache, then rows of up to `group_size` candidates packed on a
  copy of their prompt's cache: attention and copy costs grow linearly, not quadratically, with the
  number of candidates (100 Wordle words: ~1.7x faster than packed);
- Reuse (real models): one prompt at a time, starting from the KV cache of the longest cached prompt
  it begins with (prefixes.PrefixCache: the previous turn, the shared instruction), then its
  candidates packed in rows on that prompt's cache;
- Auto: Packed up to `packed_max_candidates` candidates, else Cached.
Every layout's passes run on a passes.Runner; make_layout picks the layout a method names.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from transformers import DynamicCache

from fedse.machine import release_free_memory

from services.client_agent.model.kvcache import KV, pass_cache
from services.client_agent.model.loading import bucket_length, logits_fp32
from services.client_agent.model.passes import Prepared, Runner, Target
from services.client_agent.model.prefixes import PrefixCache, PrefixTree, common_prefix
from services.client_agent.model.work import causal_context

# The fewest prompt tokens a prompt must share with an earlier one of its batch, beyond what the
# prefix cache holds for it, to wait for a second pass that reuses them (Reuse.run).
WORTH_WAITING = 32
# The most hidden states the output layer runs on at once (Batch.add).
HEAD_ROWS = 256
# What one more pass costs beyond its tokens, in padded positions (width_groups): a pass of a few
# dozen tokens runs a CPU's matmuls far below their peak.
PASS_OVERHEAD = 64


def width_groups(widths: list[int], overhead: int | None = None) -> list[list[int]]:
    """The rows (indices into widths) split into passes, each padded to its widest row, that compute
    the fewest positions counting `overhead` for each pass: rows of like widths share a pass, and a
    row far narrower than the others gets one of its own where that saves more padding than a pass
    costs (`overhead`: PASS_OVERHEAD). Widest first; exact (the best split of the rows sorted by width
    is contiguous)."""
    overhead = PASS_OVERHEAD if overhead is None else overhead
    order = sorted(range(len(widths)), key=lambda i: -widths[i])
    best = [0.0] + [math.inf] * len(order)  # best[i]: the cost of the first i rows (sorted)
    cut = [0] * (len(order) + 1)
    for i in range(1, len(order) + 1):
        for j in range(i):  # rows j..i-1 in one pass, as wide as row j
            cost = best[j] + overhead + (i - j) * widths[order[j]]
            if cost < best[i]:
                best[i], cut[i] = cost, j
    groups, i = [], len(order)
    while i > 0:
        groups.append(order[cut[i]:i])
        i = cut[i]
    return groups[::-1]


@dataclasses.dataclass(frozen=True)
class Batch:
    """Prompts scored together, and where their scores go: items[b]'s candidate totals are
    totals[where[b]] (None until a pass adds to them)."""

    items: list[Prepared]
    where: list[int]
    totals: list[torch.Tensor | None]

    def add(self, runner: Runner, hidden: torch.Tensor, targets: list[Target]) -> None:
        """Adds log p(target) to the totals for each target, predicted from hidden[target.at]
        (hidden: [N, d]), to its prompt's candidate (every candidate where it is shared). The
        output layer runs once per distinct state: a start several candidates share predicts all
        their next tokens from one (so its logits never outnumber a pass's columns), on at most
        HEAD_ROWS states at a time (a batch of Wordle prompts predicts 800 tokens: 160 MB of fp32
        logits over SmolLM2's 49,152 tokens, twice with their log-softmax)."""
        states, which = torch.unique(torch.tensor([t.at for t in targets]), return_inverse=True)
        h = hidden[states.to(hidden.device)]
        head = runner.lm.get_output_embeddings()
        runner.work.head(len(states))
        tokens = torch.tensor([t.token for t in targets])
        logp = torch.empty(len(targets))
        for c0 in range(0, len(states), HEAD_ROWS):
            mine = (which >= c0) & (which < c0 + HEAD_ROWS)
            logits = logits_fp32(head, h[c0:c0 + HEAD_ROWS])
            rows, cols = (which[mine] - c0).to(h.device), tokens[mine].to(h.device)
            logp[mine] = torch.log_softmax(logits, dim=-1)[rows, cols].cpu()
            del logits
        items, cands = torch.tensor([t.item for t in targets]), torch.tensor([t.cand for t in targets])
        for b in set(items.tolist()):
            mine = items == b
            n_c = len(self.items[b].suffixes)
            shared = logp[mine & (cands == -1)].sum()
            per = torch.zeros(n_c).index_add_(0, cands[mine & (cands >= 0)], logp[mine & (cands >= 0)])
            if self.totals[self.where[b]] is None:
                self.totals[self.where[b]] = torch.zeros(n_c)
            self.totals[self.where[b]] += per + shared


class Layout:
    """A way of laying out a batch's passes; `concurrency`: how many episodes a client plays side by
    side by default, whose turns' prompts then share passes."""

    name = ""
    concurrency = 16

    def run(self, runner: Runner, batch: Batch) -> None:
        raise NotImplementedError


class Packed(Layout):
    """One forward pass: each row is [prompt | its candidates' prefix tree] with a 4D mask."""

    name = "packed"

    def run(self, runner: Runner, batch: Batch) -> None:
        dev = runner.device
        P = max(len(it.prompt) for it in batch.items)  # prompt block width (left padded)
        T = P + max(it.tree.width for it in batch.items)
        B = len(batch.items)
        ids = torch.full((B, T), runner.pad_id, dtype=torch.long)
        pos = torch.zeros((B, T), dtype=torch.long)
        allowed = torch.zeros((B, T, T), dtype=torch.bool)
        targets: list[Target] = []
        causal = torch.ones((P, P), dtype=torch.bool).tril()
        real = context = 0
        for b, it in enumerate(batch.items):
            n = len(it.prompt)
            real += n + it.tree.width
            context += causal_context([n]) + it.tree.context(n)
            start = P - n
            ids[b, start:P] = torch.tensor(it.prompt, dtype=torch.long)
            pos[b, start:P] = torch.arange(n)
            allowed[b, start:P, start:P] = causal[:n, :n]
            # The shared tokens and every candidate's first are predicted in the prompt block.
            targets += it.first_targets(b, b * T + P - 1)
            for col, token, j in it.tree.pack(n, ids[b, P:], pos[b, P:], allowed[b, P:, P:]):
                targets.append(Target(b, b * T + P + col, token, j))
            used = P + it.tree.width
            allowed[b, P:used, start:P] = True
            # Padding positions attend to themselves only (keeps softmax finite; never read).
            idle = torch.ones(T, dtype=torch.bool)
            idle[start:used] = False
            idle_pos = idle.nonzero().squeeze(1)
            allowed[b, idle_pos, idle_pos] = True
        hidden = runner.lm.get_decoder()(input_ids=ids.to(dev), attention_mask=runner.additive_mask(allowed).to(dev),
                                         position_ids=pos.to(dev), use_cache=False).last_hidden_state
        runner.work.forward(real, context, padded=B * T - real)
        batch.add(runner, hidden.flatten(0, 1), targets)


class Cached(Layout):
    """The prompts once (keeping their KV cache), then the candidates' later tokens in rows of up to
    `group_size` candidates of one prompt, each row on top of a copy of its prompt's cache."""

    name = "cached"

    def __init__(self, group_size: int):
        self.group_size = max(1, group_size)

    def run(self, runner: Runner, batch: Batch) -> None:
        dev = runner.device
        lm = runner.lm
        P = max(len(it.prompt) for it in batch.items)
        B = len(batch.items)
        ids = torch.full((B, P), runner.pad_id, dtype=torch.long)
        att = torch.zeros((B, P), dtype=torch.long)
        pos = torch.zeros((B, P), dtype=torch.long)
        for b, it in enumerate(batch.items):
            n = len(it.prompt)
            ids[b, P - n:] = torch.tensor(it.prompt, dtype=torch.long)
            att[b, P - n:] = 1
            pos[b, P - n:] = torch.arange(n)
        first = lm.get_decoder()(input_ids=ids.to(dev), attention_mask=att.to(dev), position_ids=pos.to(dev),
                                 use_cache=True)
        lengths = [len(it.prompt) for it in batch.items]
        runner.work.forward(sum(lengths), causal_context(lengths), padded=B * P - sum(lengths))
        layers = [(layer.keys, layer.values) for layer in first.past_key_values.layers]
        # Shared-prefix tokens and every suffix's first token are predicted from the prompt pass.
        targets = [t for b, it in enumerate(batch.items) for t in it.first_targets(b, b * P + P - 1)]
        batch.add(runner, first.last_hidden_state.flatten(0, 1), targets)
        rows = sorted(self._rows(batch.items), key=lambda row: row[1].width)
        c0 = 0
        while c0 < len(rows):
            # As many rows as fit in max_batch_tokens (rows are sorted by width; the last is widest).
            c1 = c0 + 1
            while c1 < len(rows) and (c1 + 1 - c0) * (P + rows[c1][1].width) <= runner.max_batch_tokens:
                c1 += 1
            self._later_pass(runner, batch, rows[c0:c1], layers, att)
            c0 = c1

    def _rows(self, items: list[Prepared]) -> list[tuple[int, PrefixTree]]:
        """The rows of later suffix tokens, (prompt, tree): up to `group_size` candidates of one
        prompt (in token order, so that those beginning alike share a row), laid out as the prefix
        tree of their later tokens."""
        by_prompt: dict[int, list[tuple[int, list[int]]]] = {}
        pairs = [(b, j, suf) for b, it in enumerate(items) for j, suf in enumerate(it.suffixes) if len(suf) > 1]
        for b, j, suf in sorted(pairs, key=lambda pr: (pr[0], pr[2])):
            by_prompt.setdefault(b, []).append((j, suf))
        return [(b, PrefixTree(mine[g:g + self.group_size])) for b, mine in by_prompt.items()
                for g in range(0, len(mine), self.group_size)]

    @staticmethod
    def _later_pass(runner: Runner, batch: Batch, rows: list[tuple[int, PrefixTree]], layers: KV,
                    att: torch.Tensor) -> None:
        """One pass of rows, each its tree after a copy of its prompt's cache, each column seeing the
        prompt and its own start only."""
        dev = runner.device
        P = att.shape[1]
        W = max(tree.width for _, tree in rows)
        R = len(rows)
        sel = torch.tensor([b for b, _ in rows])
        s_ids = torch.full((R, W), runner.pad_id, dtype=torch.long)
        s_pos = torch.zeros((R, W), dtype=torch.long)
        allowed = torch.zeros((R, W, P + W), dtype=torch.bool)
        allowed[:, :, :P] = att.index_select(0, sel).bool().unsqueeze(1)
        targets: list[Target] = []
        for r, (b, tree) in enumerate(rows):
            for col, token, j in tree.pack(len(batch.items[b].prompt), s_ids[r], s_pos[r], allowed[r, :, P:]):
                targets.append(Target(b, r * W + col, token, j))
            pad = torch.arange(tree.width, W)
            allowed[r, pad, P + pad] = True  # padding attends to itself only (finite, never read)
        sel_d = sel.to(dev)
        past, slots = pass_cache(layers, R, P, W)
        for (k, v), (k_to, v_to) in zip(layers, slots):
            k_to[:, :, :P] = k.index_select(0, sel_d)
            v_to[:, :, :P] = v.index_select(0, sel_d)
        hidden = runner.lm.get_decoder()(input_ids=s_ids.to(dev), attention_mask=runner.additive_mask(allowed).to(dev),
                                         position_ids=s_pos.to(dev), past_key_values=past,
                                         use_cache=True).last_hidden_state
        real = sum(tree.width for _, tree in rows)
        runner.work.forward(real, sum(tree.context(len(batch.items[b].prompt)) for b, tree in rows),
                            padded=R * W - real)
        batch.add(runner, hidden.flatten(0, 1), targets)


class Reuse(Layout):
    """The batch's prompts in one pass, each from its longest cached prefix: a row holds a prompt's
    tokens after the prefix the cache holds for it (prefixes.PrefixCache), then its candidates'
    later tokens as their prefix tree, on that prompt's own prefix (the prefixes laid side by side,
    right-aligned, in one cache; a 4D mask keeps each row to its own prefix, each prompt token to
    its earlier ones, each tree column to its prompt and its own start). Every prompt is then
    cached for the turns and episodes that extend it. A prompt whose tree is wider than
    max_batch_tokens / 4 tokens runs its candidates in passes of their own, on its cached prompt.
    Several episodes' turns so share one pass: at a few dozen new tokens a turn, a pass per prompt
    and another for its candidates left a CPU's matmuls mostly idle."""

    name = "reuse"
    # Each episode keeps its prompt's KV cache between turns (the prefix cache's budget): four
    # BabyAI episodes of 3,000 tokens already hold 280 MB of SmolLM2's.
    concurrency = 4

    def __init__(self, cache: PrefixCache):
        self.cache = cache

    def run(self, runner: Runner, batch: Batch) -> None:
        """Prompts that begin as an earlier prompt of the batch does, by more than the cache holds
        for them (episodes starting alike: the same instruction), wait for a second pass, which
        finds that prompt cached: computed once, not once per episode."""
        first: list[int] = []
        later: list[int] = []
        for b, it in enumerate(batch.items):
            shared = max((common_prefix(it.prompt, batch.items[a].prompt) for a in first), default=0)
            gain = min(shared, it.n_prompt - 1) - self.cache.match(it.prompt, it.n_prompt - 1)
            (later if gain >= WORTH_WAITING else first).append(b)
        for part in (first, later):
            # Rows of unlike widths (an episode's first turn beside others' later ones) in passes of their own.
            for group in width_groups([self._width(runner, batch.items[b]) for b in part]):
                rows = [part[g] for g in group]
                self._run(runner, Batch([batch.items[b] for b in rows], [batch.where[b] for b in rows], batch.totals))

    def _width(self, runner: Runner, it: Prepared) -> int:
        """The row a prompt takes in a pass: its tokens after its cached prefix, and its candidates' tree
        where that is at most _row_cap wide."""
        tree = it.tree.width if it.tree.width <= _row_cap(runner) else 0
        return len(it.prompt) - self.cache.match(it.prompt, it.n_prompt - 1) + tree

    def _run(self, runner: Runner, batch: Batch) -> None:
        dev, items = runner.device, batch.items
        # Reuse at most up to the token before a prompt's end: its hidden state predicts the first scored token.
        found = [self.cache.lookup(it.prompt, it.n_prompt - 1) for it in items]
        starts = [start if kv is not None else 0 for start, kv in found]
        news = [len(it.prompt) - s for it, s in zip(items, starts)]
        trees = [it.tree if it.tree.width <= _row_cap(runner) else None for it in items]  # None: passes of its own
        widths = [n + (t.width if t is not None else 0) for n, t in zip(news, trees)]
        B, C = len(items), max(starts)
        N = bucket_length(max(widths)) if runner.bucket else max(widths)
        past = DynamicCache()
        if C > 0:
            # Each row's prefix right-aligned before the new tokens; positions left of a shorter
            # prefix zeroed (masked, but garbage there could be inf or NaN, which a mask keeps).
            some = next(kv for _, kv in found if kv is not None)  # shapes and dtypes of every layer's
            past, slots = pass_cache(some, B, C, N)
            for i, (k, v) in enumerate(slots):
                for b, ((_, kv), s) in enumerate(zip(found, starts)):
                    k[b, :, :C - s] = 0
                    v[b, :, :C - s] = 0
                    if s:
                        k[b, :, C - s:C] = kv[i][0][0, :, :s]
                        v[b, :, C - s:C] = kv[i][1][0, :, :s]
        ids = torch.full((B, N), runner.pad_id, dtype=torch.long)
        pos = torch.zeros((B, N), dtype=torch.long)
        allowed = torch.zeros((B, N, C + N), dtype=torch.bool)
        causal = torch.ones((N, N), dtype=torch.bool).tril()
        targets: list[Target] = []
        for b, (it, s, n, tree) in enumerate(zip(items, starts, news, trees)):
            ids[b, :n] = torch.tensor(it.prompt[s:], dtype=torch.long)
            pos[b] = torch.arange(s, s + N)
            allowed[b, :, C - s:C] = True
            allowed[b, :n, C:C + n] = causal[:n, :n]
            targets += it.first_targets(b, b * N + n - 1)
            w = 0
            if tree is not None:
                w = tree.width
                allowed[b, n:n + w, C:C + n] = True
                for col, token, j in tree.pack(len(it.prompt), ids[b, n:], pos[b, n:], allowed[b, n:, C + n:]):
                    targets.append(Target(b, b * N + n + col, token, j))
            idle = torch.arange(n + w, N)
            allowed[b, idle, C + idle] = True  # padding attends to itself only (finite, never read)
        run = runner.lm.get_decoder()(input_ids=ids.to(dev), attention_mask=runner.additive_mask(allowed).to(dev),
                                      position_ids=pos.to(dev), past_key_values=past, use_cache=True)
        done = sum(widths)
        runner.work.forward(done, sum(causal_context([n], s) + (t.context(s + n) if t is not None else 0)
                                      for n, s, t in zip(news, starts, trees)),
                            padded=B * N - done, cached=sum(starts))
        batch.add(runner, run.last_hidden_state.flatten(0, 1), targets)
        cache = run.past_key_values
        run = None
        # Each prompt's keys and values (its prefix's and its new tokens', not its candidates') cached
        # as one block (one allocation per prompt, rather than one per layer interleaved with the
        # passes'), keys in the values' dtype: under bf16 autocast rotary embeddings leave keys in
        # fp32, but attention reads them in bf16, so bf16 keys halve the cache and change no score.
        for b, (it, s, n, tree) in enumerate(zip(items, starts, news, trees)):
            cols = slice(C - s, C + n)
            block = torch.stack([t for layer in cache.layers for t in (
                layer.keys[b:b + 1, :, cols].to(layer.values.dtype), layer.values[b:b + 1, :, cols])])
            block = block.view(len(cache.layers), 2, *block.shape[1:])
            mine = [(block[i, 0], block[i, 1]) for i in range(block.shape[0])]
            self.cache.store(it.prompt, mine)
            if tree is None:
                self._candidate_passes(runner, batch, b, mine)
        cache = None
        # A batch's passes free tensors of many sizes; glibc would keep most of them resident
        # (measured: a WebShop evaluation held 3.9 GB with the cache at 441 MB; 2.1 GB returned so).
        release_free_memory()

    @staticmethod
    def _candidate_passes(runner: Runner, batch: Batch, b: int, layers: KV) -> None:
        """Rows of the batch's prompt b's candidates in token order (those beginning alike share a
        row's prefix tree), each on the prompt's cache."""
        dev = runner.device
        it = batch.items[b]
        n = len(it.prompt)
        later = sorted(((j, suf) for j, suf in enumerate(it.suffixes) if len(suf) > 1), key=lambda c: c[1])
        row_cap = _row_cap(runner)
        while later:
            tree = PrefixTree()
            while later and (not tree.part or tree.width + tree.added_width(later[0][1]) <= row_cap):
                tree.add(*later.pop(0))
            # Columns past the tree's (bucket padding) see only the prompt; no candidate sees them.
            padded = bucket_length(tree.width) if runner.bucket else tree.width
            s_ids = torch.full((1, padded), runner.pad_id, dtype=torch.long)
            s_pos = torch.full((1, padded), n, dtype=torch.long)
            allowed = torch.zeros((1, 1, padded, n + padded), dtype=torch.bool)
            allowed[..., :n] = True
            targets = [Target(b, col, token, j) for col, token, j in tree.pack(n, s_ids[0], s_pos[0],
                                                                                 allowed[0, 0, :, n:])]
            past, slots = pass_cache(layers, 1, n, padded)
            for (k, v), (k_to, v_to) in zip(layers, slots):
                k_to[:, :, :n] = k
                v_to[:, :, :n] = v
            h = runner.lm.get_decoder()(input_ids=s_ids.to(dev), attention_mask=allowed.to(dev),
                                        position_ids=s_pos.to(dev), past_key_values=past,
                                        use_cache=True).last_hidden_state[0]
            runner.work.forward(tree.width, tree.context(n), padded=padded - tree.width)
            batch.add(runner, h, targets)


def _row_cap(runner: Runner) -> int:
    """The widest candidate tree a Reuse row takes beside its prompt; wider ones run in passes of their own."""
    return max(16, runner.max_batch_tokens // 4)


class Auto(Layout):
    """Packed where a batch's prompts have at most `packed_max_candidates` candidates, else Cached."""

    name = "auto"

    def __init__(self, packed_max_candidates: int, group_size: int):
        self.packed_max_candidates = packed_max_candidates
        self.packed, self.cached = Packed(), Cached(group_size)

    def run(self, runner: Runner, batch: Batch) -> None:
        few = max(len(it.suffixes) for it in batch.items) <= self.packed_max_candidates
        (self.packed if few else self.cached).run(runner, batch)


def make_layout(method: str, real_model_on_cpu: bool, packed_max_candidates: int, group_size: int,
                cache: PrefixCache) -> Layout:
    """The layout `method` names. "auto" is Reuse for real models on CPU, where arithmetic is dear;
    elsewhere (the tiny model, GPUs: passes are cheap, calls are not) batched across prompts: Auto."""
    makers = {"auto": lambda: Reuse(cache) if real_model_on_cpu else Auto(packed_max_candidates, group_size),
              "packed": Packed, "cached": lambda: Cached(group_size), "reuse": lambda: Reuse(cache)}
    if method not in makers:
        raise ValueError(f"method must be 'auto', 'packed', 'cached' or 'reuse', got {method!r}")
    return makers[method]()

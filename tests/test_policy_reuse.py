"""Scoring that reuses cached prefixes: the scores match a direct pass and reuse the previous turn's
cache, several episodes' turns run in one pass each on its own cached prefix, a start the episodes of
one batch share is computed once, and a pass writes its keys and values after the cached prefix
instead of concatenating."""

import os

import pytest
import torch

from observe import PrefixReuse
from policy_support import MAZE_ACTIONS, WORDS, _direct_loglik, _maze_prompts, _model
from services.client_agent.playing.policy import ActionScorer
from services.client_agent.playing.prompts import format_prompt
from services.env_server.envs.maze import MazeEnv

torch.set_num_threads(1)


def test_reuse_scores_match_a_direct_pass_and_reuse_the_previous_turns_cache():
    """The "reuse" method (real models' default) starts each prompt from the KV cache of the longest
    cached prompt it begins with; scores are those of a plain forward pass."""
    model, tok = _model()
    scorer = ActionScorer(model, tok, max_prompt_tokens=4096, method="reuse", max_batch_tokens=64)
    reuse = PrefixReuse(scorer.cache)
    env = MazeEnv()
    ep = env.reset(3)
    turns, prompts = [], []
    for _ in range(4):  # a growing episode: each prompt extends the previous one
        prompts.append(format_prompt(ep.instruction, turns, ep.observation, max_history=10))
        action = ep.expert_action()
        turns.append((ep.observation, action))
        ep.step(action)
    cands = [MAZE_ACTIONS, ["move left", "move right"], WORDS, ["a", "bb", "ccc"]]
    for prompt, cs in zip(prompts, cands):
        s = scorer.score([prompt], [cs])[0]
        direct = torch.tensor([_direct_loglik(model, tok, prompt, c, 4096) for c in cs])
        assert torch.allclose(s, direct, atol=1e-3), (s, direct)
    assert reuse.hits == 3  # every prompt after the first started from the previous one's cache
    assert len(scorer.cache) == 1  # ... and its cache replaced the one it extends
    assert reuse.reused >= sum(len(p) for p in prompts[:-1]) - 3
    scorer.forget()
    assert scorer.cache.bytes == 0
    # Padded to bucket lengths (as bf16 on a CPU is), every pass has a bucket's width, the scores
    # stay those of a direct pass and the cache holds the prompts' own tokens only.
    from services.client_agent.model.loading import bucket_length
    widths: list[int] = []
    hook = model.get_base_model().get_input_embeddings().register_forward_hook(
        lambda module, args, out: widths.append(args[0].shape[-1]))
    bucketed = ActionScorer(model, tok, max_prompt_tokens=4096, method="reuse", max_batch_tokens=64, bucket=True)
    reuse = PrefixReuse(bucketed.cache)
    try:
        scores = [bucketed.score([prompt], [cs])[0] for prompt, cs in zip(prompts, cands)]
    finally:
        hook.remove()
    for prompt, cs, s in zip(prompts, cands, scores):
        direct = torch.tensor([_direct_loglik(model, tok, prompt, c, 4096) for c in cs])
        assert torch.allclose(s, direct, atol=1e-3), (s, direct)
    assert widths and all(w == bucket_length(w) for w in widths), widths
    assert reuse.hits == 3
    (ids, kv, _), = bucketed.cache._entries
    assert kv[0][0].shape[-2] == len(ids)  # no padding kept
    # The cache never holds more than its budget (six prompts that do not extend each other).
    small = ActionScorer(model, tok, max_prompt_tokens=4096, method="reuse", cache_bytes=4_000_000)
    small.score(_maze_prompts(6), [MAZE_ACTIONS] * 6)
    assert 0 < small.cache.bytes <= 4_000_000 and 1 <= len(small.cache) < 6


@pytest.mark.parametrize("bucket,overhead,rows", [(False, 10_000, [3]), (True, 10_000, [3]), (False, 64, [2, 1])])
def test_reuse_runs_several_episodes_turns_in_one_pass_each_on_its_own_cached_prefix(bucket, overhead, rows,
                                                                                     monkeypatch):
    """Concurrent episodes' prompts are scored together: one pass holds every prompt's new tokens,
    each after the prefix the cache holds for it (of different lengths, or none), and its
    candidates; the scores are a direct pass's. Where a pass costs less than the padding it saves
    (layouts.PASS_OVERHEAD), a row far narrower than the others (a Maze turn's new tokens and its
    few actions, 55 positions, beside rows of 164 and 189) runs in a pass of its own."""
    from services.client_agent.model import layouts

    monkeypatch.setattr(layouts, "PASS_OVERHEAD", overhead)
    model, tok = _model()
    scorer = ActionScorer(model, tok, max_prompt_tokens=4096, method="reuse", bucket=bucket)
    env = MazeEnv()
    episodes = []  # per task, its prompts turn by turn
    for task, length in ((1, 3), (4, 2), (6, 1)):
        ep, turns, prompts = env.reset(task), [], []
        for _ in range(length):
            prompts.append(format_prompt(ep.instruction, turns, ep.observation, max_history=10))
            action = ep.expert_action()
            turns.append((ep.observation, action))
            ep.step(action)
        episodes.append(prompts)
    scorer.score([episodes[0][0]], [MAZE_ACTIONS])
    scorer.score([episodes[0][1], episodes[1][0]], [MAZE_ACTIONS, WORDS])
    reuse = PrefixReuse(scorer.cache)
    passes: list[int] = []
    hook = model.get_base_model().get_input_embeddings().register_forward_hook(
        lambda module, args, out: passes.append(args[0].shape[0]))
    prompts = [episodes[0][2], episodes[1][1], episodes[2][0]]
    cands = [MAZE_ACTIONS, WORDS, ["a", "bb", "ccc"]]
    try:
        scores = scorer.score(prompts, cands)
    finally:
        hook.remove()
    for prompt, cs, s in zip(prompts, cands, scores):
        direct = torch.tensor([_direct_loglik(model, tok, prompt, c, 4096) for c in cs])
        assert torch.allclose(s, direct, atol=1e-3), (s, direct)
    assert passes == rows  # each row a prompt's new tokens, then its candidates
    # The first two continue their episodes' previous turns; the third episode's first prompt
    # shares its start (the instruction) with the others.
    assert reuse.hits == 3 and reuse.reused > sum(len(p) for p in (episodes[0][1], episodes[1][0])) - 6


def test_reuse_computes_a_start_that_episodes_of_one_batch_share_once():
    """Two episodes' first prompts begin alike (the same instruction) and nothing is cached yet: the
    second waits for a pass of its own, which starts from the first's cached prompt."""
    model, tok = _model()
    scorer = ActionScorer(model, tok, max_prompt_tokens=4096, method="reuse")
    reuse = PrefixReuse(scorer.cache)
    env = MazeEnv()
    prompts = [format_prompt(env.reset(task).instruction, [], env.reset(task).observation, max_history=10)
               for task in (1, 4)]
    shared = len(os.path.commonprefix([tok(p, add_special_tokens=False)["input_ids"] for p in prompts]))
    assert shared > 32
    rows: list[int] = []
    hook = model.get_base_model().get_input_embeddings().register_forward_hook(
        lambda module, args, out: rows.append(args[0].shape[0]))
    try:
        scores = scorer.score(prompts, [MAZE_ACTIONS] * 2)
    finally:
        hook.remove()
    assert rows == [1, 1] and reuse.hits == 1 and reuse.reused == shared
    for prompt, s in zip(prompts, scores):
        direct = torch.tensor([_direct_loglik(model, tok, prompt, c, 4096) for c in MAZE_ACTIONS])
        assert torch.allclose(s, direct, atol=1e-3), (s, direct)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_pass_writes_its_keys_and_values_after_the_cached_prefix_instead_of_concatenating(precision):
    """A pass on a cached prefix (Reuse's, its candidates', Cached's) writes each layer's new keys and
    values into tensors allocated for the whole pass, after the prefix: the hidden states are those
    of transformers' DynamicCache, which concatenates them to the prefix, to the bit (under bf16
    autocast too, where new keys come in fp32 and the cached ones are bf16, as attention reads
    them), with two concatenations fewer per layer. A pass that would overflow the tensors moves them
    to larger ones."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import DynamicCache

    from services.client_agent.model.kvcache import pass_cache
    from services.client_agent.model.loading import autocast

    model, _ = _model()
    decoder = model.get_base_model().get_decoder()
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(3)
    prefix_ids = torch.randint(0, 200, (2, 12), generator=gen)
    new_ids = torch.randint(0, 200, (2, 5), generator=gen)
    with torch.no_grad(), autocast(precision, cpu):
        first = decoder(input_ids=prefix_ids, use_cache=True).past_key_values
        # As Reuse caches a prompt: keys in the values' dtype.
        prefix = [(layer.keys.to(layer.values.dtype), layer.values) for layer in first.layers]
        pos = torch.arange(12, 17).expand(2, 5)

        def run(past):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                h = decoder(input_ids=new_ids, position_ids=pos, past_key_values=past, use_cache=True).last_hidden_state
            return h, sum(e.count for e in prof.key_averages() if e.key == "aten::cat")

        def on_prefix(room: int):
            past, slots = pass_cache(prefix, rows=2, filled=12, new=room)
            for (k, v), (k_to, v_to) in zip(prefix, slots):
                k_to[:, :, :12], v_to[:, :, :12] = k, v
            return past, slots

        concatenated, cats = run(DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in prefix]))
        past, slots = on_prefix(5)
        written, written_cats = run(past)
        assert torch.equal(concatenated, written)
        assert cats - written_cats >= 2 * len(prefix)  # more under autocast, where dtypes differ
        assert past.get_seq_length() == 17 and all(k.dtype == prefix[0][1].dtype for k, _ in slots)
        # A pass longer than the room made moves to larger tensors, with the same result.
        past, _ = on_prefix(2)
        grown, _ = run(past)
        assert torch.equal(concatenated, grown) and past.layers[0]._slots[0].shape[-2] == 28

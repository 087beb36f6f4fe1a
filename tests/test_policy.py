"""Prompt format, likelihood scoring of admissible actions, generation-mode parsing, and the ReAct
actions the agent writes where an environment lists none."""

import os

import pytest
import torch

from fedse.model.tinymodel import build_tiny_model, build_tiny_tokenizer
from observe import PrefixReuse, returns
from services.client_agent.playing.actions import Written, cut_after_action, parse_action
from services.client_agent.playing.generation import ActionLineDone, ActionWriter
from services.client_agent.model.loading import add_lora
from services.client_agent.playing.policy import ActionScorer
from services.client_agent.model.prefixes import PrefixTree
from services.client_agent.playing.prompts import (ACTION_CUE, EMPTY_TEXT_ACTION, MAX_CUED_THOUGHT_CHARS, MAX_WRITTEN_ACTION_CHARS,
                                           PlainFormat, fallback_action, format_prompt, format_target, parse_react,
                                           thought_before_cue)
from services.env_server.envs.maze import MazeEnv

torch.set_num_threads(1)

MAZE_ACTIONS = ["move up", "move down", "move left", "move right"]
WORDS = ["c r a n e", "s l a t e", "c r a t e", "s h i r e", "a b b e y", "c r a n k", "z z z z z"]


def _model():
    model, tok = build_tiny_model()
    peft_model = add_lora(model)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return peft_model, tok


def _direct_loglik(model, tok, prompt, action, max_prompt_tokens):
    """log p(format_target(action) | prompt) from one plain forward pass over prompt + target."""
    p = tok(prompt, add_special_tokens=False)["input_ids"][-max_prompt_tokens:]
    t = tok(format_target(action), add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([p + t])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return sum(float(logp[len(p) + k - 1, t[k]]) for k in range(len(t)))


def _maze_prompts(n, max_history=1):
    env = MazeEnv()
    prompts = []
    for task in range(n):
        ep = env.reset(task)
        turns = [("The goal is at position 8, 6. Somewhere.", MAZE_ACTIONS[task % 4])] * (task % 3)
        prompts.append(format_prompt(ep.instruction, turns, ep.observation, max_history))
    return prompts


def test_format_prompt_ends_where_the_agent_text_begins_and_keeps_max_history_turns():
    turns = [("obs 1", "move up"), ("obs 2", "move left"), ("obs 3", "move down")]
    p = format_prompt("Do the task.", turns, "obs 4", max_history=2)
    assert p.startswith("Do the task.\n")
    assert p.endswith("Observation: obs 4\n")
    assert "obs 1" not in p and "Observation: obs 2\nAction: move left\n" in p and "obs 3" in p
    assert "obs 2" not in format_prompt("Do the task.", turns, "obs 4", max_history=0)
    # Training text for a step is exactly prompt + target, and a trajectory reads as one ReAct text.
    assert format_target("move up") == "Action: move up\n"
    full = format_prompt("Do the task.", turns[:1], "obs 2", max_history=5) + format_target("move left")
    assert full == "Do the task.\nObservation: obs 1\nAction: move up\nObservation: obs 2\nAction: move left\n"


def test_choose_returns_valid_indices_for_ragged_candidate_lists():
    model, tok = _model()
    scorer = ActionScorer(model, tok, max_prompt_tokens=160)
    prompts = _maze_prompts(5)
    cands = [MAZE_ACTIONS[: k + 1] for k in range(4)] + [["guess crane", "guess slate", "x"]]
    gen = torch.Generator().manual_seed(0)
    for greedy in (True, False):
        picks = scorer.choose(prompts, cands, greedy=greedy, generator=gen)
        assert len(picks) == 5 and all(0 <= k < len(c) for k, c in zip(picks, cands))
    a = scorer.choose(prompts, cands, greedy=False, generator=torch.Generator().manual_seed(1))
    b = scorer.choose(prompts, cands, greedy=False, generator=torch.Generator().manual_seed(1))
    assert a == b


@pytest.mark.parametrize("method", ["packed", "cached"])
def test_greedy_picks_the_max_likelihood_candidate_of_a_direct_forward_pass(method):
    model, tok = _model()
    scorer = ActionScorer(model, tok, max_prompt_tokens=160, method=method, group_size=2)
    prompts = _maze_prompts(6)
    cands = [MAZE_ACTIONS, ["move left", "move right"], ["move up", "move upward", "move"],
             WORDS, ["a", "bb", "ccc"], ["move down"]]
    scores = scorer.score(prompts, cands)
    picks = scorer.choose(prompts, cands, greedy=True)
    for prompt, cs, s, k in zip(prompts, cands, scores, picks):
        direct = torch.tensor([_direct_loglik(model, tok, prompt, c, 160) for c in cs])
        assert torch.allclose(s, direct, atol=1e-3), (s, direct)
        assert k == int(torch.argmax(direct))


@pytest.mark.parametrize("method", ["packed", "cached"])
def test_batching_and_truncation_do_not_change_scores(method):
    model, tok = _model()
    prompts = _maze_prompts(7, max_history=3)
    cands = [MAZE_ACTIONS] * 3 + [["move up", "move down"]] * 3 + [[f"guess {w}" for w in WORDS]]
    for limit in (64, 160, 4096):  # 64 and 160 truncate on the left; 4096 keeps every prompt whole
        batched = ActionScorer(model, tok, max_prompt_tokens=limit, method=method, group_size=3).score(prompts, cands)
        # One prompt per forward pass (and, for "cached", one candidate per row).
        small = ActionScorer(model, tok, max_prompt_tokens=limit, method=method, group_size=1, max_batch_tokens=1)
        for p, c, s in zip(prompts, cands, batched):
            one = small.score([p], [c])[0]
            assert torch.allclose(s, one, atol=1e-4), (limit, s, one)


CRAFTS = ["craft 1 iron boots using 4 iron ingot", "craft 1 iron leggings using 7 iron ingot", "get 4 iron ingot",
          "get 7 iron ingot", "get 1 redstone", "inventory", "craft 1 iron boots using 4 iron ingot",
          "craft 16 iron bars using 6 iron ingot", "craft 1 compass using 4 iron ingot, 1 redstone"]


def test_a_prefix_tree_gives_each_distinct_start_one_column():
    # Each suffix's tokens but its last are inputs; starts shared by several suffixes get one column.
    tree = PrefixTree([(0, [5, 6, 7]), (1, [5, 6, 8]), (2, [5, 9, 3]), (3, [5, 6, 7]), (4, [4])])
    assert tree.tokens == [5, 6, 9] and tree.depths == [0, 1, 1] and tree.width == 3
    assert tree.paths == [[0, 1], [0, 1], [0, 2], [0, 1], []]
    assert tree.added_width([5, 6, 7, 1, 2]) == 2 and tree.added_width([5, 6, 8]) == 0
    ids, pos = torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long)
    among = torch.zeros((5, 5), dtype=torch.bool)
    scored = tree.pack(10, ids, pos, among)
    assert ids[:3].tolist() == [5, 6, 9] and pos[:3].tolist() == [10, 11, 11]
    # Each column sees itself and its own start: never a sibling branch.
    assert among[:3, :3].tolist() == [[True, False, False], [True, True, False], [True, False, True]]
    assert scored == [(0, 6, 0), (1, 7, 0), (0, 6, 1), (1, 8, 1), (0, 9, 2), (2, 3, 2), (0, 6, 3), (1, 7, 3)]


@pytest.mark.parametrize("method", ["packed", "cached", "reuse"])
def test_candidates_that_begin_alike_are_scored_as_a_direct_pass_in_fewer_columns(method):
    """Actions sharing long starts (TextCraft's) are scored as a direct pass scores them, while the
    model runs fewer candidate tokens than the candidates hold (their starts computed once)."""
    model, tok = _model()
    scorer = ActionScorer(model, tok, max_prompt_tokens=160, method=method, group_size=4, max_batch_tokens=4096)
    prompts = _maze_prompts(1) * 2
    cands = [CRAFTS, CRAFTS[::-1]]  # the order of the candidates changes nothing
    ran: list[int] = []  # tokens each pass ran, padding (token 0) not counted
    heads: list[int] = []  # hidden states the output layer ran on
    hooks = [model.get_base_model().get_input_embeddings().register_forward_hook(
                 lambda module, args, out: ran.append(int((args[0] != tok.pad_token_id).sum()))),
             model.get_base_model().get_output_embeddings().register_forward_hook(
                 lambda module, args, out: heads.append(int(args[0].shape[0])))]
    try:
        scores = scorer.score(prompts, cands)
    finally:
        for hook in hooks:
            hook.remove()
    for prompt, cs, s in zip(prompts, cands, scores):
        direct = torch.tensor([_direct_loglik(model, tok, prompt, c, 160) for c in cs])
        assert torch.allclose(s, direct, atol=1e-3), (s, direct)
    assert torch.allclose(scores[0], scores[1].flip(0), atol=1e-4)
    # Side by side, the passes would run each prompt with the text all candidates share ("Action: "),
    # then every candidate's later tokens but its last.
    targets = [tok(format_target(c), add_special_tokens=False)["input_ids"] for c in CRAFTS]
    shared = len(os.path.commonprefix(targets))
    prompt_tokens = sum(len(tok(p, add_special_tokens=False)["input_ids"][-160:]) + shared for p in prompts)
    later = 2 * sum(len(t) - shared - 1 for t in targets)
    assert sum(ran) < prompt_tokens + 0.8 * later, (sum(ran), prompt_tokens, later)
    # The output layer runs once per state that predicts something: every candidate's first token
    # comes from the prompt's last state, and a shared start's state predicts all that follow it.
    scored = 2 * sum(len(t) for t in targets)
    assert sum(heads) < 0.7 * scored, (sum(heads), scored)


def test_sampling_follows_the_softmax_over_candidates():
    model, tok = _model()
    scorer = ActionScorer(model, tok, max_prompt_tokens=160)
    prompt = _maze_prompts(1)[0]
    s = scorer.score([prompt], [MAZE_ACTIONS])[0]
    probs = torch.softmax(s.double() / 8.0, dim=0)
    gen = torch.Generator().manual_seed(0)
    n = 400
    picks = scorer.choose([prompt] * n, [MAZE_ACTIONS] * n, greedy=False, generator=gen, temperature=8.0)
    freq = torch.bincount(torch.tensor(picks), minlength=4).double() / n
    assert torch.allclose(freq, probs, atol=0.08), (freq, probs)


def test_parse_action_matches_generated_text_to_an_admissible_action():
    words = ["crane", "slate", "cranes"]
    assert parse_action("Thought: go up.\nAction: move up\n", MAZE_ACTIONS) == "move up"
    assert parse_action("Thought: hmm\nAction: \"Move Right\".", MAZE_ACTIONS) == "move right"
    assert parse_action("Action: I will move left now", MAZE_ACTIONS) == "move left"
    assert parse_action("Action: crane", words) == "crane"  # exact wins over a longer containing match
    assert parse_action("Action: guess cranes please", words) == "cranes"
    assert parse_action("Action: move rihgt", MAZE_ACTIONS) == "move right"  # close spelling
    assert parse_action("Action: jump", MAZE_ACTIONS) is None
    assert parse_action("", MAZE_ACTIONS) is None
    assert parse_action("move down", MAZE_ACTIONS) == "move down"  # no "Action:" at all


def test_generate_actions_returns_admissible_actions_with_a_fallback():
    model, tok = _model()
    scorer = ActionScorer(model, tok, max_prompt_tokens=160)
    prompts = _maze_prompts(3)
    cands = [MAZE_ACTIONS, ["move left", "move right"], MAZE_ACTIONS]
    writer = ActionWriter(scorer)
    texts = returns(writer, "generate_texts")
    actions = writer.generate_actions(prompts, cands, max_new_tokens=6)
    assert all(a in c for a, c in zip(actions, cands))
    # An untrained byte model does not write "Action: ..."; those rows fall back to greedy scoring.
    greedy = scorer.choose(prompts, cands, greedy=True)
    (generated,) = texts
    for i, text in enumerate(generated):
        if parse_action(text, cands[i]) is None:
            assert actions[i] == cands[i][greedy[i]]


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


@pytest.mark.parametrize("method", ["packed", "cached", "reuse"])
def test_calibrated_scores_are_the_log_likelihood_less_that_after_the_content_free_prompt(method):
    model, tok = _model()
    # "reuse" keeps the content-free prompt's KV cache beside the episodes' in one prefix cache.
    scorer = ActionScorer(model, tok, max_prompt_tokens=160, scoring="calibrated", method=method, group_size=3)
    null = scorer.fmt.prompt("", [], "")
    prompts = _maze_prompts(3)
    cands = [MAZE_ACTIONS, ["move left", "move right"], WORDS]
    for prompt, cs, s in zip(prompts, cands, scorer.score(prompts, cands)):
        direct = torch.tensor([_direct_loglik(model, tok, prompt, c, 160) - _direct_loglik(model, tok, null, c, 160)
                               for c in cs])
        assert torch.allclose(s, direct, atol=1e-3), (s, direct)
    # A constant per action does not change which action a prompt prefers, but it changes the choice:
    # the calibrated and the summed greedy picks differ on some of these prompts.
    summed = ActionScorer(model, tok, max_prompt_tokens=160, method=method, group_size=3)
    prompts = _maze_prompts(12)
    assert scorer.choose(prompts, [MAZE_ACTIONS] * 12, greedy=True) != \
        summed.choose(prompts, [MAZE_ACTIONS] * 12, greedy=True)


def test_calibrated_baselines_follow_the_weights_after_forget():
    model, tok = _model()
    scorer = ActionScorer(model, tok, max_prompt_tokens=160, scoring="calibrated", method="reuse")
    prompt = _maze_prompts(1)[0]
    before = scorer.baseline(MAZE_ACTIONS)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)
    assert torch.equal(scorer.baseline(MAZE_ACTIONS), before)  # remembered until told the weights changed
    scorer.forget()
    after = scorer.baseline(MAZE_ACTIONS)
    assert not torch.allclose(after, before, atol=1e-3)
    null = scorer.fmt.prompt("", [], "")
    assert torch.allclose(after, torch.tensor([_direct_loglik(model, tok, null, c, 160) for c in MAZE_ACTIONS]),
                          atol=1e-3)
    # The new weights' scores, not the cached prompts' of the old ones.
    direct = torch.tensor([_direct_loglik(model, tok, prompt, c, 160) for c in MAZE_ACTIONS]) - after
    assert torch.allclose(scorer.score([prompt], [MAZE_ACTIONS])[0], direct, atol=1e-3)
    with pytest.raises(ValueError, match="scoring must be one of sum, calibrated"):
        ActionScorer(model, tok, scoring="pmi")


# ---- writing actions (environments that list none) ---------------------------------------------------
@pytest.mark.parametrize("text,action", [
    ("Thought:\nI need planks.\n\nAction:\nget 2 planks", "get 2 planks"),  # AgentGym's format
    ("Thought:\nI need planks.\n\nAction:\nget 2 planks\n", "get 2 planks"),
    ("Thought: go down.\nAction: move down\n", "move down"),  # ours, on one line
    ("Action:   \n\n  craft 1 stick using 2 planks  \nI hope it works.", "craft 1 stick using 2 planks"),
    ("action : look", "look"),
    ('\n"craft 1 torch using 1 coal"\nAction:\n"craft 1 torch using 1 coal"\n', "craft 1 torch using 1 coal"),  # SmolLM2
    ("Action: `look`", "look"),
    ("Action: 'it's'", "it's"),  # one pair of quotes only
    ('Action: ""', '""'),  # nothing inside: kept as written
    ("Thought: the Action: line comes last.\n\nAction:\nsearch[red shoes]", "search[red shoes]"),  # the last one
    ("Thought: a Reaction: is no action\n", None),
    ("Thought: I do not know.", None),
    ("Action:", None),
    ("Action:\n   \n", None),
    ("", None),
])
def test_parse_react_reads_the_line_after_the_last_action_marker(text, action):
    assert parse_react(text) == action


def test_a_text_without_an_action_sends_its_last_line_bounded():
    assert fallback_action("Thought:\nI am lost.\n\ngo north\n\n") == "go north"
    assert fallback_action("x" * 5000) == "x" * MAX_WRITTEN_ACTION_CHARS
    assert fallback_action(" \n\t") == EMPTY_TEXT_ACTION  # an env server refuses an empty action
    assert fallback_action("Thought: lost." + ACTION_CUE) == "Thought: lost."  # the cue, then nothing written
    assert thought_before_cue("\n I go.\nNorth.\n\nAction (no)\n") == " I go.\nNorth."
    assert thought_before_cue("y" * 900) == "y" * MAX_CUED_THOUGHT_CHARS
    assert parse_react("Action: " + "y" * 5000) == "y" * MAX_WRITTEN_ACTION_CHARS


def test_generation_stops_after_an_action_on_its_own_line():
    text = "Thought:\nhmm\n\nAction:\nmove up\n"
    assert cut_after_action(text + "Thought: more") == text
    assert cut_after_action("Action: move up\nmore") == "Action: move up\n"
    assert cut_after_action("Action:\n") == "Action:\n"  # not yet an action: kept whole, generation goes on
    tok = build_tiny_tokenizer()
    done = ActionLineDone(tok, 0)
    rows = ["Thought:\nx\n\nAction:\n", "Thought:\nx\n\nAction:\nmove up\n", "Action: a\n"]
    ids = torch.tensor([tok(r.ljust(30), add_special_tokens=False)["input_ids"][:30] for r in rows])
    assert done(ids, None).tolist() == [False, True, True]


def test_written_actions_are_parsed_or_fall_back_counted_and_sampled_reproducibly():
    model, tok = _model()
    scorer = ActionScorer(model, tok, max_prompt_tokens=160, fmt=PlainFormat(1, 160, react=True))
    prompts = _maze_prompts(3)
    writer = ActionWriter(scorer)
    out = writer.write_actions(prompts, max_new_tokens=12)
    assert len(out) == 3 and all(isinstance(w, Written) for w in out)
    assert not all(w.parsed for w in out)  # the tiny model's bytes rarely name an action by themselves
    for w in out:
        assert w.action == (parse_react(w.text) or fallback_action(w.text)) and w.action.strip()
        if not w.parsed:  # its thought's first paragraph, the cue, and the line the model wrote after it
            thought, line = w.text.split(ACTION_CUE)
            assert "\n\n" not in thought.strip("\n") and len(thought) <= MAX_CUED_THOUGHT_CHARS
            assert (parse_react(w.text) or "") in line and (parse_react(w.text) is not None) == bool(line.strip())
    assert (writer.written, writer.unparsed) == (3, sum(not w.parsed for w in out))
    assert [w.text for w in writer.write_actions(prompts, max_new_tokens=12)] == [w.text for w in out]  # greedy
    # The text kept is the whole answer: the opening the prompts end with, then what the model wrote.
    opened = writer.write_actions(prompts, max_new_tokens=12, opening="Thought:")
    assert [w.text for w in opened] == ["Thought:" + w.text for w in out]
    a = writer.generate_texts(prompts, 12, greedy=False, generator=torch.Generator().manual_seed(3))
    b = writer.generate_texts(prompts, 12, greedy=False, generator=torch.Generator().manual_seed(3))
    c = writer.generate_texts(prompts, 12, greedy=False, generator=torch.Generator().manual_seed(4))
    assert a == b and a != c


def test_a_merged_lora_scores_as_the_adapter_does_in_one_matmul_a_layer_and_leaves_the_weights_as_they_were():
    from services.client_agent.model.loading import get_adapter_state, merged_lora

    model, tok = _model()
    scorer = ActionScorer(model, tok, max_prompt_tokens=160, method="packed")
    prompts, cands = _maze_prompts(3), [MAZE_ACTIONS] * 3
    plain = scorer.score(prompts, cands)
    linears = [m for m in model.modules() if hasattr(m, "lora_A") and "default" in m.lora_A]
    weights = [(m.get_base_layer().weight, m.get_base_layer().weight.clone()) for m in linears]
    adapter = get_adapter_state(model)
    factor_calls: list[int] = []
    hooks = [m.lora_A["default"].register_forward_hook(lambda *a: factor_calls.append(1)) for m in linears]
    try:
        with merged_lora(model) as n:
            assert n == len(linears) > 0
            merged = scorer.score(prompts, cands)
            assert all(m.get_base_layer().weight is not w for m, (w, _) in zip(linears, weights))
    finally:
        for h in hooks:
            h.remove()
    assert factor_calls == []  # no LoRA factor ran: each layer was one matmul
    for p, m in zip(plain, merged):
        assert torch.allclose(p, m, atol=1e-4), (p, m)
    # Afterwards: the same weight tensors, unchanged, and the adapter runs again as before.
    for m, (w, copy) in zip(linears, weights):
        assert m.get_base_layer().weight is w and torch.equal(w, copy) and not m.merged
    assert all(torch.equal(v, get_adapter_state(model)[k]) for k, v in adapter.items())
    again = scorer.score(prompts, cands)
    assert all(torch.equal(p, a) for p, a in zip(plain, again))
    # Where the merged copies would not fit in the room given, the layers run as they are.
    with merged_lora(model, max_bytes=1000) as n:
        assert n == 0 and not any(m.merged for m in linears)
        assert all(torch.equal(p, s) for p, s in zip(plain, scorer.score(prompts, cands)))
    # An error inside the block restores them too.
    with pytest.raises(RuntimeError, match="boom"):
        with merged_lora(model):
            raise RuntimeError("boom")
    assert all(m.get_base_layer().weight is w and not m.merged for m, (w, _) in zip(linears, weights))


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


def test_the_output_layer_runs_on_a_few_states_at_a_time_with_the_same_scores(monkeypatch):
    from services.client_agent.model import layouts

    model, tok = _model()
    prompts, cands = _maze_prompts(2), [WORDS, MAZE_ACTIONS]
    whole = ActionScorer(model, tok, max_prompt_tokens=160, method="packed").score(prompts, cands)
    rows: list[int] = []
    hook = model.get_base_model().get_output_embeddings().register_forward_hook(
        lambda module, args, out: rows.append(args[0].shape[0]))
    monkeypatch.setattr(layouts, "HEAD_ROWS", 3)
    try:
        parts = ActionScorer(model, tok, max_prompt_tokens=160, method="packed").score(prompts, cands)
    finally:
        hook.remove()
    assert len(rows) > 2 and max(rows) == 3
    for w, p in zip(whole, parts):
        assert torch.allclose(w, p, atol=1e-5), (w, p)


def test_width_groups_split_rows_where_a_pass_costs_less_than_the_padding_it_saves():
    import itertools
    import random

    from services.client_agent.model.layouts import width_groups

    assert width_groups([300, 30, 28, 290], overhead=64) == [[0, 3], [1, 2]]
    assert width_groups([300, 30, 28, 290], overhead=1000) == [[0, 3, 1, 2]]
    assert width_groups([40, 40, 40]) == [[0, 1, 2]] and width_groups([]) == []

    def cost(groups, widths, overhead):
        return sum(overhead + len(g) * max(widths[i] for i in g) for g in groups)

    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for p in partitions(rest):
            yield [[first]] + p
            for k in range(len(p)):
                yield p[:k] + [[first] + p[k]] + p[k + 1:]

    rng = random.Random(0)
    for _ in range(40):
        widths = [rng.choice([8, 20, 64, 100, 300, 700]) + rng.randrange(8) for _ in range(rng.randrange(1, 7))]
        overhead = rng.choice([0, 16, 64, 256])
        groups = width_groups(widths, overhead)
        assert sorted(itertools.chain(*groups)) == list(range(len(widths)))
        every = partitions(list(range(len(widths))))
        assert cost(groups, widths, overhead) == min(cost(p, widths, overhead) for p in every)


def test_scores_of_a_bf16_output_layer_are_computed_in_fp32_as_a_gpu_holds_it():
    """A real model on CUDA holds its output layer in bf16: the scores are those of the same weights
    in fp32, not of logits rounded to bf16 (which reorder near-tied actions)."""
    model, tok = _model()
    head = model.get_base_model().get_output_embeddings()
    with torch.no_grad():
        head.weight.copy_(head.weight.bfloat16().float())  # the values a bf16 weight holds
    prompts, cands = _maze_prompts(3), [WORDS, MAZE_ACTIONS, MAZE_ACTIONS]
    in_fp32 = ActionScorer(model, tok, max_prompt_tokens=160, method="packed").score(prompts, cands)
    head.weight = torch.nn.Parameter(head.weight.detach().bfloat16(), requires_grad=False)
    in_bf16 = ActionScorer(model, tok, max_prompt_tokens=160, method="packed").score(prompts, cands)
    for a, b in zip(in_fp32, in_bf16):
        assert torch.allclose(a, b, atol=1e-4), (a, b)
    with torch.no_grad():  # the kept fp32 copy follows the weight when it changes
        head.weight.mul_(0.5)
    halved = ActionScorer(model, tok, max_prompt_tokens=160, method="packed").score(prompts, cands)
    assert not torch.allclose(halved[0], in_bf16[0], atol=1e-3)


def test_auto_precision_is_bf16_for_a_real_model_in_bf16_on_cuda_and_fp32_for_the_tiny_one():
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.client_agent.model.loading import pick_precision

    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    small = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)
    assert pick_precision("auto", LlamaForCausalLM(small).to(torch.bfloat16), cuda) == "bf16"
    assert pick_precision("auto", LlamaForCausalLM(small), cuda) == "fp32"
    assert pick_precision("auto", build_tiny_model()[0], cuda) == "fp32"
    assert pick_precision("fp32", LlamaForCausalLM(small).to(torch.bfloat16), cuda) == "fp32"


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


def test_generation_writes_each_token_into_room_made_once_and_writes_the_same_texts(monkeypatch):
    """generate's cache (kvcache.generation_cache) makes room for the prompt and max_new_tokens at
    the prompt's pass and writes each token after it: the texts of transformers' own cache, greedy
    and sampled; a model with sliding-window layers keeps transformers' cache."""
    from transformers import DynamicCache, MistralConfig

    from services.client_agent.playing import generation

    from services.client_agent.model import kvcache

    model, tok = _model()
    writer = ActionWriter(ActionScorer(model, tok, max_prompt_tokens=256))
    prompts = _maze_prompts(3)
    made = []

    def spy(config, reserve):
        made.append(kvcache.generation_cache(config, reserve))
        return made[-1]

    monkeypatch.setattr(generation, "generation_cache", spy)
    ours = [writer.generate_texts(prompts, max_new_tokens=24),
            writer.generate_texts(prompts, max_new_tokens=24, greedy=False, generator=torch.Generator().manual_seed(1))]
    monkeypatch.setattr(generation, "generation_cache", lambda config, reserve: None)
    theirs = [writer.generate_texts(prompts, max_new_tokens=24),
              writer.generate_texts(prompts, max_new_tokens=24, greedy=False, generator=torch.Generator().manual_seed(1))]
    assert ours == theirs and any(t for t in ours[0])
    slots = made[0].layers[0]
    longest = max(len(writer.scorer.tokenize.prompt(p, 256)) for p in prompts)
    assert isinstance(slots, kvcache.Slots) and slots._slots[0].shape[-2] == longest + 24  # never grown
    sliding = MistralConfig(num_hidden_layers=2, sliding_window=16, hidden_size=32, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=64)
    default = kvcache.generation_cache(sliding, 8)
    assert isinstance(default, DynamicCache) and not any(isinstance(x, kvcache.Slots) for x in default.layers)

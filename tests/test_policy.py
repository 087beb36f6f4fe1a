"""Prompt format and likelihood scoring of admissible actions: greedy and sampled choice, batching,
truncation and prefix trees leave the scores as a direct forward pass gives them, calibrated scores,
a merged LoRA, the output layer a few states at a time, width groups and precision.

Reusing cached prefixes: tests/test_policy_reuse.py; the actions the agent writes (generation mode,
ReAct): tests/test_policy_actions.py."""

import os

import pytest
import torch

from fedse.model.tinymodel import build_tiny_model
from policy_support import MAZE_ACTIONS, WORDS, _direct_loglik, _maze_prompts, _model
from services.client_agent.playing.policy import ActionScorer
from services.client_agent.model.prefixes import PrefixTree
from services.client_agent.playing.prompts import format_prompt, format_target

torch.set_num_threads(1)


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
    # One scorer, each call by its environment's rule (a client of several environments).
    assert summed.choose(prompts, [MAZE_ACTIONS] * 12, greedy=True, scoring="calibrated") == \
        scorer.choose(prompts, [MAZE_ACTIONS] * 12, greedy=True)


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

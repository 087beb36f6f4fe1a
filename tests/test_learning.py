"""LoRA training: determinism, frozen base, and that imitation of expert demonstrations is learned
well enough to raise held-out maze success (a small version of bench/learning_curve.py)."""

import random

import pytest
import torch

from fedse.model.tinymodel import build_tiny_model, weights_digest
from lockstep import play_side_by_side
from services.client_agent.model.loading import add_lora, get_adapter_state
from services.client_agent.playing.policy import ActionScorer
from services.client_agent.playing.prompts import TINY_MAX_PROMPT_TOKENS, PlainFormat, format_prompt
from services.client_agent.training.trainer import train_lora
from services.env_server.registry import make_environment
from services.env_server.envs.maze import MazeEnv

torch.set_num_threads(1)

MAX_HISTORY = 1


def play(env, task_ids, choose, fmt=None):
    """Plays the tasks in lock step; choose(prompts, candidate lists) -> indices, or None for the
    expert; prompts in the given format (default: format_prompt with MAX_HISTORY turns, no window).
    Returns (successes, [(prompt, action) of each successful episode])."""
    prompt = fmt.prompt if fmt else (lambda instruction, turns, obs: format_prompt(instruction, turns, obs, MAX_HISTORY))
    played = play_side_by_side(env, task_ids, choose, prompt)
    return sum(p.success for p in played), [s for p in played if p.success for s in p.steps]


def _examples(n=24):
    env = MazeEnv()
    return play(env, env.tasks("train")[:n], None)[1]


def test_training_is_deterministic_and_touches_only_the_lora():
    examples = _examples(4)
    states, digests = [], []
    for seed in (3, 3, 4):
        model, tok = build_tiny_model()
        before = weights_digest(model)
        peft_model = add_lora(model)
        stats = train_lora(peft_model, tok, examples, epochs=1, batch_size=8, seed=seed)
        assert stats["steps"] == -(-len(examples) // 8) and stats["loss"] < stats["first_loss"] + 1e-9
        states.append(get_adapter_state(peft_model))
        digests.append(weights_digest(peft_model.get_base_model()) == before)
        # After training, the B matrices are no longer zero.
        assert any(float(v.abs().max()) > 0 for k, v in states[-1].items() if "lora_B" in k)
    a, b, c = states
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    # LoRA layers wrap the base weights: the base's own tensors ("base_layer") are unchanged.
    model, _ = build_tiny_model()
    peft_model = add_lora(model)
    base_before = {k: v.clone() for k, v in peft_model.state_dict().items() if "lora_" not in k}
    train_lora(peft_model, build_tiny_model()[1], examples[:8], epochs=1, batch_size=8)
    assert all(torch.equal(v, peft_model.state_dict()[k]) for k, v in base_before.items())


def test_progress_callback_reports_every_step():
    seen = []
    model, tok = build_tiny_model()
    stats = train_lora(add_lora(model), tok, _examples(2), epochs=2, batch_size=4, progress=seen.append)
    assert [s["step"] for s in seen] == list(range(1, stats["steps"] + 1))
    assert all(s["steps"] == stats["steps"] for s in seen)


def test_imitating_expert_demonstrations_raises_held_out_maze_success():
    env = MazeEnv()
    model, tok = build_tiny_model()
    peft_model = add_lora(model)
    scorer = ActionScorer(peft_model, tok)
    test = env.tasks("test")

    def greedy(prompts, cands):
        return scorer.choose(prompts, cands, greedy=True)

    pre, _ = play(env, test, greedy)
    demo_tasks = random.Random(0).sample(env.tasks("train"), 20)
    n_ok, demos = play(env, demo_tasks, None)
    assert n_ok == 20
    for round_ in range(3):  # three rounds of the paper's 2 epochs on D_0 (no exploration here)
        stats = train_lora(peft_model, tok, demos, epochs=2, batch_size=8, seed=round_)
    post, _ = play(env, test, greedy)
    # Measured: 0/25 before; 21/25 after (20..24 for other samples of demonstration tasks).
    assert pre <= 3, f"the untrained policy already solves {pre}/25 test tasks"
    assert stats["loss"] < 0.05
    assert post >= 15, f"held-out success {pre}/25 -> {post}/25 after imitation"


def test_calibrated_scoring_lets_the_untrained_tiny_model_act_on_babyais_goal():
    """Summed log-likelihood makes the untrained model take the shortest action ("turn left", about
    7 nats a byte cheaper) wherever it is; calibrated, the copy circuit's preference for the goal's
    words ("go to the red ball" -> "go to red ball 1") decides."""
    env = make_environment("babyai", seed=0)
    model, tok = build_tiny_model()
    peft_model = add_lora(model)
    fmt = PlainFormat(1, TINY_MAX_PROMPT_TOKENS)
    test = env.tasks("test")[:20]
    wins = {}
    for scoring in ("sum", "calibrated"):
        scorer = ActionScorer(peft_model, tok, fmt=fmt, scoring=scoring)
        wins[scoring], _ = play(env, test, lambda p, c: scorer.choose(p, c, greedy=True), fmt)
    # Measured: 0/20 summed, 7/20 calibrated.
    assert wins["calibrated"] >= 4 and wins["calibrated"] >= wins["sum"] + 3, wins


def test_micro_batches_stay_within_the_token_budget():
    from services.client_agent.model.loading import micro_batches

    lengths = [50, 120, 30, 400, 90, 90, 10, 700]
    runs = micro_batches(lengths, 256)
    assert [i for run in runs for i in run] == list(range(len(lengths)))  # every sequence, in order
    for run in runs:
        assert len(run) == 1 or len(run) * max(lengths[i] for i in run) <= 256
    assert [3] in runs and [7] in runs  # longer than the budget: alone


def _lora_with_gradients():
    """(tiny model with LoRA, tokenizer, its LoRA parameters by name), B nonzero so every LoRA
    parameter gets a gradient, all of them requiring one."""
    model, tok = build_tiny_model()
    peft_model = add_lora(model)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    params = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    for p in params.values():
        p.requires_grad_(True)
    return peft_model, tok, params


def test_gradient_accumulation_over_micro_batches_gives_the_whole_batch_gradient():
    """A token budget changes how a step's gradient is computed, not the gradient: one sequence per
    micro-batch accumulates what one pass over the whole batch gives."""
    from services.client_agent.training.trainer import accumulate_gradients, encode_pairs

    peft_model, tok, params = _lora_with_gradients()
    batch = encode_pairs(tok, _examples(3), 160)
    grads, losses = [], []
    for budget in (1 << 20, 1):
        for p in params.values():
            p.grad = None
        losses.append(accumulate_gradients(peft_model, batch, budget, tok.pad_token_id))
        grads.append({n: p.grad.clone() for n, p in params.items()})
    whole, one_by_one = grads
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    # fp32 rounding of other summation orders: about 1.5e-6 on gradients of about 1 (a wrong scale
    # of a micro-batch's share would move them by orders of magnitude more)
    assert all(torch.allclose(whole[n], one_by_one[n], rtol=1e-4, atol=1e-5 * float(whole[n].abs().max()))
               for n in whole)
    assert all(float(g.abs().max()) > 0 for g in whole.values())


def test_bucketed_micro_batches_give_the_same_gradient_from_passes_of_bucket_lengths_only():
    """Padding micro-batches to bucket lengths (bf16 on a CPU, where oneDNN keeps a kernel per length)
    changes the passes' widths, not the gradient."""
    from services.client_agent.model.loading import bucket_length
    from services.client_agent.training.trainer import accumulate_gradients, encode_pairs

    assert [bucket_length(n) for n in (1, 16, 17, 250, 256, 257, 320, 2871)] == [16, 16, 32, 256, 256, 320, 320, 2880]
    peft_model, tok, params = _lora_with_gradients()
    batch = encode_pairs(tok, _examples(5), 160)
    widths: list[int] = []
    hook = peft_model.get_base_model().get_input_embeddings().register_forward_hook(
        lambda module, args, out: widths.append(args[0].shape[-1]))
    grads, losses = [], []
    for bucket in (False, True):
        for p in params.values():
            p.grad = None
        widths.clear()
        losses.append(accumulate_gradients(peft_model, batch, 200, tok.pad_token_id, bucket=bucket))
        grads.append({n: p.grad.clone() for n, p in params.items()})
        seen = list(widths)
    hook.remove()
    assert seen and all(w == bucket_length(w) for w in seen), seen
    assert sorted({len(e.ids) for e in batch}) != sorted(set(seen))  # the plain passes had other widths
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    plain, bucketed = grads
    # fp32 rounding of passes of other widths: up to 4e-7 on gradients of about 0.3 (a padded token
    # that real ones attended to would move them by orders of magnitude more)
    assert all(torch.allclose(plain[n], bucketed[n], rtol=1e-4, atol=1e-5 * float(plain[n].abs().max()))
               for n in plain)


def test_optimizer_steps_hold_batch_size_turns_however_they_are_packed():
    from services.client_agent.training.trainer import turn_batches

    assert turn_batches([1] * 10, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]  # one turn a sequence
    steps = turn_batches([3, 5, 1, 12, 2, 2, 4], 8)
    assert steps == [[0, 1], [2], [3], [4, 5, 6]]  # 8, 1 (12 would overflow), 12 alone, 8
    assert [i for step in steps for i in step] == list(range(7))

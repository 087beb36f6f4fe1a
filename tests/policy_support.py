"""What the policy tests (tests/test_policy*.py) share: the tiny model with a random LoRA (its B
not zero, so the adapter changes the scores), the log-likelihood of an action from one plain
forward pass to compare scores with, and Maze prompts."""

import torch

from fedse.model.tinymodel import build_tiny_model
from services.client_agent.model.loading import add_lora
from services.client_agent.playing.prompts import format_prompt, format_target
from services.env_server.envs.maze import MazeEnv

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

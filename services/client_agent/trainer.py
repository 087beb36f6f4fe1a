"""LoRA fine-tuning on (prompt, action) examples: the loss covers only the agent's own tokens.

Each example is the prompt (truncated on the left to `max_prompt_tokens`, exactly as the scorer
truncates it) followed by format_target(action); prompt tokens are labelled -100. AdamW over the
LoRA parameters only, cosine schedule with a short warmup, gradient clipping at 1.0, a fresh
optimizer per call (one call = one round's local training, as in the paper), examples shuffled
each epoch by a generator seeded from `seed`: the same inputs give the same adapter.

Default learning rate 3e-3 (TINY_LR): the paper's 5e-5 is for 7B models. On the tiny default model
5e-5 leaves maze success at 0 for 3 rounds (loss 7.0 -> 6.2 nats/token: a 70 k-parameter LoRA moves
too little in a round's ~40 steps); 1e-3 learns a round later than 3e-3; 1e-2 is unstable (see
MODEL_NOTES.md). For real LLMs pass the paper's value (PAPER_LR).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch
from transformers import get_cosine_schedule_with_warmup

from .policy import TokenCache, default_max_prompt_tokens, encode_example

TINY_LR = 3e-3
PAPER_LR = 5e-5


def _batches(encoded: list[tuple[list[int], list[int]]], order: list[int], batch_size: int, pad_id: int):
    for start in range(0, len(order), batch_size):
        chunk = [encoded[i] for i in order[start:start + batch_size]]
        width = max(len(p) + len(t) for p, t in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        att = torch.zeros((len(chunk), width), dtype=torch.long)
        for b, (p, t) in enumerate(chunk):
            n = len(p) + len(t)
            ids[b, :n] = torch.tensor(p + t, dtype=torch.long)
            labels[b, len(p):n] = torch.tensor(t, dtype=torch.long)
            att[b, :n] = 1
        yield ids, att, labels


def train_lora(peft_model, tokenizer, examples: Sequence[tuple[str, str]], epochs: int = 2,
               lr: float = TINY_LR, batch_size: int = 8, seed: int = 0,
               max_prompt_tokens: int | None = None, warmup_ratio: float = 0.05,
               weight_decay: float = 0.0, max_grad_norm: float = 1.0,
               progress: Callable[[dict], None] | None = None) -> dict:
    """Fine-tunes the LoRA parameters of `peft_model` in place on (prompt, action) examples.

    Returns {"loss": mean target-token loss over the last epoch, "first_loss": over the first epoch,
    "steps", "examples", "tokens" (target tokens per epoch), "seconds"}. `progress`, if given, is
    called after every optimizer step with {"step", "steps", "epoch", "loss", "lr"}.
    """
    t0 = time.perf_counter()
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got {epochs} and {batch_size}")
    if not examples:
        return {"loss": float("nan"), "first_loss": float("nan"), "steps": 0, "examples": 0,
                "tokens": 0, "seconds": 0.0}
    params = [p for n, p in peft_model.named_parameters() if "lora_" in n]
    if not params:
        raise ValueError("train_lora: the model has no LoRA parameters (wrap it with add_lora first)")
    for p in params:
        p.requires_grad_(True)
    device = params[0].device
    max_prompt_tokens = max_prompt_tokens or default_max_prompt_tokens(peft_model)
    tokenize = TokenCache(tokenizer)
    encoded = [encode_example(tokenize, prompt, action, max_prompt_tokens) for prompt, action in examples]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    steps_per_epoch = math.ceil(len(encoded) / batch_size)
    total = steps_per_epoch * epochs
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(round(warmup_ratio * total)), total)
    gen = torch.Generator().manual_seed(int(seed))
    n_target = sum(len(t) for _, t in encoded)
    inner = peft_model.get_base_model()
    decoder, head = inner.get_decoder(), inner.get_output_embeddings()
    was_training = peft_model.training
    peft_model.train()
    step, epoch_losses = 0, []
    try:
        for epoch in range(epochs):
            order = torch.randperm(len(encoded), generator=gen).tolist()
            loss_sum = 0.0
            for ids, att, labels in _batches(encoded, order, batch_size, pad_id):
                ids, att, labels = ids.to(device), att.to(device), labels.to(device)
                # The output layer runs only where a target token is predicted (vocabularies are large).
                hidden = decoder(input_ids=ids, attention_mask=att, use_cache=False).last_hidden_state
                where = labels[:, 1:] != -100
                logits = head(hidden[:, :-1][where]).float()
                tok_loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:][where], reduction="sum")
                n_tok = int(where.sum())
                loss = tok_loss / max(n_tok, 1)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
                optimizer.step()
                scheduler.step()
                step += 1
                loss_sum += float(tok_loss.detach())
                if progress is not None:
                    progress({"step": step, "steps": total, "epoch": epoch, "loss": float(loss.detach()),
                              "lr": scheduler.get_last_lr()[0]})
            epoch_losses.append(loss_sum / max(n_target, 1))
    finally:
        peft_model.train(was_training)
    return {"loss": epoch_losses[-1], "first_loss": epoch_losses[0], "steps": step, "examples": len(encoded),
            "tokens": n_target, "seconds": time.perf_counter() - t0}

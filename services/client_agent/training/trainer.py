"""LoRA fine-tuning on the agent's own tokens: the loss covers only what the agent wrote.

Training sequences (prompts.Encoded) hold a prompt, truncated on the left exactly as acting
truncates it, and the agent's text after it; in the chat format one sequence holds several turns
of an episode, each action in it a target. Plain (prompt, action) pairs are encoded in the plain
format (`format_target`). AdamW over the LoRA parameters only, cosine schedule with a short
warmup, gradient clipping at 1.0, a fresh optimizer per call (one call = one round's local
training, as in the paper), sequences shuffled each epoch by a generator seeded from `seed`: the
same inputs give the same adapter. An optimizer step covers about `batch_size` agent turns
(turn_batches), whether they come one per sequence or a window of an episode each.

Memory is bounded by design, whatever the prompts' length: a step's sequences run in micro-batches
of at most `max_batch_tokens` tokens (rows x padded width; a longer sequence runs alone) whose
gradients accumulate, so the step is the one a whole batch would take
(the loss is the mean over the batch's target tokens). `checkpointing` recomputes each layer's
activations in the backward pass instead of keeping them (real models; the tiny model needs no
help): on every layer (True), or (a Checkpointing) on the fewest layers that bring each
micro-batch's kept activations within the memory room it is given, none where the whole micro-batch
fits (recomputing costs about a third more time). `precision` "bf16" runs the forward and backward
under bfloat16 autocast (the LoRA weights and optimizer stay fp32).

Default learning rate 3e-3 (TINY_LR): the paper's 5e-5 is for 7B models. On the tiny default model
5e-5 leaves maze success at 0 for 3 rounds (loss 7.0 -> 6.2 nats/token: a 70 k-parameter LoRA moves
too little in a round's ~40 steps); 1e-3 learns a round later than 3e-3; 1e-2 is unstable (see
MODEL_NOTES.md). For real LLMs pass the paper's value (PAPER_LR) or what their notes measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Iterator, Sequence

import torch
from transformers import get_cosine_schedule_with_warmup

from fedse.machine import release_free_memory

from services.client_agent.model.loading import autocast, bucket_length, lora_input_as_is, micro_batches, pads_to_buckets
from services.client_agent.training.buffer import Trajectory
from services.client_agent.playing.prompts import (Encoded, PromptFormat, TokenCache, default_max_prompt_tokens, encode_example,
                      encode_trajectory, format_target)
from services.client_agent.model.work import Work, causal_context

TINY_LR = 3e-3
PAPER_LR = 5e-5
# Tokens per micro-batch on CPU (rows x padded width). Measured with SmolLM2-135M, checkpointing and
# bf16 autocast: about 330 kB per token of budget at the peak (1,024: 1.6 GB for the whole process,
# 2,048: 1.9 GB, 4,096: 2.6 GB; without checkpointing 2,048 takes 3.9 GB), and no slower at 1,024.
DEFAULT_TRAIN_BATCH_TOKENS = 1024


def kept_by_autograd(model, step: Callable[[], torch.Tensor]) -> int:
    """The bytes of the tensors autograd keeps for the backward pass while `step` runs the forward pass
    and returns a loss, counted once per storage and leaving out the model's parameters (resident
    already); the loss is then back-propagated and the parameters' gradients cleared."""
    frozen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in frozen:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = step()
        loss.backward()
    finally:
        for p in model.parameters():
            p.grad = None
    return sum(seen.values())


def _checkpointing_layers(inner) -> list[torch.nn.Module]:
    """The decoder layers that can recompute their activations (transformers' GradientCheckpointingLayer)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in inner.modules() if isinstance(m, GradientCheckpointingLayer)]


def _stop_checkpointing(inner) -> None:
    """Checkpointing off, and the hook that made the embeddings' output require grad removed too
    (transformers removes it only from a model that loaded an adapter itself: each round's training
    would leave one more on the embeddings, run by every later pass, scoring included)."""
    inner.activation_checkpointing_disable()
    inner.disable_input_require_grads()


@contextlib.contextmanager
def checkpointing_on(inner, kwargs: dict | None = None) -> Iterator[None]:
    """Activation checkpointing enabled on `inner` (the base model) for the block (each layer's flag
    then says whether it recomputes: _checkpoint), and switched off again after (_stop_checkpointing)."""
    inner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    try:
        yield
    finally:
        _stop_checkpointing(inner)


def _checkpoint(layers: list[torch.nn.Module], k: int) -> None:
    """k of the layers, spread evenly, recompute their activations in the backward pass; the others keep them."""
    n = len(layers)
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = (i + 1) * k // n != i * k // n


def kept_by_decoder_pass(peft_model, ids: torch.Tensor, checkpointed: int, precision: str = "fp32") -> int:
    """The bytes autograd keeps (kept_by_autograd) over one forward pass of `ids` through the decoder,
    under `precision`'s autocast, with `checkpointed` of its layers recomputing their activations
    (within checkpointing_on where that is more than none)."""
    inner = peft_model.get_base_model()
    _checkpoint(_checkpointing_layers(inner), checkpointed)

    def step() -> torch.Tensor:
        with autocast(precision, ids.device):
            return inner.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state.float().square().mean()

    return kept_by_autograd(peft_model, step)


@dataclasses.dataclass(frozen=True)
class ActivationCost:
    """What autograd keeps for a training micro-batch, as measured on a model (ActivationCost.measure):
    a row of w tokens keeps per_token * w + per_pair * w * w bytes with no layer checkpointed (per_pair:
    attention that keeps its weights), and `checkpointed_per_token` * w with every one of the `layers`
    checkpointed (each keeps only its input); k checkpointed layers save k / layers of the difference."""

    layers: int
    per_token: float
    per_pair: float
    checkpointed_per_token: float

    def bytes(self, rows: int, width: int, checkpointed: int = 0) -> float:
        full = self.per_token * width + self.per_pair * width * width
        saved = (full - self.checkpointed_per_token * width) * checkpointed / max(1, self.layers)
        return rows * (full - max(0.0, saved))

    def fewest_checkpointed(self, rows: int, width: int, room: float) -> int:
        """The fewest layers to checkpoint for rows x width tokens to keep at most `room` bytes (all of
        them where even that does not fit: the micro-batch budget bounds it then)."""
        full, least = self.bytes(rows, width), self.bytes(rows, width, self.layers)
        if full <= room or self.layers == 0:
            return 0
        if least >= room:
            return self.layers
        k = int((full - room) / (full - least) * self.layers) + 1  # bytes fall linearly in k
        return min(self.layers, k)

    @classmethod
    def measure(cls, peft_model, precision: str, device: torch.device, widths: tuple[int, int] = (64, 128)) -> \
            "ActivationCost":
        """Measured with one-row passes of random tokens (forward and backward through the decoder) at
        two widths without checkpointing, and at the first with every layer checkpointed, leaving the
        caller's random state as it was (dropout draws from it). A model whose layers cannot recompute
        (no GradientCheckpointingLayer) has 0 layers: it never checkpoints."""
        inner = peft_model.get_base_model()
        layers = _checkpointing_layers(inner) if getattr(inner, "supports_gradient_checkpointing", False) else []
        params = [p for n, p in peft_model.named_parameters() if "lora_" in n]
        vocab = peft_model.get_input_embeddings().weight.shape[0]
        gen = torch.Generator().manual_seed(0)

        def kept(width: int, checkpointed: int) -> int:
            ids = torch.randint(3, max(4, vocab), (1, width), generator=gen).to(device)
            return kept_by_decoder_pass(peft_model, ids, checkpointed, precision)

        was_training = peft_model.training
        for p in params:
            p.requires_grad_(True)
        cuda = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), contextlib.ExitStack() as undo:
            undo.callback(peft_model.train, was_training)
            peft_model.train()
            if layers:
                undo.enter_context(checkpointing_on(inner))
            (w1, w2), (f1, f2) = widths, (kept(widths[0], 0), kept(widths[1], 0))
            low = kept(w1, len(layers)) if layers else f1
        per_pair = max(0.0, (f2 / w2 - f1 / w1) / (w2 - w1))
        per_token = max(f1 / w1 - per_pair * w1, f2 / w2 - per_pair * w2)
        return cls(len(layers), per_token, per_pair, low / w1)


@dataclasses.dataclass(frozen=True)
class Checkpointing:
    """Checkpoint, in each micro-batch, the fewest layers that keep its activations within `room` bytes
    (ActivationCost.fewest_checkpointed)."""

    cost: ActivationCost
    room: float

    def layers(self, rows: int, width: int) -> int:
        return self.cost.fewest_checkpointed(rows, width, self.room)


def training_examples(trajectories: list[Trajectory], fmt: PromptFormat, tokenize: TokenCache,
                      max_prompt_tokens: int, react_fmt: PromptFormat | None = None,
                      writes: frozenset[str] | set[str] = frozenset()) -> list[Encoded]:
    """The training sequences of every turn of every trajectory, each turn's prompt as the agent
    saw it (prompts.encode_trajectory); the loss covers only the agent's text.

    In the environments of `writes` (they list no actions) the agent writes its text: their
    trajectories train in `react_fmt` on each turn's whole written text (thought and action). In the
    others it picks among listed actions, by scoring "Action: <action>" (or generating just that
    line), so they train on exactly that, even where a demonstration file gave the turn a thought:
    learning to write thoughts first would teach nothing scoring uses."""
    out: list[Encoded] = []
    for t in trajectories:
        if t.env in writes and react_fmt is not None:
            out += encode_trajectory(react_fmt, tokenize, t.instruction, t.turns, max_prompt_tokens, t.texts)
        else:
            out += encode_trajectory(fmt, tokenize, t.instruction, t.turns, max_prompt_tokens)
    return out


def turn_batches(turns: Sequence[int], batch_size: int) -> list[list[int]]:
    """Splits the indices 0..n-1, in order, into optimizer steps of about batch_size agent turns: a
    step takes sequences until it holds batch_size turns (one that alone holds more is a step of its
    own). With one turn per sequence (the plain format) every step holds batch_size sequences."""
    out: list[list[int]] = []
    run: list[int] = []
    held = 0
    for i, n in enumerate(turns):
        if run and held + n > batch_size:
            out.append(run)
            run, held = [], 0
        run.append(i)
        held += n
    if run:
        out.append(run)
    return out


def _tensors(chunk: list[Encoded], pad_id: int, bucket: bool = False):
    """ids and labels (-100 where no loss) of a micro-batch, padded on the right to its longest
    sequence, or with `bucket` to that length's bucket (model.bucket_length). No attention mask:
    causal attention already keeps every real token from seeing the padding after it."""
    width = max(len(e.ids) for e in chunk)
    width = bucket_length(width) if bucket else width
    ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
    labels = torch.full((len(chunk), width), -100, dtype=torch.long)
    for b, e in enumerate(chunk):
        row = torch.tensor(e.ids, dtype=torch.long)
        ids[b, :len(e.ids)] = row
        for s, t in e.spans:
            labels[b, s:t] = row[s:t]
    return ids, labels


class HeapRelease:
    """When training returns the heap it freed to the system (release_free_memory): before a
    micro-batch that recomputes activations (memory is tight), and before one larger (rows x width)
    than any since the last return; otherwise it runs in what earlier micro-batches freed.

    glibc keeps freed memory resident. Returning it before every micro-batch bounds a process's
    memory most tightly, but makes each micro-batch fault its pages in afresh: SmolLM2 (bf16, a
    2-core AMD EPYC) trained 1.15x as fast without that over one epoch of 24 sequences where no layer
    recomputes (a client's round 0: 1.10-1.13x), its peak 5-9% higher (docs/results.md has the
    figures)."""

    def __init__(self, release: Callable[[], None] = release_free_memory) -> None:
        self.release = release
        self.largest = 0

    def before(self, rows: int, width: int, recomputes: bool = False) -> None:
        if recomputes or rows * width > self.largest:
            self.release()
            self.largest = rows * width


def accumulate_gradients(peft_model, batch: Sequence[Encoded], max_batch_tokens: int, pad_id: int,
                         precision: str = "fp32", bucket: bool = False, work: Work | None = None,
                         before: Callable[[int, int], None] | None = None) -> float:
    """Adds to the parameters' .grad the gradient of the batch's mean target-token loss, computed in
    micro-batches of at most max_batch_tokens tokens (micro_batches); returns the summed token loss.
    `bucket`: pad each micro-batch to its length's bucket (model.bucket_length). `work` counts the
    tokens and FLOPs (work.Work). `before(rows, width)` is called before each micro-batch runs."""
    inner = peft_model.get_base_model()
    decoder, head = inner.get_decoder(), inner.get_output_embeddings()
    device = head.weight.device
    n_tok = max(1, sum(e.targets for e in batch))
    total = 0.0
    # Shortest first, so that a micro-batch holds sequences of like lengths and pads little (the
    # step's gradient is the same sum in any order).
    batch = sorted(batch, key=lambda e: len(e.ids))
    for run in micro_batches([len(e.ids) for e in batch], max_batch_tokens):
        ids, labels = (t.to(device) for t in _tensors([batch[i] for i in run], pad_id, bucket))
        lengths = [len(batch[i].ids) for i in run]
        if before is not None:
            before(*ids.shape)
        # Without a mask attention keeps its fused causal kernel (measured: a 2,880-token BabyAI
        # sequence padded by 9 tokens and masked made training 10x slower).
        with autocast(precision, device):
            hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
        # The output layer runs only where a target token is predicted (vocabularies are large), in
        # the weights' dtype.
        where = labels[:, 1:] != -100
        logits = head(hidden[:, :-1][where].to(head.weight.dtype)).float()
        tok_loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:][where], reduction="sum")
        (tok_loss / n_tok).backward()
        total += float(tok_loss.detach())
        if work is not None:
            work.forward(sum(lengths), causal_context(lengths), padded=ids.numel() - sum(lengths), kind="train")
            work.head(int(where.sum()), train=True)
        del hidden, logits, tok_loss  # freed before the next micro-batch's forward, not after it
    return total


def encode_pairs(tokenizer, examples: Sequence[tuple[str, str]], max_prompt_tokens: int) -> list[Encoded]:
    """(prompt, action) pairs in the plain format as one-turn training sequences."""
    tokenize = TokenCache(tokenizer)
    out = []
    for prompt, action in examples:
        p, t = encode_example(tokenize, prompt, format_target(action), max_prompt_tokens)
        out.append(Encoded(tuple(p + t), ((len(p), len(p) + len(t)),)))
    return out


def _lora_parameters(peft_model) -> list[torch.nn.Parameter]:
    """The LoRA parameters of `peft_model`, set to require grad (a ValueError where it has none)."""
    params = [p for n, p in peft_model.named_parameters() if "lora_" in n]
    if not params:
        raise ValueError("train_lora: the model has no LoRA parameters (wrap it with add_lora first)")
    for p in params:
        p.requires_grad_(True)
    return params


def _sequences(peft_model, tokenizer, examples: Sequence[Encoded] | Sequence[tuple[str, str]],
               max_prompt_tokens: int | None) -> list[Encoded]:
    """The training sequences as given, or plain (prompt, action) pairs encoded (encode_pairs)."""
    if isinstance(examples[0], Encoded):
        return list(examples)
    return encode_pairs(tokenizer, examples, max_prompt_tokens or default_max_prompt_tokens(peft_model))


def _epoch_plans(encoded: Sequence[Encoded], epochs: int, batch_size: int,
                 seed: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Per epoch, the sequences' order (shuffled by a generator seeded from `seed`) and its optimizer
    steps (turn_batches: indices into that order)."""
    gen = torch.Generator().manual_seed(int(seed))
    orders = [torch.randperm(len(encoded), generator=gen).tolist() for _ in range(epochs)]
    plans = [turn_batches([encoded[i].turns for i in order], batch_size) for order in orders]
    return orders, plans


def _micro_batch_hook(checkpointing: bool | Checkpointing, layers: list[torch.nn.Module],
                      release_memory: "bool | HeapRelease", passes: list[int]) -> Callable[[int, int], None] | None:
    """What runs before each micro-batch (accumulate_gradients' `before`): the heap returned where
    `release_memory` asks (HeapRelease), and the layers that recompute chosen (every one of `layers`,
    or the fewest a Checkpointing needs), counted in `passes` (layer passes run, recomputed); None
    where there is neither to do."""
    release = release_memory if isinstance(release_memory, HeapRelease) else HeapRelease() if release_memory else None

    def before(rows: int, width: int) -> None:
        k = checkpointing.layers(rows, width) if isinstance(checkpointing, Checkpointing) else len(layers)
        if release is not None:
            release.before(rows, width, recomputes=k > 0)
        if layers:
            _checkpoint(layers, k)
            passes[0] += len(layers)
            passes[1] += k

    return before if layers or release else None


def train_lora(peft_model, tokenizer, examples: Sequence[Encoded] | Sequence[tuple[str, str]], epochs: int = 2,
               lr: float = TINY_LR, batch_size: int = 8, seed: int = 0,
               max_prompt_tokens: int | None = None, warmup_ratio: float = 0.05,
               weight_decay: float = 0.0, max_grad_norm: float = 1.0,
               max_batch_tokens: int | None = None, checkpointing: bool | Checkpointing = False,
               precision: str = "fp32",
               release_memory: "bool | HeapRelease" = False, bucket: bool | None = None,
               progress: Callable[[dict], None] | None = None, work: Work | None = None) -> dict:
    """Fine-tunes the LoRA parameters of `peft_model` in place on training sequences (or plain
    (prompt, action) pairs). batch_size counts agent turns per optimizer step (turn_batches), so a
    step sees as much of the agent's text whether turns come one per sequence or an episode each.

    Returns {"loss": mean target-token loss over the last epoch, "first_loss": over the first epoch,
    "steps", "examples" (sequences), "turns" (agent turns in them), "tokens" (target tokens per
    epoch), "seconds", "recomputed" (the share of layer passes that recomputed their activations)}.
    `checkpointing`: False, True (every layer) or a Checkpointing (the fewest layers a micro-batch
    needs). `bucket`: pad micro-batches to bucket lengths (None: where
    model.pads_to_buckets says, bf16 on a CPU). `progress`, if given, is called after every
    optimizer step with {"step", "steps", "epoch", "loss", "lr"}. `work` counts the tokens and FLOPs
    (work.Work). `release_memory`: return the freed heap to the system between micro-batches where
    memory could grow (True, or the HeapRelease to use).
    """
    t0 = time.perf_counter()
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be >= 1, got {epochs} and {batch_size}")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
    if not examples:
        return {"loss": float("nan"), "first_loss": float("nan"), "steps": 0, "examples": 0, "turns": 0,
                "tokens": 0, "seconds": 0.0, "recomputed": 0.0}
    params = _lora_parameters(peft_model)
    device = params[0].device
    encoded = _sequences(peft_model, tokenizer, examples, max_prompt_tokens)
    bucket = pads_to_buckets(precision, device) if bucket is None else bucket
    budget = max_batch_tokens or (DEFAULT_TRAIN_BATCH_TOKENS if device.type == "cpu" else 32768)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    orders, plans = _epoch_plans(encoded, epochs, batch_size, seed)
    total = sum(len(plan) for plan in plans)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(round(warmup_ratio * total)), total)
    n_target = sum(e.targets for e in encoded)
    inner = peft_model.get_base_model()
    was_training = peft_model.training
    layers = _checkpointing_layers(inner) if checkpointing else []
    passes = [0, 0]  # layer passes run, recomputed
    before = _micro_batch_hook(checkpointing, layers, release_memory, passes)
    step, epoch_losses = 0, []
    with contextlib.ExitStack() as undo:
        undo.callback(peft_model.train, was_training)
        peft_model.train()
        undo.enter_context(lora_input_as_is(peft_model, precision))
        if checkpointing:
            undo.enter_context(checkpointing_on(inner, {"use_reentrant": False}))
        for epoch, (order, plan) in enumerate(zip(orders, plans)):
            loss_sum = 0.0
            for run in plan:
                batch = [encoded[order[i]] for i in run]
                n_tok = max(1, sum(e.targets for e in batch))
                optimizer.zero_grad(set_to_none=True)
                batch_loss = accumulate_gradients(peft_model, batch, budget, pad_id, precision, bucket, work, before)
                if max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
                optimizer.step()
                scheduler.step()
                step += 1
                loss_sum += batch_loss
                if progress is not None:
                    progress({"step": step, "steps": total, "epoch": epoch, "loss": batch_loss / n_tok,
                              "lr": scheduler.get_last_lr()[0]})
            epoch_losses.append(loss_sum / max(n_target, 1))
    return {"loss": epoch_losses[-1], "first_loss": epoch_losses[0], "steps": step, "examples": len(encoded),
            "turns": sum(e.turns for e in encoded), "tokens": n_target, "seconds": time.perf_counter() - t0,
            "recomputed": passes[1] / passes[0] if passes[0] else 0.0}

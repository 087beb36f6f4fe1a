"""The work the agent's model does, counted in tokens and in model FLOPs, per phase of a round.

Every pass through the model adds to one phase ("eval", "explore", "train"; what runs outside them
counts as "other") and one kind of token:
- `prompt`: prompt and candidate tokens computed by a scoring pass, and the prompts a generation
  reads before it writes (its prefill);
- `cached`: prompt tokens not computed because a reused prefix cache held them (the previous turn
  of an episode, another episode's shared instruction);
- `generated`: tokens a generation wrote;
- `train`: training tokens, run forward and backward;
- `padding`: positions computed that hold no token (rows padded to a common or bucket length,
  rows that finished generating while others went on). Their FLOPs are waste, never counted.

Model FLOPs, as MFU counts them (the work the tokens need, not what the hardware did):
- a forward pass: 2 x the decoder's linear weights (LoRA's included) per token, plus attention's
  4 x layers x (query heads x head size) x the positions it reads, per token;
- the output layer: 2 x its weights per row it runs on (scoring and training run it only where a
  scored token is predicted);
- training adds the backward pass: gradients of the activations only (the base is frozen, LoRA's
  weight gradients are negligible), so 2 x the forward's linear and output-layer FLOPs and 3 x its
  attention FLOPs. Checkpointing's recomputed forward is not counted: it is the hardware's work,
  not the model's.
MFU is then FLOPs / seconds / the machine's measured peak (fedse.machine.matmul_peak).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

import torch

from services.client_agent.playing.prompts import inner_model

PHASES = ("eval", "explore", "train", "other")
KINDS = ("prompt", "cached", "generated", "train", "padding")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What model FLOPs are computed from: the decoder's linear weights, its layers, its attention
    width (query heads x head size) and the output layer's weights."""

    linear: int
    layers: int
    attention: int
    head: int

    @classmethod
    def of(cls, model) -> ModelShape:
        lm = inner_model(model)
        cfg = lm.config
        linear = sum(m.weight.numel() for m in lm.get_decoder().modules() if isinstance(m, torch.nn.Linear))
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(linear, cfg.num_hidden_layers, heads * head_dim, lm.get_output_embeddings().weight.numel())

    def forward_flops(self, tokens: int, context: int, train: bool = False) -> float:
        """A forward pass over `tokens` tokens that read `context` positions in all (each token
        counts the positions it attends to, itself included); `train`: with the backward pass
        through the activations (1x the linear FLOPs again, 2x attention's)."""
        linear, attention = 2.0 * self.linear * tokens, 4.0 * self.layers * self.attention * context
        return 2 * linear + 3 * attention if train else linear + attention

    def head_flops(self, rows: int, train: bool = False) -> float:
        """The output layer on `rows` hidden states (`train`: and back through them)."""
        return (2.0 if train else 1.0) * 2.0 * self.head * rows


def causal_context(lengths, start: int = 0) -> int:
    """The positions that tokens start+1 .. start+n of each causal row of length n read in all."""
    return sum(n * start + n * (n + 1) // 2 for n in lengths)


class Work:
    """Tokens and model FLOPs per phase, counted as passes run (`forward`, `head`), and handed on to
    whoever watches (`watch`: Prometheus counters) as they are counted. `phase(name)` says which
    phase the passes inside it belong to."""

    def __init__(self, shape: ModelShape):
        self.shape = shape
        self.tokens: dict[tuple[str, str], int] = {(p, k): 0 for p in PHASES for k in KINDS}
        self.flops: dict[str, float] = {p: 0.0 for p in PHASES}
        self.current = "other"
        self._watchers: list[Callable[[str, str, int, float], None]] = []

    @classmethod
    def of(cls, model) -> Work:
        return cls(ModelShape.of(model))

    def watch(self, watcher: Callable[[str, str, int, float], None]) -> None:
        """Calls watcher(phase, kind, tokens, flops) for every count from now on (kind None: FLOPs
        of the output layer, no tokens)."""
        self._watchers.append(watcher)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {name!r}")
        before, self.current = self.current, name
        try:
            yield
        finally:
            self.current = before

    def _add(self, kind: str | None, n: int, flops: float = 0.0) -> None:
        if n <= 0 and flops <= 0:
            return
        if kind is not None:
            self.tokens[self.current, kind] += n
        self.flops[self.current] += flops
        for w in self._watchers:
            w(self.current, kind, n, flops)

    def forward(self, tokens: int, context: int, padded: int = 0, cached: int = 0, kind: str = "prompt") -> None:
        """A forward pass that computed `tokens` tokens of `kind` ("prompt", "generated" or "train":
        then with its backward pass), reading `context` positions in all, plus `padded` positions
        that hold none, after `cached` tokens a prefix cache served."""
        self._add(kind, tokens, self.shape.forward_flops(tokens, context, train=kind == "train"))
        self._add("padding", padded)
        self._add("cached", cached)

    def head(self, rows: int, train: bool = False) -> None:
        """The output layer ran on `rows` hidden states (and, training, back through them)."""
        self._add(None, 0, self.shape.head_flops(rows, train))

    def totals(self) -> tuple[int, int]:
        """Tokens computed (prompt, generated, train) and padding positions so far, every phase."""
        computed = sum(n for (_, k), n in self.tokens.items() if k in ("prompt", "generated", "train"))
        return computed, sum(n for (_, k), n in self.tokens.items() if k == "padding")

    def snapshot(self) -> tuple[dict[tuple[str, str], int], dict[str, float]]:
        return dict(self.tokens), dict(self.flops)

    def since(self, snap: tuple[dict[tuple[str, str], int], dict[str, float]], phase: str,
              seconds: float, peak_flops: float | None) -> dict[str, float]:
        """One phase's work since `snap`, as a round's metrics: `<phase>_tokens` (tokens computed:
        prompt, generated and train), `<phase>_cached`, `<phase>_generated`, `<phase>_padding`
        (share of the computed positions), `<phase>_tokens_per_s` (tokens computed per second of
        the phase) and `<phase>_mfu` (against `peak_flops`, where known). Empty if the phase ran
        no model."""
        tokens, flops = snap
        d = {k: self.tokens[phase, k] - tokens[phase, k] for k in KINDS}
        computed = d["prompt"] + d["generated"] + d["train"]
        if computed == 0:
            return {}
        out = {f"{phase}_tokens": float(computed), f"{phase}_padding": d["padding"] / (computed + d["padding"])}
        if phase != "train":
            out[f"{phase}_cached"] = float(d["cached"])
            out[f"{phase}_generated"] = float(d["generated"])
        if seconds > 0:
            out[f"{phase}_tokens_per_s"] = computed / seconds
            if peak_flops:
                out[f"{phase}_mfu"] = (self.flops[phase] - flops[phase]) / seconds / peak_flops
        return out

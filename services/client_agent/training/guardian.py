"""The client's guardian: it sizes the work to this machine and keeps the organisation's privacy budget.

Sizing (--guardian), before the client joins. It chooses what the organisation left to it: the LoRA
rank (--lora-r 0), the tokens of a training micro-batch (--train-batch-tokens 0) and the precision
(--precision auto); a value given pins it. For each candidate, largest first (ranks from the run's
maximum, or 16, halving; micro-batches from the trainer's default, halving to 64 tokens; the
precision 'auto' picks, then bf16 where that was fp32; the smallest setting is measured first, so
that where even it does not fit the search ends at once), it adds a LoRA of that rank to the loaded
base model and runs the trainer's own step (accumulate_gradients) on the micro-batches it would run:
sequences as long as the longest the trainer runs whole (a prompt of the client's width and the
agent's text: longest_sequence; a micro-batch of fewer tokens does not make that sequence shorter, so
a smaller micro-batch needs no less than it), and where more rows fit, the micro-batch full of shorter
ones (step_shapes). It measures what the step held at its peak, plus AdamW's two moments:
  - on CUDA, the allocator's peak above what was allocated before the step;
  - on a CPU, the process's peak resident set (VmHWM, reset before the micro-batch, the freed heap
    returned first) above what it held before: the real peak, which the bytes autograd saved plus
    the LoRA's gradients (the floor kept) under-counted (SmolLM2-135M at 1,024 tokens: by 21 %).
    Where the peak cannot be reset, that count times COUNT_TO_PEAK.
  The step runs without activation checkpointing: an upper bound.
The choice is kept in the state directory (guardian.json): a restarted client joins again with it,
at the rank its uploads have, as long as the base model and the run's ranks are the same. The first
candidate whose need fits is taken: need = resident + step + (a real model's --score-cache-mb)
+ 10 %, resident being what the process holds with the model loaded and its weights paged in by a
short forward pass (RSS, or CUDA's allocated bytes: resident_after_forward),
against --memory-limit-mb (else the GPU's memory, or the cgroup's limit or the machine's available
memory on a CPU). The rank comes first (a larger rank changes what is learnt; a smaller micro-batch
only how many passes a step takes), then the micro-batch, then the precision.

Advice (--guardian-model, optional): a language model chooses among the settings that fit, given the
organisation's wishes in words (--guardian-notes, e.g. "leave half the memory to other work"). The
guardian measures the alternatives (each smaller rank, and half the micro-batch, at what fits), asks
the model with them as JSON, and checks its answer: it must name one of the options measured to fit.
Any other answer, or a model that fails, leaves the tools' choice standing, and the fallback is
counted and said.

Privacy (--privacy-epsilon E, --privacy-delta D; privacy.py): the organisation's (E, D) over every run
it takes part in. Each round this client uploads to, synchronous or asynchronous, is one release of the
Gaussian mechanism over its data, at the noise this client adds itself under secure aggregation
(RunConfig.noise_multiplier z: rho = 1/(2 z^2), fedse.privacy.accounting), so the budget never rests on the
aggregator's word: a run without it is refused at Join (UnaccountedRun). Before each round it would
upload to, the guardian books that release in its ledger (privacy.json in the state directory, written
before the upload, so a restart spends nothing twice); if the ledger's total would exceed E, it
declines the round (its heartbeat says "declined", and the aggregator does not wait for it) and every
later one. The ledger spans runs: a new run id, which the aggregator chooses, starts nothing afresh.
Only the organisation resets it: `fedse client --reset-privacy-ledger` (same --state-dir and
--client-id) moves privacy.json aside to privacy.reset-<UTC time>.json and exits, and the next start
spends from zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import pathlib
from typing import Callable, Iterator

import torch

from fedse.agents.asking import AnswerError, json_object
from fedse.files import atomic_write
from fedse.machine import (available_memory_bytes, peak_resident_bytes, release_free_memory, reset_peak_resident,
                           resident_bytes)
from fedse.transport.serving import log_fields

from services.client_agent.training.privacy import LedgerError, PrivacyBudget, UnaccountedRun, reset_ledger  # noqa: F401 - the guardian's

log = logging.getLogger("fedse.client.guardian")

MIN_BATCH_TOKENS = 64
DEFAULT_TOP_RANK = 16  # the largest rank tried where the run does not say one
HEADROOM = 1.10  # need = 110 % of what was measured and resident
# Where a CPU's peak cannot be isolated: what autograd saved and the gradients, scaled by this. Measured:
# SmolLM2-135M's step at 1,024 tokens peaked 21 % above that count (the tiny model's, 2-3x: its
# output layer's and attention's passing tensors weigh more against its small layers).
COUNT_TO_PEAK = 1.25
REFERENCE_RANK = 8  # with --lora-r 0, --lora-alpha is read as this rank's: a chosen rank keeps the ratio


def alpha_for(config, rank: int) -> int:
    """The LoRA alpha of `rank`: --lora-alpha where the rank is pinned, else at its ratio to REFERENCE_RANK."""
    return config.lora_alpha if config.lora_r else max(1, round(rank * config.lora_alpha / REFERENCE_RANK))


@contextlib.contextmanager
def lora_on(base, config, rank: int, add_lora: Callable | None = None) -> Iterator:
    """The base model with a LoRA of `rank` while the block runs; the base model bare again after it
    (peft's unload gives back the same module)."""
    from services.client_agent.model.loading import add_lora as default_add_lora

    peft = (add_lora or default_add_lora)(base, r=rank, alpha=alpha_for(config, rank), dropout=config.lora_dropout,
                                          target_modules=config.lora_targets(), seed=config.seed)
    try:
        yield peft
    finally:
        peft.unload()


@dataclasses.dataclass(frozen=True)
class Candidate:
    lora_r: int
    batch_tokens: int
    precision: str
    step_bytes: int = 0
    need_bytes: int = 0

    @staticmethod
    def measured(lora_r: int, batch_tokens: int, precision: str, step: int, held: int) -> "Candidate":
        """A candidate whose step held `step` bytes, in a process that holds `held` besides (resident and
        the score cache): it needs HEADROOM times both."""
        return Candidate(lora_r, batch_tokens, precision, step, int((held + step) * HEADROOM))

    def describe(self) -> str:
        return (f"rank {self.lora_r}, {self.batch_tokens} tokens a micro-batch, {self.precision}: needs "
                f"{self.need_bytes / 1e6:.0f} MB")


@dataclasses.dataclass(frozen=True)
class Sizing:
    """What the guardian chose, and why (`tried`: every candidate measured, in order)."""

    chosen: Candidate
    limit_bytes: int
    resident_bytes: int
    tried: tuple[Candidate, ...]
    pinned: tuple[str, ...]
    advice: str = ""  # what the model said of its choice (--guardian-model)
    fallback: str = ""  # why the model's answer did not stand, where it did not

    def reason(self) -> str:
        skipped = [c for c in self.tried if c != self.chosen]
        why = f"; too large: {'; '.join(c.describe() for c in skipped)}" if skipped else ""
        pins = f"; pinned: {', '.join(self.pinned)}" if self.pinned else ""
        advice = f"; the model: {self.advice}" if self.advice else ""
        fallback = f"; the model's answer did not stand ({self.fallback}): the tools' choice" if self.fallback else ""
        return (f"{self.chosen.describe()} of {self.limit_bytes / 1e6:.0f} MB (resident "
                f"{self.resident_bytes / 1e6:.0f} MB){why}{pins}{advice}{fallback}")


class DoesNotFit(RuntimeError):
    """Not even the smallest setting fits this machine's memory."""


def ranks_from(top: int) -> list[int]:
    """top, top/2, ..., 1."""
    out, r = [], top
    while r >= 1:
        out.append(r)
        r //= 2
    return out


def tokens_from(top: int) -> list[int]:
    """top, top/2, ... down to MIN_BATCH_TOKENS."""
    out, t = [], top
    while t >= MIN_BATCH_TOKENS:
        out.append(t)
        t //= 2
    return out or [top]


def longest_sequence(model, width: int, config) -> int:
    """The longest training sequence the trainer may run whole (a sequence longer than the micro-batch
    runs alone: trainer.micro_batches): a prompt of `width` tokens (truncated on the left to it) and the
    agent's text after it (at most --max-new-tokens), within the model's positions."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    positions = getattr(getattr(inner, "config", None), "max_position_embeddings", None) or 0
    longest = width + max(1, config.max_new_tokens)
    return min(longest, positions) if positions > 1 else longest


def step_shapes(batch_tokens: int, longest: int) -> list[tuple[int, int]]:
    """The micro-batches (rows, width) a step of `batch_tokens` tokens may run when sequences are up to
    `longest` tokens: the longest sequences, as many as fit (at least one: it runs whole), and, where more
    rows fit, one row more of shorter sequences, which fill the micro-batch's tokens."""
    shapes = [(max(1, batch_tokens // longest), longest)]
    if batch_tokens >= longest:
        rows = batch_tokens // longest + 1
        if batch_tokens // rows >= 2:
            shapes.append((rows, batch_tokens // rows))
    return shapes


def _micro_batch_bytes(peft_model, rows: int, width: int, precision: str, device: torch.device) -> tuple[int, int]:
    """(what the process's memory grew by at the peak, the bytes autograd saved) while the trainer's own
    accumulate_gradients runs one micro-batch of `rows` random sequences of `width` tokens, their last
    quarter the target (the output layer runs on targets only). The peak: CUDA's allocator's, or on a
    CPU the resident set's (VmHWM reset before); -1 where it cannot be isolated."""
    from services.client_agent.model.loading import lora_input_as_is, pads_to_buckets
    from services.client_agent.playing.prompts import Encoded
    from services.client_agent.training.trainer import accumulate_gradients

    vocab = peft_model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    target = max(1, width // 4)
    batch = [Encoded(tuple(torch.randint(3, max(4, vocab), (width,), generator=gen).tolist()),
                     ((width - target, width),)) for _ in range(rows)]
    frozen = {p.untyped_storage().data_ptr() for p in peft_model.parameters()}  # resident already
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in frozen:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        release_free_memory()  # what an earlier measurement freed is not counted as held
    isolated = cuda or reset_peak_resident()
    before = resident_bytes(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), lora_input_as_is(peft_model, precision):
        accumulate_gradients(peft_model, batch, rows * width, 0, precision, pads_to_buckets(precision, device))
    params = [p for p in peft_model.parameters() if p.grad is not None]
    torch.nn.utils.clip_grad_norm_(params, 1.0)  # and the optimizer's step, as the trainer takes it: its
    torch.optim.AdamW(params, lr=0.0).step()  # moments and temporaries (lr 0: the LoRA is thrown away anyway)
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        peak = peak_resident_bytes() - before if isolated else -1
    return max(0, peak) if isolated else -1, sum(saved.values())


def step_bytes(peft_model, batch_tokens: int, longest: int, precision: str, device: torch.device) -> int:
    """What one training step with micro-batches of `batch_tokens` tokens, sequences up to `longest`
    (step_shapes), holds beyond what is resident, measured on the model by running the trainer's step:
    the largest of its micro-batches' peaks, each with the LoRA's gradients and an AdamW step (its moments).
    On a CPU it is never less than what autograd saved plus the gradients; where the peak cannot be
    isolated (no VmHWM reset), that count times COUNT_TO_PEAK."""
    params = [p for n, p in peft_model.named_parameters() if "lora_" in n]
    for p in params:
        p.requires_grad_(True)
    lora = sum(p.numel() * p.element_size() for p in params)
    peft_model.train()
    worst = 0
    try:
        for rows, width in step_shapes(batch_tokens, longest):
            peak, saved = _micro_batch_bytes(peft_model, rows, width, precision, device)
            if device.type != "cuda":
                counted = saved + 3 * lora  # the gradients and AdamW's two moments
                peak = max(peak, counted) if peak >= 0 else int(counted * COUNT_TO_PEAK)
            worst = max(worst, peak)
            for p in params:
                p.grad = None
    finally:
        peft_model.eval()
    return int(worst)


def resident_after_forward(base, device: torch.device) -> int:
    """What the process holds with the model's weights paged in: a weight file's memory map is read
    as passes touch it (SmolLM2-135M: 435 MB resident after loading, 971 MB after one forward), so one
    short forward pass runs first, and the heap it freed is returned before measuring."""
    vocab = base.get_input_embeddings().weight.shape[0]
    ids = torch.randint(3, max(4, vocab), (1, 16), generator=torch.Generator().manual_seed(0)).to(device)
    was_training = base.training
    base.eval()
    try:
        with torch.no_grad():
            base(input_ids=ids, use_cache=False)
    finally:
        base.train(was_training)
    release_free_memory()  # what this pass and earlier phases freed is not held
    return resident_bytes(device)


def size(base, config, device: torch.device, width: int, top_rank: int, fixed_rank: int = 0,
         limit_bytes: int = 0, extra_bytes: int = 0, resident: int | None = None,
         add_lora: Callable | None = None, on_try: Callable[[Candidate], None] = lambda c: None,
         measure_step: Callable[..., int] = step_bytes) -> Sizing:
    """The largest rank, micro-batch and precision that fit (see the module doc). `config`: the client's
    (its lora_r, train_batch_tokens and precision pin what is not 0 / 'auto'); `top_rank`: the largest
    rank to try; `fixed_rank`: the one rank the run takes (a run of one rank), 0 where it takes any up to
    top_rank; `extra_bytes`: what the client holds besides the step (its score cache). The base model
    comes back without a LoRA. `resident`: what the process holds (None: measured now). DoesNotFit where
    nothing fits. `measure_step`: what measures a step (step_bytes; a test's may be exact where real peaks vary by
    some percent from run to run)."""
    from services.client_agent.model.loading import pick_precision

    pinned = []
    if config.lora_r:
        ranks, pinned = [config.lora_r], pinned + [f"rank {config.lora_r}"]
    elif fixed_rank:
        ranks, pinned = [fixed_rank], pinned + [f"rank {fixed_rank} (the run's)"]
    else:
        ranks = ranks_from(top_rank)
    default_tokens = 1024 if device.type == "cpu" else 32768
    if config.train_batch_tokens:
        tokens, pinned = [config.train_batch_tokens], pinned + [f"{config.train_batch_tokens} tokens"]
    else:
        tokens = tokens_from(default_tokens)
    if config.precision != "auto":
        precisions, pinned = [config.precision], pinned + [config.precision]
    else:
        first = pick_precision("auto", base, device)
        precisions = [first] + (["bf16"] if first == "fp32" and device.type == "cpu" else [])
    longest = longest_sequence(base, width, config)
    if resident is None:
        resident = resident_after_forward(base, device)
    limit = limit_bytes or available_memory_bytes(device)
    tried: list[Candidate] = []  # what the search measured, in order (the smallest, which fits, is not listed)

    def measure(r: int, t: int, precision: str, peft) -> Candidate:
        c = Candidate.measured(r, t, precision, measure_step(peft, t, longest, precision, device), resident + extra_bytes)
        on_try(c)
        return c

    # The smallest setting first: where even it does not fit, nothing will, and the search ends at once.
    # It is also the search's last candidate, so the search below always ends at a setting that fits.
    with lora_on(base, config, ranks[-1], add_lora) as peft:
        least = measure(ranks[-1], tokens[-1], precisions[-1], peft)
    if least.need_bytes > limit:
        raise DoesNotFit(f"no setting fits this machine's memory limit of {limit / 1e6:.0f} MB (resident "
                         f"{resident / 1e6:.0f} MB): the smallest, {least.describe()}; give more memory "
                         "(--memory-limit-mb), a smaller model, or pin a smaller --train-batch-tokens")
    for precision in precisions:
        for r in ranks:
            with lora_on(base, config, r, add_lora) as peft:
                for t in tokens:
                    if (r, t, precision) == (least.lora_r, least.batch_tokens, least.precision):
                        return Sizing(least, limit, resident, tuple(tried), tuple(pinned))
                    c = measure(r, t, precision, peft)
                    tried.append(c)
                    if c.need_bytes <= limit:
                        return Sizing(c, limit, resident, tuple(tried), tuple(pinned))
    raise AssertionError("unreachable: the search ends at the smallest setting, which fits")


# ---- the model's advice --------------------------------------------------------------------------

def alternatives(base, config, s: Sizing, device: torch.device, width: int, extra_bytes: int = 0,
                 fixed_rank: int = 0, add_lora: Callable | None = None) -> list[Candidate]:
    """The options a model may choose among: the tools' choice, then each smaller rank (unless the rank is
    pinned, or `fixed_rank` is the run's one rank) and half the micro-batch (unless pinned), each
    measured and kept where it fits."""
    c = s.chosen
    wanted = [] if config.lora_r or fixed_rank else [(r, c.batch_tokens) for r in ranks_from(c.lora_r)[1:]]
    if not config.train_batch_tokens and c.batch_tokens // 2 >= MIN_BATCH_TOKENS:
        wanted.append((c.lora_r, c.batch_tokens // 2))
    options = [c]
    for r, t in wanted:
        with lora_on(base, config, r, add_lora) as peft:
            step = step_bytes(peft, t, longest_sequence(base, width, config), c.precision, device)
        option = Candidate.measured(r, t, c.precision, step, s.resident_bytes + extra_bytes)
        if option.need_bytes <= s.limit_bytes:
            options.append(option)
    return options


def prompt(s: Sizing, options: list[Candidate], notes: str) -> str:
    """The question: the machine, the options measured to fit, the organisation's wishes, the answer's form."""
    listed = [{"option": i, "lora_rank": c.lora_r, "micro_batch_tokens": c.batch_tokens, "precision": c.precision,
               "needs_mb": round(c.need_bytes / 1e6)} for i, c in enumerate(options)]
    return ("You size the training of a federated learning client on this machine. A larger LoRA rank learns "
            "more; a larger micro-batch trains faster; both need memory. Memory: {limit} MB, {resident} MB of it "
            "already in use. The organisation says: {notes}\nOptions that fit: {options}\nAnswer with one JSON "
            'object and nothing else: {{"option": number, "reason": "one sentence"}}\nAnswer: ').format(
                limit=round(s.limit_bytes / 1e6), resident=round(s.resident_bytes / 1e6),
                notes=json.dumps(notes or "nothing more"), options=json.dumps(listed, separators=(",", ":")))


def check_advice(answer: str, options: list[Candidate]) -> tuple[Candidate, str]:
    """(the option chosen, the reason) from the model's answer; AnswerError saying what is wrong."""
    value = json_object(answer)
    index = value.get("option")
    if isinstance(index, bool) or not isinstance(index, int):
        raise AnswerError('"option" is not a number')
    if not 0 <= index < len(options):
        raise AnswerError(f'"option" {index} is not one of the {len(options)} options measured to fit')
    reason = value.get("reason", "")
    return options[index], (reason if isinstance(reason, str) else json.dumps(reason))[:200]


def advise(s: Sizing, options: list[Candidate], answer: Callable[[str], str], notes: str = "") -> Sizing:
    """The sizing with the model's choice among `options` where its answer passes the check; else the
    tools' choice, with why (Sizing.fallback)."""
    try:
        text = answer(prompt(s, options, notes))
    except Exception as exc:  # noqa: BLE001 - a model that cannot run leaves the tools' choice
        return dataclasses.replace(s, fallback=f"the model could not answer: {str(exc)[:200]}")
    try:
        chosen, why = check_advice(text, options)
    except AnswerError as exc:
        return dataclasses.replace(s, fallback=f"{exc}; it answered {' '.join(text.split())[:120]!r}")
    return dataclasses.replace(s, chosen=chosen, advice=f"{chosen.describe()}: {why}")


# ---- the privacy budget --------------------------------------------------------------------------

def save_sizing(path: pathlib.Path, s: Sizing, context: dict) -> None:
    """Keeps the choice in the state directory, with what it was made for (`context`: the base model and
    the run's ranks), so that a restarted client joins again with the rank its uploads have."""
    atomic_write(path, json.dumps({"context": context, "chosen": dataclasses.asdict(s.chosen),
                                   "limit_bytes": s.limit_bytes, "resident_bytes": s.resident_bytes,
                                   "pinned": list(s.pinned), "advice": s.advice, "fallback": s.fallback}).encode())


def load_sizing(path: pathlib.Path, context: dict) -> Sizing | None:
    """The choice kept for the same `context`, or None (none kept, another context, or unreadable)."""
    try:
        saved = json.loads(path.read_text())
        if saved["context"] != context:
            return None
        chosen = Candidate(**saved["chosen"])
        return Sizing(chosen, int(saved["limit_bytes"]), int(saved["resident_bytes"]), (),
                      tuple(saved["pinned"]), str(saved.get("advice", "")), str(saved.get("fallback", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def log_sizing(s: Sizing) -> None:
    log.info("guardian sized the work", extra=log_fields(
        lora_r=s.chosen.lora_r, train_batch_tokens=s.chosen.batch_tokens, precision=s.chosen.precision,
        need_mb=round(s.chosen.need_bytes / 1e6), limit_mb=round(s.limit_bytes / 1e6), tried=len(s.tried),
        reason=s.reason()))

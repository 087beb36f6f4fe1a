"""Asking a language model for a JSON answer that must parse: constrained decoding, under a deadline.

A small model (SmolLM2-135M) asked for JSON seldom writes it (the aggregator's selector measured 0 valid
answers of 27). `BoundedAsker` masks, at each step, every token that would leave the answer's JSON
schema (lm-format-enforcer's `TokenEnforcer` over its `JsonSchemaParser`), so what comes back parses
and has the schema's form whatever the model; what the answer says is still the caller's to check.

It loads the model once (`load`, at the caller's start, so that a model that cannot load is found
then), and `answer` runs the whole call (a load not done yet, the prompt's prefill, the generation) in
a worker thread that it waits for at most `max_seconds`: past that it raises AnswerError and tells the
worker to stop at its next token. One generation runs at a time (a worker still stopping holds the
next one up, within that one's deadline).

lm-format-enforcer's own transformers integration imports a module transformers 5 no longer has, so
the few lines that join its token enforcer to `generate` are here (a LogitsProcessor).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from fedse.agents.asking import AnswerError

ALPHABET = "".join(chr(c) for c in range(32, 127))  # what the constrained answer's strings may hold


class BoundedAsker:
    def __init__(self, name: str, max_new_tokens: int = 96, max_seconds: float = 10.0,
                 constrained: bool = True) -> None:
        if not isinstance(max_new_tokens, int) or not 8 <= max_new_tokens <= 1024:
            raise ValueError(f"max_new_tokens must be an integer from 8 to 1024, got {max_new_tokens!r}")
        if isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float)) or not 0 < max_seconds <= 600:
            raise ValueError(f"max_seconds must be a number of seconds in (0, 600], got {max_seconds!r}")
        self.name, self.max_new_tokens, self.max_seconds = name, max_new_tokens, float(max_seconds)
        self.constrained = constrained
        self._loaded: tuple[Any, Any, Any] | None = None  # model, tokenizer, lm-format-enforcer's tokenizer data
        self._lock = threading.Lock()  # one load, one generation at a time

    @property
    def loaded(self) -> bool:
        return self._loaded is not None

    def load(self) -> None:
        """Loads the model (once) on the CPU, and what constraining its tokens needs."""
        with self._lock:
            self._load_locked()

    def _load_locked(self) -> tuple[Any, Any, Any]:
        if self._loaded is None:
            from fedse.model.pretrained import load_base

            model, tokenizer = load_base(self.name, "cpu")
            self._loaded = (model, tokenizer, tokenizer_data(tokenizer) if self.constrained else None)
        return self._loaded

    def answer(self, prompt: str, schema: dict[str, Any] | None = None, budget: int = 0) -> str:
        """The model's greedy answer to `prompt`, held to the JSON `schema` where one is given and the asker
        is constrained; `budget` more new tokens than max_new_tokens (a long list of ids). AnswerError
        when the whole call takes more than max_seconds."""
        box: dict[str, Any] = {}
        stop = threading.Event()
        deadline = time.monotonic() + self.max_seconds

        def work() -> None:
            try:
                box["text"] = self._generate(prompt, schema, budget, stop, deadline)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = exc

        worker = threading.Thread(target=work, name="bounded-asker", daemon=True)
        worker.start()
        worker.join(self.max_seconds)
        if worker.is_alive():
            stop.set()
            raise AnswerError(f"no answer within {self.max_seconds:g} s (the model's load, the prompt and the "
                              "answer together)")
        if "error" in box:
            raise box["error"]
        return box["text"]

    def _generate(self, prompt: str, schema: dict[str, Any] | None, budget: int, stop: threading.Event,
                  deadline: float) -> str:
        import torch
        from transformers import LogitsProcessorList, StoppingCriteriaList

        with self._lock:
            model, tokenizer, data = self._load_locked()
            if stop.is_set() or time.monotonic() >= deadline:
                return ""
            text = prompt
            if getattr(tokenizer, "chat_template", None):
                text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                     add_generation_prompt=True)
            ids = tokenizer(text, return_tensors="pt")
            processors = LogitsProcessorList()
            if schema is not None and data is not None:
                processors.append(_Enforce(data, schema, ids["input_ids"].shape[1]))
            with torch.no_grad():
                out = model.generate(**ids, max_new_tokens=self.max_new_tokens + max(0, budget), do_sample=False,
                                     max_time=max(0.01, deadline - time.monotonic()), logits_processor=processors,
                                     stopping_criteria=StoppingCriteriaList([_Stopped(stop)]),
                                     pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def tokenizer_data(tokenizer: Any) -> Any:
    """lm-format-enforcer's view of `tokenizer`'s vocabulary (each regular token's text, and whether it
    starts a word), as its transformers integration builds it; built once per model."""
    from lmformatenforcer import TokenEnforcerTokenizerData

    special = set(tokenizer.all_special_ids)
    zero = tokenizer.encode("0", add_special_tokens=False)[-1]
    regular = []
    for i in range(len(tokenizer)):
        if i in special:
            continue
        after_zero = tokenizer.decode([zero, i])[1:]  # a word-start token decodes with its space after a "0"
        if not after_zero or "\ufffd" in after_zero or any(c < " " or c == "\x7f" for c in after_zero):
            # A part of a character (a byte of UTF-8), which the enforcer would take for "nothing", allowed
            # anywhere; or a control character (newlines, tabs too: a one-line answer needs none).
            continue
        regular.append((i, after_zero, len(after_zero) > len(tokenizer.decode([i]))))
    eos = tokenizer.eos_token_id
    return TokenEnforcerTokenizerData(regular, lambda tokens: tokenizer.decode(tokens).rstrip("\ufffd"), eos,
                                      False, len(tokenizer))


class _Enforce:
    """A LogitsProcessor: every token that would leave the JSON schema gets -inf (the enforcer takes the
    first sequence it is shown for the prompt, and parses what follows it)."""

    def __init__(self, data: Any, schema: dict[str, Any], prompt_tokens: int) -> None:
        from lmformatenforcer import CharacterLevelParserConfig, JsonSchemaParser, TokenEnforcer

        # Printable ASCII, one space at most between tokens of the JSON, fields in the schema's order: a
        # model gets no room to spend its tokens on whitespace or control characters JSON refuses.
        config = CharacterLevelParserConfig(alphabet=ALPHABET, max_consecutive_whitespaces=1,
                                            force_json_field_order=True)
        self.enforcer = TokenEnforcer(data, JsonSchemaParser(schema, config=config))
        # The enforcer's cache of allowed tokens does not keep the count of spaces in a row, so it lets a model
        # write spaces until its tokens run out: no blank token after another one, here.
        self.blank = {i for i, text, _ in data.regular_tokens if not text.strip()}
        self.prompt_tokens = prompt_tokens

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        mask = torch.full_like(scores, float("-inf"))
        for row, seq in enumerate(input_ids.tolist()):
            allowed = self.enforcer.get_allowed_tokens(seq).allowed_tokens
            if len(seq) > self.prompt_tokens and seq[-1] in self.blank:
                allowed = [t for t in allowed if t not in self.blank] or allowed
            mask[row, [t for t in allowed if t < scores.shape[1]]] = 0.0
        return scores + mask


class _Stopped:
    """A StoppingCriteria: stops the generation once the caller gave up on it (its deadline passed)."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        return torch.full((input_ids.shape[0],), self.stop.is_set(), dtype=torch.bool)

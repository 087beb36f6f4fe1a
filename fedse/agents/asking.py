"""Asking a language model for a decision: the agents that run a federation (the aggregator's selector,
the client's guardian) put a question as text and read one JSON object back.

`Asker` loads the model once (the embedded tiny model or a local Hugging Face directory, on the CPU),
answers greedily, in the model's chat template where it has one, and cuts the answer off after
`max_seconds`. `json_object` finds the answer's first JSON object. What the object may say is the
caller's to check: an answer is never acted on unchecked.
"""

from __future__ import annotations

import json
import threading
from typing import Any


class AnswerError(ValueError):
    """A model's answer that cannot be used; the text says why."""


class Asker:
    def __init__(self, max_new_tokens: int = 96, max_seconds: float = 10.0) -> None:
        if not isinstance(max_new_tokens, int) or not 8 <= max_new_tokens <= 1024:
            raise ValueError(f"max_new_tokens must be an integer from 8 to 1024, got {max_new_tokens!r}")
        if isinstance(max_seconds, bool) or not isinstance(max_seconds, (int, float)) or not 0 < max_seconds <= 600:
            raise ValueError(f"max_seconds must be a number of seconds in (0, 600], got {max_seconds!r}")
        self.max_new_tokens, self.max_seconds = max_new_tokens, float(max_seconds)
        self._loaded: tuple[str, Any, Any] | None = None
        self._lock = threading.Lock()

    def answer(self, name: str, prompt: str) -> str:
        """Model `name`'s greedy answer to `prompt` (loaded once, on the CPU)."""
        import torch

        from fedse.model.pretrained import load_base

        with self._lock:
            if self._loaded is None or self._loaded[0] != name:
                model, tokenizer = load_base(name, "cpu")
                self._loaded = (name, model, tokenizer)
            _, model, tokenizer = self._loaded
        text = prompt
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=self.max_new_tokens, do_sample=False, max_time=self.max_seconds,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def json_object(answer: str, limit: int = 4096) -> dict:
    """The first JSON object in `answer` (its first `limit` characters); AnswerError if there is none."""
    text = answer[:limit]
    start = text.find("{")
    if start < 0:
        raise AnswerError("no JSON object in the answer")
    try:
        value, _ = json.JSONDecoder().raw_decode(text[start:])
    except ValueError as exc:
        raise AnswerError(f"the answer's JSON does not parse ({exc.msg})") from None
    if not isinstance(value, dict):
        raise AnswerError("the answer is not a JSON object")
    return value

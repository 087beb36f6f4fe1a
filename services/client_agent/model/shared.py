"""The model a client agent plays and trains with, apart from the agent (`SharedModel`): the frozen base
model with its LoRA wrapper, tokenizer, device, precision, prompt window, tokenizer cache and prompt
formats. A client agent builds its own; a client host (services.client_host) builds one and lends it
to each of its members in turn.

The LoRA weights in the model are whichever member used it last, so a member takes the model for
the whole span in which it relies on them (`use`: from loading the global adapter to its trained
adapter saved) and, where another member held it since, loads the global adapter again and forgets
what it cached under the other's weights (the agent's `model_use`). A lone agent is the only holder:
its model never changes hands, and nothing is reloaded or forgotten."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from services.client_agent.config import ClientConfig
from services.client_agent.model import loading as mdl
from services.client_agent.playing.prompts import TokenCache, default_max_prompt_tokens, make_format


class SharedModel:
    """The base model with its LoRA (rank, alpha, dropout, targets and seed from `config`) and what is
    derived from it alone: device, precision (--precision, 'auto' measured once here), prompt window,
    tokenizer cache and the prompt formats (plain and ReAct)."""

    def __init__(self, config: ClientConfig, base, tokenizer):
        self.model = mdl.add_lora(base, r=config.lora_r, alpha=config.lora_alpha, dropout=config.lora_dropout,
                                  target_modules=config.lora_targets(), seed=config.seed)
        self.tokenizer = tokenizer
        self.device = next(self.model.parameters()).device
        self.precision = mdl.run_in(config.precision, self.model, self.device)
        self.max_prompt_tokens = default_max_prompt_tokens(self.model)
        # One tokenizer cache for the prompt format's window checks, the scorer and training: the
        # prompt a window check tokenized is the one the scorer then scores.
        self.tokenize = TokenCache(self.tokenizer)
        self.fmt = make_format(self.model, self.tokenizer, config.max_history, self.max_prompt_tokens, self.tokenize)
        # The format where the agent writes its own ReAct text (environments that list no actions).
        self.react_fmt = self.fmt.as_react()
        self._lock = threading.Lock()
        self._holder: object | None = None  # the last user of the model's LoRA weights
        # What the model's settings must be for a member to share it (a host's members all have these).
        self.settings = shared_settings(config)

    @classmethod
    def load(cls, config: ClientConfig) -> "SharedModel":
        """Loads --base-model and wraps it (what a client host does once for all its members)."""
        base, tokenizer = mdl.load_base(config.base_model, config.device or None, seed=config.seed)
        return cls(config, base, tokenizer)

    @contextlib.contextmanager
    def use(self, holder: object) -> Iterator[bool]:
        """Exclusive use of the model for `holder` within the block; yields whether another holder used it
        since `holder` last did (its LoRA weights and anything computed under them are then not
        `holder`'s). The first use by the first holder yields False."""
        with self._lock:
            changed = self._holder is not None and self._holder is not holder
            self._holder = holder
            yield changed


# The settings that make a model: members sharing one must agree on all of them.
MODEL_SETTINGS = ("base_model", "device", "seed", "lora_r", "lora_alpha", "lora_dropout", "target_modules",
                  "precision", "max_history")


def shared_settings(config: ClientConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in MODEL_SETTINGS}

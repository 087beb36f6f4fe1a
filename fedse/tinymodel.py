"""The embedded default base model: a tiny byte-level Llama built deterministically in code.

Every process that calls `build_tiny_model(seed)` with the same overrides gets bit-identical weights,
with no files and no downloads, so clients and the aggregator agree on the base model by name alone.
It is a stock `LlamaForCausalLM`, so peft (`get_peft_model`, `PeftModel.from_pretrained`) works
unchanged; the tokenizer is transformers' file-free byte-level `ByT5Tokenizer` (pad 0, eos 1, unk 2,
byte b is token b + 3).

Why these initial scales: with the usual initialisation (std 0.02, tied embeddings) the frozen output
layer keeps every logit within about +-2.6 (hidden size x std), so a LoRA on the linear layers cannot
make any next token likely and training stalls. Here the output head is untied and drawn with
std `head_std` (0.16), so a unit-RMS final hidden state can reach logits of about
hidden_size x head_std (~20) when LoRA aligns it with a row, while the untrained model's logits stay
moderate (std ~1.8). The linear layers use std `init_std` = 0.15: with 0.04-0.08 LoRA fits the
maze's easy cells but learns to read the position digits far more slowly (the cells that need them
stay wrong); 0.15 reads them within a few dozen steps. Embeddings are N(0, 1) (RMS-normed anyway).
4 layers x 128 wide (0.72 M parameters, 70 k in the r=8 LoRA) trains at ~55-60 examples/s of
~176 tokens on one CPU thread. Measurements: services/client_agent/MODEL_NOTES.md.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch
from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

TINY_MODEL_NAME = "fedse-tiny"

# Architecture and initialisation; any of these can be overridden in build_tiny_model(**overrides).
TINY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    # Initial scales (normal, mean 0): linear layers, token embeddings, output head.
    "init_std": 0.15,
    "embed_std": 1.0,
    "head_std": 0.16,
}

VOCAB_SIZE = 259  # ByT5Tokenizer(extra_ids=0): 3 special tokens + 256 bytes.
PAD_ID, EOS_ID = 0, 1


def build_tiny_tokenizer() -> ByT5Tokenizer:
    """The file-free byte-level tokenizer of the tiny model (pad 0, eos 1, byte b -> b + 3)."""
    return ByT5Tokenizer(extra_ids=0)


def tiny_settings(**overrides: Any) -> dict[str, Any]:
    """TINY_DEFAULTS with overrides applied; unknown names are an error."""
    unknown = set(overrides) - set(TINY_DEFAULTS)
    if unknown:
        raise TypeError(f"unknown tiny-model setting(s) {sorted(unknown)}: known are {sorted(TINY_DEFAULTS)}")
    return {**TINY_DEFAULTS, **overrides}


def tiny_config(**overrides: Any) -> LlamaConfig:
    """The LlamaConfig of the tiny model (architecture only; initial scales are not part of it)."""
    s = tiny_settings(**overrides)
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=s["hidden_size"],
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_hidden_layers"],
        num_attention_heads=s["num_attention_heads"],
        num_key_value_heads=s["num_key_value_heads"],
        max_position_embeddings=s["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": float(s["rope_theta"])},
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        rms_norm_eps=1e-6,
        use_cache=True,
    )
    cfg.name_or_path = TINY_MODEL_NAME
    return cfg


def build_tiny_model(seed: int = 0, **overrides: Any) -> tuple[LlamaForCausalLM, ByT5Tokenizer]:
    """(model, tokenizer): fp32 on CPU, eval mode, bit-identical for the same seed and overrides.

    Weights are drawn from a private torch.Generator in parameter-name order, so neither the global
    RNG state nor transformers' own init code affect them (and the global RNG is left untouched).
    """
    s = tiny_settings(**overrides)
    config = tiny_config(**overrides)
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name == "model.embed_tokens.weight":
                param.normal_(0.0, s["embed_std"], generator=gen)
            elif name == "lm_head.weight":
                param.normal_(0.0, s["head_std"], generator=gen)
            elif name.endswith(".weight") and param.dim() == 2:
                param.normal_(0.0, s["init_std"], generator=gen)
            else:  # pragma: no cover - Llama has no other parameters (no biases)
                raise RuntimeError(f"tiny model: no init rule for parameter {name}")
    model.eval()
    model.name_or_path = TINY_MODEL_NAME
    return model, build_tiny_tokenizer()


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over parameter names, shapes and fp32 bytes: two processes agree on a base model iff equal."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def tiny_config_json(seed: int = 0, **overrides: Any) -> str:
    """config.json text of the tiny model, plus how to rebuild it (`fedse_tiny`: seed and settings)."""
    d = tiny_config(**overrides).to_dict()
    d["_name_or_path"] = TINY_MODEL_NAME
    d["fedse_tiny"] = {"seed": int(seed), **tiny_settings(**overrides)}
    return json.dumps(d, indent=2, sort_keys=True)


def export_tiny_model(directory: str, seed: int = 0, **overrides: Any) -> str:
    """Writes the tiny model as a standard Hugging Face model directory (config.json, safetensors,
    tokenizer files), so tools without fedse can load it with AutoModelForCausalLM.from_pretrained
    and apply a fedse adapter with a stock PeftModel.from_pretrained. Returns the directory."""
    model, tokenizer = build_tiny_model(seed, **overrides)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        f.write(tiny_config_json(seed, **overrides))
    return directory

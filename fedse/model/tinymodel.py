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

A built-in copy circuit (`copy_circuit`): a random model cannot copy a word from its prompt into its
answer, and a LoRA learns that only slowly from examples, yet every environment but the Maze needs
it (BabyAI's goal "go to the red ball" -> "go to red ball 1", WebShop's "color: white" ->
"click[white]", TextCraft's goal -> its craft command). So beside the random part (`hidden_size`
wide, `num_attention_heads` heads) the residual stream has `COPY_DIMS` more dimensions, set by hand,
that hold an induction circuit, the mechanism pretrained transformers use to continue a repeated text:
- every token's embedding carries a code of the byte (case-folded, so "B09EE" matches "b09ee");
- layer 0's extra head attends to the previous position (its query and key are constant vectors,
  rotated so that RoPE's high frequencies make the score peak at an offset of one) and writes that
  position's code into a "previous byte" slot;
- layer 1's extra head matches the current byte's code against every position's "previous byte"
  (through RoPE's lowest frequencies only, which barely turn over a few hundred positions), so it
  attends to what followed earlier occurrences of the current byte, and writes their codes into an
  "output" slot;
- the output head reads that slot: the bytes that followed the current one earlier in the prompt
  get a logit boost.
The random part reads and writes only its own dimensions, so the circuit is exact in the untrained
model; the LoRA, on every linear layer, learns when to rely on it and where to look. Measured
in-process (services/client_agent/MODEL_NOTES.md): with the circuit on 4 layers BabyAI learned from
60 expert demonstrations to 25% held-out success by the second round and 50% by the third (without
it 0% and 20%; on the default 3 layers 10-15% by rounds 2-3), the Maze to 72-80% after the first
round (48%). In the 5-client federation of `fedse run` the Maze learns; BabyAI, scored calibrated,
solves 35% untrained and 40-45% after training (docs/results.md).
3 layers, 128 + 64 wide, 6 heads of 32 (0.99 M parameters, 69 k in the r=8 LoRA): 3 layers score
TextCraft's 19 candidates 1.2x as long as the 4 layers x 128 without the circuit did (4 layers with
it: 1.6x) and learn the Maze as well. Measurements: services/client_agent/MODEL_NOTES.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

import torch
from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

from fedse.model.names import TINY_MODEL_NAME


# Architecture and initialisation; any of these can be overridden in build_tiny_model(**overrides).
TINY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
    # High enough that RoPE's lowest frequencies barely turn over the prompt window (the copy
    # circuit matches bytes through them), with its highest left for finding the previous byte.
    "rope_theta": 1_000_000.0,
    # The hand-set induction circuit in COPY_DIMS extra residual dimensions (see above).
    "copy_circuit": True,
    # Initial scales (normal, mean 0): linear layers, token embeddings, output head.
    "init_std": 0.15,
    "embed_std": 1.0,
    "head_std": 0.16,
}

VOCAB_SIZE = 259  # ByT5Tokenizer(extra_ids=0): 3 special tokens + 256 bytes.
PAD_ID, EOS_ID = 0, 1

# The copy circuit's layout in the residual stream, after the random part's `hidden_size` dims:
# byte code, previous byte's code, copied bytes' codes (CODE_DIMS each), one constant dim.
COPY_DIMS = 64
CODE_DIMS = 18  # = 9 RoPE pairs of a 32-dim head, those of the lowest frequencies
POSITION_PAIRS = 6  # RoPE pairs (highest frequencies) that find the previous position
CODE_SEED = 12345
# Scales, set for the random part's residual growth (its RMS is ~6 at layer 1's input, ~10 at the
# output): a prompt byte's previous-position score ~50 (the next best offset ~10 lower), a byte
# match ~35 above a mismatch, and a copied byte's logit raised by ~4 nats when attention is sharp.
CONSTANT = 3.0
POSITION_SCALE = 50.0
MATCH_SCALE = 500.0
COPY_OUT = 10.0
COPY_LOGIT = 30.0


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
    copy = bool(s["copy_circuit"])
    if s["hidden_size"] % s["num_attention_heads"] or s["num_attention_heads"] != s["num_key_value_heads"]:
        raise ValueError("tiny model: hidden_size must be a multiple of num_attention_heads, and "
                         "num_key_value_heads equal to it")
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    if copy and (head_dim < 2 * (POSITION_PAIRS + CODE_DIMS // 2) or COPY_DIMS % head_dim
                 or s["num_hidden_layers"] < 2):
        raise ValueError(f"tiny model: the copy circuit needs heads of at least {2 * (POSITION_PAIRS + CODE_DIMS // 2)} "
                         f"dims that divide {COPY_DIMS}, and 2 layers; got {head_dim} and {s['num_hidden_layers']}")
    extra_heads = COPY_DIMS // head_dim if copy else 0
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=s["hidden_size"] + (COPY_DIMS if copy else 0),
        intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_hidden_layers"],
        num_attention_heads=s["num_attention_heads"] + extra_heads,
        num_key_value_heads=s["num_key_value_heads"] + extra_heads,
        head_dim=head_dim,
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
    width = s["hidden_size"]  # the random part's residual dims, and its heads' q/k/v rows
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            param.zero_()
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name == "model.embed_tokens.weight":
                param[:, :width].normal_(0.0, s["embed_std"], generator=gen)
            elif name == "lm_head.weight":
                param[:, :width].normal_(0.0, s["head_std"], generator=gen)
            elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
                param[:width, :width].normal_(0.0, s["init_std"], generator=gen)
            elif name.endswith("o_proj.weight"):
                param[:width, :width].normal_(0.0, s["init_std"], generator=gen)
            elif name.endswith(("gate_proj.weight", "up_proj.weight")):
                param[:, :width].normal_(0.0, s["init_std"], generator=gen)
            elif name.endswith("down_proj.weight"):
                param[:width, :].normal_(0.0, s["init_std"], generator=gen)
            else:  # pragma: no cover - Llama has no other parameters (no biases)
                raise RuntimeError(f"tiny model: no init rule for parameter {name}")
        if s["copy_circuit"]:
            _set_copy_circuit(model, width, s["num_attention_heads"], float(s["rope_theta"]))
    model.eval()
    model.name_or_path = TINY_MODEL_NAME
    return model, build_tiny_tokenizer()


def byte_codes() -> torch.Tensor:
    """[VOCAB_SIZE, CODE_DIMS]: the copy circuit's code of every token, each of norm sqrt(CODE_DIMS);
    an upper-case ASCII letter has its lower-case letter's code."""
    codes = torch.randn(VOCAB_SIZE, CODE_DIMS, generator=torch.Generator().manual_seed(CODE_SEED))
    codes = codes / codes.norm(dim=1, keepdim=True) * math.sqrt(CODE_DIMS)
    for upper in range(ord("A"), ord("Z") + 1):
        codes[upper + 3] = codes[upper + 32 + 3]  # token = byte + 3
    return codes


def _set_copy_circuit(model: LlamaForCausalLM, width: int, head: int, rope_theta: float) -> None:
    """Writes the induction circuit (module docstring) into the zeroed extra dims, through the first
    head after the random part's (`head`); the other extra heads stay zero until a LoRA uses them."""
    head_dim = model.config.head_dim
    half = head_dim // 2
    rows = slice(head * head_dim, (head + 1) * head_dim)
    code, prev, out, const = (width, width + CODE_DIMS, width + 2 * CODE_DIMS, width + 3 * CODE_DIMS)
    codes = byte_codes()
    model.model.embed_tokens.weight[:, code:code + CODE_DIMS] = codes
    model.model.embed_tokens.weight[:, const] = CONSTANT
    freqs = rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)

    # Layer 0: attend to the previous position. RoPE pairs dims (d, d + half) as a complex number
    # rotated by position x freq[d]; a key rotated one step ahead of the query scores
    # sum_d w_d cos(freq[d] (offset - 1)), highest at offset 1 (w_d falls with d: see POSITION_SCALE).
    attn = model.model.layers[0].self_attn
    q, k = attn.q_proj.weight[rows], attn.k_proj.weight[rows]
    for d in range(POSITION_PAIRS):
        r = math.sqrt(POSITION_SCALE / (1 + d) * math.sqrt(head_dim)) / CONSTANT
        q[d, const] = r
        k[d, const] = r * math.cos(freqs[d])
        k[d + half, const] = r * math.sin(freqs[d])
    for i in range(CODE_DIMS):
        attn.v_proj.weight[rows][i, code + i] = 1.0
        attn.o_proj.weight[prev + i, head * head_dim + i] = 1.0

    # Layer 1: the current byte's code against each position's previous byte, on the lowest
    # frequencies; the value is that position's byte, written to the output slot.
    attn = model.model.layers[1].self_attn
    low = list(range(half - CODE_DIMS // 2, half))
    dims = low + [d + half for d in low]
    scale = math.sqrt(MATCH_SCALE * math.sqrt(head_dim) / CODE_DIMS)
    for i, d in enumerate(dims):
        attn.q_proj.weight[rows][d, code + i] = scale
        attn.k_proj.weight[rows][d, prev + i] = scale
        attn.v_proj.weight[rows][i, code + i] = 1.0
        attn.o_proj.weight[out + i, head * head_dim + i] = COPY_OUT
    model.lm_head.weight[:, out:out + CODE_DIMS] = codes * (COPY_LOGIT / CODE_DIMS)


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

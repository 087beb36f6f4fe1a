"""The shapes of a Llama-2-7B LoRA adapter (r = 8 on every linear layer of every block), shared by
the benchmarks that move or aggregate adapters of a realistic size (32 layers in fp32: 80 MB)."""

from __future__ import annotations

RANK = 8
HIDDEN, INTERMEDIATE = 4096, 11008  # Llama-2-7B
MAX_LAYERS = 32
MODULES = {  # module -> (in_features, out_features)
    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, HIDDEN),
    "self_attn.v_proj": (HIDDEN, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
    "mlp.gate_proj": (HIDDEN, INTERMEDIATE), "mlp.up_proj": (HIDDEN, INTERMEDIATE),
    "mlp.down_proj": (INTERMEDIATE, HIDDEN),
}
BYTES_PER_LAYER = 4 * sum(RANK * (i + o) for i, o in MODULES.values())  # fp32


def schema(layers: int, rank: int = RANK) -> dict[str, tuple[int, int]]:
    """PEFT state-dict names -> shapes: lora_A is (r, in), lora_B is (out, r)."""
    out = {}
    for layer in range(layers):
        for module, (fan_in, fan_out) in MODULES.items():
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{prefix}.lora_A.weight"] = (rank, fan_in)
            out[f"{prefix}.lora_B.weight"] = (fan_out, rank)
    return out

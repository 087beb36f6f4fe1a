"""The model and its adapters: LoRA adapters on the wire (adapter), mixed LoRA ranks (ranks), the
embedded tiny model (tinymodel), real pretrained models installed offline (pretrained) and the
attention they run on (attention)."""

"""The client's model and its passes: loading the base model and the LoRA adapter (loading), how
forward passes are laid out over prompts and candidates (layouts, prefixes, kvcache) and the work
they do, counted in tokens and FLOPs (work)."""

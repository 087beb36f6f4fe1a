"""The client's model and its passes: loading the base model and the LoRA adapter (loading), how
forward passes are laid out over prompts and candidates (layouts, over the prompts prepared for
scoring and the runner of passes in passes; prefixes, kvcache) and the work they do, counted in
tokens and FLOPs (work)."""

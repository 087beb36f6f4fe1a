"""A model directory of another's shape and tokenizer, with random weights, for measuring speed.

The model's speed depends on its shape (layers, widths, heads, vocabulary) and the tokens it runs,
not on its weights' values: where a model's weights cannot be copied (a machine with no network and
a limit on what reaches it), this writes a stand-in from the directory's config.json and tokenizer
files alone, weights drawn by transformers' initialiser (seeded), in bf16. Its actions are random,
so its episodes run as long as the environments allow; tokens/s and MFU compare, success does not.

    .venv/bin/python bench/random_weights.py models/smollm2-135m-instruct /tmp/smollm2-shape
    make bench-model ARGS="--base-model /tmp/smollm2-shape"
"""

from __future__ import annotations

import argparse
import pathlib
import shutil

# What a model directory holds besides its weights and config (and fedse's marker, which names the
# weights' hash).
KEPT = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "chat_template.jinja")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="a Hugging Face model directory; its weights are not read")
    ap.add_argument("target", help="the directory to write")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source, target = pathlib.Path(args.source), pathlib.Path(args.target)
    config = AutoConfig.from_pretrained(source, local_files_only=True)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    for name in KEPT:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    print(f"{target}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters of "
          f"{source.name}'s shape, random (seed {args.seed}), bf16")


if __name__ == "__main__":
    main()

"""The embedded tiny model's name, where checking a --base-model must not import torch (tinymodel
builds the model; pretrained loads it, or a real model, by name)."""

TINY_MODEL_NAME = "fedse-tiny"

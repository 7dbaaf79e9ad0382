"""Load a Hugging Face safetensors checkpoint into a model, checking every tensor by name and shape.

Files are memory-mapped by safetensors; each tensor is copied once, straight into the (possibly fused)
parameter view the model declares for it, and cast to the serving dtype on the way. A linear stored quantized
(AWQ, GPTQ, compressed-tensors, FP8: engine/quantization/) is dequantized into that view once its tensors are read,
or, where the engine's kernels multiply 4- and 8-bit codes (`keep_codes`), kept as codes (quantization/kept.py).
Then the model's ops adapt the loaded weights to themselves (the CPU kernels' packed layout), once.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import safe_open

from qwenserve import progress
from qwenserve.engine.errors import CheckpointError
from qwenserve.engine.quantization import QuantizedLinears, quantization_of
from qwenserve.engine.quantization.kept import CodePacker, CodePlacer, codes_held
from qwenserve.engine.quantization.scheme import IntegerWeight
from qwenserve.models import ModelConfig, QwenForCausalLM

log = logging.getLogger("qwenserve.engine")

INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that carry no weights we need.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Elements sampled per tensor for the fingerprint: enough to tell two weight sets apart, cheap to read.
FINGERPRINT_SAMPLES = 64


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those named by the index file, else every *.safetensors."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{INDEX_FILE} names {f.name}, which is not in {folder}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {folder}")
    return files


def tensor_names(files: list[Path]) -> list[str]:
    """Every tensor name in the safetensors `files` (their headers only)."""
    names: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


def load_checkpoint(model: QwenForCausalLM, folder: str | Path, keep_codes: bool = False,
                    pack_codes: CodePacker | None = None) -> str:
    """Fill `model` from the checkpoint in `folder` and prepare its weights for its ops; returns the model
    fingerprint (hex). `keep_codes`: the model's ops multiply 4- and 8-bit codes (W4A16 / W8A16), so a checkpoint's
    4- and 8-bit linears stay codes where they can, packed by `pack_codes` (None: the CPU kernel's QuantWeight); the
    fingerprint is the same either way.

    Raises CheckpointError naming the tensor when one is missing, unexpected or of the wrong shape, and in one line
    when the checkpoint's quantization is not supported.
    """
    folder = Path(folder)
    targets = model.checkpoint_targets()
    optional = model.optional_checkpoint_tensors()
    skipped_parts = model.skipped_checkpoint_prefixes()
    skipped: dict[str, int] = dict.fromkeys(skipped_parts, 0)
    seen: set[str] = set()
    samples: dict[str, bytes] = {}
    files = checkpoint_files(folder)
    in_memory = sum(dst.numel() * dst.element_size() for dst in targets.values())
    quantized = QuantizedLinears.find(quantization_of(model.cfg.raw), tensor_names(files), targets, keep_codes)
    placer = None
    if quantized is not None and quantized.keep_codes:
        placer = CodePlacer(model, targets) if pack_codes is None else CodePlacer(model, targets, pack_codes)
    dequantized_codes: set[str] = set()  # linears read as codes but dequantized after all
    with torch.inference_mode(), progress.step(f"loading weights from {folder}", total=len(targets),
                                               unit="tensors", total_bytes=in_memory) as step:

        def copy_in(name: str, tensor: torch.Tensor | IntegerWeight) -> None:
            dst = targets[name]
            stride = max(1, dst.numel() // FINGERPRINT_SAMPLES)
            if isinstance(tensor, IntegerWeight):  # codes: sampled as their dequantized values
                assert placer is not None
                sample = tensor.values_at(torch.arange(0, dst.numel(), stride)[:FINGERPRINT_SAMPLES])
                for part, weight in placer.take(name, tensor):
                    targets[part].copy_(weight.dequantize())
                    dequantized_codes.add(part)
            else:
                dst.copy_(tensor)
                sample = tensor.reshape(-1)[::stride][:FINGERPRINT_SAMPLES].float()
            samples[name] = sample.numpy().tobytes()
            seen.add(name)
            step.advance(1, dst.numel() * dst.element_size())

        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    if name.endswith(IGNORED_SUFFIXES) or (name in optional and name not in targets):
                        continue
                    part = next((p for p in skipped_parts if name.startswith(p)), None)
                    if part is not None:
                        skipped[part] += 1
                        continue
                    if quantized is not None and quantized.owns(name):
                        done = quantized.add(name, f.get_tensor(name), path.name)
                        if done is not None:  # the linear's last part: its dequantized weight
                            copy_in(*done)
                        continue
                    dst = targets.get(name)
                    if dst is None:
                        raise CheckpointError(
                            f"unexpected tensor {name!r} in {path.name}: the config.json "
                            f"({model.cfg.model_type}, {model.cfg.num_layers} layers) has no place for it",
                            name,
                        )
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != tuple(dst.shape):
                        raise CheckpointError(
                            f"tensor {name!r} in {path.name} has shape {list(shape)} but config.json implies "
                            f"{list(dst.shape)}",
                            name,
                        )
                    copy_in(name, f.get_tensor(name))
    for part, count in skipped.items():
        if count:
            log.info("skipped %d checkpoint tensors under %s: %s", count, part, skipped_parts[part])
    missing = sorted(set(targets) - seen)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"tensor {missing[0]!r}{more} is missing from the checkpoint in {folder}", missing[0])
    if quantized is not None:
        if placer is not None:
            with torch.inference_mode():
                for part, weight in placer.finish():
                    targets[part].copy_(weight.dequantize())
                    dequantized_codes.add(part)
        _log_quantized(model, files, targets, quantized, placer, len(dequantized_codes), in_memory)
    fingerprint = model_fingerprint(model.cfg, {n: tuple(t.shape) for n, t in targets.items()}, samples)
    model.ops.prepare(model)  # a progress step where it changes anything: it says how many
    return fingerprint


def _log_quantized(model: QwenForCausalLM, files: list[Path], targets: dict[str, torch.Tensor],
                   quantized: QuantizedLinears, placer: CodePlacer | None, dequantized_codes: int, in_memory: int) -> None:
    """One line: the format, how many linears were kept as codes or dequantized, and what the weights take."""
    dtype = str(next(iter(targets.values())).dtype).removeprefix("torch.")
    on_disk = sum(p.stat().st_size for p in files) / 2**30
    if placer is not None and placer.replaced:
        codes = sum(w.nbytes for w in codes_held(model))
        plain = sum(p.nbytes for p in model.parameters())
        log.info("quantized checkpoint, %s: %d linear weights kept as %d-bit codes in %d parameters for the W%dA16 "
                 "kernels (%.2f GiB), %d dequantized to %s; the weights take %.2f GiB in memory (%.2f GiB on disk)",
                 quantized.quant.describe(), len(quantized) - dequantized_codes, quantized.quant.bits,
                 placer.replaced, quantized.quant.bits, codes / 2**30, dequantized_codes, dtype,
                 (codes + plain) / 2**30, on_disk)
    else:
        log.info("quantized checkpoint, %s: %d linear weights dequantized to %s at load; the weights take %.2f GiB "
                 "in memory (%.2f GiB on disk)", quantized.quant.describe(), len(quantized), dtype, in_memory / 2**30,
                 on_disk)


def architecture_fingerprint(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> str:
    """Hash of the normalised config (less where its tensors sit in the file) and the model's tensor names and
    shapes, without their values: a model's bf16 checkpoint and its AWQ/GPTQ/compressed-tensors ones share it (the
    model's tensors are the dequantized linears, whatever the file stores)."""
    h = hashlib.sha256(b"architecture\0")
    config = {k: v for k, v in asdict(cfg).items() if k not in ("raw", "weight_prefix")}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name in sorted(shapes):
        h.update(f"{name}:{tuple(shapes[name])}".encode())
    return h.hexdigest()[:32]


def model_fingerprint(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], samples: dict[str, bytes]) -> str:
    """Hash of the normalised config, tensor names and shapes, and a sample of every tensor's values."""
    h = hashlib.sha256()
    config = {k: v for k, v in asdict(cfg).items() if k != "raw"}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name in sorted(shapes):
        h.update(f"{name}:{shapes[name]}".encode())
        h.update(samples.get(name, b""))
    return h.hexdigest()[:32]


def embedded_by_codes(fingerprint: str, cfg: ModelConfig, lm_head_codes: str | None) -> str:
    """The KV fingerprint of a model whose tied embedding table is read from its LM head's codes (`lm_head_codes`,
    e.g. 'w8a16': --quantize-lm-head): its prompts' KV comes from other embeddings than the checkpoint's, so a peer
    serving the plain table must not take it for its own. An untied head or a plain one changes no KV."""
    if not lm_head_codes or not cfg.tie_word_embeddings:
        return fingerprint
    return hashlib.sha256(f"{fingerprint}+embeddings={lm_head_codes}".encode()).hexdigest()[:32]

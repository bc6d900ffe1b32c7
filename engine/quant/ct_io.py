"""compressed-tensors ``nvfp4-pack-quantized`` checkpoints, both ways.

Export turns a Hugging Face safetensors checkpoint (Llama, Qwen2, Qwen3) into the NVFP4A16
checkpoint llm-compressor would write: every decoder linear (q, k, v, o, gate, up, down)
as weight_packed / weight_scale / weight_global_scale, with one global scale for q/k/v and
one for gate/up (vLLM fuses them); embeddings, lm_head, norms and biases stay bf16.
transformers (with compressed-tensors installed) and vLLM load the result as is, and it is
the very base qerl trains on: weights are cast to bf16 before quantizing, as the trainer does.

Import reads such a checkpoint (ours or llm-compressor's) back into NVFP4Linear modules.
"""
from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.quant.nvfp4 import BLOCK, NVFP4Linear, global_scale_for, quantize_nvfp4

FORMAT = "nvfp4-pack-quantized"
CT_VERSION = "0.20.1"  # the compressed-tensors release whose config layout this mirrors
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
MAX_SHARD_BYTES = 5 * 2**30
QUANTIZED_WEIGHT = re.compile(r"^(.*\.layers\.\d+\.(?:self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj))\.weight$")
_FUSED = re.compile(r"^(.*\.layers\.\d+)\.(?:self_attn\.([qkv])_proj|mlp\.(gate|up)_proj)$")
_COPIED_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


def quantization_config() -> dict:
    """The NVFP4A16 ``quantization_config`` exactly as compressed-tensors serializes it."""
    weights = {
        "dynamic": False,
        "group_size": BLOCK,
        "num_bits": 4,
        "scale_dtype": "torch.float8_e4m3fn",
        "strategy": "tensor_group",
        "symmetric": True,
        "type": "float",
    }
    group = {"format": FORMAT, "input_activations": None, "output_activations": None,
             "targets": ["Linear"], "weights": weights}
    return {
        "config_groups": {"group_0": group},
        "format": FORMAT,
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": CT_VERSION,
    }


def shared_scale_groups(module_names: Iterable[str]) -> list[list[str]]:
    """Group decoder linears that share one global scale: [q, k, v] and [gate, up] of each
    layer; every other linear stands alone. Order follows the input."""
    groups: dict[str, list[str]] = {}
    for name in module_names:
        m = _FUSED.match(name)
        key = f"{m.group(1)}/{'qkv' if m.group(2) else 'gate_up'}" if m else name
        groups.setdefault(key, []).append(name)
    return list(groups.values())


# -- reading -------------------------------------------------------------------------------
def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> safetensors file of a (possibly sharded) checkpoint."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors files; give a Hugging Face safetensors checkpoint dir")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(f, framework="pt") as h:
            out.update((k, f) for k in h.keys())
    return out


class _Reader:
    """Lazy tensor access over the files of one checkpoint."""

    def __init__(self, model_dir: Path) -> None:
        self.files = _tensor_files(model_dir)
        self._handles: dict[Path, object] = {}

    def _handle(self, name: str):
        f = self.files[name]
        if f not in self._handles:
            self._handles[f] = safe_open(f, framework="pt")
        return self._handles[f]

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)


def _read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.exists():
        raise ValueError(f"{model_dir} has no config.json; give a Hugging Face model directory")
    return json.loads(path.read_text())


# -- writing -------------------------------------------------------------------------------
class _ShardWriter:
    """Writes tensors into safetensors shards of at most ``max_bytes`` (plus an index)."""

    def __init__(self, out_dir: Path, max_bytes: int) -> None:
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.detach().to("cpu").contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        save_file(self.pending, str(self.out_dir / f"shard-{len(self.shards)}.tmp"), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.shards:
            self._flush()
        n = len(self.shards)
        if n == 1:
            (self.out_dir / "shard-0.tmp").rename(self.out_dir / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self.shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.out_dir / f"shard-{i}.tmp").rename(self.out_dir / fname)
            weight_map.update((name, fname) for name in names)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"output directory {out_dir} already exists and is not empty; choose a new path or remove it")


def export_compressed_tensors(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Write the NVFP4A16 compressed-tensors checkpoint of an HF checkpoint; returns out_dir.

    ``device`` is where quantization runs (one fused group at a time); ``dtype`` is the dtype
    weights are cast to before quantizing and that the unquantized tensors keep. The output
    appears atomically: it is built in a temporary sibling directory and renamed.
    """
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = _read_config(model_dir)
    if "quantization_config" in config:
        raise ValueError(f"{model_dir} is already quantized; export needs an unquantized bf16/fp16/fp32 checkpoint")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported for NVFP4 export; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    _check_out_dir(out_dir)
    reader = _Reader(model_dir)
    modules = [m.group(1) for name in sorted(reader.files) if (m := QUANTIZED_WEIGHT.match(name))]
    if not modules:
        raise ValueError(f"{model_dir} has no decoder linear weights (model.layers.N.self_attn.q_proj.weight, ...)")
    for module in modules:
        shape = reader.shape(f"{module}.weight")
        if len(shape) != 2 or shape[1] % BLOCK:
            raise ValueError(
                f"{module}.weight has shape {shape}; NVFP4 needs in_features divisible by {BLOCK}. "
                "This model cannot be exported to NVFP4; train it with quantization='bf16' or 'nf4'."
            )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        writer = _ShardWriter(tmp, max_shard_bytes)
        for group in shared_scale_groups(modules):
            weights = [reader.get(f"{m}.weight").to(device=device, dtype=dtype) for m in group]
            global_scale = global_scale_for(weights)
            for module, weight in zip(group, weights):
                packed, scale, gs = quantize_nvfp4(weight, global_scale)
                writer.add(f"{module}.weight_global_scale", gs)
                writer.add(f"{module}.weight_packed", packed)
                writer.add(f"{module}.weight_scale", scale)
            del weights
        quantized = {f"{m}.weight" for m in modules}
        for name in sorted(reader.files):
            if name not in quantized:
                t = reader.get(name)
                writer.add(name, t.to(dtype) if t.is_floating_point() else t)
        writer.close()

        dtype_key = next((k for k in ("dtype", "torch_dtype") if k in config), "dtype")
        config[dtype_key] = str(dtype).removeprefix("torch.")
        config["quantization_config"] = quantization_config()
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        for fname in _COPIED_FILES:
            if (model_dir / fname).is_file():
                shutil.copy2(model_dir / fname, tmp / fname)
        tmp.chmod(0o755)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# -- import --------------------------------------------------------------------------------
def _check_quantization_config(config: dict, model_dir: Path) -> dict:
    qc = config.get("quantization_config")
    if not qc or qc.get("quant_method") != "compressed-tensors":
        raise ValueError(
            f"{model_dir} is not a compressed-tensors checkpoint "
            "(config.json has no compressed-tensors quantization_config)"
        )
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError(f"{model_dir}: quantization_config has no config_groups")
    for name, group in groups.items():
        fmt = group.get("format") or qc.get("format")
        w = group.get("weights") or {}
        ok = (
            fmt == FORMAT
            and w.get("num_bits") == 4
            and w.get("type") == "float"
            and w.get("group_size") == BLOCK
            and w.get("symmetric", True)
        )
        if not ok:
            raise ValueError(
                f"{model_dir}: config group {name!r} is not NVFP4 ({FORMAT}, 4-bit float weights, "
                f"group_size {BLOCK}, symmetric); qerl reads only NVFP4 compressed-tensors checkpoints"
            )
    return qc


def load_compressed_tensors(
    model_dir: str | Path, *, device: str | torch.device = "cpu"
) -> tuple[dict, dict[str, NVFP4Linear | torch.Tensor]]:
    """Read an NVFP4 compressed-tensors checkpoint -> (config, {module name: NVFP4Linear,
    other tensor name: tensor}). A quantized module's bias goes into its NVFP4Linear.
    Activation-quantization tensors (NVFP4 W4A4 checkpoints) are dropped: qerl runs W4A16."""
    model_dir = Path(model_dir)
    config = _read_config(model_dir)
    _check_quantization_config(config, model_dir)
    reader = _Reader(model_dir)
    names = set(reader.files)
    out: dict[str, NVFP4Linear | torch.Tensor] = {}
    used: set[str] = set()
    for packed_name in sorted(n for n in names if n.endswith(".weight_packed")):
        module = packed_name.removesuffix(".weight_packed")
        if f"{module}.weight_zero_point" in names:
            raise ValueError(f"{module} has a weight_zero_point: asymmetric NVFP4 is not supported")
        parts = [f"{module}.{p}" for p in ("weight_packed", "weight_scale", "weight_global_scale")]
        missing = [p for p in parts if p not in names]
        if missing:
            raise ValueError(f"{model_dir}: {module} lacks {', '.join(missing)}")
        bias_name = f"{module}.bias"
        bias = reader.get(bias_name).to(device) if bias_name in names else None
        packed, scale, gs = (reader.get(p).to(device) for p in parts)
        out[module] = NVFP4Linear(packed, scale, gs, bias)
        used.update(parts + [bias_name, f"{module}.input_global_scale", f"{module}.input_scale"])
    if not out:
        raise ValueError(f"{model_dir} has no *.weight_packed tensors; it is not an {FORMAT} checkpoint")
    for name in sorted(names - used):
        out[name] = reader.get(name).to(device)
    return config, out


def quantize_cli(model: str, out_dir: str) -> Path:
    """``qerl quantize MODEL OUT_DIR``: MODEL is a local HF checkpoint dir. Quantizes on the
    GPU when there is one."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return export_compressed_tensors(Path(model), Path(out_dir), device=device)

"""The decoder (Llama / Qwen2 / Qwen3) with frozen quantized projections, and its loader."""
from engine.model.cache import KVCache
from engine.model.config import ModelConfig
from engine.model.decoder import CausalLM
from engine.model.layers import RMSNorm
from engine.model.load import compute_dtype, load_model, resolve_model_dir
from engine.model.tokenizer import eos_token_ids, load_tokenizer

__all__ = ["CausalLM", "KVCache", "ModelConfig", "RMSNorm", "compute_dtype", "load_model", "resolve_model_dir",
           "load_tokenizer", "eos_token_ids"]

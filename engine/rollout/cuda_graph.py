"""GPU rollouts: static KV cache, the decode step captured in a CUDA graph per batch bucket.

Same contract and sampling as engine.rollout.native.generate (prompts sorted by length,
sub-batches of ``max_batch``, left-padded prefill, sampler log-probs, eos / stop strings /
max_new_tokens / should_stop per sequence, one Completion per prompt in prompt order); what
changes is how a decode token is computed:

- one preallocated KV cache (layers, B_max, kv, S, D); a sub-batch of n rows uses rows [0, b)
  of it, b = the power-of-two bucket >= n. Finished rows keep their row until the live rows fit
  a smaller bucket; then the live rows are moved to the front and decoding continues there.
- the step reads its inputs from static buffers (tokens, positions, write column, key mask) and
  advances them itself, so a captured graph replays step after step; one graph per
  (bucket, attention length rounded up to ``len_bucket``). Sampling stays eager and on the
  GPU (one kernel after the draws on Hopper: sampler.FUSED); the host reads the sampled tokens
  once every ``sync_every`` steps (eos, stop strings, length, ``should_stop``), each window while
  the GPU runs the step after it, so the GPU does not wait for the host. Rows that end inside a
  window are sampled on to its end and the extra tokens dropped. Sampling with a CPU generator,
  the host reads every step (same generator use as the eager sampler).
- q/k/v and gate/up run as one GEMM each: NVFP4 weights repacked once into one fused kernel
  operand, whose row ranges become the members' only copy (NVFP4Linear.make_resident: the
  compressed-tensors buffers are dropped, training reads the same operand); bf16 weights become
  views into one concatenated tensor. The LoRA stays unmerged: its shrink (input @ the
  concatenated A's) is computed by the kernel that makes the input (residual + RMSNorm for q/k/v
  and gate/up, SiLU * up for down) or, for o and past one wave of blocks, in a launch of its own;
  for o on NVFP4 at one row (O_SHRINK_TASK_ROWS) by blocks of its own GEMM;
  its expand runs inside the group's epilogue kernel on the members' B's (scaling folded in; for
  o and down on NVFP4 at small batch, and gate/up at <= GU_EPILOGUE_ROWS, inside the GEMM). Both
  are refreshed from the live parameters at the start of every call, like the RMSNorm weights
  with their AQN noise (no re-quantization).
- the prompts are prefilled through the same groups and element-wise ops with one row per prompt
  token (``_prefill``, eager, in chunks of sequences): the same function as the model's forward
  with a cache, in a few launches per layer instead of the eager model's hundred-odd small ops.
  A small prefill (PREFILL_GRAPH_ROWS), which the host's launches would bound, replays a CUDA
  graph of its shape from the second time that shape comes.
- the element-wise work between GEMMs (bias and LoRA epilogues, residual add + RMSNorm,
  RoPE + cache write, SiLU * up) is one fused kernel per group on Hopper (fused_ops.CudaOps), or
  at one row of a wide model (FUSED_NORM_ROWS) the residual adds and RMSNorms run inside the NVFP4
  GEMMs around them;
  attention is one split-key kernel per layer (engine.rollout.attention), SDPA elsewhere.

On CPU (tests) the same code runs eagerly with TorchOps and dense fused weights.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.lora import LoRALinear
from engine.quant.base import FrozenLinear
from engine.rollout.attention import pick_attention
from engine.rollout.fused_ops import CudaOps, LoraTerm, TorchOps, pick_ops
from engine.rollout.batching import Rows, check_prompts, eos_ids, left_pad, sub_batches
from engine.rollout.params import Completion, SamplingParams
from engine.rollout.sampler import sample_next

log = logging.getLogger(__name__)

GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
          ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))


PREFILL_ROWS = 8192  # prompt tokens per prefill chunk
# A prefill of up to this many prompt tokens (rows) is host-bound when run eagerly (7B on H200,
# one prompt of 256 tokens: 48 ms on the host for 17 ms of kernels); from the second time a
# (prompts, length) shape comes, it replays a CUDA graph captured for that shape instead (at most
# PREFILL_GRAPHS shapes are kept, the least recently used dropped first).
PREFILL_GRAPH_ROWS = 1024
PREFILL_GRAPHS = 8
PREFILL_SEEN_MAX = 4096  # shapes remembered as seen once
PREFILL_KERNEL_SHRINK_ROWS = 64  # above: the prefill's LoRA shrinks as fp32 matmuls
_MATMUL_OPS = TorchOps()
# gate/up's LoRA expand goes into its NVFP4 GEMM's epilogue up to this many rows (the epilogue
# runs in the split-K column's last block, one thread per output: its r loads per output cost
# more latency than a launch from a few rows on); then SiLU * up and the down shrink are one launch.
GU_EPILOGUE_ROWS = 2
# q/k/v's bias and LoRA expand go into its NVFP4 GEMM's epilogue up to this many rows, leaving
# RoPE and the cache write to the epilogue kernel (7B batch 1: 3.00 -> 2.96 ms per step; at 8 rows,
# once the epilogue's loads went out in one round: 7B 3.13 -> 3.08, 32B 10.08 -> 9.92).
QKV_EPILOGUE_ROWS = 8
# With NVFP4 groups on the fused ops, up to FUSED_NORM_ROWS rows (at most 16, the small kernel's)
# and a hidden size of at least FUSED_NORM_MIN_HIDDEN, the residual add + RMSNorm + LoRA shrink
# between o and gate/up and between down and the next q/k/v run inside the two GEMMs (residual
# mode, then norm mode: nvfp4_gemm.RowNorm) instead of a kernel of their own. Measured on H200 (r=16,
# ms per step, off -> on, same run): 32B at one row 8.65 -> 8.35; but 7B at one row 2.43 -> 2.44 and
# at 8 rows 3.19 -> 3.23, 32B at 8 rows 10.16 -> 10.44: a GEMM that directly follows a GEMM starts
# cold (few of its blocks are resident before its predecessor ends), which costs about what the
# norm kernel did, except where that kernel splits its inputs over blocks (hidden > 4096) at one row.
FUSED_NORM_ROWS = 1
FUSED_NORM_MIN_HIDDEN = 4097
# Up to this many rows (at most 16), the LoRA shrink of o's input (from attention) is computed by
# tasks inside o's own NVFP4 GEMM launch (nvfp4_gemm.shrink_tasks) instead of a launch of its own.
# Measured on H200 (r=16, ms per step, off -> on, same run): 32B at one row 8.377 -> 8.189, 7B
# 2.385 -> 2.370; but at 8 rows 7B 2.957 -> 3.034 and 32B 9.920 -> 10.025: o's launch is short,
# and the tasks (one block per rank row over all of K) then hold its epilogue back.
O_SHRINK_TASK_ROWS = 1
# With the fused ops, a step's inputs (token embeddings, RoPE rows, the valid mask's new column)
# and its outputs (logits to fp32, positions and write column moved on) are one launch each
# instead of four and three small kernels.
STEP_KERNELS = True


def batch_bucket(n: int, cap: int) -> int:
    """The engine's batch for ``n`` sequences: the next power of two, at most ``cap``."""
    return min(cap, 1 << max(0, (n - 1).bit_length()))


@dataclass
class _Refresh:
    """The copies of one refresh, run as a few foreach ops instead of one launch (and one Python
    round) per tensor: the same values as copying each (B^T * scaling is taken in B's dtype, as
    the per-tensor copy did; norm weights are added to their noise in fp32)."""

    a_dst: list = field(default_factory=list)
    a_src: list = field(default_factory=list)
    b_dst: list = field(default_factory=list)
    b_src: list = field(default_factory=list)
    b_scale: list = field(default_factory=list)
    zero: list = field(default_factory=list)
    w_dst: list = field(default_factory=list)
    w_src: list = field(default_factory=list)
    noise_dst: list = field(default_factory=list)
    noise: list = field(default_factory=list)

    def run(self) -> None:
        if self.a_dst:
            torch._foreach_copy_(self.a_dst, self.a_src)
        if self.b_dst:
            torch._foreach_copy_(self.b_dst, torch._foreach_mul(self.b_src, self.b_scale))
        if self.zero:
            torch._foreach_zero_(self.zero)
        if self.w_dst:
            torch._foreach_copy_(self.w_dst, self.w_src)
        if self.noise_dst:
            torch._foreach_add_(self.noise_dst, self.noise)


class _Group:
    """One fused projection of one layer: base GEMM (no bias) + bias + LoRA delta."""

    def __init__(self, parent: nn.Module, names: tuple[str, ...], *, use_kernels: bool, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.members = [getattr(parent, n) for n in names]
        self.bases: list[FrozenLinear] = [m.base if isinstance(m, LoRALinear) else m for m in self.members]
        self.sizes = [b.out_features for b in self.bases]
        self.n, self.k = sum(self.sizes), self.bases[0].in_features
        fmts = {b.fmt for b in self.bases}
        self.mode, self.prepared, self.weight = "each", None, None
        if fmts == {"nvfp4"} and use_kernels and self._same_global_scale():
            self._fuse_nvfp4()
        elif fmts == {"bf16"}:
            self._fuse_dense_views()
        elif fmts == {"nvfp4"} and device.type == "cpu":
            self.mode = "dense"  # as native's CPU path: the base dequantized once (engine.rollout.dense)
            self.weight = torch.cat([b.dequantize(dtype) for b in self.bases])
        biases = [b.bias for b in self.bases]
        if all(x is None for x in biases):
            self.bias = None
        else:
            self.bias = torch.cat([x.to(dtype) if x is not None else torch.zeros(s, dtype=dtype, device=device)
                                   for x, s in zip(biases, self.sizes)])
        self.loras = [m if isinstance(m, LoRALinear) else None for m in self.members]
        self.ranks = [m.lora_A.shape[0] if m is not None else 0 for m in self.loras]
        self.lora = any(self.ranks)
        if self.lora:  # member m's A in rows [m*r, m*r + r_m) of a_cat, its B^T in b_pack's columns of its outputs
            self.r = max(self.ranks)
            self.a_cat = torch.zeros(len(self.members) * self.r, self.k, dtype=torch.float32, device=device)
            self.b_pack = torch.zeros(self.r, self.n, dtype=torch.float32, device=device)  # B^T's side by side
            edges = [sum(self.sizes[:i + 1]) for i in range(len(self.sizes))] + [2**31 - 1] * 2
            self.n1, self.n2 = edges[0], edges[1]

    def _same_global_scale(self) -> bool:
        g = [b.weight_global_scale for b in self.bases]
        return all(torch.equal(g[0], x) for x in g[1:])

    def _fuse_nvfp4(self) -> None:
        """One kernel operand for the group; it becomes the members' only copy of their weights.

        The members' operands are row ranges of the fused one when every member has a multiple
        of 64 rows (no padding rows between them): each member is then made resident on its
        range and its compressed-tensors buffers are dropped, so rollouts and training read one
        copy of the base. Otherwise the fused operand is a second copy, used by rollouts only."""
        from engine.kernels import PreparedNVFP4, prepare_tensors
        from engine.kernels.nvfp4_gemm import split_counters

        bs = self.bases
        if len(bs) == 1:
            bs[0].make_resident()
            self.prepared, self.mode = bs[0].resident, "nvfp4"
            return
        views = all(s % 64 == 0 for s in self.sizes)
        if views and all(b.resident is not None for b in bs):  # rebuilt engine: members already resident
            first = bs[0].resident
            fused = PreparedNVFP4(torch.cat([b.resident.wq for b in bs]), first.alpha,
                                  split_counters(self.n // 16, first.wq.device), self.n, self.k, first.alpha_value)
        else:
            sources = [b.source_buffers() for b in bs]
            packed = torch.cat([p for p, _ in sources])
            scale = torch.cat([s.view(torch.uint8) for _, s in sources]).view(torch.float8_e4m3fn)
            del sources
            fused = prepare_tensors(packed, scale, bs[0].weight_global_scale)
            del packed, scale
        self.prepared, self.mode = fused, "nvfp4"
        if views:
            row = 0
            for b, s in zip(bs, self.sizes):
                counters = split_counters(s // 16, fused.wq.device)
                b.make_resident(PreparedNVFP4(fused.wq[row // 16:(row + s) // 16], fused.alpha, counters, s, self.k,
                                              fused.alpha_value))
                row += s

    def _fuse_dense_views(self) -> None:
        if len(self.bases) == 1:
            self.weight, self.mode = self.bases[0].weight, "dense"
            return
        w = torch.cat([b.weight for b in self.bases])
        row = 0
        for b, s in zip(self.bases, self.sizes):
            b.weight = w[row:row + s]  # the member now reads the fused tensor: one copy
            row += s
        self.weight, self.mode = w, "dense"

    def refresh_lists(self, out: _Refresh) -> None:
        """Add the copies that bring the live LoRA weights in to ``out`` (scaling folded into B; a
        disabled adapter adds 0), to run batched with every other group's (``_Refresh.run``)."""
        if not self.lora:
            return
        n0 = 0
        for i, (m, r, s) in enumerate(zip(self.loras, self.ranks, self.sizes)):
            if m is not None:
                out.a_dst.append(self.a_cat[i * self.r:i * self.r + r])
                out.a_src.append(m.lora_A)
                blk = self.b_pack[:r, n0:n0 + s]
                if m.disabled:
                    out.zero.append(blk)
                else:
                    out.b_dst.append(blk)
                    out.b_src.append(m.lora_B.t())
                    out.b_scale.append(m.scaling)
            n0 += s

    def base(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, K) -> (B, N) without bias."""
        if self.mode == "nvfp4":
            from engine.kernels.nvfp4_gemm import matmul_2d

            return matmul_2d(x, self.prepared)
        if self.mode == "dense":
            return torch.matmul(x, self.weight.t())
        return torch.cat([b._matmul(x) for b in self.bases], dim=-1)

    @property
    def a(self) -> torch.Tensor | None:
        """The concatenated A's (the shrink's operand), None without LoRA."""
        return self.a_cat if self.lora else None

    def term(self, s: torch.Tensor | None) -> LoraTerm | None:
        """The LoRA term whose shrink (input @ A_cat^T) is s; its expand runs in the epilogue."""
        return None if s is None else LoraTerm(s, self.b_pack, self.r, self.n1, self.n2)

    def lora_term(self, ops, x: torch.Tensor) -> LoraTerm | None:  # noqa: ANN001 - TorchOps | CudaOps
        """The LoRA term of input x (B, K): its shrink now, its expand in the epilogue; or None."""
        return self.term(ops.lora_shrink(x, self.a_cat)) if self.lora else None


@dataclass
class _Layer:
    qkv: _Group
    o: _Group
    gu: _Group
    down: _Group
    w_in: torch.Tensor  # fp32 (H,): input_layernorm weight + AQN noise
    w_post: torch.Tensor
    norm_in: nn.Module
    norm_post: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None


@dataclass
class RolloutStats:
    """Timings of the last ``generate`` call (seconds; decode includes sampling)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    graphs_captured: int = 0
    ops: str = ""
    attention: str = ""
    graphs: bool = False
    extra: dict = field(default_factory=dict)


class GraphRollout:
    """The decode engine of one model. Build once (``engine_for``); ``generate`` per rollout."""

    def __init__(self, model: nn.Module, *, max_batch: int = 64, max_len: int = 2048, use_graphs: bool | None = None,
                 fused_ops: bool | None = None, len_bucket: int = 256, sync_every: int = 16) -> None:
        self.model = model
        cfg = model.config
        self.cfg, self.device, self.dtype = cfg, model.device, model.dtype
        self.max_batch, self.max_len, self.len_bucket = max_batch, max_len, len_bucket
        self.sync_every = max(1, sync_every)
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
        self.ops = pick_ops(self.device, self.dtype, qk_norm=cfg.qk_norm, head_dim=cfg.head_dim, fused=fused_ops,
                            hidden=cfg.hidden_size)
        self.attention = pick_attention(self.device, self.dtype, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                                        head_dim=cfg.head_dim, max_batch=max_batch)
        import engine.quant.nvfp4 as nvfp4

        use_kernels = False
        if nvfp4.use_kernels and self.device.type == "cuda":
            from engine.kernels import available

            use_kernels = available(torch.empty(1, 16, dtype=self.dtype, device=self.device))
        with torch.no_grad():
            self.layers = []
            for layer in model.model.layers:
                groups = [_Group(getattr(layer, p), names, use_kernels=use_kernels, device=self.device,
                                 dtype=self.dtype) for p, names in GROUPS]
                h = cfg.hidden_size
                self.layers.append(_Layer(*groups, w_in=torch.empty(h, dtype=torch.float32, device=self.device),
                                          w_post=torch.empty(h, dtype=torch.float32, device=self.device),
                                          norm_in=layer.input_layernorm, norm_post=layer.post_attention_layernorm,
                                          q_norm=layer.self_attn.q_norm, k_norm=layer.self_attn.k_norm))
            self.w_final = torch.empty(cfg.hidden_size, dtype=torch.float32, device=self.device)
            inv_freq = model.inv_freq.to(self.device)  # a non-persistent buffer: may be left on the CPU
            freqs = torch.arange(max_len, device=self.device)[:, None].float() * inv_freq  # (max_len, D/2)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.rope_cos, self.rope_sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)  # (max_len, D)
            shape = (cfg.num_layers, max_batch, cfg.num_kv_heads, max_len, cfg.head_dim)
            self.kc = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.vc = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.valid = torch.zeros(max_batch, max_len, dtype=torch.bool, device=self.device)
            self.pos = torch.zeros(max_batch, dtype=torch.long, device=self.device)
            self.tok = torch.zeros(max_batch, dtype=torch.long, device=self.device)
            self.slot = torch.zeros(1, dtype=torch.long, device=self.device)
            self.logits = torch.zeros(max_batch, cfg.vocab_size, dtype=torch.float32, device=self.device)
            # the task counters of the norm-mode launches (q/k/v and gate/up of each layer) and of
            # o's shrink tasks, zeroed every step that uses them
            self.norm_sync = torch.zeros(cfg.num_layers, 3, dtype=torch.int32, device=self.device)
        self._small: dict[tuple[int, str, int], bool] = {}
        self._fused_norm_ok = (isinstance(self.ops, CudaOps) and cfg.hidden_size % 16 == 0 and
                               cfg.hidden_size >= FUSED_NORM_MIN_HIDDEN and
                               all(g.mode == "nvfp4" for L in self.layers for g in (L.qkv, L.o, L.gu, L.down)))
        emb = model.model.embed_tokens
        # a step's input gathers and output copy as kernels of fused_decode.cu (STEP_KERNELS)
        self._step_kernels = (STEP_KERNELS and isinstance(self.ops, CudaOps) and type(emb) is nn.Embedding
                              and emb.weight.dtype == self.dtype and emb.weight.is_contiguous()
                              and emb.max_norm is None)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # prefill graphs by (prompts, length): (graph, ids, mask, logits), most recently used last;
        # their own pool, since a prefill's temporaries are much larger than a decode step's
        self.prefill_graphs: dict[tuple[int, int], tuple] = {}
        self._prefill_seen: set[tuple[int, int]] = set()
        self.prefill_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.prefill_graph_error = ""
        self.stats = RolloutStats(ops=self.ops.name, attention=self.attention.name, graphs=self.use_graphs)

    # -- refresh per call: LoRA weights, norm weights + AQN noise ----------------------------
    @staticmethod
    def _norm_weight(norm: nn.Module, out: torch.Tensor, r: _Refresh) -> None:
        r.w_dst.append(out)
        r.w_src.append(norm.weight)
        if getattr(norm, "noise", None) is not None:
            r.noise_dst.append(out)
            r.noise.append(norm.noise)

    def refresh(self) -> None:
        r = _Refresh()
        for L in self.layers:
            self._norm_weight(L.norm_in, L.w_in, r)
            self._norm_weight(L.norm_post, L.w_post, r)
            for g in (L.qkv, L.o, L.gu, L.down):
                g.refresh_lists(r)
        self._norm_weight(self.model.model.norm, self.w_final, r)
        with torch.no_grad():
            r.run()

    def _cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE cos and sin (rows, D) in the model dtype for positions (rows,), as the model computes
        them (rows of tables made once: two gathers per step instead of six element-wise kernels)."""
        return self.rope_cos.index_select(0, pos), self.rope_sin.index_select(0, pos)

    # -- one decode step over rows [0, b), attention over columns [0, s) ---------------------
    def _step(self, b: int, s: int) -> None:
        from engine.kernels.nvfp4_gemm import shrink_tasks

        cfg, ops = self.cfg, self.ops
        heads, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        if self._step_kernels:  # the three gathers and the fill below in one launch
            x, cos, sin = ops.step_inputs(self.tok[:b], self.pos[:b], self.slot, self.model.model.embed_tokens.weight,
                                          self.rope_cos, self.rope_sin, self.valid[:b])
        else:
            self.valid[:b].index_fill_(1, self.slot, True)
            cos, sin = self._cos_sin(self.pos[:b])  # (B, D)
            x = self.model.model.embed_tokens(self.tok[:b])  # (B, H)
        # The shrink (x @ A^T) of a LoRA term is computed by the kernel that makes x (norm, SiLU *
        # up) where there is one: s_qkv, s_gu, s_down; only o's input comes from attention (its
        # shrink in a launch of its own, or by tasks of o's GEMM launch: O_SHRINK_TASK_ROWS).
        x, h, s_qkv = ops.add_rmsnorm_shrink(x, None, None, None, self.layers[0].w_in, eps, self.layers[0].qkv.a)
        self.attention.begin_step(self.valid, b, heads // kvh, s, self.dtype)
        fused = self._fused_norm(b)
        o_tasks = self._o_tasks(b)
        if fused or o_tasks:
            self.norm_sync.zero_()
        hw = None  # with the fused norm: q/k/v's input x * w, its RMSNorm applied in its GEMM (else h)
        n = len(self.layers)
        for i, L in enumerate(self.layers):
            if hw is None:
                qkv = self._project(L.qkv, h, L.qkv.term(s_qkv), QKV_EPILOGUE_ROWS)
            else:
                qkv = self._project_norm(L.qkv, hw, x, self.norm_sync[i, 0:1], QKV_EPILOGUE_ROWS)
            q = ops.qkv_rope_cache(*qkv, cos, sin, self.kc[i], self.vc[i], self.slot, heads=heads, kv_heads=kvh, d=d,
                                   q_norm=L.q_norm, k_norm=L.k_norm)
            o = self.attention(q, self.kc[i], self.vc[i], self.valid, s, self.slot)  # (B, heads * D)
            if o_tasks:  # o's shrink by tasks of its own GEMM launch
                o_norm = shrink_tasks(b, L.o.a, self.norm_sync[i, 2:3])
                o_lora = L.o.term(o_norm.s)
            else:
                o_norm, o_lora = None, L.o.lora_term(ops, o)
            if fused:  # x += o's projection in its GEMM, whose output is gate/up's input x * w_post
                hw = self._project_residual(L.o, o, o_lora, x, L.w_post, norm=o_norm)
                gu = self._project_norm(L.gu, hw, x, self.norm_sync[i, 1:2], GU_EPILOGUE_ROWS)
            else:
                x, h, s_gu = ops.add_rmsnorm_shrink(x, *self._project(L.o, o, o_lora, norm=o_norm), L.w_post,
                                                    eps, L.gu.a)
                gu = self._project(L.gu, h, L.gu.term(s_gu), GU_EPILOGUE_ROWS)
            a, s_down = ops.silu_mul_shrink(*gu, L.down.a)
            nxt = self.layers[i + 1] if i + 1 < n else None
            if fused and nxt is not None:
                hw = self._project_residual(L.down, a, L.down.term(s_down), x, nxt.w_in)
            else:
                x, h, s_qkv = ops.add_rmsnorm_shrink(x, *self._project(L.down, a, L.down.term(s_down)),
                                                     nxt.w_in if nxt else self.w_final, eps,
                                                     nxt.qkv.a if nxt else None)
        if self._step_kernels:  # the copy to fp32 and the two increments in one launch
            ops.step_outputs(F.linear(h, self.model.lm_head.weight), self.logits, self.pos, self.slot)
        else:
            self.logits[:b].copy_(F.linear(h, self.model.lm_head.weight))
            self.pos[:b] += 1
            self.slot += 1

    # -- prefill: the prompt tokens of sequences [0, n) through the same fused groups ---------
    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Write the caches of rows [0, n) for the left-padded prompts ``ids`` / ``mask`` (n, T)
        and return the logits (n, V) of their last tokens. The same computation as the model's
        forward with a cache, through the engine's fused groups and element-wise ops (one GEMM
        per group, the LoRA and AQN weights as refreshed), with rows = tokens: a few launches per
        layer instead of the eager model's hundred-odd small ops. Sequences go in chunks of at
        most PREFILL_ROWS tokens (bounds activation memory and grid sizes)."""
        n, t = ids.shape
        m = mask.to(torch.bool)
        self.valid[:n, :t] = m
        pos = (torch.cumsum(m.long(), dim=1) - 1).clamp(min=0)  # (n, T), as KVCache.begin
        self.slot.zero_()
        per = max(1, PREFILL_ROWS // t)
        out = []
        for r0 in range(0, n, per):
            r1 = min(n, r0 + per)
            out.append(self._prefill_rows(ids[r0:r1], pos[r0:r1], r0))
        self.pos[:n].copy_(m.long().sum(dim=1))
        self.slot.fill_(t)
        return torch.cat(out)

    def _warm_up(self, fn: Callable, *args) -> None:
        """fn(*args) once on a side stream before it is captured: library handles and workspaces
        are made outside the capture."""
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            fn(*args)
        cur.wait_stream(side)

    def _run_prefill(self, ids: torch.Tensor, mask: torch.Tensor, *, capture: bool = False) -> torch.Tensor:
        """``_prefill``, replayed from a CUDA graph for small shapes seen before (PREFILL_GRAPH_ROWS;
        ``capture``: capture a graph for this shape now even if it is new)."""
        n, t = ids.shape
        key = (n, t)
        if not self.use_graphs or n * t > PREFILL_GRAPH_ROWS or self.prefill_graph_error:
            return self._prefill(ids, mask)
        entry = self.prefill_graphs.pop(key, None)
        if entry is None:
            if key not in self._prefill_seen and not capture:
                if len(self._prefill_seen) >= PREFILL_SEEN_MAX:  # a service that sees ever new lengths
                    self._prefill_seen.clear()
                self._prefill_seen.add(key)  # a shape seen once runs eagerly: no capture for one-off shapes
                return self._prefill(ids, mask)
            entry = self._capture_prefill(ids, mask, warm=key not in self._prefill_seen)
            self._prefill_seen.add(key)
            if entry is None:
                return self._prefill(ids, mask)
        self.prefill_graphs[key] = entry  # most recently used last
        while len(self.prefill_graphs) > PREFILL_GRAPHS:
            self.prefill_graphs.pop(next(iter(self.prefill_graphs)))
        graph, ids_s, mask_s, logits = entry
        ids_s.copy_(ids)
        mask_s.copy_(mask)
        graph.replay()
        return logits.clone()

    def _capture_prefill(self, ids: torch.Tensor, mask: torch.Tensor, *, warm: bool) -> tuple | None:
        """(graph, static ids, static mask, logits) of ``_prefill`` for this shape, or None where
        capture fails (the prefill then stays eager for every shape). Capturing runs nothing."""
        ids_s, mask_s = ids.clone(), mask.clone()
        if warm:  # a shape seen before has its library handles and workspaces
            self._warm_up(self._prefill, ids_s, mask_s)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.prefill_pool):
                logits = self._prefill(ids_s, mask_s)
        except RuntimeError as exc:
            log.warning("CUDA graph capture of the prefill failed, prefilling without graphs: %s", exc)
            self.prefill_graph_error = str(exc)[:500]
            self.stats.extra["prefill_graph_error"] = self.prefill_graph_error
            return None
        self.stats.graphs_captured += 1
        return graph, ids_s, mask_s, logits

    def _prefill_rows(self, ids: torch.Tensor, pos: torch.Tensor, r0: int) -> torch.Tensor:
        from engine.model.decoder import _mask
        from engine.model.layers import _attention

        cfg, ops = self.cfg, self.ops
        heads, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        n, t = ids.shape
        r1 = r0 + n
        cos, sin = self._cos_sin(pos.reshape(-1))  # (n*T, D)
        attn_mask = _mask(self.valid[r0:r1, :t], t, 0)  # (n, 1, T, T)
        shrink = ops if n * t <= PREFILL_KERNEL_SHRINK_ROWS else _MATMUL_OPS  # LoRA shrink: kernel or matmul
        eps = cfg.rms_norm_eps
        x = self.model.model.embed_tokens(ids.reshape(-1))  # (n*T, H)
        x, h = ops.add_rmsnorm(x, None, None, None, self.layers[0].w_in, eps)
        last = len(self.layers) - 1
        for i, L in enumerate(self.layers):
            kc, vc = self.kc[i, r0:r1], self.vc[i, r0:r1]
            q = ops.qkv_rope_cache(L.qkv.base(h), L.qkv.bias, L.qkv.lora_term(shrink, h), cos, sin, kc, vc, self.slot,
                                   heads=heads, kv_heads=kvh, d=d, q_norm=L.q_norm, k_norm=L.k_norm, seq=t)
            q, mq = q.view(n, t, heads, d).transpose(1, 2), attn_mask
            if i == last:  # only the last tokens feed the logits: the rest of the layer for them alone
                q, mq, x = q[:, :, -1:], attn_mask[:, :, -1:], x.view(n, t, -1)[:, -1].contiguous()
            o = _attention(q, kc[:, :, :t], vc[:, :, :t], mq)  # (n, heads, T or 1, D)
            o = o.transpose(1, 2).reshape(x.shape[0], heads * d)
            x, h = ops.add_rmsnorm(x, L.o.base(o), L.o.bias, L.o.lora_term(shrink, o), L.w_post, eps)
            a = ops.silu_mul(L.gu.base(h), L.gu.bias, L.gu.lora_term(shrink, h))
            w_next = self.layers[i + 1].w_in if i < last else self.w_final
            x, h = ops.add_rmsnorm(x, L.down.base(a), L.down.bias, L.down.lora_term(shrink, a), w_next, eps)
        return self.model.lm_head(h).float()

    def _project(self, g: _Group, inp: torch.Tensor, lora: LoraTerm | None, epilogue_rows: int = 1 << 30, *,
                 norm=None):  # noqa: ANN001 - nvfp4_gemm.RowNorm
        """Group g's GEMM of inp: (output, bias, LoRA term) with bias and LoRA still to add, or
        (output, None, None) where an NVFP4 group's small-M kernel added them in its epilogue
        (for at most ``epilogue_rows`` rows; that launch also runs the tasks of ``norm``, which
        must then be given only where that kernel runs)."""
        if g.mode == "nvfp4" and isinstance(self.ops, CudaOps) and inp.shape[0] <= epilogue_rows:
            from engine.kernels.nvfp4_gemm import matmul_epilogue

            y = matmul_epilogue(inp, g.prepared, g.bias, lora, norm=norm)
            if y is not None:
                return y, None, None
        if norm is not None:
            raise RuntimeError("a launch with tasks needs the small-M kernel")
        return g.base(inp), g.bias, lora

    def _small_kernel(self, b: int, groups: str) -> bool:
        """Whether every layer's named groups (e.g. "o", "qkv o gu down") run b rows on the NVFP4
        small-M kernel (whose epilogue modes and tasks the step may then use)."""
        from engine.kernels import nvfp4_gemm

        key = (b, groups, nvfp4_gemm.SMALL_PATH_MAX)
        if key not in self._small:
            probe = torch.empty(b, 16, dtype=self.dtype, device=self.device)
            self._small[key] = all(g.mode == "nvfp4" and nvfp4_gemm.small_epilogue(probe, g.prepared)
                                   for L in self.layers for g in (getattr(L, n) for n in groups.split()))
        return self._small[key]

    def _fused_norm(self, b: int) -> bool:
        """Whether a step of b rows runs the residual adds and RMSNorms inside the GEMMs
        (FUSED_NORM_ROWS): NVFP4 groups on the small kernel, fused element-wise ops."""
        return self._fused_norm_ok and b <= FUSED_NORM_ROWS and self._small_kernel(b, "qkv o gu down")

    def _o_tasks(self, b: int) -> bool:
        """Whether a step of b rows computes o's LoRA shrink inside o's GEMM (O_SHRINK_TASK_ROWS)."""
        return (isinstance(self.ops, CudaOps) and b <= min(16, O_SHRINK_TASK_ROWS)
                and all(L.o.lora and L.o.k % 16 == 0 for L in self.layers) and self._small_kernel(b, "o"))

    def _project_residual(self, g: _Group, inp: torch.Tensor, lora: LoraTerm | None, x: torch.Tensor,
                          w: torch.Tensor, *, norm=None) -> torch.Tensor:  # noqa: ANN001
        """x += group g's projection of inp (bias and LoRA included) in place; returns bf16(x * w),
        the next group's input for _project_norm."""
        from engine.kernels.nvfp4_gemm import matmul_residual

        return matmul_residual(inp, g.prepared, g.bias, lora, x, w, norm=norm)

    def _project_norm(self, g: _Group, hw: torch.Tensor, x: torch.Tensor, sync: torch.Tensor, epilogue_rows: int):
        """Group g's GEMM of RMSNorm(x) * w given hw = bf16(x * w) (norm mode, nvfp4_gemm.RowNorm):
        as _project, the LoRA shrink computed in the same launch."""
        from engine.kernels.nvfp4_gemm import RowNorm, matmul_epilogue

        b = hw.shape[0]
        r = torch.empty(b, dtype=torch.float32, device=hw.device)
        s = torch.empty(b, g.a_cat.shape[0], dtype=torch.float32, device=hw.device) if g.lora else None
        norm = RowNorm(x, g.a, s, r, sync, self.cfg.rms_norm_eps)
        lora = g.term(s)
        if b <= epilogue_rows:
            return matmul_epilogue(hw, g.prepared, g.bias, lora, norm=norm), None, None
        return matmul_epilogue(hw, g.prepared, None, None, norm=norm), g.bias, lora

    def _run_step(self, b: int, slot: int) -> None:
        s = min(self.max_len, -(-(slot + 1) // self.len_bucket) * self.len_bucket)
        if not self.use_graphs:
            self._step(b, s)
            return
        g = self.graphs.get((b, s))
        if g is None:
            saved = (self.slot.clone(), self.pos.clone())
            self._warm_up(self._step, b, s)
            self.slot.copy_(saved[0])
            self.pos.copy_(saved[1])
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g, pool=self.pool):
                    self._step(b, s)
            except RuntimeError as exc:  # an op that cannot be captured here: decode eagerly instead
                log.warning("CUDA graph capture failed, decoding without graphs: %s", exc)
                self.use_graphs = False
                self.stats.graphs = False
                self.graph_error = str(exc)[:500]
                self.stats.extra["graph_error"] = self.graph_error
                self._step(b, s)
                return
            self.graphs[(b, s)] = g
            self.stats.graphs_captured += 1
        g.replay()

    def capture(self, b: int, first_slot: int, last_slot: int, *, prompts: int = 0) -> int:
        """Capture now the graphs a rollout of bucket ``b`` replays for write columns
        [first_slot, last_slot), and with ``prompts`` the prefill graph of that many prompts of
        first_slot tokens (where PREFILL_GRAPH_ROWS takes it), so that capturing stays out of
        timed runs; returns how many were new. Leaves garbage in the cache (the next rollout
        starts from a clean state)."""
        if not self.use_graphs:
            return 0
        lb = self.len_bucket
        lengths = sorted({min(self.max_len, -(-(s + 1) // lb) * lb) for s in range(first_slot, min(last_slot, self.max_len))})
        new = 0
        with torch.no_grad():
            self.refresh()
            key = (prompts, first_slot)
            if prompts and prompts * first_slot <= PREFILL_GRAPH_ROWS and key not in self.prefill_graphs:
                ids = torch.ones(key, dtype=torch.long, device=self.device)
                self._run_prefill(ids, torch.ones_like(ids), capture=True)
                new += key in self.prefill_graphs
            for s in lengths:
                if (b, s) not in self.graphs:
                    self.slot.fill_(s - 1)
                    self._run_step(b, s - 1)
                    new += 1
        return new

    def _sync_every(self, generator: torch.Generator | None, temperature: float) -> int:
        """Decode steps between two reads of the sampled tokens by the host: 1 when sampling
        with a CPU generator (the host has each step's tokens anyway, and the eager sampler's
        use of the generator is kept: the same tokens for the same seed), else ``sync_every``
        (greedy decoding uses no generator)."""
        cpu_rng = generator is not None and generator.device.type == "cpu" and temperature > 0
        return 1 if cpu_rng else self.sync_every

    def _compact(self, rows: torch.Tensor) -> None:
        """Move cache rows ``rows`` to the front, in that order."""
        n = rows.numel()
        for t in (self.kc, self.vc):
            for i in range(t.shape[0]):  # one layer at a time: no full-cache temporary
                t[i, :n] = t[i].index_select(0, rows)
        self.valid[:n] = self.valid.index_select(0, rows)
        self.pos[:n] = self.pos.index_select(0, rows)

    # -- a sub-batch -------------------------------------------------------------------------
    def _generate_batch(self, tokenizer, prompts: list[list[int]], params: SamplingParams, eos: set[int],
                        generator: torch.Generator | None, stop: Callable[[], bool]) -> tuple[list[Completion], bool]:
        dev = self.device
        n = len(prompts)
        ids, mask = left_pad(prompts, tokenizer.pad_token_id)
        if ids.shape[1] + params.max_new_tokens > self.max_len:
            raise ValueError(f"prompt ({ids.shape[1]}) + max_new_tokens ({params.max_new_tokens}) exceeds the rollout "
                             f"engine's max_len {self.max_len}; build it with a larger max_len")
        b = batch_bucket(n, self.max_batch)
        self.valid.zero_()
        self.pos.zero_()
        self.tok.zero_()
        t0 = _now(dev)
        logits = self._run_prefill(ids.to(dev), mask.to(dev))  # (n, V) fp32
        slot = ids.shape[1]
        t1 = _now(dev)
        self.stats.prefill_s += t1 - t0
        rows = Rows(tokenizer, params, eos, n)
        # Sampled entry j of a step is cache row at[j]; cols[i] is the entry of live row i.
        # Tokens stay on the GPU for ``every`` steps, then are copied to the host in one window,
        # which is read once the step after it is launched (the GPU runs that step meanwhile;
        # rows that ended in the window leave the batch from the step after).
        every = self._sync_every(generator, params.temperature)
        at, cols, pending = list(range(n)), list(range(n)), []
        rows_at = None  # at on the GPU while it is not 0..len(at)-1 (made once per change: no copy per step)
        window: _Window | None = None
        cancelled = False
        for t in range(params.max_new_tokens):
            if window is not None:
                cols, window = window.record(rows, cols), None
                if not rows.live:
                    break
                if stop():
                    cancelled = True
                    rows.cancel(range(len(rows.live)))
                    break
                if len(cols) < len(at):  # rows ended: sample only the live ones from now on
                    logits = logits.index_select(0, torch.tensor(cols, device=dev))
                    at, cols = [at[c] for c in cols], list(range(len(cols)))
                    nb = batch_bucket(len(at), self.max_batch)
                    if nb < b:
                        self._compact(torch.tensor(at, device=dev))
                        at, b = list(range(len(at))), nb
                    rows_at = None if at == list(range(len(at))) else torch.tensor(at, device=dev)
            into = self.tok if rows_at is None else None  # the next step's inputs, written by the sampler
            nxt, lp = sample_next(logits, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                  generator=generator, tokens_into=into)
            pending.append((nxt, lp))
            if len(pending) == every or t + 1 == params.max_new_tokens:
                window, pending = _Window(pending), []
            if t + 1 == params.max_new_tokens:
                break
            if rows_at is not None:
                self.tok.index_copy_(0, rows_at, nxt)
            self._run_step(b, slot)
            slot += 1
            self.stats.steps += 1
            logits = self.logits[:len(at)] if rows_at is None else self.logits.index_select(0, rows_at)
        if window is not None:  # the last window (at max_new_tokens)
            window.record(rows, cols)
        self.stats.decode_s += _now(dev) - t1
        outs = rows.completions(prompts)
        self.stats.tokens += sum(len(c.token_ids) for c in outs)
        return outs, cancelled

    def generate(self, tokenizer, prompts: list[list[int]], params: SamplingParams, *,
                 generator: torch.Generator | None = None, should_stop: Callable[[], bool] | None = None,
                 max_batch: int | None = None) -> list[Completion]:
        max_batch = min(max_batch or self.max_batch, self.max_batch)
        check_prompts(prompts, max_batch)
        model = self.model
        eos = eos_ids(model, tokenizer, params)
        stop = should_stop or (lambda: False)
        was_training = model.training
        model.eval()
        self.stats = RolloutStats(ops=self.ops.name, attention=self.attention.name, graphs=self.use_graphs,
                                  graphs_captured=0)
        if getattr(self, "graph_error", None):
            self.stats.extra["graph_error"] = self.graph_error
        try:
            with torch.no_grad():
                self.refresh()
                return sub_batches(prompts, max_batch, stop,
                                   lambda batch: self._generate_batch(tokenizer, batch, params, eos, generator, stop))
        finally:
            model.train(was_training)


class _Window:
    """A window of sampled steps on its way to the host: one copy of its tokens and one of their
    log-probs, asynchronous on a GPU (pinned buffers), read by ``record``."""

    def __init__(self, pending: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        toks = torch.stack([p[0] for p in pending])
        lps = torch.stack([p[1].float() for p in pending])
        self.done = None
        if toks.is_cuda:
            self.toks = torch.empty(toks.shape, dtype=toks.dtype, pin_memory=True).copy_(toks, non_blocking=True)
            self.lps = torch.empty(lps.shape, dtype=lps.dtype, pin_memory=True).copy_(lps, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.toks, self.lps = toks, lps

    def record(self, rows: Rows, cols: list[int]) -> list[int]:
        """Record the window's tokens (live row i reads entry cols[i] of each step); returns the
        entries of the rows still live."""
        if self.done is not None:
            self.done.synchronize()
        for tk, lp in zip(self.toks.tolist(), self.lps.tolist()):
            keep = rows.record([tk[c] for c in cols], [lp[c] for c in cols])
            if len(keep) < len(cols):
                rows.live, cols = [rows.live[j] for j in keep], [cols[j] for j in keep]
            if not cols:
                break
        return cols


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


KV_LEN_BUCKET = 256  # the cached engine's KV length rounds up to this (fewer rebuilds as prompts vary)


def kv_len(tokens: int) -> int:
    """The KV length of the engine ``generate`` uses for sequences of up to ``tokens`` tokens."""
    return max(KV_LEN_BUCKET, -(-tokens // KV_LEN_BUCKET) * KV_LEN_BUCKET)


def engine_for(model: nn.Module, *, max_batch: int = 64, max_len: int = 2048, **kwargs) -> GraphRollout:
    """The model's cached engine, rebuilt when it is too small for (max_batch, max_len) or
    the LoRA modules changed. The old engine (its KV cache, graphs and their memory pools) is let
    go before the new one allocates, so a rebuild never holds both."""
    eng = getattr(model, "_graph_rollout", None)
    loras = tuple(id(m) for m in model.modules() if isinstance(m, LoRALinear))
    if eng is None or eng.max_batch < max_batch or eng.max_len < max_len or eng._loras != loras or kwargs:
        if eng is not None:
            model._graph_rollout = eng = None
            gc.collect()  # in case anything of it is held in a reference cycle
        eng = GraphRollout(model, max_batch=max_batch, max_len=max_len, **kwargs)
        eng._loras = loras
        model._graph_rollout = eng
    return eng


def generate(model, tokenizer, prompts: list[list[int]], params: SamplingParams, *,
             generator: torch.Generator | None = None, should_stop: Callable[[], bool] | None = None,
             max_batch: int = 64) -> list[Completion]:
    """engine.rollout.generate on the graph engine (one Completion per prompt, prompt order)."""
    max_len = kv_len(max((len(p) for p in prompts), default=1) + params.max_new_tokens)
    eng = engine_for(model, max_batch=batch_bucket(min(max_batch, max(1, len(prompts))), max_batch), max_len=max_len)
    return eng.generate(tokenizer, prompts, params, generator=generator, should_stop=should_stop, max_batch=max_batch)

"""A small Llama-style language model trained byte-level on Python's own standard library.

    python examples/lm.py                                     # one process, the defaults (lm.yaml)
    python examples/lm.py engine.steps=20 model.n_layers=2    # overrides
    python examples/lm.py nproc=2                             # two processes (cadence.launch): DDP
    python examples/lm.py nproc=2 engine.backend=mesh mesh.shard=2
    python examples/lm.py nproc=4 engine.backend=mesh mesh.shard=2 mesh.tensor=2
    python examples/lm.py nproc=2 engine.backend=mesh mesh.shard=1 mesh.context=2 model.causal=false
    python examples/lm.py nproc=2 engine.backend=mesh mesh.shard=2 mesh.expert=2 model.n_experts=4
    python examples/lm.py nproc=4 engine.backend=mesh mesh.shard=4 mesh.expert=2 mesh.expert_tensor=2 model.n_experts=4
    python examples/lm.py nproc=2 engine.backend=mesh mesh.shard=2 mesh.accumulation_sync=every engine.grad_accum=4
    python examples/lm.py nproc=2 engine.backend=mesh mesh.shard=1 mesh.tensor=2 \
        tensor_parallel.sequence_parallel=true tensor_parallel.loss_parallel=true
    python examples/lm.py engine.precision=bf16 precision_overrides='{RMSNorm: fp32, output: fp32}'
    python examples/lm.py engine.device=cuda engine.precision=bf16 float8.enabled=true   # a GPU of capability >= 8.9
    python examples/lm.py nproc=2 'callbacks=[{name: collective_guard}, {name: time_budget, max_time: "01:00:00"}]'
    torchrun --nproc_per_node 2 examples/lm.py                # or under torchrun

The corpus is the `.py` files at the top of the running interpreter's standard
library (a sorted, fixed list: every machine has it offline), read as bytes;
files go to validation by a stable hash of their name, so the split is by file.
The model is a decoder with RMSNorm, rotary position embeddings, grouped-query
attention and SwiGLU feed-forward blocks (or, with `model.n_experts`, a
mixture of SwiGLU experts: `MoE`). It tells the backends how to parallelize it
(`parallelize(mesh)`: tensor parallel over the mesh's `tensor` axis;
`context_parallel_buffers(batch)` and `causal`: context parallel, which on CPU
needs `model.causal=false`, fine for a test model; `MoE.shard_experts`: expert
parallel over the `expert` and `expert_tensor` axes) and which modules are FSDP2 units (`fsdp_units()`), and counts its own
training FLOPs per token, from which TrainMetrics logs TFLOP/s and MFU (give
`peak_flops`, e.g. 989e12 for an H100 in bf16).

The script prints tokens/s and the loss at each log interval, and the
validation loss at each evaluation. The same file runs unchanged on the
`local`, `ddp` and `mesh` backends: only `engine.backend` (and `mesh.*`) change.

Like every Cadence run it leaves a run directory (`runs/lm-<code>/<run_id>/`,
printed at the start) with the log, `metrics.jsonl` (`cadence plot <run
directory>` draws it), the config as it ran, and checkpoints saved in the
background every `checkpoint.interval` steps (`checkpoint.*` are the
`Checkpoint` callback's settings). Stop it with Ctrl-C and run the same command
again: it resumes from its last checkpoint.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import sysconfig
import time
import zlib
from pathlib import Path
from typing import Any, ClassVar

import attrs
import torch
from torch import nn
from torch.nn import functional as F

import cadence
from cadence.backends.float8 import Float8Config
from cadence.callbacks import JSONL, Checkpoint, TextLog, TrainMetrics
from cadence.callbacks.checkpoint import CheckpointConfig
from cadence.run.config_cli import parse_cli
from cadence.run.registry import build_callback

# -- the model ---------------------------------------------------------------------------


@attrs.define(kw_only=True)
class ModelConfig:
    """The decoder's shape.

    Attributes:
        dim: width of the residual stream.
        n_layers: number of transformer blocks.
        n_heads: attention (query) heads.
        n_kv_heads: key/value heads (grouped-query attention; divides n_heads).
        ffn_hidden: hidden width of the SwiGLU feed-forward block.
        vocab: vocabulary size (256: bytes).
        seq_len: tokens per training sequence.
        rope_theta: base of the rotary embedding's frequencies.
        causal: causal attention (False gives bidirectional attention, e.g. for
            context parallel on CPU, where only non-causal attention is supported:
            a test model, not a language model worth training).
        norm_eps: RMSNorm's epsilon.
        n_experts: 0: every block has the SwiGLU feed-forward; > 0: a
            mixture-of-experts layer with that many SwiGLU experts instead
            (sharded over the mesh's `expert` axis, and each expert's
            `ffn_hidden` over its `expert_tensor` axis).
        top_k: experts each token is routed to.
        balance_coef: weight of the load-balancing loss added to the
            training loss (sequence-wise: mean over sequences of
            n_experts x sum_e fraction_e x mean-probability_e).
    """

    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 352
    vocab: int = 256
    seq_len: int = 128
    rope_theta: float = 10000.0
    causal: bool = True
    norm_eps: float = 1e-5
    n_experts: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    top_k: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    balance_coef: float = attrs.field(default=0.01, validator=attrs.validators.ge(0))

    def __attrs_post_init__(self) -> None:
        if self.n_experts and self.top_k > self.n_experts:
            raise ValueError(f"model.top_k={self.top_k} is larger than model.n_experts={self.n_experts}")
        if self.dim % self.n_heads:
            raise ValueError(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"the head width dim/n_heads={self.dim // self.n_heads} must be even for rotary embeddings"
            )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's rotation angles, (seq_len, head_dim / 2) each."""
    frequencies = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), frequencies)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (batch, seq, heads, head_dim) `x`, pairs (even, odd) rotated."""
    even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
    cos, sin = cos[: x.shape[1], None, :], sin[: x.shape[1], None, :]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.dim // config.n_heads
        self.repeats = config.n_heads // config.n_kv_heads
        self.causal = config.causal
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallel each rank holds its share of the heads.
        q = rotate(self.wq(x).view(batch, seq, -1, self.head_dim), cos, sin)
        k = rotate(self.wk(x).view(batch, seq, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.repeats > 1:  # grouped-query attention: each key/value head serves `repeats` query heads
            k, v = k.repeat_interleave(self.repeats, dim=2), v.repeat_interleave(self.repeats, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=self.causal
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """A mixture of SwiGLU experts: a router picks `top_k` experts per token, their outputs are mixed by its weights.

    Expert weights are stacked (first dimension: the expert). On one process
    every expert is here. `shard_experts(mesh)` (the mesh backend's `expert`
    and `expert_tensor` axes) keeps this rank's share as DTensors: the experts
    `Shard(0)` over "expert", and each expert's hidden dimension over
    "expert_tensor" (w1, w3 column-wise, w2 row-wise). Forward then gathers
    the expert_tensor peers' tokens, sends each to its experts' owners and
    back with two all-to-alls on the expert group, and sums the peers'
    partial outputs for its own tokens (all autograd-aware, so the backward
    brings every rank's contribution to the experts' gradients).

    After each forward, `balance_loss` (sequence-wise load-balancing loss) and
    `tokens_per_expert` (this rank's routed tokens per expert, detached) hold
    that batch's values.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = config.n_experts, config.top_k
        experts, dim, hidden = config.n_experts, config.dim, config.ffn_hidden
        self.expert_hidden = hidden  # what the mesh's expert_tensor axis splits
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.groups: Any = None  # (expert group, expert_tensor group), after shard_experts
        self.balance_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None

    def shard_experts(self, mesh: Any) -> None:
        """Keep this rank's share of the weights: `mesh` is the 2-D ("expert", "expert_tensor") mesh."""
        from torch.distributed.tensor import Shard, distribute_tensor

        hidden_dim = {"w1": 1, "w3": 1, "w2": 2}  # w1, w3: (expert, hidden, dim); w2: (expert, dim, hidden)
        for name, dim in hidden_dim.items():
            full = getattr(self, name).detach()
            setattr(self, name, nn.Parameter(distribute_tensor(full, mesh, [Shard(0), Shard(dim)])))
        self.groups = (mesh["expert"].get_group(), mesh["expert_tensor"].get_group())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        probs = F.softmax(self.router(tokens).float(), dim=-1)  # (tokens, experts)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).type_as(x)
        experts = self.num_experts
        per_sequence = F.one_hot(chosen.view(batch, -1), experts).sum(1).float() / (seq * self.top_k)
        self.balance_loss = experts * (per_sequence * probs.view(batch, seq, experts).mean(1)).sum(-1).mean()
        flat = chosen.reshape(-1)
        counts = torch.bincount(flat, minlength=experts)
        self.tokens_per_expert = counts.detach()
        order = flat.argsort(stable=True)  # assignments grouped by expert
        token_index = order // self.top_k
        routed = tokens[token_index]
        if self.groups is None:
            out = self._experts(routed, counts.tolist(), self.w1, self.w3, self.w2)
        else:
            out = self._tensor_parallel(routed, counts)
        mixed = out * weights.reshape(-1)[order, None]
        return torch.zeros_like(tokens).index_add_(0, token_index, mixed).view(batch, seq, dim)

    @staticmethod
    def _experts(
        x: torch.Tensor, counts: list[int], w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
    ) -> torch.Tensor:
        outs = []
        for e, part in enumerate(x.split(counts)):
            outs.append((F.silu(part @ w1[e].T) * (part @ w3[e].T)) @ w2[e].T)
        return torch.cat(outs)

    def _tensor_parallel(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Gather the expert_tensor peers' assignments, dispatch them all, sum the peers' partial outputs for ours."""
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        group = self.groups[1]
        peers = dist.get_world_size(group)
        if peers == 1:
            return self._dispatch(routed, counts)
        gathered_counts = torch.empty(peers * counts.numel(), dtype=counts.dtype, device=counts.device)
        dist.all_gather_into_tensor(gathered_counts, counts, group=group)
        gathered_counts = gathered_counts.view(peers, -1)  # [peer, expert]
        rows = gathered_counts.sum(1).tolist()  # each peer's assignments
        mine = routed.shape[0]
        # An all-gather of unequal parts (autograd-aware): every peer receives our rows.
        gathered = all_to_all_single_autograd(routed.repeat(peers, 1), rows, [mine] * peers, group)
        # Rows arrive by (peer, expert): regroup them by expert.
        experts = torch.arange(self.num_experts, device=routed.device).repeat(peers)
        regroup = experts.repeat_interleave(gathered_counts.reshape(-1)).argsort(stable=True)
        out = self._dispatch(gathered[regroup], gathered_counts.sum(0))
        partial = torch.empty_like(out).index_copy(0, regroup, out)  # rows by peer again
        # Each peer's partial outputs (its hidden slice) for our rows, summed: a reduce-scatter of unequal parts.
        received = all_to_all_single_autograd(partial, [mine] * peers, rows, group)
        return received.view(peers, mine, -1).sum(0)

    def _dispatch(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Send each assignment to its expert's owner, run the local experts (their hidden slice), send the results back."""
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        w1, w3, w2 = (w.to_local() for w in (self.w1, self.w3, self.w2))
        group = self.groups[0]
        ranks = dist.get_world_size(group)
        if ranks == 1:
            return self._experts(routed, counts.tolist(), w1, w3, w2)
        local = self.num_experts // ranks
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=group)  # [source rank, local expert]
        received_counts = received_counts.view(ranks, local)
        send = counts.view(ranks, local).sum(1).tolist()
        receive = received_counts.sum(1).tolist()
        received = all_to_all_single_autograd(routed, receive, send, group)
        # Rows arrive by (source rank, local expert): regroup them by local expert.
        expert_of_row = (
            torch.arange(local, device=routed.device).repeat(ranks).repeat_interleave(received_counts.reshape(-1))
        )
        regroup = expert_of_row.argsort(stable=True)
        out = self._experts(received[regroup], received_counts.sum(0).tolist(), w1, w3, w2)
        back = torch.empty_like(out).index_copy(0, regroup, out)  # rows in arrival order again
        return all_to_all_single_autograd(back, send, receive, group)


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward: nn.Module = MoE(config) if config.n_experts else FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """The decoder: embeddings, `n_layers` blocks, a final norm and the output projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab, bias=False)
        cos, sin = rotary_tables(config.dim // config.n_heads, config.seq_len, config.rope_theta)
        # Not persistent: derived from the config, so checkpoints hold only learned weights.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            if p.ndim == 3:  # stacked expert weights
                residual = name.endswith("w2")
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layers) if residual else 0.02)
            elif p.ndim == 2:
                # Scaled init of the residual projections, as in GPT-2 and Llama reference code.
                residual = name.endswith(("wo.weight", "w2.weight"))
                std = 0.02 / math.sqrt(2 * self.config.n_layers) if residual else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage holds some of the layers (the others are None / left out of
        # `layers`): it takes the previous stage's activations and hands its own on.
        x = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        x = self.norm(x) if self.norm is not None else x
        return self.output(x) if self.output is not None else x

    # -- what the backends ask of a model ----------------------------------------------

    @property
    def causal(self) -> bool:
        """Whether attention is causal (context parallel picks its attention path by it)."""
        return self.config.causal

    def context_parallel_buffers(self, batch: Any) -> list[tuple[torch.Tensor, int]]:
        """What context parallel splits along the sequence: tokens and targets (dim 1), the rotary tables (dim 0)."""
        inputs, targets = batch
        if inputs.shape[1] != self.rope_cos.shape[0]:
            raise ValueError(
                f"context parallel needs sequences of model.seq_len={self.rope_cos.shape[0]} tokens "
                f"(the rotary tables are split with them), got {inputs.shape[1]}"
            )
        return [(inputs, 1), (targets, 1), (self.rope_cos, 0), (self.rope_sin, 0)]

    def balance_loss(self) -> torch.Tensor:
        """The mixture-of-experts layers' load-balancing losses of the last forward, summed (0 without experts)."""
        losses = [m.balance_loss for m in self.modules() if isinstance(m, MoE) and m.balance_loss is not None]
        return torch.stack(losses).sum() if losses else torch.zeros(())

    def pipeline_split(self, parts: int) -> list[list[str]]:
        """Module FQNs of each pipeline stage: the embeddings first, the blocks evenly, the norm and output last."""
        n = self.config.n_layers
        if parts > n:
            raise ValueError(f"a pipeline of {parts} stages needs at least {parts} layers; model.n_layers={n}")
        split: list[list[str]] = [[] for _ in range(parts)]
        for i in range(n):
            split[i * parts // n].append(f"layers.{i}")
        split[0].insert(0, "tok_embeddings")
        split[-1] += ["norm", "output"]
        return split

    def fsdp_units(self) -> list[nn.Module]:
        """The modules FSDP2 shards as units (each block; the root gets the rest)."""
        return list(self.layers)

    def parallelize(self, mesh: Any, *, sequence_parallel: bool = False, loss_parallel: bool = False) -> None:
        """Tensor parallel over `mesh["tensor"]`: Megatron-style column/row splits in every block.

        Query/key/value and the SwiGLU input projections are split by output
        columns (each rank gets whole heads), the attention output and the
        SwiGLU output projection by input rows, so each block needs one
        all-reduce in forward per sub-block. Embeddings, norms and the output
        projection stay replicated, unless:

        - `sequence_parallel`: the residual stream between the blocks' matrix
          multiplications (norms, residual additions) is split along the
          sequence (`SequenceParallel`): each block's all-reduces become an
          all-gather before its column-wise projections and a reduce-scatter
          after its row-wise ones, and activations there take 1/tensor of the
          memory. The embeddings are split by vocabulary rows (their output
          reduce-scattered along the sequence), the output projection gathers
          the sequence back.
        - `loss_parallel`: the output projection is split by vocabulary
          columns and its logits stay sharded (`use_local_output=False`): no
          rank holds the whole batch x sequence x vocabulary logits, and the
          loss is computed on the shards (the mesh backend's `loss_parallel`,
          which `next_byte_loss` works with).
        """
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        tp = mesh["tensor"]
        size = tp.size()
        for what, count in (("n_heads", self.config.n_heads), ("n_kv_heads", self.config.n_kv_heads)):
            if count % size:
                raise ValueError(f"model.{what}={count} is not divisible by the tensor axis ({size})")
        # Under sequence parallel a sub-block's input arrives split along the sequence and is gathered; its
        # output is reduce-scattered back (RowwiseParallel to Shard(1)) instead of all-reduced.
        rows = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
        plan: dict[str, Any] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": rows,
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": rows,
        }
        if sequence_parallel:
            gather = {"input_layouts": (Shard(1), None, None), "desired_input_layouts": (Replicate(), None, None)}
            plan |= {
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(**gather, use_local_output=True),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                ),
            }
        for block in self.layers:
            parallelize_module(block, tp, plan)
        top: dict[str, Any] = {}
        if sequence_parallel:
            top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
            top["norm"] = SequenceParallel()
        if sequence_parallel or loss_parallel:
            top["output"] = ColwiseParallel(
                input_layouts=Shard(1) if sequence_parallel else Replicate(),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            )
        if top:
            parallelize_module(self, tp, top)

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 x (non-embedding parameters) + attention's 12 x layers x dim x seq_len.

        The usual accounting (Kaplan et al., PaLM appendix B): a multiply-add is
        2 FLOPs, backward costs twice forward; the embedding lookup is free.
        """
        c = self.config
        params = sum(p.numel() for name, p in self.named_parameters() if not name.startswith("tok_embeddings"))
        return 6.0 * params + 12.0 * c.n_layers * c.dim * c.seq_len


# -- the data ------------------------------------------------------------------------------


class HFLlama:
    """Names of Hugging Face's Llama layout for this decoder (a key mapping, see cadence.checkpoint.hf).

    `cadence export CKPT --to hf --mapping examples/lm.py:HFLlama OUT` writes
    `config.json` (LlamaForCausalLM) and the weights under Llama's names;
    `Checkpoint(pretrained=OUT, pretrained_mapping="examples/lm.py:HFLlama")`
    loads them back. Names only: `rotate` pairs (even, odd) channels, as
    Meta's Llama code does, where transformers' Llama rotates halves, so
    transformers needs wq and wk rows permuted (as its own Llama conversion
    script does) before it computes the same attention. Mixture-of-experts
    blocks have no Llama name and are left out.
    """

    PARTS: ClassVar[dict[str, str]] = {
        "attention.wq": "self_attn.q_proj",
        "attention.wk": "self_attn.k_proj",
        "attention.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj",
        "feed_forward.w1": "mlp.gate_proj",
        "feed_forward.w3": "mlp.up_proj",
        "feed_forward.w2": "mlp.down_proj",
        "attention_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }
    WHOLE: ClassVar[dict[str, str]] = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }

    def to_hf(self, key: str) -> str | None:
        if key in self.WHOLE:
            return self.WHOLE[key]
        parts = key.split(".")
        if len(parts) >= 4 and parts[0] == "layers":
            inner, last = ".".join(parts[2:-1]), parts[-1]
            if inner in self.PARTS:
                return f"model.layers.{parts[1]}.{self.PARTS[inner]}.{last}"
        return None

    def from_hf(self, name: str) -> str | None:
        back = {v: k for k, v in self.WHOLE.items()}
        if name in back:
            return back[name]
        parts = name.split(".")
        if len(parts) >= 5 and parts[:2] == ["model", "layers"]:
            inner, last = ".".join(parts[3:-1]), parts[-1]
            ours = {v: k for k, v in self.PARTS.items()}.get(inner)
            if ours is not None:
                return f"layers.{parts[2]}.{ours}.{last}"
        return None

    def hf_config(self, payload: dict[str, Any]) -> dict[str, Any]:
        model = ((payload.get("config") or {}).get("run") or {}).get("model") or {}
        shape = ModelConfig(**{k: v for k, v in model.items() if k in attrs.fields_dict(ModelConfig)})
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": shape.dim,
            "num_hidden_layers": shape.n_layers,
            "num_attention_heads": shape.n_heads,
            "num_key_value_heads": shape.n_kv_heads,
            "intermediate_size": shape.ffn_hidden,
            "vocab_size": shape.vocab,
            "max_position_embeddings": shape.seq_len,
            "rope_theta": shape.rope_theta,
            "rms_norm_eps": shape.norm_eps,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }


@attrs.define(kw_only=True)
class DataConfig:
    """The corpus.

    Attributes:
        max_bytes: read at most this many bytes of source (files in sorted order).
        val_every: one file in `val_every` (by a stable hash of its name) goes to validation.
    """

    max_bytes: int = attrs.field(default=2_000_000, validator=attrs.validators.gt(0))
    val_every: int = attrs.field(default=10, validator=attrs.validators.ge(2))


def stdlib_corpus(config: DataConfig) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Train and validation bytes from the standard library's top-level `.py` files, and the file list."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library folder {root}")
    train: list[bytes] = []
    val: list[bytes] = []
    used, total = [], 0
    for path in files:
        data = path.read_bytes()
        if total + len(data) > config.max_bytes and used:
            break
        (val if zlib.crc32(path.name.encode()) % config.val_every == 0 else train).append(data)
        used.append(path.name)
        total += len(data)
    if not val:
        val.append(train.pop())

    def as_tensor(parts: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"\n".join(parts)), dtype=torch.uint8)

    return as_tensor(train), as_tensor(val), used


class ByteSequences(torch.utils.data.Dataset):
    """Non-overlapping windows of `seq_len + 1` bytes: (inputs, next-byte targets)."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len
        self.count = (len(data) - 1) // seq_len
        if self.count < 1:
            raise ValueError(f"{len(data)} bytes hold no sequence of {seq_len + 1}")

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.data[index * self.seq_len : (index + 1) * self.seq_len + 1].long()
        return window[:-1], window[1:]


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position; on vocabulary-sharded logits (loss parallel) computed on the shards.

    Loss parallel gives a replicated DTensor: its local value is the loss, as
    a plain tensor for the engine (no communication).
    """
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    return loss.to_local() if hasattr(loss, "to_local") else loss


# -- the run -------------------------------------------------------------------------------


@attrs.define(kw_only=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay.

    Attributes:
        lr: peak learning rate.
        weight_decay: decoupled weight decay.
        warmup: warmup steps.
        min_lr_ratio: the final learning rate as a fraction of `lr`.
    """

    lr: float = attrs.field(default=3e-3, validator=attrs.validators.gt(0))
    weight_decay: float = 0.1
    warmup: int = attrs.field(default=20, validator=attrs.validators.ge(0))
    min_lr_ratio: float = 0.1


@attrs.define(kw_only=True)
class TensorParallelConfig:
    """Options of the tensor-parallel plan (`Transformer.parallelize`): `engine.backend=mesh` with `mesh.tensor` > 1.

    Attributes:
        sequence_parallel: norms and residual additions run on sequence shards
            (`SequenceParallel`); their activations take 1/tensor of the memory.
        loss_parallel: the output projection's logits stay sharded over the
            vocabulary and the loss is computed on the shards (also sets the
            mesh backend's `loss_parallel`).
    """

    sequence_parallel: bool = False
    loss_parallel: bool = False


@attrs.define(kw_only=True)
class LMConfig:
    """Everything examples/lm.py reads (defaults: examples/lm.yaml).

    Attributes:
        model: the decoder's shape.
        data: the corpus.
        optim: the optimizer and its schedule.
        mesh: MeshBackend options when `engine.backend` is "mesh" (axes such as
            `shard`, `tensor`, `replicate`, `accumulation_sync`; see docs/backends.md).
        tensor_parallel: sequence and loss parallel in the tensor-parallel plan.
        precision_overrides: `{module class or name: fp32}`, e.g. `{RMSNorm: fp32,
            output: fp32}`: modules that compute in fp32 in a bf16 run (local,
            ddp and mesh backends).
        float8: float8 training through torchao (`Float8Config`; local, ddp and
            mesh backends; a GPU of compute capability >= 8.9).
        peak_flops: one device's peak FLOP/s for MFU (None: not logged).
        nproc: processes to start with `cadence.launch` (ignored under torchrun,
            which starts them itself); with more than one, `engine.backend`
            "auto" is DDP.
        checkpoint: the run's checkpoints (`CheckpointConfig`): every 50 steps,
            written in the background (`async_mode: async`), resumed by the same
            command (`auto_resume`).
        callbacks: more callbacks as config entries by registry name, e.g.
            `[{name: collective_guard}]` (ranks that issue different collectives
            fail at once), `[{name: time_budget, max_time: "01:00:00"}]`,
            `[{name: heartbeat, timeout: 600}]`.
        engine: the loop's settings.
    """

    model: ModelConfig = attrs.field(factory=ModelConfig)
    data: DataConfig = attrs.field(factory=DataConfig)
    optim: OptimConfig = attrs.field(factory=OptimConfig)
    mesh: dict[str, Any] = attrs.field(factory=dict)
    tensor_parallel: TensorParallelConfig = attrs.field(factory=TensorParallelConfig)
    precision_overrides: dict[str, str] = attrs.field(factory=dict)
    float8: Float8Config = attrs.field(factory=Float8Config)
    peak_flops: float | None = None
    nproc: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    checkpoint: CheckpointConfig = attrs.field(
        factory=lambda: CheckpointConfig(interval=50, async_mode="async", auto_resume=True)
    )
    callbacks: list[dict[str, Any]] = attrs.field(factory=list)
    engine: cadence.EngineConfig = attrs.field(
        factory=lambda: cadence.EngineConfig(
            steps=200,
            seed=0,
            log_interval=20,
            eval_every_steps=100,
            eval_every_epochs=None,
            lineage="lm",
            train=cadence.DataConfig(batch_size=16, drop_last=True),
            eval=cadence.DataConfig(batch_size=16),
        )
    )


def cosine_schedule(optimizer: torch.optim.Optimizer, config: OptimConfig, steps: int) -> Any:
    def factor(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        progress = min(1.0, (step - config.warmup) / max(1, steps - config.warmup))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_backend(cfg: LMConfig) -> Any:
    """The backend named by `engine.backend`: with `mesh.*` and the tensor-parallel plan's options when it is the
    mesh backend, with `precision_overrides` and `float8` on the local, ddp and mesh backends."""
    from cadence.run import registry

    transforms: dict[str, Any] = {}
    if cfg.precision_overrides:
        transforms["precision_overrides"] = dict(cfg.precision_overrides)
    if cfg.float8.enabled:
        transforms["float8"] = attrs.asdict(cfg.float8)
    tp, name = cfg.tensor_parallel, cfg.engine.backend
    if name != "mesh":
        for key in ("sequence_parallel", "loss_parallel"):
            if getattr(tp, key):
                raise ValueError(f"tensor_parallel.{key} needs engine.backend=mesh with mesh.tensor > 1")
        if not transforms:
            return name
        if name == "auto":
            name = "ddp" if cfg.nproc > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1 else "local"
        if name not in ("local", "ddp"):
            raise ValueError(f"precision_overrides and float8 apply on the local, ddp and mesh backends, not {name!r}")
        return registry.backends.resolve(name)(device=cfg.engine.device, precision=cfg.engine.precision, **transforms)
    mesh_backend = registry.backends.resolve("mesh")
    if not cfg.mesh and not transforms:
        return mesh_backend.from_engine_config(cfg.engine)
    twice = sorted(set(transforms) & set(cfg.mesh))
    if twice:
        raise ValueError(f"{twice} given both at the top level and under mesh: set them in one place")
    options: dict[str, Any] = {"device": cfg.engine.device, **cfg.mesh, **transforms}  # mesh.device wins
    loss_parallel = tp.loss_parallel or bool(cfg.mesh.get("loss_parallel"))
    if loss_parallel or tp.sequence_parallel:
        options["loss_parallel"] = loss_parallel
        options["parallelize"] = functools.partial(
            Transformer.parallelize, sequence_parallel=tp.sequence_parallel, loss_parallel=loss_parallel
        )
    return mesh_backend(**options)


def training_loss(model: Transformer) -> Any:
    """The next-byte loss, plus the weighted load-balancing loss while training a mixture-of-experts model."""
    coef = model.config.balance_coef if model.config.n_experts else 0.0
    if not coef:
        return next_byte_loss

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        value = next_byte_loss(logits, targets)
        return value + coef * model.balance_loss() if model.training else value

    return loss


def log_experts(engine: cadence.Engine) -> None:
    """Each forward's load-balancing loss (`moe.balance_loss`) and tokens routed per expert (`moe.tokens.<i>`, summed)."""
    layers = [m for m in engine.model.modules() if isinstance(m, MoE) and m.tokens_per_expert is not None]
    if not layers:
        return
    engine.log("moe.balance_loss", engine.model.balance_loss().detach())
    counts = torch.stack([m.tokens_per_expert for m in layers]).sum(0)
    for i, count in enumerate(counts.unbind()):
        engine.log(f"moe.tokens.{i}", count, reduce="sum")


def build_engine(cfg: LMConfig, callbacks: list[Any] | None = None) -> cadence.Engine:
    torch.manual_seed(cfg.engine.seed or 0)
    model = Transformer(cfg.model)
    train_bytes, val_bytes, _ = stdlib_corpus(cfg.data)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    # An LM step is long: the step hooks of time.data_wait cost nothing here, and it says when input is the bottleneck.
    metrics = TrainMetrics(flops_per_token=model.flops_per_token(), peak_flops=cfg.peak_flops, data_wait=True)
    train = ByteSequences(train_bytes, cfg.model.seq_len)
    if cfg.engine.backend == "mesh" and cfg.mesh.get("pipeline", 1) > 1:
        # A pipeline runs grad_accum micro-batches of one shape per step: whole steps per epoch on every data rank.
        train.count -= train.count % (cfg.engine.train.batch_size * cfg.engine.grad_accum * cfg.nproc)
    engine = cadence.Engine(
        model,
        optimizer,
        train,
        loss_fn=training_loss(model),
        eval_data=ByteSequences(val_bytes, cfg.model.seq_len),
        scheduler=cosine_schedule(optimizer, cfg.optim, cfg.engine.steps or 1000),
        callbacks=[metrics, *(callbacks or [])],
        backend=make_backend(cfg),
        config=cfg.engine,
        run_config=cfg,
    )
    seq_len = cfg.model.seq_len
    if cfg.model.n_experts:
        engine.on(cadence.Event.ON_FORWARD)(log_experts)

    # Every sample is seq_len tokens: TrainMetrics reports tokens/s and MFU from this count.
    @engine.on(cadence.Event.ON_STEP_END)
    def count_tokens(engine: cadence.Engine) -> None:
        engine.state.tokens_seen = engine.state.samples_seen * seq_len

    return engine


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train and evaluate; with `nproc` > 1 (and not under torchrun), on that many local processes."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--config" not in args and not any(a in ("-h", "--help") for a in args):
        args = ["--config", str(Path(__file__).with_name("lm.yaml")), *args]  # the documented defaults
    cfg = parse_cli(LMConfig, args, prog="examples/lm.py")
    if cfg.nproc > 1 and "RANK" not in os.environ:
        from cadence.launch import WorkerError, launch

        try:
            return launch(train, cfg, nprocs=cfg.nproc, start_method="fork", timeout=3600)
        except (KeyboardInterrupt, WorkerError) as exc:  # the workers got the Ctrl-C too; launch has stopped them
            if isinstance(exc, WorkerError) and exc.exitcode != 130:
                raise
            print("interrupted: run the same command again to resume from the last checkpoint", file=sys.stderr)
            raise SystemExit(130) from None
    return train(cfg)


def train(cfg: LMConfig) -> dict[str, float]:
    """One process's part of the run; returns the final validation metrics."""
    checkpoint = Checkpoint(cfg.checkpoint)
    # metrics.jsonl and the log in the run directory, and checkpoints the same command resumes from.
    extra = [build_callback(entry) for entry in cfg.callbacks]
    engine = build_engine(cfg, callbacks=[JSONL(), TextLog(console_metrics=False), checkpoint, *extra])

    @engine.on(cadence.Event.ON_FIT_START, when=lambda engine: engine.backend.is_main)
    def announce(engine: cadence.Engine) -> None:
        if engine.restored_from is not None:
            print(f"resumed from step {engine.state.step}: {engine.restored_from}", flush=True)
        print(f"run directory: {engine.run_dir}", flush=True)

    @engine.on(cadence.Event.ON_LOG, when=lambda engine: engine.backend.is_main)
    def report(engine: cadence.Engine) -> None:
        logged = engine.logged
        if "loss" in logged:
            tokens = logged.get("throughput.tokens_per_sec")
            mfu = logged.get("mfu")
            print(
                f"step {engine.state.step:5d}  loss {logged['loss']:.4f}"
                + (f"  tokens/s {tokens:,.0f}" if tokens is not None else "")
                + (f"  mfu {mfu:.3%}" if mfu is not None else ""),
                flush=True,
            )
        if "val.loss" in logged:
            print(f"step {engine.state.step:5d}  val.loss {logged['val.loss']:.4f}", flush=True)

    start = time.perf_counter()
    try:
        with engine:
            engine.fit()
            # The schedule may have evaluated the last step already: its results, not a second evaluation.
            every = cfg.engine.eval_every_steps
            evaluated = every is not None and engine.state.step % every == 0 and "val" in engine.eval_results
            results = engine.eval_results["val"] if evaluated else engine.evaluate()
    except KeyboardInterrupt:
        if engine.backend.is_main:
            saved = checkpoint.last_saved is not None or engine.restored_from is not None
            print(
                "interrupted: run the same command again to resume from the last checkpoint"
                if saved
                else "interrupted before the first checkpoint: the same command starts the run over",
                file=sys.stderr,
            )
        raise SystemExit(130) from None
    if engine.backend.is_main:
        tokens = engine.state.tokens_seen * engine.backend.data_size
        elapsed = time.perf_counter() - start
        print(
            f"trained {engine.state.step} steps, {tokens:,} tokens in {elapsed:.1f} s on "
            f"{engine.backend.describe()}; final val.loss {results['val.loss']:.4f}",
            flush=True,
        )
    return results


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()

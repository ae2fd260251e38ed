"""A small Llama-style decoder that splits into pipeline stages.

Pre-norm decoder blocks (RMSNorm, causal self-attention with rotary position embeddings,
SwiGLU MLP, residual connections), a token embedding in front and a final RMSNorm and an
LM head, tied to the embedding, at the end. ``build_stages`` cuts the model into stages whose
forward takes and returns one tensor, so a pipeline runtime can send it between ranks:

* stage 0 takes int64 tokens ``[B, T]`` and returns hidden states ``[B, T, H]``;
* middle stages map hidden states to hidden states;
* the last stage returns logits ``[B, T, V]``.

Every projection is a plain ``nn.Linear(bias=False)`` called as a module, which is how the
runtime recognises the GEMMs whose weight gradients it may defer. With
``LlamaConfig.use_kernels`` the norms, the SwiGLU and the loss call ``graphpipe.kernels``;
otherwise plain torch ops. ``graphpipe.kernels`` is imported only when it is asked for.

**Mixture of experts.** With ``LlamaConfig(num_experts=E, top_k=k, capacity_factor=c)`` every
``moe_every``-th block's MLP is an ``MoEMLP`` (``graphpipe.models.moe``) and the stages are
``LlamaMoEStage``: they carry the load-balancing loss next to the hidden states, so

* stage 0 takes tokens ``[B, T]`` and returns ``(hidden [B, T, H], aux [1])``;
* middle stages map ``(hidden, aux)`` to ``(hidden, aux)``;
* the last stage returns ``(logits [B, T, V], aux [1])``,

where ``aux`` is the sum of ``aux_loss_coef * load-balancing loss`` of the MoE blocks so far.
``LlamaLoss`` adds it to the cross-entropy, so its gradient reaches every router through the
pipeline's ordinary backward, scaled like the language-model loss (by ``1/M`` and by a
``GradScaler``); it costs one ``[1]`` tensor per stage edge, which rides in the same gloo
packet as the hidden states.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from graphpipe.keymap import set_unsplit_keys
from graphpipe.models.moe import MoEMLP, reset_dropped_tokens
from graphpipe.models.overlap import Exchange, Tape, drain, overlapped_pair
from graphpipe.roles import unique_parameters
from graphpipe.schedule.splits import check_layers_per_stage, layers_per_stage

_even_split = layers_per_stage  # build_stages' keyword of the same name hides it there

__all__ = [
    "LlamaBlock",
    "LlamaConfig",
    "LlamaLoss",
    "LlamaMoEStage",
    "LlamaStage",
    "MoEBlock",
    "RMSNorm",
    "build_model",
    "build_stages",
    "layers_per_stage",
    "llama_loss",
    "num_parameters",
    "unique_parameters",
]

_INIT_STD = 0.02

_kernels_module: ModuleType | None = None


def _kernels() -> ModuleType:
    """Import ``graphpipe.kernels`` on first use, with an error that says what to do."""
    global _kernels_module
    if _kernels_module is None:
        try:
            import graphpipe.kernels as kernels
        except ImportError as exc:
            raise ImportError(
                "use_kernels=True needs graphpipe.kernels, which did not import "
                f"({exc}); install graphpipe or pass use_kernels=False"
            ) from exc
        _kernels_module = kernels
    return _kernels_module


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")


def _check_finite(name: str, value: object, positive: bool) -> None:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        sign = "positive" if positive else "non-negative"
        raise ValueError(f"{name} must be a {sign} finite number, got {name}={value!r}")


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of the model. Defaults give a ~0.2M-parameter byte-level model."""

    vocab_size: int = 256
    """Number of token ids; 256 for byte-level text."""
    hidden: int = 64
    """Width of the residual stream (model dimension)."""
    n_layers: int = 4
    """Number of decoder blocks."""
    n_heads: int = 4
    """Attention heads; ``hidden / n_heads`` must be an even head dimension (for RoPE)."""
    ffn_hidden: int | None = None
    """Width of the SwiGLU MLP; None picks the multiple of 16 nearest ``8/3 * hidden``."""
    max_seq_len: int = 256
    """Longest sequence the rotary tables cover."""
    eps: float = 1e-6
    """Epsilon inside every RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    use_kernels: bool = True
    """Norms, SwiGLU and loss through ``graphpipe.kernels`` (else plain torch ops)."""
    num_experts: int = 0
    """Experts per MoE block; 0: a dense model (every block has a SwiGLU MLP)."""
    top_k: int = 1
    """Experts each token is routed to (softmax top-k, weighted by the router probability)."""
    capacity_factor: float = 1.25
    """Slots per expert: ``ceil(capacity_factor * tokens * top_k / num_experts)`` (at most the
    micro-batch's token count); assignments beyond are dropped."""
    moe_every: int = 1
    """With experts: blocks ``moe_every - 1``, ``2 * moe_every - 1``, ... are MoE blocks (1:
    all of them); the others keep their dense MLP."""
    expert_ffn_hidden: int | None = None
    """Width of each expert's SwiGLU; None: ``ffn_dim``."""
    aux_loss_coef: float = 0.01
    """Weight of each MoE block's load-balancing loss in the training loss."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden", "n_layers", "n_heads", "max_seq_len"):
            _check_positive_int(name, getattr(self, name))
        if self.ffn_hidden is not None:
            _check_positive_int("ffn_hidden", self.ffn_hidden)
        if self.hidden % self.n_heads != 0:
            raise ValueError(
                f"hidden must be divisible by n_heads, got hidden={self.hidden}, "
                f"n_heads={self.n_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"the head dimension hidden / n_heads must be even for RoPE, got "
                f"hidden={self.hidden}, n_heads={self.n_heads} (head_dim={self.head_dim})"
            )
        for name in ("eps", "rope_theta"):
            _check_finite(name, getattr(self, name), positive=True)
        if not isinstance(self.use_kernels, bool):
            raise ValueError(f"use_kernels must be a bool, got use_kernels={self.use_kernels!r}")
        self._check_experts()

    def _check_experts(self) -> None:
        e = self.num_experts
        if not isinstance(e, int) or isinstance(e, bool) or e < 0:
            raise ValueError(f"num_experts must be an int >= 0, got num_experts={e!r}")
        _check_positive_int("moe_every", self.moe_every)
        if self.expert_ffn_hidden is not None:
            _check_positive_int("expert_ffn_hidden", self.expert_ffn_hidden)
        _check_positive_int("top_k", self.top_k)
        if e and self.top_k > e:
            raise ValueError(
                f"top_k must be <= num_experts, got top_k={self.top_k}, num_experts={e}"
            )
        _check_finite("capacity_factor", self.capacity_factor, positive=True)
        _check_finite("aux_loss_coef", self.aux_loss_coef, positive=False)

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """The SwiGLU width actually used: ``ffn_hidden`` or its default."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return max(16, 16 * round(8 * self.hidden / 3 / 16))

    @property
    def expert_ffn_dim(self) -> int:
        """The SwiGLU width of each expert: ``expert_ffn_hidden`` or ``ffn_dim``."""
        return self.expert_ffn_hidden if self.expert_ffn_hidden is not None else self.ffn_dim

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` (global) has experts instead of a dense MLP."""
        return self.num_experts > 0 and index % self.moe_every == self.moe_every - 1


# --------------------------------------------------------------------------- functional ops


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, use_kernels: bool) -> torch.Tensor:
    if use_kernels:
        return _kernels().rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rms_norm_residual(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, use_kernels: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``."""
    if use_kernels:
        return _kernels().rms_norm_residual(x, residual, weight, eps)
    new_residual = x + residual
    return F.rms_norm(new_residual, (x.shape[-1],), weight, eps), new_residual


def _swiglu(gate: torch.Tensor, up: torch.Tensor, use_kernels: bool) -> torch.Tensor:
    if use_kernels:
        return _kernels().swiglu(gate, up)
    return F.silu(gate) * up


def llama_loss(
    logits: torch.Tensor, labels: torch.Tensor, use_kernels: bool = True
) -> torch.Tensor:
    """Mean cross-entropy over all tokens (``ignore_index=-100``).

    logits: ``[B, T, V]`` (any leading shape); labels: int64 ``[B, T]``. Returns a scalar.
    """
    logits2d = logits.reshape(-1, logits.shape[-1])
    target = labels.reshape(-1)
    if use_kernels:
        return _kernels().cross_entropy(logits2d, target)
    return F.cross_entropy(logits2d, target, ignore_index=-100)


@dataclass(frozen=True)
class LlamaLoss:
    """``llama_loss`` as a picklable callable ``loss(logits, labels) -> scalar``; for an MoE
    model's ``(logits, aux)`` output, the cross-entropy plus ``aux``."""

    use_kernels: bool = True
    """Use ``graphpipe.kernels.cross_entropy`` (else ``F.cross_entropy``)."""

    def __call__(
        self, logits: torch.Tensor | tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor
    ) -> torch.Tensor:
        """Mean cross-entropy of ``logits`` ``[B, T, V]`` against ``labels`` ``[B, T]`` (plus
        the carried load-balancing loss ``aux`` ``[1]`` when given ``(logits, aux)``)."""
        if isinstance(logits, tuple):
            logits, aux = logits
            ce = llama_loss(logits, labels, use_kernels=self.use_kernels)
            return ce + aux.sum().to(ce.dtype)
        return llama_loss(logits, labels, use_kernels=self.use_kernels)


# --------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale and an optional fused residual add."""

    def __init__(self, dim: int, eps: float, use_kernels: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.use_kernels = use_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x / rms(x) * weight``."""
        return _rms_norm(x, self.weight, self.eps, self.use_kernels)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``, fused when kernels are on."""
        return _rms_norm_residual(x, residual, self.weight, self.eps, self.use_kernels)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, use_kernels={self.use_kernels}"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of shape ``[max_seq_len, head_dim]``, computed in float64 on CPU."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
    angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary position embeddings."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden, bias=False)
        self.proj = nn.Linear(config.hidden, config.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: ``[B, T, H]``; cos, sin: ``[T, head_dim]``. Returns ``[B, T, H]``."""
        b, t, h = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, T, head_dim]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, h))


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.use_kernels = config.use_kernels
        self.gate = nn.Linear(config.hidden, config.ffn_dim, bias=False)
        self.up = nn.Linear(config.hidden, config.ffn_dim, bias=False)
        self.down = nn.Linear(config.ffn_dim, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, H] -> [B, T, H]``."""
        return self.down(_swiglu(self.gate(x), self.up(x), self.use_kernels))


class LlamaBlock(nn.Module):
    """One pre-norm decoder block: ``x + attn(norm(x))`` then ``h + mlp(norm(h))``.

    The residual stream is carried as ``(delta, residual)``, the block's output being
    ``delta + residual``: the add is left to the next norm, which fuses it
    (``RMSNorm.add_and_norm``). ``residual=None`` means the input is ``delta`` alone.
    """

    def __init__(self, config: LlamaConfig, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden, config.eps, config.use_kernels)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden, config.eps, config.use_kernels)
        self.mlp = mlp if mlp is not None else MLP(config)

    def attend(
        self,
        delta: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block up to its MLP: ``(mlp_norm(h), h)`` with ``h = x + attn(norm(x))``."""
        if residual is None:
            residual = delta
            normed = self.attn_norm(delta)
        else:
            normed, residual = self.attn_norm.add_and_norm(delta, residual)
        return self.mlp_norm.add_and_norm(self.attn(normed, cos, sin), residual)

    def forward(
        self,
        delta: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(delta, residual)`` whose sum is the block's output."""
        normed, residual = self.attend(delta, residual, cos, sin)
        return self.mlp(normed), residual


class MoEBlock(LlamaBlock):
    """A decoder block whose MLP is an ``MoEMLP`` (experts over ``ep_group``).

    ``LlamaMoEStage`` runs it in chunks (``attend``, then the MoE parts); ``forward`` runs it
    whole and also returns the block's scaled load-balancing loss.
    """

    mlp: MoEMLP

    def __init__(self, config: LlamaConfig, ep_group: Any = None) -> None:
        swiglu = functools.partial(_swiglu, use_kernels=config.use_kernels)
        moe = MoEMLP(
            config.hidden,
            config.expert_ffn_dim,
            config.num_experts,
            config.top_k,
            config.capacity_factor,
            config.aux_loss_coef,
            swiglu,
            ep_group,
        )
        super().__init__(config, moe)

    def forward(  # type: ignore[override]
        self,
        delta: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns ``(delta, residual, aux)``: the block's output is ``delta + residual``."""
        normed, residual = self.attend(delta, residual, cos, sin)
        out, aux = self.mlp(normed)
        return out, residual, aux


class LlamaStage(nn.Module):
    """A contiguous slice of the model: optional embedding, some blocks, optional head.

    ``forward`` takes one tensor and returns one: tokens or hidden states in, hidden states or
    logits out (see the module docstring). ``first_layer`` is the global index of
    ``layers[0]``.
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(
        self,
        config: LlamaConfig,
        layers: list[LlamaBlock],
        *,
        first_layer: int,
        embed: nn.Embedding | None,
        norm: RMSNorm | None,
        head: nn.Linear | None,
    ) -> None:
        super().__init__()
        if (norm is None) != (head is None):
            raise ValueError("the final norm and the head go together")
        self.config = config
        self.first_layer = first_layer
        self.embed = embed
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.head = head
        cos, sin = _rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def is_first(self) -> bool:
        """Whether this stage holds the token embedding (takes tokens)."""
        return self.embed is not None

    @property
    def is_last(self) -> bool:
        """Whether this stage holds the final norm and the LM head (returns logits)."""
        return self.head is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens ``[B, T]`` or hidden ``[B, T, H]`` in; hidden or logits ``[B, T, V]`` out."""
        x, cos, sin = self._enter(x)
        delta, residual = x, None
        for layer in self.layers:
            delta, residual = layer(delta, residual, cos, sin)
        return self._leave(delta, residual)

    def _enter(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The embedding (stage 0) and the rotary tables: ``(hidden, cos, sin)``."""
        if self.embed is not None:
            x = self.embed(x)
        seq_len = x.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_len={self.config.max_seq_len}"
            )
        return x, self.rope_cos[:seq_len].to(x.dtype), self.rope_sin[:seq_len].to(x.dtype)

    def _leave(self, delta: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The stage's output from the residual stream: logits (last stage) or hidden."""
        if self.norm is not None and self.head is not None:
            if residual is None:
                return self.head(self.norm(delta))
            return self.head(self.norm.add_and_norm(delta, residual)[0])
        return delta if residual is None else delta + residual

    def extra_repr(self) -> str:
        last = self.first_layer + len(self.layers)
        return f"layers {self.first_layer}..{last - 1}" if self.layers else "no layers"


class LlamaMoEStage(LlamaStage):
    """A ``LlamaStage`` with MoE blocks, whose forward and backward run in chunks.

    ``forward(x, aux=None)`` takes tokens (stage 0) or ``(hidden, aux)`` and returns
    ``(hidden or logits, aux)`` (see the module docstring). Under grad mode the forward is
    chunked at every all-to-all (``graphpipe.models.overlap``): attention, router and
    dispatch layout; dispatch; experts; combine; the rest up to the next MoE block's dispatch
    (or the stage's end). The runtime's plain ``B`` / ``I`` backward runs those chunks in
    reverse; ``overlapped_forward_backward`` interleaves one micro-batch's forward chunks with
    another's backward chunks so that each all-to-all is in flight while the other
    micro-batch computes, with the same results as the F then the B.

    events: None, or a list that receives a ``MoEEvent`` at every chunk, exchange issue and
        exchange wait (share one list between a rank's stages to see pairs whole).
    chunked: False runs forward and backward unchunked (one autograd graph; the reference
        for the chunked path).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events: list | None = None
        self.chunked = True
        self._driving = False
        self._reached: Tape | None = None

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, aux: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens or ``(hidden, aux)`` in; ``(hidden or logits, aux)`` out."""
        tape = Tape(self) if self.chunked and torch.is_grad_enabled() else None
        return drain(self.forward_steps(tape, x, aux))

    def forward_steps(
        self, tape: Tape | None, x: torch.Tensor, aux: torch.Tensor | None = None
    ) -> Generator[Exchange, None, tuple[torch.Tensor, torch.Tensor]]:
        """The forward as a generator that yields each posted exchange (with ``tape``) and
        returns the stage's outputs; ``tape=None``: unchunked, blocking exchanges."""
        x, cos, sin = self._enter(x)
        if aux is None:
            dtype = torch.promote_types(x.dtype, torch.float32)
            aux = torch.zeros(1, dtype=dtype, device=x.device)
        delta, residual, last = x, None, -1
        for i, layer in enumerate(self.layers):
            if not isinstance(layer, MoEBlock):
                delta, residual = layer(delta, residual, cos, sin)
                continue
            index, moe = self.first_layer + i, layer.mlp
            normed, residual = layer.attend(delta, residual, cos, sin)
            shape = normed.shape
            buf, routing = moe.route(normed.reshape(-1, shape[-1]))
            aux, weights = aux + routing.aux, routing.weights
            if tape is None:
                back = moe.exchange(moe.experts(moe.exchange(moe.to_ranks(buf))))
            else:
                send, residual, weights, aux = tape.cut(
                    "attn", index, moe.to_ranks(buf), residual, weights, aux
                )
                ex = tape.exchange("dispatch", index, send, moe.ep_group)
                yield ex
                (y,) = tape.cut("experts", index, moe.experts(tape.received(send, ex)))
                ex = tape.exchange("combine", index, y, moe.ep_group)
                yield ex
                back = tape.received(y, ex)
            routing = routing._replace(weights=weights)
            delta = moe.combine(back.view(buf.shape), routing).view(shape)
            last = index
        outputs = (self._leave(delta, residual), aux)
        if tape is None:
            return outputs
        return tape.end("post", last, outputs)

    def chunked_forward(
        self, x: torch.Tensor, aux: torch.Tensor | None = None
    ) -> Generator[Exchange, None, tuple[torch.Tensor, torch.Tensor]]:
        """``forward_steps`` on a new tape."""
        return self.forward_steps(Tape(self), x, aux)

    @staticmethod
    def overlapped_forward_backward(
        fmod: LlamaMoEStage,
        inputs: tuple[torch.Tensor, ...],
        bmod: LlamaMoEStage,
        outputs: tuple[torch.Tensor, ...],
        grads: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """graphpipe's F&B hook: ``bmod``'s backward of ``outputs`` (with ``grads``)
        interleaved with ``fmod``'s forward of ``inputs``; returns the forward's outputs."""
        return overlapped_pair(fmod, fmod.chunked_forward, inputs, bmod, outputs, grads)


# --------------------------------------------------------------------------- building


@torch.no_grad()
def _init_parameters(
    embed: nn.Embedding, blocks: list[LlamaBlock], norm: RMSNorm, config: LlamaConfig, seed: int
) -> None:
    """Fill every parameter in a fixed order from one generator (float32, on CPU)."""
    gen = torch.Generator().manual_seed(seed)
    out_std = _INIT_STD / math.sqrt(2 * config.n_layers)

    def fill(param: torch.Tensor, std: float | None) -> None:
        if std is None:
            value = torch.ones(param.shape)
        else:
            value = torch.randn(param.shape, generator=gen) * std
        param.copy_(value)

    def fill_experts(param: torch.Tensor, moe: MoEMLP, std: float) -> None:
        # Every expert is drawn, whatever this rank holds: the weights do not depend on ep.
        value = torch.randn((moe.num_experts, *param.shape[1:]), generator=gen) * std
        param.copy_(value[moe.first_expert : moe.first_expert + moe.local_experts])

    fill(embed.weight, _INIT_STD)
    for block in blocks:
        fill(block.attn_norm.weight, None)
        fill(block.attn.qkv.weight, _INIT_STD)
        fill(block.attn.proj.weight, out_std)
        fill(block.mlp_norm.weight, None)
        if isinstance(block, MoEBlock):
            moe = block.mlp
            fill(moe.router.weight, _INIT_STD)
            fill_experts(moe.w_gate, moe, _INIT_STD)
            fill_experts(moe.w_up, moe, _INIT_STD)
            fill_experts(moe.w_down, moe, out_std)
            moe.mark_experts()
            continue
        fill(block.mlp.gate.weight, _INIT_STD)
        fill(block.mlp.up.weight, _INIT_STD)
        fill(block.mlp.down.weight, out_std)
    fill(norm.weight, None)


def build_stages(
    config: LlamaConfig,
    num_stages: int,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    ep_group: Any = None,
    layers_per_stage: Sequence[int] | None = None,
) -> list[LlamaStage]:
    """Build the model and cut it into ``num_stages`` ``LlamaStage`` modules.

    With ``config.num_experts`` the stages are ``LlamaMoEStage`` and each MoE block holds this
    rank's ``num_experts / ep`` experts of the expert-parallel ``ep_group`` (size ``ep``; None:
    all experts, local); the expert weights do not depend on ``ep`` either.

    The weights depend only on ``config`` and ``seed``, not on ``num_stages`` or ``dtype``
    (they are drawn in float32 in a fixed order, then cast), and building does not touch the
    global RNG. The head of the last stage is an ``nn.Linear`` whose ``weight`` is the very
    ``Parameter`` of stage 0's embedding, so ``nn.Sequential(*stages)`` is the whole model.
    Each stage declares which keys of ``build_model`` it holds (``layers.j`` is
    ``layers.{first_layer + j}``; ``graphpipe.keymap.set_unsplit_keys``), so that
    ``graphpipe.checkpoint.export_state_dict`` of a checkpoint loads into ``build_model``.
    Blocks are spread as ``layers_per_stage`` says: a list of ``num_stages`` counts (stage
    ``s`` holds the next ``layers_per_stage[s]`` blocks; every middle stage at least one, the
    first and the last may hold none besides the embedding or the head; ``graphpipe.plan_stages``
    chooses one from measured costs), or None for the even split of
    ``graphpipe.models.layers_per_stage``. It raises ``ValueError`` when
    ``config.n_layers < num_stages - 2``, or naming the counts that do not fit.
    """
    if layers_per_stage is None:
        counts = _even_split(config.n_layers, num_stages)
    else:
        counts = check_layers_per_stage(layers_per_stage, config.n_layers, num_stages)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got seed={seed!r}")
    if config.use_kernels:
        _kernels()  # fail now, not in the first forward
    device = torch.device("cpu") if device is None else torch.device(device)

    with torch.device("meta"):  # no memory, no global-RNG draws for the default inits
        embed = nn.Embedding(config.vocab_size, config.hidden)
        blocks = [
            MoEBlock(config, ep_group) if config.is_moe_layer(i) else LlamaBlock(config)
            for i in range(config.n_layers)
        ]
        norm = RMSNorm(config.hidden, config.eps, config.use_kernels)
    for module in (embed, *blocks, norm):
        module.to_empty(device=device)
        module.to(dtype=dtype)
    _init_parameters(embed, blocks, norm, config, seed)
    reset_dropped_tokens(blocks)  # to_empty left the counters uninitialized
    head = nn.Linear(config.hidden, config.vocab_size, bias=False, device="meta")
    head.weight = embed.weight  # tied: one Parameter shared by the first and last stage

    stages: list[LlamaStage] = []
    start = 0
    kind = LlamaMoEStage if config.num_experts else LlamaStage
    for index, count in enumerate(counts):
        last = index == num_stages - 1
        stage = kind(
            config,
            blocks[start : start + count],
            first_layer=start,
            embed=embed if index == 0 else None,
            norm=norm if last else None,
            head=head if last else None,
        )
        stage.rope_cos = stage.rope_cos.to(device=device, dtype=dtype)
        stage.rope_sin = stage.rope_sin.to(device=device, dtype=dtype)
        # Its blocks are layers.0.. here and layers.start.. in the unsplit model.
        set_unsplit_keys(stage, {f"layers.{j}": f"layers.{start + j}" for j in range(count)})
        stages.append(stage)
        start += count
    return stages


def build_model(
    config: LlamaConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    ep_group: Any = None,
) -> LlamaStage:
    """The unsplit model: ``build_stages(config, 1, ...)[0]`` (tokens in, logits out, or
    ``(logits, aux)`` with experts)."""
    return build_stages(config, 1, seed=seed, dtype=dtype, device=device, ep_group=ep_group)[0]


def num_parameters(stages: Iterable[nn.Module] | nn.Module) -> int:
    """Number of scalar parameters across ``stages``, a tied parameter counted once."""
    return sum(param.numel() for param in unique_parameters(stages))

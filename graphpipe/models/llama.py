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
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LlamaBlock",
    "LlamaConfig",
    "LlamaLoss",
    "LlamaStage",
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
            value = getattr(self, name)
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"{name} must be a positive finite number, got {name}={value!r}")
        if not isinstance(self.use_kernels, bool):
            raise ValueError(f"use_kernels must be a bool, got use_kernels={self.use_kernels!r}")

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
    """``llama_loss`` as a picklable callable ``loss(logits, labels) -> scalar``."""

    use_kernels: bool = True
    """Use ``graphpipe.kernels.cross_entropy`` (else ``F.cross_entropy``)."""

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of ``logits`` ``[B, T, V]`` against ``labels`` ``[B, T]``."""
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

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden, config.eps, config.use_kernels)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden, config.eps, config.use_kernels)
        self.mlp = MLP(config)

    def forward(
        self,
        delta: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(delta, residual)`` whose sum is the block's output."""
        if residual is None:
            residual = delta
            normed = self.attn_norm(delta)
        else:
            normed, residual = self.attn_norm.add_and_norm(delta, residual)
        normed, residual = self.mlp_norm.add_and_norm(self.attn(normed, cos, sin), residual)
        return self.mlp(normed), residual


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
        if self.embed is not None:
            x = self.embed(x)
        seq_len = x.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_len={self.config.max_seq_len}"
            )
        cos = self.rope_cos[:seq_len].to(x.dtype)
        sin = self.rope_sin[:seq_len].to(x.dtype)
        delta, residual = x, None
        for layer in self.layers:
            delta, residual = layer(delta, residual, cos, sin)
        if self.norm is not None and self.head is not None:
            if residual is None:
                return self.head(self.norm(delta))
            return self.head(self.norm.add_and_norm(delta, residual)[0])
        return delta if residual is None else delta + residual

    def extra_repr(self) -> str:
        last = self.first_layer + len(self.layers)
        return f"layers {self.first_layer}..{last - 1}" if self.layers else "no layers"


# --------------------------------------------------------------------------- building


def layers_per_stage(n_layers: int, num_stages: int) -> list[int]:
    """How many blocks each stage gets: as even as possible, middle stages first.

    Stage 0 also holds the embedding and the last stage the final norm and the head, so when
    the layers do not divide evenly the spare ones go to the middle stages, then to stage 0,
    then to the last stage. Every middle stage must get at least one block (a stage with no
    parameters would be a pure relay), so ``n_layers >= num_stages - 2`` is required; the
    first and last stages may end up with only the embedding or the head.
    """
    _check_positive_int("num_stages", num_stages)
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 0:
        raise ValueError(f"n_layers must be a non-negative int, got n_layers={n_layers!r}")
    if n_layers < num_stages - 2:
        raise ValueError(
            f"n_layers={n_layers} is too few for num_stages={num_stages}: every middle stage "
            f"needs a block, so n_layers must be >= num_stages - 2 = {num_stages - 2}"
        )
    base, spare = divmod(n_layers, num_stages)
    counts = [base] * num_stages
    order = [*range(1, num_stages - 1), 0, num_stages - 1]
    for stage in order[:spare]:
        counts[stage] += 1
    return counts


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

    fill(embed.weight, _INIT_STD)
    for block in blocks:
        fill(block.attn_norm.weight, None)
        fill(block.attn.qkv.weight, _INIT_STD)
        fill(block.attn.proj.weight, out_std)
        fill(block.mlp_norm.weight, None)
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
) -> list[LlamaStage]:
    """Build the model and cut it into ``num_stages`` ``LlamaStage`` modules.

    The weights depend only on ``config`` and ``seed``, not on ``num_stages`` or ``dtype``
    (they are drawn in float32 in a fixed order, then cast), and building does not touch the
    global RNG. The head of the last stage is an ``nn.Linear`` whose ``weight`` is the very
    ``Parameter`` of stage 0's embedding, so ``nn.Sequential(*stages)`` is the whole model.
    Blocks are spread as ``layers_per_stage`` says; it raises ``ValueError`` when
    ``config.n_layers < num_stages - 2``.
    """
    counts = layers_per_stage(config.n_layers, num_stages)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be an int, got seed={seed!r}")
    if config.use_kernels:
        _kernels()  # fail now, not in the first forward
    device = torch.device("cpu") if device is None else torch.device(device)

    with torch.device("meta"):  # no memory, no global-RNG draws for the default inits
        embed = nn.Embedding(config.vocab_size, config.hidden)
        blocks = [LlamaBlock(config) for _ in range(config.n_layers)]
        norm = RMSNorm(config.hidden, config.eps, config.use_kernels)
    for module in (embed, *blocks, norm):
        module.to_empty(device=device)
        module.to(dtype=dtype)
    _init_parameters(embed, blocks, norm, config, seed)
    head = nn.Linear(config.hidden, config.vocab_size, bias=False, device="meta")
    head.weight = embed.weight  # tied: one Parameter shared by the first and last stage

    stages: list[LlamaStage] = []
    start = 0
    for index, count in enumerate(counts):
        last = index == num_stages - 1
        stage = LlamaStage(
            config,
            blocks[start : start + count],
            first_layer=start,
            embed=embed if index == 0 else None,
            norm=norm if last else None,
            head=head if last else None,
        )
        stage.rope_cos = stage.rope_cos.to(device=device, dtype=dtype)
        stage.rope_sin = stage.rope_sin.to(device=device, dtype=dtype)
        stages.append(stage)
        start += count
    return stages


def build_model(
    config: LlamaConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> LlamaStage:
    """The unsplit model: ``build_stages(config, 1, ...)[0]`` (tokens in, logits out)."""
    return build_stages(config, 1, seed=seed, dtype=dtype, device=device)[0]


def unique_parameters(stages: Iterable[nn.Module] | nn.Module) -> list[nn.Parameter]:
    """The parameters of ``stages`` in order, each once (the tied embedding/head weight is in
    the first and the last stage); what to hand an optimizer that sees several stages."""
    modules = [stages] if isinstance(stages, nn.Module) else list(stages)
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for param in module.parameters():
            seen.setdefault(id(param), param)
    return list(seen.values())


def num_parameters(stages: Iterable[nn.Module] | nn.Module) -> int:
    """Number of scalar parameters across ``stages``, a tied parameter counted once."""
    return sum(param.numel() for param in unique_parameters(stages))

"""Hugging Face causal LMs split into pipeline stages, and HF's causal-LM loss.

``split_hf_causal_lm(model, num_stages)`` cuts a transformers causal LM into
``HFCausalLMStage`` modules by decoder layer. The stages run the model's own modules: the
Llama layout (``model.model.embed_tokens``, ``.layers``, ``.norm``, ``.rotary_emb`` and
``model.lm_head``: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma 2, Gemma 3 text, Phi-3,
OLMo 2, Granite) or GPT-2's (``model.transformer.wte``, ``.wpe``, ``.drop``, ``.h``,
``.ln_f``). What the families' top models do around those modules the stages read from the
config and the model: Gemma's embedding scale is inside its embedding module, Granite's
``embedding_multiplier`` and ``logits_scaling``, Gemma's ``final_logit_softcapping``, a
rotary embedding per attention kind (Gemma 3's rope bases, when the rotary module's
``forward`` takes ``layer_type``), the sliding window of each layer (``config.layer_types``,
else every layer when ``config.sliding_window`` is set), GPT-2's learned positions; what
differs inside a decoder layer (pre/post feed-forward norms, query/key norms, attention
soft-capping, Granite's residual and attention multipliers, routed experts) is the layer's
own. The families of ``SUPPORTED_MODEL_TYPES`` are tested against the unsplit model. Another
``config.model_type`` in one of the two layouts is checked when it is split: the model runs
once on a probe (two rows of 8 tokens, or past a small sliding window; no gradients, eval
mode) with hooks on its decoder layers and final norm, and everything its top model hands
the layers (the embedding's output, each layer's mask, rotary embedding, position ids and any
other argument, the hidden states between layers) and makes of the last layer's output (the
logits) must equal, value for value, what the stages compute from the same modules; the
first that differs is named in the ``ValueError`` (Cohere's ``logit_scale``, a top model that
scales its embedding). What the probe cannot see (a difference that only shows at other
lengths or values) is not checked: the tested families are the ones vouched for.

* stage 0 takes int64 ``input_ids`` ``[B, T]`` and returns hidden states ``[B, T, H]``;
* middle stages map hidden states to hidden states;
* the last stage returns logits ``[B, T, V]`` (the final norm and the head).

What HF's top model computes once per forward (position ids, rotary embeddings, the causal
mask) every stage computes for itself, from the shape of its input and the keyword tensors
``attention_mask`` and ``position_ids``, which the pipeline hands every stage (they are given
on every rank and never cross a stage edge). The mask is built with tensor ops only, exactly
the values HF's ``masking_utils`` builds for eager (0 / ``finfo(dtype).min``, additive) and
sdpa (bool) attention, but without calling it: its ``create_causal_mask`` (transformers 5)
looks for packed sequences with a host read (``find_packed_sequence_indices``:
``(mask[:, -1] == 0).all()`` in a Python ``if`` unless tracing), and its sdpa mask skips
itself when no token is padded (``_ignore_causal_mask_sdpa``: ``fast_all(padding_mask)``, a
device-to-host read); a captured step can do neither, and every micro-batch of a captured
step must take the same path. So the packed form is always built, and with an
``attention_mask`` the sdpa stages always pass the mask (HF passes none when nothing is
padded: the same attention, through another kernel).

``causal_lm_loss`` is HF's ``ForCausalLMLoss`` (labels shifted left, ``ignore_index=-100``,
logits upcast with ``.float()``), as a ``loss_fn`` for either ``loss_reduction``; with
``num_items_in_batch`` (``causal_lm_num_items``) it is the token-weighted loss whose sum over
micro-batches and replicas is HF's mean over the whole batch's valid tokens.

transformers is not imported here: the stages call the model's own modules, and everything
else is read off the model's attributes and config.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from graphpipe.keymap import set_unsplit_keys
from graphpipe.models.llama import layers_per_stage as _even_split
from graphpipe.roles import mark_tied

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "HFCausalLMStage",
    "causal_lm_loss",
    "causal_lm_num_items",
    "split_hf_causal_lm",
]

SUPPORTED_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "granite",
    "gpt2",
)
"""``config.model_type`` of the models whose decoder stack ``HFCausalLMStage`` reproduces,
each tested against the unsplit model (other models with the same module names may scale the
embedding or norm differently in their top model's forward, which the stages do not run)."""

_ATTENTION = ("eager", "sdpa")
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class _Layout:
    """Where a causal LM keeps the modules the stages are made of, below ``base``."""

    like: str  # the class whose layout this is, for the error
    base: str
    embed: str
    layers: str
    norm: str
    rotary: str | None  # rotary position embeddings (computed per stage)
    positions: str | None = None  # learned position embeddings (added to the tokens')
    dropout: str | None = None  # the embedding's dropout

    def modules(self) -> tuple[tuple[str, type | None], ...]:
        kinds = [
            (self.base, None),
            (f"{self.base}.{self.embed}", nn.Embedding),
            (f"{self.base}.{self.layers}", nn.ModuleList),
            (f"{self.base}.{self.norm}", nn.Module),
        ]
        if self.rotary is not None:
            kinds.append((f"{self.base}.{self.rotary}", nn.Module))
        if self.positions is not None:
            kinds.append((f"{self.base}.{self.positions}", nn.Embedding))
        if self.dropout is not None:
            kinds.append((f"{self.base}.{self.dropout}", nn.Module))
        return (*kinds, ("lm_head", nn.Linear))


_LLAMA = _Layout("LlamaForCausalLM", "model", "embed_tokens", "layers", "norm", "rotary_emb")
_GPT2 = _Layout("GPT2LMHeadModel", "transformer", "wte", "h", "ln_f", None, "wpe", "drop")


def _attr(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj


def _missing(model: nn.Module, layout: _Layout) -> list[str]:
    missing = []
    for path, kind in layout.modules():
        value = _attr(model, path)
        if value is None or (kind is not None and not isinstance(value, kind)):
            got = "missing" if value is None else type(value).__name__
            want = f" ({kind.__name__})" if kind is not None else ""
            missing.append(f"{path}{want}: {got}")
    return missing


def _find_layout(model: nn.Module) -> _Layout:
    """The layout of ``model`` (Llama's or GPT-2's): ``ValueError`` naming the missing
    modules of the one it is nearer to."""
    layout = _GPT2 if hasattr(model, "transformer") and not hasattr(model, "model") else _LLAMA
    missing = _missing(model, layout)
    if missing:
        children = ", ".join(n for n, _ in model.named_children()) or "none"
        raise ValueError(
            f"split_hf_causal_lm: {type(model).__name__} does not have the layout of a "
            f"{layout.like}: {'; '.join(missing)} (its children: {children})"
        )
    return layout


def _layer_types(config: Any, n_layers: int) -> list[str]:
    """Each decoder layer's attention kind, as the HF model picks its mask: ``layer_types``
    (Qwen2/3), else every layer sliding when ``sliding_window`` is set (Mistral), else full."""
    types = getattr(config, "layer_types", None)
    if types is None:
        window = getattr(config, "sliding_window", None)
        types = ["sliding_attention" if window is not None else "full_attention"] * n_layers
    types = list(types)[:n_layers]
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown:
        raise ValueError(
            f"split_hf_causal_lm: layer types {unknown} are not supported (only {_LAYER_TYPES})"
        )
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in types and (not isinstance(window, int) or window < 1):
        raise ValueError(
            f"split_hf_causal_lm: sliding-attention layers need config.sliding_window, a "
            f"positive int, got {window!r}"
        )
    return types


def _check_config(config: Any) -> None:
    """What a supported family's config may switch on that the stages do not reproduce."""
    if getattr(config, "is_causal", True) is False:
        raise ValueError("split_hf_causal_lm: config.is_causal=False (bidirectional attention)")
    if getattr(config, "use_bidirectional_attention", None):
        raise ValueError(
            "split_hf_causal_lm: config.use_bidirectional_attention=True (bidirectional "
            "attention): the stages build causal masks only"
        )
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            "split_hf_causal_lm: config.output_router_logits=True: HF adds the router's "
            "auxiliary load-balancing loss (router_aux_loss_coef) to the loss, which the "
            "stages do not compute; set it False to train on the language-model loss alone"
        )


def _check_attention(config: Any) -> str:
    impl = getattr(config, "_attn_implementation", None)
    if impl not in _ATTENTION:
        raise ValueError(
            f"HFCausalLMStage supports attn_implementation 'eager' or 'sdpa', got {impl!r}"
        )
    return impl


def _causal_allowed(
    batch: int,
    seq: int,
    device: torch.device,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    window: int | None,
) -> torch.Tensor:
    """Which keys each query sees, ``[B, 1, T, T]`` bool, as HF's ``create_causal_mask`` (or
    ``create_sliding_window_causal_mask`` with ``window``) decides without a cache.

    With an ``attention_mask``: causal (and in the window) and the key not padded. Without
    one, HF looks for packed sequences in the position ids (a new sequence wherever the
    position does not go up by one) and keeps each query within its own sequence, comparing
    positions; for unpacked rows (positions ``arange(T) + c``) that is the causal mask. Here
    the packed form is always built: no branch on the values."""
    if attention_mask is None and position_ids is not None:
        pos = position_ids.expand(batch, -1)
        start = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1
        sequence = start.cumsum(-1)
        q, k = pos[:, :, None], pos[:, None, :]
        allowed = (k <= q) & (sequence[:, :, None] == sequence[:, None, :])
    else:
        idx = torch.arange(seq, device=device)
        q, k = idx[:, None], idx[None, :]
        allowed = (k <= q)[None]
        if attention_mask is not None:
            allowed = allowed & attention_mask.to(device=device, dtype=torch.bool)[:, None, :]
    if window is not None:
        allowed = allowed & (k > q - window)
    return allowed.expand(batch, seq, seq)[:, None]


class HFCausalLMStage(nn.Module):
    """A slice of a Hugging Face causal LM: optional embedding, decoder layers, optional final
    norm and head, sharing the model's modules (no copies).

    ``forward(x, *, attention_mask=None, position_ids=None)``: ``input_ids`` ``[B, T]``
    (first stage) or hidden states ``[B, T, H]`` in; hidden states or logits ``[B, T, V]``
    out. ``attention_mask``: ``[B, T]``, 1 (or True) for a real token, 0 for padding, as a
    tokenizer returns it; ``position_ids``: ``[B, T]`` int (default ``arange(T)``, what HF
    uses when none are given). ``first_layer`` is the global index of ``layers[0]``.

    What the families' top models add around the modules is read from the config: after the
    embedding ``config.embedding_multiplier`` (Granite), the learned position embeddings
    ``embed_positions`` and the embedding dropout ``embed_dropout`` (GPT-2); after the head
    ``config.logits_scaling`` (Granite: the logits divided by it) and
    ``config.final_logit_softcapping`` (Gemma 2/3: ``tanh(logits / c) * c``). A rotary
    embedding whose ``forward`` takes ``layer_type`` (Gemma 3: a rope base per attention
    kind) is computed once per kind of this stage's layers; ``rotary_emb=None`` (GPT-2)
    passes the layers no ``position_embeddings``.

    checkpoint_layers: recompute each decoder layer in the backward
        (``torch.utils.checkpoint``, non-reentrant) instead of keeping its activations.
    """

    def __init__(
        self,
        config: Any,
        layers: list[nn.Module],
        *,
        first_layer: int,
        layer_types: list[str],
        rotary_emb: nn.Module | None,
        embed_tokens: nn.Embedding | None = None,
        embed_positions: nn.Embedding | None = None,
        embed_dropout: nn.Module | None = None,
        norm: nn.Module | None = None,
        lm_head: nn.Linear | None = None,
        checkpoint_layers: bool = False,
    ) -> None:
        super().__init__()
        if (norm is None) != (lm_head is None):
            raise ValueError("the final norm and the head go together")
        if embed_tokens is None and (embed_positions is not None or embed_dropout is not None):
            raise ValueError("the position embeddings and the embedding dropout need the embedding")
        if len(layer_types) != len(layers):
            raise ValueError(f"{len(layers)} layers but {len(layer_types)} layer types")
        self.config = config
        self.first_layer = first_layer
        self.layer_types = tuple(layer_types)
        self.checkpoint_layers = checkpoint_layers
        self.embed_tokens = embed_tokens
        self.embed_positions = embed_positions
        self.embed_dropout = embed_dropout
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = lm_head
        self.rotary_emb = rotary_emb  # buffers only, none of them persistent
        forward = getattr(rotary_emb, "forward", None)
        self._rope_per_kind = forward is not None and (
            "layer_type" in inspect.signature(forward).parameters
        )
        self._embedding_multiplier = getattr(config, "embedding_multiplier", None)
        self._logits_scaling = getattr(config, "logits_scaling", None)
        self._softcap = getattr(config, "final_logit_softcapping", None)

    @property
    def is_first(self) -> bool:
        """Whether this stage holds the embedding (takes ``input_ids``)."""
        return self.embed_tokens is not None

    @property
    def is_last(self) -> bool:
        """Whether this stage holds the final norm and the head (returns logits)."""
        return self.lm_head is not None

    def forward(
        self,
        x: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids`` or hidden states in; hidden states or logits out."""
        batch, seq = x.shape[:2]
        for name, t in (("attention_mask", attention_mask), ("position_ids", position_ids)):
            if t is not None and tuple(t.shape) != (batch, seq):
                raise ValueError(
                    f"{name} must have the shape [batch, seq] = {[batch, seq]} of the "
                    f"micro-batch, got {list(t.shape)}"
                )
        positions = position_ids
        if positions is None:
            positions = torch.arange(seq, device=x.device).unsqueeze(0)
        hidden = self._embed(x, positions) if self.embed_tokens is not None else x
        if len(self.layers):
            kw = self._layer_kwargs(hidden, attention_mask, position_ids, positions)
            recompute = self.checkpoint_layers and torch.is_grad_enabled()
            for layer, kind in zip(self.layers, self.layer_types):
                if recompute:
                    out = checkpoint(layer, hidden, use_reentrant=False, **kw[kind])
                else:
                    out = layer(hidden, **kw[kind])
                hidden = out[0] if isinstance(out, tuple) else out
        if self.lm_head is not None:
            hidden = self._head(hidden)
        return hidden

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The first decoder layer's input, as the top model computes it."""
        hidden = self.embed_tokens(ids)
        if self._embedding_multiplier is not None:
            hidden = hidden * self._embedding_multiplier
        if self.embed_positions is not None:
            hidden = hidden + self.embed_positions(positions).to(hidden.device)
        if self.embed_dropout is not None:
            hidden = self.embed_dropout(hidden)
        return hidden

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of the last decoder layer's output, as the top model computes them."""
        logits = self.lm_head(self.norm(hidden))
        if self._logits_scaling is not None:
            logits = logits / self._logits_scaling
        if self._softcap is not None:
            logits = logits / self._softcap
            logits = torch.tanh(logits)
            logits = logits * self._softcap
        return logits

    def _layer_kwargs(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        positions: torch.Tensor,
    ) -> dict[str, dict[str, Any]]:
        """The keyword arguments of a decoder layer of each attention kind of this stage."""
        kinds = list(dict.fromkeys(self.layer_types))
        rope: dict[str, Any] = {}
        if self.rotary_emb is not None and self._rope_per_kind:
            rope = {kind: self.rotary_emb(hidden, positions, kind) for kind in kinds}
        elif self.rotary_emb is not None:
            cos_sin = self.rotary_emb(hidden, positions)
            rope = dict.fromkeys(kinds, cos_sin)
        masks = self._masks(hidden, attention_mask, position_ids)
        out = {}
        for kind in kinds:
            kw: dict[str, Any] = dict(attention_mask=masks[kind], position_ids=positions)
            if self.rotary_emb is not None:
                kw["position_embeddings"] = rope[kind]
            out[kind] = kw
        return out

    def _masks(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> dict[str, torch.Tensor | None]:
        """The mask of each attention kind this stage's layers use, as the attention
        implementation takes it: eager an additive float mask, sdpa a bool one, or None where
        HF passes none (sdpa without a mask or position ids: its ``is_causal`` path)."""
        impl = _check_attention(self.config)
        batch, seq = hidden.shape[:2]
        masks: dict[str, torch.Tensor | None] = {}
        for kind in dict.fromkeys(self.layer_types):
            window = self.config.sliding_window if kind == "sliding_attention" else None
            plain = attention_mask is None and position_ids is None
            if impl == "sdpa" and plain and (window is None or seq < window):
                masks[kind] = None  # as HF: a shape decision, no value read
                continue
            allowed = _causal_allowed(
                batch, seq, hidden.device, attention_mask, position_ids, window
            )
            if impl == "sdpa":
                masks[kind] = allowed
            else:
                zero = torch.zeros((), dtype=hidden.dtype, device=hidden.device)
                masks[kind] = torch.where(allowed, zero, torch.finfo(hidden.dtype).min)
        return masks

    def extra_repr(self) -> str:
        last = self.first_layer + len(self.layers)
        return f"layers {self.first_layer}..{last - 1}" if self.layers else "no layers"


_IGNORED_LAYER_KWARGS = frozenset(
    {"cache", "past_key_values", "past_key_value", "use_cache", "cache_position"}
)
"""Keyword arguments a top model may pass its decoder layers that a step without a KV cache
does not use (None or False there)."""


def _same(a: Any, b: Any) -> bool:
    """Equal values (NaN where the other is NaN), tensor by tensor through tuples."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point():
            return bool(((a == b) | (a.isnan() & b.isnan())).all())
        return torch.equal(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return a == b


def _probe_length(config: Any) -> int:
    """The probe's sequence length: 8, or past the smallest sliding window up to 64, within
    the model's positions."""
    length = 8
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and 0 < window < 63:
        length = max(length, window + 2)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 0)
    return min(length, limit) if isinstance(limit, int) and limit > 1 else length


def _check_untested(model: nn.Module, probe: HFCausalLMStage, model_type: Any) -> None:
    """For a ``model_type`` outside ``SUPPORTED_MODEL_TYPES``: run the model once (no
    gradients, eval mode, two rows of ``_probe_length`` tokens, the second right-padded)
    and check that what its top model hands each decoder layer and makes of the last one's
    output is what the stages compute, value for value: the embedding's output, each layer's
    mask, rotary embedding, position ids and other arguments, the hidden states between the
    layers and the logits. ``ValueError`` naming the first that differs."""
    name = f"{type(model).__name__} (config.model_type={model_type!r})"
    weight = probe.embed_tokens.weight
    if weight.device.type == "meta":
        raise ValueError(
            f"split_hf_causal_lm: {name} is not one of the tested families "
            f"{SUPPORTED_MODEL_TYPES}, whose forward is checked against the stages' on a "
            "probe, which needs the weights: load them before splitting (not on the meta device)"
        )
    seq = _probe_length(model.config)
    vocab = int(getattr(model.config, "vocab_size", weight.shape[0]))
    ids = (torch.arange(2 * seq, device=weight.device).reshape(2, seq) * 7 + 1) % vocab
    mask = torch.ones_like(ids)
    mask[1, -1] = 0  # padding: HF's sdpa gets a mask too, as the stages give one
    seen: list[tuple[tuple, dict]] = []
    outs: list[Any] = []
    norm_in: list[torch.Tensor] = []
    hooks = []
    for layer in probe.layers:
        hooks.append(
            layer.register_forward_pre_hook(
                lambda _m, a, k: seen.append((a, dict(k))), with_kwargs=True
            )
        )
        hooks.append(layer.register_forward_hook(lambda _m, _a, out: outs.append(out)))
    hooks.append(probe.norm.register_forward_pre_hook(lambda _m, a: norm_in.append(a[0])))
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            try:
                logits = model(ids, attention_mask=mask, use_cache=False).logits
            except Exception as e:  # the model's own forward: anything
                raise ValueError(
                    f"split_hf_causal_lm: {name} is not one of the tested families, and its "
                    f"own forward on a probe of {seq} tokens (to check it against the "
                    f"stages') raised {type(e).__name__}: {e}"
                ) from e
            positions = torch.arange(seq, device=ids.device).unsqueeze(0)
            first = probe._embed(ids, positions)
            ours = probe._layer_kwargs(first, mask, None, positions)
            last = outs[-1][0] if isinstance(outs[-1], tuple) else outs[-1]
            head = probe._head(last)
    finally:
        for h in hooks:
            h.remove()
        for m, mode in modes.items():
            m.train(mode)

    def refuse(what: str) -> None:
        raise ValueError(
            f"split_hf_causal_lm: {name} is not one of the tested families "
            f"{SUPPORTED_MODEL_TYPES}, and its forward differs from the stages' on a probe of "
            f"{seq} tokens: {what}"
        )

    if len(seen) != len(probe.layers):
        refuse(f"it ran {len(seen)} decoder layer calls for {len(probe.layers)} layers")
    previous = first
    for i, ((args, kwargs), out) in enumerate(zip(seen, outs)):
        hidden = args[0] if args else kwargs.pop("hidden_states", None)
        if not _same(hidden, previous):
            what = "the embedding's output" if i == 0 else f"decoder layer {i - 1}'s output"
            refuse(f"decoder layer {i}'s input is not {what} (the model changes it between)")
        if any(a is not None for a in args[1:]):
            refuse(f"it passes decoder layer {i} positional arguments besides the hidden states")
        expected = ours[probe.layer_types[i]]
        for key, value in kwargs.items():
            if key in expected:
                if not _same(value, expected[key]):
                    refuse(f"decoder layer {i} gets another {key}")
            elif key not in _IGNORED_LAYER_KWARGS and value is not None and value is not False:
                refuse(f"it passes decoder layer {i} {key}, which the stages do not")
        missing = [k for k in expected if k not in kwargs and expected[k] is not None]
        if missing:
            refuse(f"it does not pass decoder layer {i} {', '.join(missing)}")
        previous = out[0] if isinstance(out, tuple) else out
    if not norm_in or not _same(norm_in[-1], previous):
        refuse("the final norm's input is not the last decoder layer's output")
    if not _same(head, logits):
        refuse("the logits are not the head's output as the stages compute it")


def _check_counts(counts: Any, num_stages: int, n_layers: int) -> list[int]:
    """``layers_per_stage`` as given: ``ValueError`` naming the value unless it is a list of
    ``num_stages`` non-negative ints summing to ``n_layers``, every middle stage holding one
    at least (the first and the last stage may hold only the embedding or the head)."""
    what = f"split_hf_causal_lm: layers_per_stage={counts!r}"
    if not isinstance(counts, (list, tuple)) or not all(
        isinstance(c, int) and not isinstance(c, bool) for c in counts
    ):
        raise ValueError(f"{what} must be a list of ints, one per stage")
    if len(counts) != num_stages:
        raise ValueError(f"{what} has {len(counts)} entries for num_stages={num_stages}")
    negative = [i for i, c in enumerate(counts) if c < 0]
    if negative:
        raise ValueError(f"{what} has negative counts (stages {negative})")
    if sum(counts) != n_layers:
        raise ValueError(
            f"{what} sums to {sum(counts)}, but the model has {n_layers} decoder layers"
        )
    empty = [i for i, c in enumerate(counts) if c == 0 and 0 < i < num_stages - 1]
    if empty:
        raise ValueError(
            f"{what} leaves middle stages {empty} without a decoder layer (only the first and "
            "the last stage may hold none besides the embedding or the head)"
        )
    return list(counts)


def split_hf_causal_lm(
    model: nn.Module,
    num_stages: int,
    *,
    layers_per_stage: list[int] | None = None,
    checkpoint_layers: bool = False,
) -> list[HFCausalLMStage]:
    """Split a Hugging Face causal LM (a family of ``SUPPORTED_MODEL_TYPES``: Llama,
    Mistral, Qwen2, Qwen3, Qwen3-MoE, Gemma 2, Gemma 3 text, Phi-3, OLMo 2, Granite, GPT-2)
    into ``num_stages`` ``HFCausalLMStage`` modules by decoder layer; they share the model's
    parameters.

    The embedding goes to stage 0, the final norm and the head to the last stage, and the
    decoder layers are spread as evenly as possible: every stage gets
    ``num_layers // num_stages``, and the remaining ones go one each to the middle stages
    first, then to stage 0, then to the last stage (the first and last stages also hold the
    embedding and the head; ``graphpipe.models.layers_per_stage``).

    layers_per_stage: the number of decoder layers of each stage instead, a list of
        ``num_stages`` ints summing to the number of decoder layers, in order (a planner's
        split, or one chosen by hand); every middle stage holds one at least, the first and
        the last stage may hold none (only the embedding, or only the final norm and head).

    Tied embeddings (``lm_head.weight`` is ``model.embed_tokens.weight``, or GPT-2's
    ``transformer.wte.weight``, as with
    ``tie_word_embeddings``) stay one Parameter in the stages, and that Parameter is marked
    with ``graphpipe.mark_tied``: on one rank (DualPipeV: stage 0 and the last stage) it is
    simply shared, across ranks (1F1B) each rank's copy is kept equal. Each stage declares
    its keys in the HF model (``model.layers.{i}``, ``transformer.h.{i}``, ...;
    ``graphpipe.keymap``), so that
    ``graphpipe.checkpoint.export_state_dict`` of a checkpoint loads into the HF model with
    ``load_state_dict(strict=True)`` (then ``save_pretrained``).

    checkpoint_layers: activation checkpointing per decoder layer (non-reentrant
        ``torch.utils.checkpoint``; works with the pipeline's split backward). Leave HF's
        own ``gradient_checkpointing_enable()`` off: it is refused here.

    A ``config.model_type`` outside ``SUPPORTED_MODEL_TYPES`` is checked on a probe first
    (the module docstring says how; it needs the weights, not the meta device).

    Raises ``ValueError`` naming what does not fit: a model without that layout (naming the
    missing modules), another ``config.model_type`` whose forward differs from the stages'
    on the probe (naming where), a config asking for what the stages do
    not compute (``output_router_logits=True``: the router's auxiliary loss;
    ``use_bidirectional_attention=True``), an attention implementation other than
    ``"eager"`` or ``"sdpa"``, attention kinds other than full and sliding-window,
    ``num_stages`` not in ``1..num_layers`` (without ``layers_per_stage``), a
    ``layers_per_stage`` that does not fit (naming it), or HF's gradient checkpointing
    switched on.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"split_hf_causal_lm takes an nn.Module, got {type(model).__name__}")
    layout = _find_layout(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    _check_config(config)
    _check_attention(config)
    inner = getattr(model, layout.base)
    all_layers = getattr(inner, layout.layers)
    n_layers = getattr(config, "num_hidden_layers", len(all_layers))
    layers = list(all_layers)[:n_layers]
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got num_stages={num_stages!r}")
    if layers_per_stage is not None:
        counts = _check_counts(layers_per_stage, num_stages, len(layers))
    elif num_stages > len(layers):
        raise ValueError(
            f"split_hf_causal_lm: num_stages={num_stages} is more than the model's "
            f"{len(layers)} decoder layers (every stage gets at least one)"
        )
    else:
        counts = _even_split(len(layers), num_stages)
    on = [i for i, layer in enumerate(layers) if getattr(layer, "gradient_checkpointing", False)]
    if on:
        raise ValueError(
            f"split_hf_causal_lm: HF gradient checkpointing is on (layers {on}); call "
            "model.gradient_checkpointing_disable() and pass checkpoint_layers=True instead"
        )
    types = _layer_types(config, len(layers))
    embed, head = getattr(inner, layout.embed), model.lm_head
    base = layout.base

    def part(name: str | None) -> nn.Module | None:
        return None if name is None else getattr(inner, name)

    if model_type not in SUPPORTED_MODEL_TYPES:
        whole = HFCausalLMStage(
            config,
            layers,
            first_layer=0,
            layer_types=types,
            rotary_emb=part(layout.rotary),
            embed_tokens=embed,
            embed_positions=part(layout.positions),
            embed_dropout=part(layout.dropout),
            norm=part(layout.norm),
            lm_head=head,
        )
        _check_untested(model, whole, model_type)
    if head.weight is embed.weight:
        mark_tied(embed.weight, f"hf.lm_head.weight={base}.{layout.embed}.weight")

    stages: list[HFCausalLMStage] = []
    start = 0
    for index, count in enumerate(counts):
        first, last = index == 0, index == num_stages - 1
        stage = HFCausalLMStage(
            config,
            layers[start : start + count],
            first_layer=start,
            layer_types=types[start : start + count],
            rotary_emb=part(layout.rotary),
            embed_tokens=embed if first else None,
            embed_positions=part(layout.positions) if first else None,
            embed_dropout=part(layout.dropout) if first else None,
            norm=part(layout.norm) if last else None,
            lm_head=head if last else None,
            checkpoint_layers=checkpoint_layers,
        )
        keys = {f"layers.{j}": f"{base}.{layout.layers}.{start + j}" for j in range(count)}
        if first:
            keys["embed_tokens"] = f"{base}.{layout.embed}"
            if layout.positions is not None:
                keys["embed_positions"] = f"{base}.{layout.positions}"
        if last:
            keys |= {"norm": f"{base}.{layout.norm}", "lm_head": "lm_head"}
        held = stage.state_dict()  # a module without tensors (OLMo's norm) has no keys
        keys = {k: v for k, v in keys.items() if any(n.startswith(f"{k}.") for n in held)}
        set_unsplit_keys(stage, keys)
        stages.append(stage)
        start += count
    return stages


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """HF's causal-LM loss (``ForCausalLMLoss``): token ``t`` predicts ``labels[:, t + 1]``
    (the last token predicts nothing), labels equal to ``ignore_index`` count for nothing,
    and the cross-entropy is computed on ``logits.float()`` (float32 for float64 logits too,
    as HF does). Returns a 0-dim float32 tensor.

    Without ``num_items_in_batch``: the mean over the valid tokens of ``labels`` (with
    ``loss_reduction="mean"`` the pipeline averages these per-micro-batch means). With it:
    the sum of the token losses divided by ``num_items_in_batch``, the number of valid tokens
    of the whole batch (all micro-batches and replicas): a 0-dim tensor, an int, or, as a
    keyword tensor of ``pipe.step`` (split on dim 0 like the batch), a ``[B]`` tensor holding
    that count in every row (``causal_lm_num_items``; its first element is read, on the
    device). With ``loss_reduction="sum"`` the pipeline's loss and gradients are then HF's
    ``model(input_ids, attention_mask=..., labels=...)`` on the whole batch; a batch with no
    valid token at all gives 0 (HF: NaN), an empty micro-batch adds 0.

    Under ``loss_reduction="mean"`` without ``num_items_in_batch`` a micro-batch with no
    valid token is refused before the step, on every rank, naming it (``check_labels``): its
    mean would be 0 / 0.

    logits: ``[B, T, V]``; labels: int ``[B, T]``.
    """
    logits = logits.float()
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    flat = logits.reshape(-1, logits.shape[-1])
    target = shifted.reshape(-1).to(flat.device)
    if num_items_in_batch is None:
        return F.cross_entropy(flat, target, ignore_index=ignore_index)
    total = F.cross_entropy(flat, target, ignore_index=ignore_index, reduction="sum")
    count = num_items_in_batch
    if isinstance(count, torch.Tensor):
        # A batch without a valid token counts 0 items: its loss and gradients are 0 (HF's
        # sum / 0 is NaN). No host synchronization: clamped on the device.
        return total / count.reshape(-1)[0].to(total.device).clamp(min=1)
    return total / max(count, 1)


def _check_causal_lm_labels(
    labels: Any,
    keywords: tuple[str, ...],
    *,
    num_microbatches: int,
    loss_reduction: str,
    ignore_index: int = -100,
) -> None:
    """``causal_lm_loss.check_labels``, run by the pipeline on the loss rank before a step:
    under ``loss_reduction="mean"`` without ``num_items_in_batch`` every micro-batch needs a
    valid token (its loss is the mean over them: 0 / 0 otherwise); ``ValueError`` naming the
    first micro-batch that has none and the remedy. With ``num_items_in_batch`` an empty
    micro-batch adds 0 and needs no check."""
    if loss_reduction != "mean" or "num_items_in_batch" in keywords:
        return
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
        return
    valid = (labels[..., 1:] != ignore_index).reshape(num_microbatches, -1).any(dim=1)
    empty = [i for i, ok in enumerate(valid.tolist()) if not ok]
    if empty:
        rows = labels.shape[0] // num_microbatches
        i = empty[0]
        raise ValueError(
            f"micro-batch {i} (rows {i * rows} to {(i + 1) * rows - 1}) has no valid label "
            f"(every label past the first token is {ignore_index}; {len(empty)} of "
            f"{num_microbatches} micro-batches are so): under loss_reduction='mean' its loss, "
            "the mean over its valid tokens, would be 0 / 0 (NaN). Build the pipeline with "
            "loss_reduction='sum' and pass num_items_in_batch=causal_lm_num_items(labels) "
            "(then the step is the loss of one process on the whole batch, empty micro-batches "
            "included), or leave the empty rows out of the batch"
        )


causal_lm_loss.check_labels = _check_causal_lm_labels  # type: ignore[attr-defined]


def causal_lm_num_items(
    labels: torch.Tensor, *, dp_group: Any = None, ignore_index: int = -100
) -> torch.Tensor:
    """The ``num_items_in_batch`` keyword tensor of ``causal_lm_loss`` for this step: the
    number of tokens the loss counts in ``labels`` ``[B, T]`` (``labels[:, 1:] !=
    ignore_index``), summed over the data-parallel replicas with ``dp_group`` (an
    ``all_reduce`` of a device tensor: no host synchronization), as an int64 ``[B]`` tensor
    holding that count in every row.

    Every pipeline rank passes the same keyword tensors, so every rank calls it on its
    replica's labels (the ranks of one replica see the same batch).
    """
    count = (labels[..., 1:] != ignore_index).sum().reshape(1)
    if dp_group is not None:
        import torch.distributed as dist

        dist.all_reduce(count, group=dp_group)
    return count.repeat(labels.shape[0])

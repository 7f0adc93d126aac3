"""Every h2o-mini policy inside `transformers`: an evicting cache for an `AutoModelForCausalLM` (the `hf` extra;
nothing in the core imports this module).

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from h2o_mini.transformers_cache import evicting_cache
    model, tok = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    ids = tok("The lighthouse keeper", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=64, cache=evicting_cache(model, "h2o", budget=32))

It goes through two of transformers' own extension points and patches no model code:

* **A `Cache` of `CacheLayerMixin` layers** (`EvictingCache`, `EvictingLayer`). Every attention module that
  follows transformers' functional pattern calls `cache.update(k, v, layer)` with the keys after RoPE and then the
  attention function with what `update` returned; the layer hands the keys on with a reference to itself.
* **An attention function and a mask function registered as "h2o_mini"** (`AttentionInterface`,
  `AttentionMaskInterface`; the cache sets the model's `attn_implementation` to it). The mask function passes on
  only which tokens are padding: what a token attends is the cache's business. The attention function gives the
  queries, keys and values, the tokens' positions and the model's own scale, soft-cap and window to the layer's
  h2o-mini `cache.LayerCache`, which picks its path from the input's shape exactly as under h2o-mini's own
  decoder: one token per row is the decode step, a longer input a prompt chunk (`dense` or `stream`,
  docs/spec.md). The layer holds C slots per row and KV head, so transformers' model holds C tokens, not a mask.

A model whose attention cannot go this way (no attention-registry support, encoder-decoders, linear or chunked
attention layers) is refused in one line when the cache is made. docs/transformers.md says more.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import AttentionInterface

from .cache import KVCache
from .config import Config
from .config_readers import READERS, Fields
from .errors import UserError
from .policies import Policy, make_policy
from .policies.base import parse_budget, refuse_lookahead
from .quant import check_kv_bits

NAME = "h2o_mini"  # the attention implementation this module registers
HANDLE = "h2o_mini_layer"  # the attribute of the keys `EvictingLayer.update` hands to the attention function


def evicting_cache(model: PreTrainedModel, policy: "str | Policy" = "h2o", budget: float | int | str | None = None,
                   length: int | None = None, recent=None, prefill: str = "dense", kv_bits: int | None = None,
                   naive: bool = False) -> "EvictingCache":
    """A cache that runs `policy` (a `--policy` text: "h2o", "h2o:recent=16", "file.py:Class", "learned:weights=F";
    or a `Policy`) at `budget` (a fraction of `length`, or a token count) inside `model`. length: the longest row,
    prompt and new tokens (needed for a fractional budget and for `full`; else the model's positions). prefill:
    "dense" or "stream" (docs/spec.md). naive: the naive reference instead (`checks/naive.py`: one row, every key
    kept, eviction as a mask; prompts dense or one token at a time): what the fast cache is checked against."""
    cfg = model_config(model)
    if isinstance(policy, Policy):
        made = policy
    else:
        if length is None and budget is not None and isinstance(parse_budget(budget), float):
            raise UserError(f"--budget {budget} is a fraction of the sequence: give length= (the longest row, prompt "
                            "and new tokens)")
        made = make_policy(policy, budget, length or cfg.max_seq_len, recent)
    if length is None and made.capacity is None:
        raise UserError(f"policy {made.name!r} keeps every token: give length= (the longest row, prompt and new "
                        "tokens), the slots it holds")
    refuse_lookahead(made)
    if made.state_size(cfg.head_dim) and cfg.family not in READERS and not naive:
        raise UserError(f"policy {made.name!r} observes rotated queries, and h2o-mini reads the rotary embedding "
                        f"only of its own families, not of {cfg.family!r}")
    if prefill not in ("dense", "stream"):
        raise UserError(f"unknown prefill {prefill!r} (choose dense or stream)")
    use_attention(model)
    return EvictingCache(cfg, made, length or cfg.max_seq_len, prefill, check_kv_bits(kv_bits), naive)


def use_attention(model: PreTrainedModel) -> None:
    """Sets the model's attention implementation to the one registered here (transformers' own switch)."""
    model.set_attn_implementation(NAME)
    if model.config._attn_implementation != NAME:  # (transformers only warns where it cannot switch)
        raise UserError(f"{type(model).__name__} cannot switch its attention implementation to {NAME!r}")


def model_config(model) -> Config:
    """What h2o-mini's cache needs of a transformers model: its layers, heads, head size and each layer's window
    (for a family h2o-mini's decoder has, also RoPE: `config_readers.READERS`); or a one-line refusal."""
    if not isinstance(model, PreTrainedModel):
        raise UserError(f"an evicting cache needs a transformers PreTrainedModel, not {type(model).__name__}")
    hf = model.config.get_text_config()
    kind, name = hf.model_type, type(model).__name__
    if getattr(hf, "is_encoder_decoder", False):
        raise UserError(f"{name} is an encoder-decoder: the evicting cache holds a decoder's self-attention only")
    if not type(model)._supports_attention_backend:
        raise UserError(f"{name} computes attention in its own code, not through transformers' attention registry, "
                        "so an evicting cache cannot see its queries and keys")
    types, per_layer = get_layer_types_and_kwargs(hf)  # transformers' own reading of each layer's kind and window
    if other := sorted(set(types) - {"full_attention", "sliding_attention"}):
        raise UserError(f"{name} has {other[0]!r} layers: the evicting cache holds full and sliding-window "
                        "attention layers only")
    if getattr(hf, "attention_chunk_size", None):
        raise UserError(f"{name} attends in chunks, which the evicting cache does not model")
    if kind in READERS:  # h2o-mini's own reading: the same windows and rotary embedding as its decoder
        return READERS[kind](Fields(hf.to_dict(), f"{name}.config"))
    f = Fields(hf.to_dict(), f"{name}.config")
    n_head, d = f.count("num_attention_heads"), f.count("hidden_size")
    windows = tuple(kw.get("sliding_window") if t == "sliding_attention" else None for t, kw in zip(types, per_layer))
    return Config(family=kind, vocab_size=f.count("vocab_size"), n_layer=len(types), n_head=n_head,
                  n_kv_head=f.count("num_key_value_heads", n_head), d_model=d,
                  head_dim=f.count("head_dim", d // n_head), d_ff=f.count("intermediate_size", 1),
                  max_seq_len=f.count("max_position_embeddings", 2**31), windows=windows if any(windows) else ())


class EvictingCache(Cache):
    """transformers' `Cache` over one h2o-mini `KVCache` (or, with `naive`, the naive reference), built at the first
    attention call: that call gives the batch, dtype and device, and the model's own attention scale and soft-cap."""

    def __init__(self, cfg: Config, policy: Policy, length: int, prefill: str = "dense", kv_bits: int | None = None,
                 naive: bool = False, inner: KVCache | None = None):
        """inner: an h2o-mini cache made already (`generate.Decoder.new_cache`, for `--engine transformers`)."""
        super().__init__(layers=[EvictingLayer(self, i, cfg.window(i) is not None) for i in range(cfg.n_layer)])
        self.cfg, self.policy, self.length, self.prefill, self.kv_bits, self.naive = (
            cfg, policy, length, prefill, kv_bits, naive)
        self.inner = inner  # the h2o-mini cache: `layers[i].attend(q, k, v, pos)` per layer
        self.scaling = None  # the model's (scale, soft-cap), read at the first call, the same in every layer
        self.query_scale = 1.0  # what the model's queries are multiplied by before h2o-mini's cache reads them
        self.real = None  # (B, columns): which columns were tokens, for a caller that passes no 2D mask of its own

    @classmethod
    def over(cls, cfg: Config, inner: KVCache) -> "EvictingCache":
        return cls(cfg, inner.policy, inner.length, inner.prefill, inner.kv_bits, inner=inner)

    def mask(self, real: torch.Tensor) -> torch.Tensor:
        """transformers' 2D attention mask (B, columns so far) after a call whose columns `real` (B, T) are tokens."""
        self.real = real if self.real is None else torch.cat([self.real, real], 1)
        return self.real

    def slots(self, layer: int, query, key, scaling, softcap, window):
        """Layer `layer`'s h2o-mini cache, made at the first call; a call unlike the first is refused."""
        if self.scaling is None:
            self.build(query.shape[0], key, scaling, softcap)
        if (scaling, softcap) != self.scaling:
            raise UserError(f"layer {layer} attends with scale {scaling} and soft-cap {softcap}, layer 0 with "
                            f"{self.scaling}: the evicting cache takes one for all layers")
        expected = self.cfg.window(layer)
        if (window if window is not None and window < self.cfg.max_seq_len else None) != expected:
            raise UserError(f"layer {layer} attends within a window of {window}, which its config does not declare "
                            f"({expected})")
        return self.inner.layers[layer]

    def build(self, B: int, key, scaling, softcap) -> None:
        """The h2o-mini cache for B rows, if not given. A family h2o-mini's decoder has keeps that decoder's scale;
        a model that scales its queries before attention (transformers' OPT passes scale 1) has them scaled back,
        so that a rule that reads queries (Expected Attention) gets what it gets under h2o-mini's decoder. Another
        family attends with the scale and soft-cap its attention passes."""
        cfg, own = self.cfg, self.cfg.family in READERS
        if not own:
            cfg = replace(cfg, attn_scalar=None if scaling is None else scaling ** -2, attn_softcap=softcap)
        elif softcap != cfg.attn_softcap:
            raise UserError(f"the model soft-caps attention at {softcap}, its config at {cfg.attn_softcap}")
        self.query_scale = 1.0 if scaling is None or not own else scaling / cfg.attn_scale
        self.scaling = (scaling, softcap)
        if self.inner is not None:
            if not own:  # made from the config alone: the scale and soft-cap the model attends with
                for layer in self.inner.layers:
                    layer.scale, layer.cap = cfg.attn_scale, softcap
        elif self.naive:
            from .checks.naive import NaiveCache  # evaluation code, here only for the reference
            if B != 1:
                raise UserError("the naive reference reads one row")
            self.inner = NaiveCache(cfg, self.policy, self.length, self.kv_bits)
        else:
            self.inner = KVCache(cfg, self.policy, B, self.length, key.dtype, key.device, self.prefill, self.kv_bits)

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (keys and values as stored, positions, scores); 0 before the first call."""
        return 0 if self.inner is None or self.naive else self.inner.nbytes


class EvictingLayer(CacheLayerMixin):
    """One layer: counts what it has read (transformers' positions and masks are sized by it) and hands each call's
    keys to the attention function; the slots live in the h2o-mini cache."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: EvictingCache, index: int, sliding: bool):
        super().__init__()
        self.owner, self.index, self.is_sliding = owner, index, sliding
        self.seen = 0  # columns read, padding included (what transformers calls the sequence length)
        self.handed = False  # keys handed on by `update` and not yet attended
        self.next_pos = None  # (B, 1): each row's next original position (padding has none)

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.handed:  # the last call's keys never reached the attention function: it attended without the cache
            raise UserError(f"layer {self.index} attended without the evicting cache: the model's attention "
                            f"implementation must stay {NAME!r} while the cache is in use")
        self.handed = True
        handed = key_states.view_as(key_states)  # a view: the caller's tensor is left as it was
        setattr(handed, HANDLE, self)
        return handed, value_states

    def attend(self, query, key, value, real, scaling, softcap, window) -> torch.Tensor:
        """query: (B, n_head, T, hd), key/value: (B, H, T, hd) after RoPE; real: (B, T) bool, False for padding, or
        None. -> (B, n_head, T, hd)."""
        B, T = query.shape[0], query.shape[2]
        self.handed = False
        if self.next_pos is None:
            self.next_pos = torch.zeros(B, 1, dtype=torch.int64, device=query.device)
        if real is None:  # no padding (transformers leaves out a mask of all ones)
            pos = self.next_pos + torch.arange(T, device=query.device) if T > 1 else self.next_pos  # (B, T)
            self.next_pos = self.next_pos + T
        else:
            real = real[:, -T:]
            pos = torch.where(real, self.next_pos + real.cumsum(-1) - 1, -1)  # (B, T): h2o-mini's positions
            self.next_pos = self.next_pos + real.sum(-1, keepdim=True)
        self.seen += T
        slots = self.owner.slots(self.index, query, key, scaling, softcap, window)
        if self.owner.query_scale != 1.0:
            query = query * self.owner.query_scale
        return slots.attend(query, key, value, pos)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise UserError("an evicting cache is made for one generation: make a new one")

    def reorder_cache(self, beam_idx) -> None:
        raise UserError("an evicting cache runs greedy or sampled decoding, not beam search: each row evicts on its own")

    def crop(self, tokens_to_remove: int) -> None:
        raise UserError("an evicting cache cannot be cropped (assisted decoding): what it evicted is gone")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.seen:
            raise UserError("an evicting cache that has read tokens cannot be repeated across rows")

    def batch_select_indices(self, indices) -> None:
        raise UserError("an evicting cache keeps all its rows")


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
              sliding_window=None, **kwargs):
    """transformers' attention-function signature; returns (B, T, n_head, hd) and no weights."""
    layer = getattr(key, HANDLE, None)
    if layer is None:
        raise UserError(f"attn_implementation {NAME!r} attends only through an evicting cache "
                        "(h2o_mini.transformers_cache.evicting_cache), and this call came without one")
    out = layer.attend(query, key, value, attention_mask, scaling, softcap, sliding_window)
    return out.transpose(1, 2), None


def padding(batch_size, q_length, kv_length, *args, attention_mask=None, **kwargs):
    """transformers' mask-function signature: only which tokens are real, (B, kv_length) bool, or None (no
    padding). What a token attends is the cache's to say (its slots, its windows)."""
    return None if attention_mask is None else attention_mask.bool()


AttentionInterface.register(NAME, attention)
AttentionMaskInterface.register(NAME, padding)

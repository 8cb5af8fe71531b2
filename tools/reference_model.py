#!/usr/bin/env python3
"""Independent PyTorch reference of the attnres model (float64, functional).

This file restates /work/shared/SPEC.md sections 1-3 in plain PyTorch so that
the C++ engine can be checked against it.  It deliberately shares no code with
the engine.  Everything is functional: parameters live in an ordered dict
``name -> tensor`` keyed by the checkpoint names, and ``forward`` reads them.

Conventions (see docs/MODEL.md, "Exact definition", for the full list):
  * all weights are (out_features, in_features); no biases;
  * RMSNorm(x) = x * rsqrt(mean(x^2) + eps) * g;
  * attention: GQA with HF ``repeat_kv`` mapping (query head h reads kv head
    h // (n_head / n_kv_head)), rotate-half RoPE (GPT-NeoX / HF Llama layout),
    scale 1/sqrt(hd), causal mask;
  * MLP: SwiGLU  w2(silu(w1 x) * w3 x);
  * loss: mean cross-entropy over all B*T positions.
  * sublayers are numbered 0-based here: sublayer 2i is block i's attention,
    sublayer 2i+1 is block i's MLP (SPEC numbers them 1-based).

Residual paths are pluggable objects with begin(emb) / input(l) / push(l, out)
/ final():  PreNormResidual (mode "prenorm"), FullAttnRes (mode "full"),
BlockAttnRes (mode "block", block_size S sublayers per block), StaticMix (mode
"static": input-independent softmax(logits) weights over the full source list)
and DenseFormer (mode "denseformer": depth-weighted averages of block outputs).

The AttnRes depth mix (modes full / block) has the ablation options of the
paper (SPEC 6): gate softmax|sigmoid, key norm rms|none, H depth heads,
static|dynamic query, sliding window K.  See docs/MODEL.md ("Exact definition") for the exact
definitions.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass, asdict
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

Params = "OrderedDict[str, torch.Tensor]"


@dataclass
class Config:
    n_layer: int
    n_head: int
    n_kv_head: int
    d_model: int
    ffn_hidden: int
    vocab_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tied: bool = False
    residual: str = "prenorm"  # "prenorm" | "full" | "block" | "static" | "denseformer"
    block_size: int = 0  # sublayers per block, only for residual == "block" (full == S = 1)
    # AttnRes depth-mix options (modes full / block only; defaults = the paper's method)
    attnres_gate: str = "softmax"    # "softmax" | "sigmoid" (no normalisation over sources)
    attnres_key_norm: str = "rms"    # "rms" (keys = RMSNorm(v; g)) | "none" (keys = v, no gain)
    attnres_heads: int = 1           # H contiguous slices of d, one depth attention each
    attnres_query: str = "static"    # "static" (q = w) | "dynamic" (q = w + W u, u = last source)
    attnres_window: int = 0          # K > 0: sources = [emb] + last K non-embedding sources
    attnres_key_eps: float = 0.0     # epsilon of the key RMSNorm; 0 = norm_eps
    attnres_temperature: float = 1.0  # score multiplier: s = T * (q . k)

    @property
    def key_eps(self) -> float:
        """Epsilon of the AttnRes key norms (attnres_key_eps when set, else norm_eps)."""
        return self.attnres_key_eps if self.attnres_key_eps > 0 else self.norm_eps

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def n_sublayer(self) -> int:
        return 2 * self.n_layer

    @property
    def is_attnres(self) -> bool:
        """Modes with the pseudo-query depth attention (full, block)."""
        return self.residual in ("full", "block")

    @property
    def sublayers_per_block(self) -> int:
        """S; full AttnRes is block AttnRes with S = 1."""
        return 1 if self.residual == "full" else self.block_size

    ATTNRES_KEYS = ("attnres_gate", "attnres_key_norm", "attnres_heads",
                    "attnres_query", "attnres_window")

    def to_json(self) -> str:
        """Metadata "config".  prenorm: exactly the original key set (fixture bytes stay
        stable).  Other modes add block_size (full: 1, block: S; absent for static and
        denseformer) and always the five attnres_* keys."""
        d = asdict(self)
        keys = ["n_layer", "n_head", "n_kv_head", "d_model", "ffn_hidden",
                "vocab_size", "norm_eps", "rope_theta", "tied", "residual"]
        if self.residual != "prenorm":
            d["block_size"] = self.sublayers_per_block
            if self.is_attnres:
                keys.append("block_size")
            keys += list(self.ATTNRES_KEYS)
            if self.is_attnres and self.attnres_key_eps > 0:
                keys.append("attnres_key_eps")  # absent: the key norms use norm_eps
            if self.is_attnres and self.attnres_temperature != 1.0:
                keys.append("attnres_temperature")  # absent: 1
        return json.dumps({k: d[k] for k in keys})

    def validate(self) -> None:
        assert self.d_model % self.n_head == 0
        assert self.n_head % self.n_kv_head == 0
        assert self.head_dim % 2 == 0
        assert self.residual in ("prenorm", "full", "block", "static", "denseformer")
        if self.residual == "block":
            assert self.block_size >= 1
        if self.residual == "full":
            assert self.block_size in (0, 1)
        assert self.attnres_gate in ("softmax", "sigmoid")
        assert self.attnres_key_norm in ("rms", "none")
        assert self.attnres_query in ("static", "dynamic")
        assert self.attnres_heads >= 1 and self.d_model % self.attnres_heads == 0
        assert self.attnres_window >= 0
        if not self.is_attnres:  # the options only exist for the pseudo-query mix
            assert (self.attnres_gate, self.attnres_key_norm, self.attnres_heads,
                    self.attnres_query, self.attnres_window) == ("softmax", "rms", 1, "static", 0)


# --------------------------------------------------------------------------
# parameter names and initialisation
# --------------------------------------------------------------------------

def mixer_shapes(cfg: Config, prefix: str, n_src: int) -> "OrderedDict[str, tuple]":
    """Parameters of one depth mixer ("layers.{i}.attn_res.", "layers.{i}.mlp_res.",
    "out_res.").  n_src = number of sources (only used by mode static)."""
    d = cfg.d_model
    s: "OrderedDict[str, tuple]" = OrderedDict()
    if cfg.residual == "static":
        s[prefix + "logits"] = (n_src,)
    elif cfg.is_attnres:
        s[prefix + "query"] = (d,)
        if cfg.attnres_key_norm == "rms":
            s[prefix + "key_norm.weight"] = (d,)
        if cfg.attnres_query == "dynamic":
            s[prefix + "query_proj.weight"] = (d, d)
    return s


def param_shapes(cfg: Config) -> "OrderedDict[str, tuple]":
    """Checkpoint name -> shape, in the canonical order used by the fixtures."""
    d, hd = cfg.d_model, cfg.head_dim
    L = cfg.n_sublayer
    s: "OrderedDict[str, tuple]" = OrderedDict()
    s["tok_embeddings.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.n_layer):
        p = f"layers.{i}."
        s.update(mixer_shapes(cfg, p + "attn_res.", 2 * i + 1))
        s[p + "attention_norm.weight"] = (d,)
        s[p + "attention.wq.weight"] = (cfg.n_head * hd, d)
        s[p + "attention.wk.weight"] = (cfg.n_kv_head * hd, d)
        s[p + "attention.wv.weight"] = (cfg.n_kv_head * hd, d)
        s[p + "attention.wo.weight"] = (d, cfg.n_head * hd)
        s.update(mixer_shapes(cfg, p + "mlp_res.", 2 * i + 2))
        s[p + "ffn_norm.weight"] = (d,)
        s[p + "feed_forward.w1.weight"] = (cfg.ffn_hidden, d)
        s[p + "feed_forward.w2.weight"] = (d, cfg.ffn_hidden)
        s[p + "feed_forward.w3.weight"] = (cfg.ffn_hidden, d)
        if cfg.residual == "denseformer":
            s[p + "dwa.weight"] = (i + 2,)  # alpha_{i,0..i+1} over X_0 .. X_{i+1}
    s.update(mixer_shapes(cfg, "out_res.", L + 1))
    s["norm.weight"] = (d,)
    if not cfg.tied:
        s["output.weight"] = (cfg.vocab_size, d)
    return s


def is_router_param(name: str) -> bool:
    """Parameters of the residual path itself (depth mixers, DWA weights)."""
    return ("_res." in name or name.startswith("out_res.") or name.endswith("dwa.weight"))


def is_decayed(name: str, shape) -> bool:
    """AdamW weight-decay group: 2-D weight matrices except the embedding and the
    dynamic-query projections (*.query_proj.weight).  No router param is decayed."""
    return (len(shape) == 2 and name != "tok_embeddings.weight"
            and not name.endswith("query_proj.weight"))


def init_params(cfg: Config, rng: np.random.Generator,
                attnres_init: str = "paper",
                query_proj_std: float = 0.5) -> "OrderedDict[str, torch.Tensor]":
    """Draw parameters in float64, round to float32, return them as float64.

    Draw order = param_shapes order; for each tensor:
      tok_embeddings.weight / output.weight ... normal(0, 1) for the embedding,
                                               normal(0, 1/sqrt(d)) for output
      2-D linear weights                      normal(0, 1/sqrt(in_features))
      RMSNorm gains (*norm.weight)            uniform(0.5, 1.5)
      attn-res query                          0 ("paper") or normal(0, 1/sqrt(d)) ("random")
      attn-res key_norm.weight                1 ("paper") or uniform(0.5, 1.5) ("random")
      attn-res query_proj.weight (d, d)       0 ("paper") or normal(0, query_proj_std/sqrt(d))
                                              ("random"; query_proj_std defaults to 0.5)
      static-mix logits                       0 ("paper") or normal(0, 1) ("random")
      layers.{i}.dwa.weight (i+2)             e_{i+1} ("paper", = plain residual) or
                                              normal(0, 0.5) + e_{i+1} ("random")
    (normal(0, s) means standard deviation s.)  Constant tensors ("paper" init) consume
    no random numbers, so the other weights equal those of a prenorm model with the same seed.
    """
    cfg.validate()
    assert attnres_init in ("paper", "random")
    paper = attnres_init == "paper"
    out: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for name, shape in param_shapes(cfg).items():
        if name == "tok_embeddings.weight":
            a = rng.standard_normal(shape)
        elif name.endswith(".query"):
            a = np.zeros(shape) if paper else rng.standard_normal(shape) / math.sqrt(cfg.d_model)
        elif name.endswith("key_norm.weight"):
            a = np.ones(shape) if paper else rng.uniform(0.5, 1.5, shape)
        elif name.endswith("query_proj.weight"):
            a = (np.zeros(shape) if paper
                 else query_proj_std * rng.standard_normal(shape) / math.sqrt(cfg.d_model))
        elif name.endswith(".logits"):
            a = np.zeros(shape) if paper else rng.standard_normal(shape)
        elif name.endswith("dwa.weight"):
            a = np.zeros(shape) if paper else 0.5 * rng.standard_normal(shape)
            a[-1] += 1.0
        elif name.endswith("norm.weight"):
            a = rng.uniform(0.5, 1.5, shape)
        else:
            assert len(shape) == 2, name
            a = rng.standard_normal(shape) / math.sqrt(shape[1])
        a32 = np.asarray(a, dtype=np.float64).astype(np.float32)
        out[name] = torch.from_numpy(a32.astype(np.float64))
    return out


# --------------------------------------------------------------------------
# building blocks
# --------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * g


def rope_cos_sin(T: int, hd: int, theta: float, dtype=torch.float64):
    """cos/sin tables (T, hd), rotate-half layout (per-i value repeated in both halves)."""
    i = torch.arange(hd // 2, dtype=dtype)
    freq = theta ** (-2.0 * i / hd)
    pos = torch.arange(T, dtype=dtype)
    ang = pos[:, None] * freq[None, :]  # (T, hd/2)
    ang = torch.cat([ang, ang], dim=-1)  # (T, hd)
    return torch.cos(ang), torch.sin(ang)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., T, hd); cos/sin (T, hd)."""
    return x * cos + rotate_half(x) * sin


def attention(x: torch.Tensor, P, pre: str, cfg: Config) -> torch.Tensor:
    B, T, d = x.shape
    H, Hkv, hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    q = (x @ P[pre + "wq.weight"].T).view(B, T, H, hd).transpose(1, 2)
    k = (x @ P[pre + "wk.weight"].T).view(B, T, Hkv, hd).transpose(1, 2)
    v = (x @ P[pre + "wv.weight"].T).view(B, T, Hkv, hd).transpose(1, 2)
    cos, sin = rope_cos_sin(T, hd, cfg.rope_theta, x.dtype)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    n_rep = H // Hkv
    k = k.repeat_interleave(n_rep, dim=1)  # head h -> kv head h // n_rep
    v = v.repeat_interleave(n_rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)  # (B,H,T,T)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    att = torch.softmax(scores, dim=-1)
    o = (att @ v).transpose(1, 2).reshape(B, T, H * hd)
    return o @ P[pre + "wo.weight"].T


def mlp(x: torch.Tensor, P, pre: str) -> torch.Tensor:
    a = x @ P[pre + "w1.weight"].T
    b = x @ P[pre + "w3.weight"].T
    return (F.silu(a) * b) @ P[pre + "w2.weight"].T


# --------------------------------------------------------------------------
# residual paths
# --------------------------------------------------------------------------

def sublayer_prefix(l: int) -> str:
    """0-based sublayer index -> parameter prefix of its depth mixer."""
    return f"layers.{l // 2}." + ("attn_res." if l % 2 == 0 else "mlp_res.")


def window_sources(sources: List[torch.Tensor], K: int) -> List[torch.Tensor]:
    """Sliding window: [emb] + the last K non-embedding sources (all if fewer); K = 0: off."""
    if K <= 0:
        return list(sources)
    rest = sources[1:]
    return [sources[0]] + rest[max(0, len(rest) - K):]


def depth_mix(sources: List[torch.Tensor], P, pre: str, cfg: Config) -> torch.Tensor:
    """Pseudo-query depth attention (SPEC 2, with the SPEC 6 ablation options).

    sources: list of (B,T,d) tensors, sources[0] = embedding.  Per token and head h
    (slice of dh = d/H channels):
      keys    k = g * v * rsqrt(mean_slice(v^2) + eps)   (key norm "rms"; "none": k = v)
      query   q = w                                     (static)
              q = w + W u, u = last source in the list   (dynamic)
      score   s_{i,h} = T * sum_{c in slice h} q_c k_{i,c}   (T = attnres_temperature, default 1)
      gate    a = softmax_i(s)  or  sigmoid(s)
      output  x_c = sum_i a_{i,h(c)} v_{i,c}            (values are the raw sources)
    """
    srcs = window_sources(sources, cfg.attnres_window)
    V = torch.stack(srcs, dim=0)  # (n, B, T, d)
    n, B, T, d = V.shape
    H = cfg.attnres_heads
    dh = d // H
    Vh = V.reshape(n, B, T, H, dh)
    if cfg.attnres_key_norm == "rms":
        g = P[pre + "key_norm.weight"].reshape(H, dh)
        K = Vh * torch.rsqrt(Vh.pow(2).mean(dim=-1, keepdim=True) + cfg.key_eps) * g
    else:
        K = Vh
    q = P[pre + "query"]  # (d)
    if cfg.attnres_query == "dynamic":
        q = q + srcs[-1] @ P[pre + "query_proj.weight"].T  # (B, T, d)
    qh = q.reshape(*q.shape[:-1], H, dh)
    s = cfg.attnres_temperature * (K * qh).sum(dim=-1)  # (n, B, T, H)
    a = torch.softmax(s, dim=0) if cfg.attnres_gate == "softmax" else torch.sigmoid(s)
    return (a.unsqueeze(-1) * Vh).sum(dim=0).reshape(B, T, d)


def static_mix(sources: List[torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
    """Input-independent scalar mixing: x = sum_i softmax(logits)_i v_i (same for every token)."""
    V = torch.stack(sources, dim=0)
    a = torch.softmax(logits, dim=0)
    return (a.view(-1, 1, 1, 1) * V).sum(dim=0)


class PreNormResidual:
    """Standard residual: x_l = v_0 + ... + v_{l-1}; final = v_0 + ... + v_L."""

    def __init__(self, P, cfg: Config):
        self.h = None

    def begin(self, emb):
        self.h = emb

    def input(self, l):
        return self.h

    def push(self, l, out):
        self.h = self.h + out

    def final(self):
        return self.h


class FullAttnRes:
    """SPEC 2: every sublayer mixes all previous raw outputs v_0..v_{l-1}."""

    def __init__(self, P, cfg: Config):
        self.P, self.cfg = P, cfg
        self.v: List[torch.Tensor] = []

    def begin(self, emb):
        self.v = [emb]

    def input(self, l):
        return depth_mix(self.v, self.P, sublayer_prefix(l), self.cfg)

    def push(self, l, out):
        self.v.append(out)

    def final(self):
        return depth_mix(self.v, self.P, "out_res.", self.cfg)


class BlockAttnRes:
    """SPEC 3: sources are [b_0 .. b_{n-1}] (+ partial sum p_n^(i) when i > 0)."""

    def __init__(self, P, cfg: Config):
        self.P, self.cfg, self.S = P, cfg, cfg.block_size
        self.blocks: List[torch.Tensor] = []
        self.partial: Optional[torch.Tensor] = None

    def begin(self, emb):
        self.blocks = [emb]
        self.partial = None

    def _sources(self):
        return self.blocks + ([self.partial] if self.partial is not None else [])

    def input(self, l):
        return depth_mix(self._sources(), self.P, sublayer_prefix(l), self.cfg)

    def push(self, l, out):
        self.partial = out if self.partial is None else self.partial + out
        if (l + 1) % self.S == 0:
            self.blocks.append(self.partial)
            self.partial = None

    def final(self):
        return depth_mix(self._sources(), self.P, "out_res.", self.cfg)


class StaticMix:
    """Mode static: sources as in full AttnRes, weights softmax(logits) per mixer."""

    def __init__(self, P, cfg: Config):
        self.P = P
        self.v: List[torch.Tensor] = []

    def begin(self, emb):
        self.v = [emb]

    def input(self, l):
        return static_mix(self.v, self.P[sublayer_prefix(l) + "logits"])

    def push(self, l, out):
        self.v.append(out)

    def final(self):
        return static_mix(self.v, self.P["out_res.logits"])


class DenseFormer:
    """DenseFormer (Pagliardini et al. 2024): PreNorm blocks; after block i the next block's
    input is the depth-weighted average z_{i+1} = sum_{j<=i+1} alpha_{i,j} X_j of the
    embedding X_0 and the block outputs X_1..X_{i+1} (alpha = layers.{i}.dwa.weight)."""

    def __init__(self, P, cfg: Config):
        self.P = P
        self.X: List[torch.Tensor] = []
        self.h = None

    def begin(self, emb):
        self.X = [emb]
        self.h = emb  # z_0 = X_0

    def input(self, l):
        return self.h  # z_i for the attention, z_i + attn for the MLP

    def push(self, l, out):
        self.h = self.h + out
        if l % 2 == 1:  # end of transformer block i = l // 2
            self.X.append(self.h)
            alpha = self.P[f"layers.{l // 2}.dwa.weight"]
            V = torch.stack(self.X, dim=0)
            self.h = (alpha.view(-1, 1, 1, 1) * V).sum(dim=0)

    def final(self):
        return self.h


def make_residual(P, cfg: Config):
    return {"prenorm": PreNormResidual, "full": FullAttnRes, "block": BlockAttnRes,
            "static": StaticMix, "denseformer": DenseFormer}[cfg.residual](P, cfg)


# --------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------

def forward(P, cfg: Config, tokens: torch.Tensor, residual=None) -> torch.Tensor:
    """tokens (B,T) int64 -> logits (B,T,V) in the parameters' dtype."""
    eps = cfg.norm_eps
    res = residual if residual is not None else make_residual(P, cfg)
    emb = P["tok_embeddings.weight"][tokens]
    res.begin(emb)
    for i in range(cfg.n_layer):
        pre = f"layers.{i}."
        l = 2 * i
        x = res.input(l)
        out = attention(rms_norm(x, P[pre + "attention_norm.weight"], eps), P, pre + "attention.", cfg)
        res.push(l, out)
        x = res.input(l + 1)
        out = mlp(rms_norm(x, P[pre + "ffn_norm.weight"], eps), P, pre + "feed_forward.")
        res.push(l + 1, out)
    h = rms_norm(res.final(), P["norm.weight"], eps)
    W_out = P["tok_embeddings.weight"] if cfg.tied else P["output.weight"]
    return h @ W_out.T


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    V = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), reduction="mean")


# --------------------------------------------------------------------------
# training (AdamW + clipping + warm-up/cosine schedule)
# --------------------------------------------------------------------------

DEFAULT_TRAIN = {"lr": 0.01, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                 "weight_decay": 0.1, "grad_clip": 1.0, "warmup_steps": 3,
                 "total_steps": 10, "min_lr_ratio": 0.1, "schedule": "cosine"}


def lr_at(s: int, tr: Dict) -> float:
    lr, W, S = tr["lr"], tr["warmup_steps"], tr["total_steps"]
    if s < W:
        return lr * (s + 1) / W
    lr_min = lr * tr["min_lr_ratio"]
    p = (s - W) / max(1, S - W)
    return lr_min + 0.5 * (lr - lr_min) * (1.0 + math.cos(math.pi * p))


def train_adamw(P0, cfg: Config, tokens, targets, tr: Dict = DEFAULT_TRAIN,
                grad_norms: Optional[List[float]] = None):
    """Runs tr["total_steps"] AdamW steps on one fixed batch.

    Returns (losses list, final params OrderedDict).  losses[s] is the loss
    before update s.  If grad_norms is a list, the pre-clip global grad norm of
    every step is appended to it.
    """
    P = OrderedDict((n, t.clone().requires_grad_(True)) for n, t in P0.items())
    decay = [t for n, t in P.items() if is_decayed(n, t.shape)]
    no_decay = [t for n, t in P.items() if not is_decayed(n, t.shape)]
    groups = [{"params": decay, "weight_decay": tr["weight_decay"]},
              {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=tr["lr"], betas=(tr["beta1"], tr["beta2"]),
                            eps=tr["eps"], weight_decay=tr["weight_decay"],
                            amsgrad=False, foreach=False)
    losses = []
    for s in range(tr["total_steps"]):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(forward(P, cfg, tokens), targets)
        losses.append(loss.item())
        loss.backward()
        n = torch.nn.utils.clip_grad_norm_(list(P.values()), tr["grad_clip"])
        if grad_norms is not None:
            grad_norms.append(float(n))
        for g in opt.param_groups:
            g["lr"] = lr_at(s, tr)
        opt.step()
    return losses, OrderedDict((n, t.detach().clone()) for n, t in P.items())

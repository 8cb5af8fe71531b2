#!/usr/bin/python3
"""Generate the parity fixtures under tests/fixtures/ from tools/reference_model.py.

Usage (from the repository root):   /usr/bin/python3 tools/gen_fixtures.py
Options:  --out DIR        (default tests/fixtures)
          --skip-checks    (skip the self-checks: gradcheck, loop formulations, identities,
                            float32 / perturbed reruns, manual AdamW)
          --only NAME ...  (write only these fixtures; for experiments)

Everything is float64; weights are drawn with numpy's PCG64 (fixed seeds), rounded to
float32 and used as exactly those float32 values.  Files are written by hand in the
safetensors layout (no safetensors package).  See tools/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
from collections import OrderedDict

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_model as rm  # noqa: E402

torch.set_default_dtype(torch.float64)

FIXTURE_VERSION = "1"

def _c(**kw):
    base = dict(n_layer=3, vocab_size=40)
    base.update(kw)
    return rm.Config(**base)


# name -> (Config, B, T, seed, attnres_init[, init options for rm.init_params])
# The seeds of the residual-mode fixtures were chosen (offline search) so that every AdamW
# trajectory is well conditioned: a float32 rerun and two float64 reruns from weights perturbed
# by 1e-7 (relative) stay within ~1e-5 of the stored losses and final weights (checked below).
# parity_block_dynamic_temperature's seed 1 moved by 7.3e-5 (most seeds of that configuration are
# chaotic): a change of summation order in the C++ dot products then missed the test's 1e-4; seed
# 235 (the best of seeds 1-500) moves by 9.7e-6.
FIXTURES = OrderedDict([
    ("parity_prenorm_a", (rm.Config(n_layer=2, n_head=4, n_kv_head=4, d_model=32, ffn_hidden=64,
                                    vocab_size=64, tied=True, residual="prenorm"), 2, 8, 1001, "paper")),
    ("parity_prenorm_b", (rm.Config(n_layer=3, n_head=6, n_kv_head=2, d_model=48, ffn_hidden=80,
                                    vocab_size=50, tied=False, residual="prenorm"), 3, 7, 1002, "paper")),
    # Residual-mode fixtures: n_layer 3 -> L = 6 sublayers.  Router params are drawn at random
    # ("random" init) so the depth weights are far from uniform and their gradients are tested.
    ("parity_full", (_c(n_head=4, n_kv_head=2, d_model=32, ffn_hidden=32, tied=True,
                        residual="full"), 2, 8, 15, "random")),
    ("parity_block_s2", (_c(n_head=4, n_kv_head=2, d_model=24, ffn_hidden=40, tied=False,
                            residual="block", block_size=2), 2, 6, 4, "random")),
    # Same config and seed as the previous parity_block_s4 (identical tensors; blocks {0..3},{4,5}).
    ("parity_block_s4", (_c(n_head=4, n_kv_head=2, d_model=24, ffn_hidden=40, tied=False,
                            residual="block", block_size=4), 2, 6, 1004, "random")),
    ("parity_block_s4_paper_init", (_c(n_head=2, n_kv_head=1, d_model=24, ffn_hidden=32, tied=True,
                                       residual="block", block_size=4), 2, 7, 4, "paper")),
    ("parity_full_sigmoid", (_c(n_head=4, n_kv_head=4, d_model=24, ffn_hidden=40, tied=False,
                                residual="full", attnres_gate="sigmoid"), 2, 8, 4, "random")),
    ("parity_full_nokeynorm", (_c(n_head=4, n_kv_head=2, d_model=32, ffn_hidden=32, tied=True,
                                  residual="full", attnres_key_norm="none"), 2, 6, 5, "random")),
    ("parity_block_heads", (_c(n_head=6, n_kv_head=3, d_model=24, ffn_hidden=40, tied=False,
                               residual="block", block_size=2, attnres_heads=4), 2, 6, 2, "random")),
    # query_proj std 0.2/sqrt(d) instead of 0.5/sqrt(d): with 0.5 the 10-step AdamW trajectory
    # (lr 0.01) was chaotic for all ~60 seeds tried (float32 rerun drifts 1e-4 .. 1e-1).
    ("parity_full_dynamic", (_c(n_head=4, n_kv_head=2, d_model=24, ffn_hidden=32, tied=False,
                                residual="full", attnres_query="dynamic"), 2, 6, 2414, "random",
                             {"query_proj_std": 0.2})),
    ("parity_full_window", (_c(n_head=4, n_kv_head=2, d_model=32, ffn_hidden=32, tied=False,
                               residual="full", attnres_window=2), 2, 8, 5, "random")),
    ("parity_block_window", (_c(n_head=2, n_kv_head=2, d_model=24, ffn_hidden=40, tied=False,
                                residual="block", block_size=2, attnres_window=1), 2, 7, 3, "random")),
    ("parity_static", (_c(n_head=4, n_kv_head=1, d_model=24, ffn_hidden=40, tied=False,
                          residual="static"), 2, 8, 2, "random")),
    ("parity_denseformer", (_c(n_head=4, n_kv_head=2, d_model=32, ffn_hidden=32, tied=True,
                               residual="denseformer"), 2, 8, 1, "random")),
    # Key norms with their own epsilon, large enough (1e-2 against sources of mean square ~1e-3)
    # that using norm_eps for them instead changes the logits (checked in generate()).
    ("parity_full_key_eps", (_c(n_head=4, n_kv_head=2, d_model=32, ffn_hidden=32, tied=True,
                                residual="full", attnres_key_eps=1e-2), 2, 8, 15, "random")),
    # Score temperature (static queries: folded into w * g; dynamic: scaled per token).
    ("parity_full_temperature", (_c(n_head=4, n_kv_head=2, d_model=32, ffn_hidden=32, tied=True,
                                    residual="full", attnres_temperature=0.3), 2, 8, 15, "random")),
    ("parity_block_dynamic_temperature", (_c(n_head=4, n_kv_head=2, d_model=24, ffn_hidden=32,
                                             tied=False, residual="block", block_size=2,
                                             attnres_query="dynamic", attnres_temperature=1.5),
                                          2, 6, 235, "random", {"query_proj_std": 0.2})),
    ("parity_block_s2_all", (_c(n_head=4, n_kv_head=2, d_model=24, ffn_hidden=32, tied=False,
                                residual="block", block_size=2, attnres_gate="sigmoid",
                                attnres_key_norm="none", attnres_heads=2, attnres_query="dynamic",
                                attnres_window=2), 2, 6, 1, "random")),
])

# float64 torch.autograd.gradcheck on these parameters of the named fixtures (router params
# plus one ordinary weight each)
GRADCHECK = OrderedDict([
    ("parity_prenorm_a", ["norm.weight", "layers.0.attention_norm.weight", "layers.1.ffn_norm.weight",
                          "layers.0.attention.wq.weight", "layers.1.attention.wk.weight",
                          "layers.0.feed_forward.w2.weight"]),
    ("parity_full", ["layers.1.attn_res.query", "layers.2.mlp_res.key_norm.weight", "out_res.query",
                     "out_res.key_norm.weight", "layers.1.attention.wk.weight"]),
    ("parity_block_s4", ["layers.0.mlp_res.query", "layers.2.attn_res.key_norm.weight",
                         "layers.2.mlp_res.query", "out_res.query", "layers.2.attention.wv.weight"]),
    ("parity_full_sigmoid", ["layers.0.attn_res.query", "layers.1.mlp_res.query",
                             "layers.2.attn_res.key_norm.weight", "out_res.query",
                             "layers.0.attention.wk.weight"]),
    ("parity_full_nokeynorm", ["layers.1.attn_res.query", "out_res.query", "layers.2.attention.wk.weight"]),
    ("parity_block_heads", ["layers.1.attn_res.query", "layers.1.mlp_res.key_norm.weight", "out_res.query",
                            "layers.1.attention.wv.weight"]),
    # query_proj std 0.2/sqrt(d) instead of 0.5/sqrt(d): with 0.5 the 10-step AdamW trajectory
    # (lr 0.01) was chaotic for all ~60 seeds tried (float32 rerun drifts 1e-4 .. 1e-1).
    ("parity_full_dynamic", ["layers.1.attn_res.query_proj.weight", "layers.2.mlp_res.query",
                             "out_res.query_proj.weight", "out_res.key_norm.weight",
                             "layers.0.attention.wk.weight"]),
    ("parity_full_window", ["layers.2.attn_res.query", "out_res.key_norm.weight",
                            "layers.2.attention.wk.weight"]),
    ("parity_block_window", ["layers.1.mlp_res.query", "out_res.query", "layers.1.attention.wk.weight"]),
    ("parity_static", ["layers.0.mlp_res.logits", "layers.2.attn_res.logits", "out_res.logits",
                       "layers.1.attention.wk.weight"]),
    ("parity_denseformer", ["layers.0.dwa.weight", "layers.1.dwa.weight", "layers.2.dwa.weight",
                            "layers.1.attention.wk.weight"]),
    ("parity_full_temperature", ["layers.1.attn_res.query", "out_res.key_norm.weight"]),
    ("parity_block_dynamic_temperature", ["layers.1.attn_res.query_proj.weight", "layers.2.mlp_res.query",
                                          "out_res.key_norm.weight"]),
    ("parity_full_key_eps", ["layers.1.attn_res.key_norm.weight", "layers.2.mlp_res.query",
                             "out_res.key_norm.weight"]),
    ("parity_block_s2_all", ["layers.0.attn_res.query", "layers.1.mlp_res.query_proj.weight",
                             "out_res.query", "layers.1.attention.wk.weight"]),
])


# --------------------------------------------------------------------------
# safetensors writer / reader (by hand)
# --------------------------------------------------------------------------

_DT = {"F32": (np.float32, 4), "I32": (np.int32, 4)}


def write_safetensors(path: str, tensors: "OrderedDict[str, tuple]", metadata: dict) -> None:
    """tensors: name -> (dtype tag, numpy array); packed in insertion order."""
    header = OrderedDict()
    header["__metadata__"] = OrderedDict((k, str(v)) for k, v in metadata.items())
    blobs, off = [], 0
    for name, (tag, arr) in tensors.items():
        npdt, _ = _DT[tag]
        a = np.ascontiguousarray(np.asarray(arr).astype(npdt).astype(np.dtype(npdt).newbyteorder("<")))
        b = a.tobytes()
        header[name] = OrderedDict([("dtype", tag), ("shape", list(a.shape)),
                                    ("data_offsets", [off, off + len(b)])])
        blobs.append(b)
        off += len(b)
    hj = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hj)))
        f.write(hj)
        for b in blobs:
            f.write(b)


def _no_dup_pairs(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicate JSON keys {keys}"
    return OrderedDict(pairs)


def read_safetensors(path: str):
    """Independent strict parser: returns (metadata, OrderedDict name -> numpy array).

    Checks: header length multiple of 8, header is UTF-8 JSON padded only with trailing
    spaces, no duplicate keys, metadata is str -> str, dtypes F32/I32 only, shapes are lists
    of non-negative ints, tensors packed contiguously in header order from offset 0 with no
    gaps, overlaps or trailing bytes."""
    with open(path, "rb") as f:
        raw = f.read()
    assert len(raw) >= 8
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0, "header not padded to 8"
    assert 8 + n <= len(raw)
    hbytes = raw[8:8 + n]
    assert hbytes[:1] == b"{"
    stripped = hbytes.rstrip(b" ")
    assert stripped.endswith(b"}") and len(hbytes) - len(stripped) < 8, "bad header padding"
    header = json.loads(hbytes.decode("utf-8"), object_pairs_hook=_no_dup_pairs)
    data = raw[8 + n:]
    meta = header.pop("__metadata__")
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    out, expect = OrderedDict(), 0
    for name, info in header.items():
        assert set(info.keys()) == {"dtype", "shape", "data_offsets"}, name
        assert info["dtype"] in _DT, (name, info["dtype"])
        assert all(isinstance(x, int) and x >= 0 for x in info["shape"]), name
        npdt, sz = _DT[info["dtype"]]
        b, e = info["data_offsets"]
        assert b == expect, f"{name}: gap/overlap at {b} (expected {expect})"
        assert e - b == sz * int(np.prod(info["shape"], dtype=np.int64)), name
        out[name] = np.frombuffer(data[b:e], dtype=np.dtype(npdt).newbyteorder("<")).reshape(info["shape"])
        expect = e
    assert expect == len(data), "trailing bytes after last tensor"
    return meta, out


def check_config_json(cfg, text: str) -> None:
    """The metadata "config" has exactly the documented keys for its mode."""
    c = json.loads(text, object_pairs_hook=_no_dup_pairs)
    keys = ["n_layer", "n_head", "n_kv_head", "d_model", "ffn_hidden", "vocab_size", "norm_eps",
            "rope_theta", "tied", "residual"]
    if cfg.residual in ("full", "block"):
        keys.append("block_size")
    if cfg.residual != "prenorm":
        keys += ["attnres_gate", "attnres_key_norm", "attnres_heads", "attnres_query", "attnres_window"]
        if cfg.is_attnres and cfg.attnres_key_eps > 0:
            keys.append("attnres_key_eps")
        if cfg.is_attnres and cfg.attnres_temperature != 1.0:
            keys.append("attnres_temperature")
    assert list(c.keys()) == keys, (list(c.keys()), keys)
    assert c["residual"] == cfg.residual
    if cfg.residual == "full":
        assert c["block_size"] == 1
    if cfg.residual == "block":
        assert c["block_size"] == cfg.block_size >= 1
    if cfg.residual != "prenorm":
        assert c["attnres_gate"] in ("softmax", "sigmoid") and c["attnres_key_norm"] in ("rms", "none")
        assert c["attnres_query"] in ("static", "dynamic")
        assert isinstance(c["attnres_heads"], int) and isinstance(c["attnres_window"], int)
    back = rm.Config(**{k: v for k, v in c.items()})
    if cfg.residual == "full":
        back.block_size = cfg.block_size
    assert back == cfg


# --------------------------------------------------------------------------
# independent self-checks
# --------------------------------------------------------------------------

def check_rmsnorm():
    x = torch.tensor([[3.0, 4.0]])
    g = torch.tensor([1.0, 2.0])
    eps = 1e-5
    r = 1.0 / math.sqrt((9.0 + 16.0) / 2.0 + eps)
    want = torch.tensor([[3.0 * r * 1.0, 4.0 * r * 2.0]])
    assert torch.allclose(rm.rms_norm(x, g, eps), want, rtol=0, atol=1e-15)


def check_rope():
    # hand computation: hd = 2, position 1 -> plain 2-D rotation by angle 1 rad (freq_0 = 1)
    cos, sin = rm.rope_cos_sin(2, 2, 10000.0)
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    y = rm.apply_rope(x, cos, sin)
    assert torch.allclose(y[0], torch.tensor([1.0, 0.0]), atol=1e-15)
    assert torch.allclose(y[1], torch.tensor([math.cos(1.0), math.sin(1.0)]), atol=1e-15)
    # hd = 4, position 3: pairs (0,2) rotate by 3*1, pairs (1,3) by 3*10000^(-1/2)
    cos, sin = rm.rope_cos_sin(4, 4, 10000.0)
    x = torch.tensor([0.3, -0.7, 1.1, 0.5])
    y = rm.apply_rope(x.expand(4, 4), cos, sin)[3]
    a0, a1 = 3.0, 3.0 * 10000.0 ** -0.5
    want = torch.tensor([0.3 * math.cos(a0) - 1.1 * math.sin(a0),
                         -0.7 * math.cos(a1) - 0.5 * math.sin(a1),
                         1.1 * math.cos(a0) + 0.3 * math.sin(a0),
                         0.5 * math.cos(a1) + -0.7 * math.sin(a1)])
    assert torch.allclose(y, want, atol=1e-14)
    # alternative formulation: complex multiply of pairs (x_i, x_{i+hd/2}) by e^{i p f_i}
    T, hd = 9, 16
    x = torch.randn(T, hd, generator=torch.Generator().manual_seed(5))
    cos, sin = rm.rope_cos_sin(T, hd, 10000.0)
    y = rm.apply_rope(x, cos, sin)
    z = torch.complex(x[:, :hd // 2], x[:, hd // 2:])
    f = torch.tensor([10000.0 ** (-2.0 * i / hd) for i in range(hd // 2)])
    ang = torch.arange(T, dtype=torch.float64)[:, None] * f[None, :]
    zr = z * torch.polar(torch.ones_like(ang), ang)
    assert torch.allclose(y, torch.cat([zr.real, zr.imag], -1), atol=1e-13)
    # relative-position property: <rope(q,p), rope(k,p')> depends only on p - p'
    q, k = torch.randn(hd), torch.randn(hd)
    Q = rm.apply_rope(q.expand(T, hd), cos, sin)
    K = rm.apply_rope(k.expand(T, hd), cos, sin)
    assert abs(float(Q[5] @ K[2]) - float(Q[7] @ K[4])) < 1e-12


def attention_loops(x, P, pre, cfg):
    """Explicit-loop attention (no repeat_interleave, no masks), used to check rm.attention."""
    B, T, d = x.shape
    H, Hkv, hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    grp = H // Hkv
    wq, wk, wv, wo = (P[pre + n + ".weight"] for n in ("wq", "wk", "wv", "wo"))
    out = torch.zeros(B, T, H * hd)
    for b in range(B):
        for h in range(H):
            kvh = h // grp
            for t in range(T):
                def rope_vec(vec, pos):
                    r = vec.clone()
                    for i in range(hd // 2):
                        ang = pos * cfg.rope_theta ** (-2.0 * i / hd)
                        c, s = math.cos(ang), math.sin(ang)
                        r[i] = vec[i] * c - vec[i + hd // 2] * s
                        r[i + hd // 2] = vec[i + hd // 2] * c + vec[i] * s
                    return r
                qv = rope_vec(wq[h * hd:(h + 1) * hd] @ x[b, t], t)
                sc = []
                for u in range(t + 1):
                    kv = rope_vec(wk[kvh * hd:(kvh + 1) * hd] @ x[b, u], u)
                    sc.append(float(qv @ kv) / math.sqrt(hd))
                m = max(sc)
                e = [math.exp(s_ - m) for s_ in sc]
                z = sum(e)
                acc = torch.zeros(hd)
                for u in range(t + 1):
                    acc = acc + (e[u] / z) * (wv[kvh * hd:(kvh + 1) * hd] @ x[b, u])
                out[b, t, h * hd:(h + 1) * hd] = acc
    return out @ wo.T


def check_attention_gqa():
    for (H, Hkv) in ((4, 4), (6, 2), (4, 1)):
        cfg = rm.Config(n_layer=1, n_head=H, n_kv_head=Hkv, d_model=H * 4, ffn_hidden=8, vocab_size=5)
        P = rm.init_params(cfg, np.random.default_rng(7))
        x = torch.randn(2, 5, cfg.d_model, generator=torch.Generator().manual_seed(3))
        a = rm.attention(x, P, "layers.0.attention.", cfg)
        b = attention_loops(x, P, "layers.0.attention.", cfg)
        assert torch.allclose(a, b, atol=1e-12), (H, Hkv, (a - b).abs().max())


def loop_mix(srcs, P, pre, cfg):
    """Second depth-mix formulation: explicit per-token, per-head scalar loops over an explicit
    source list.  Keys use the SPEC 2 inference identity s = (q*g).v * rstd(v) (rstd of the
    head's slice); the dynamic query q = w + W u is built channel by channel."""
    eps, d, H = cfg.key_eps, cfg.d_model, cfg.attnres_heads
    dh = d // H
    w = P[pre + "query"]
    g = P[pre + "key_norm.weight"] if cfg.attnres_key_norm == "rms" else None
    Wp = P[pre + "query_proj.weight"] if cfg.attnres_query == "dynamic" else None
    B, T, _ = srcs[0].shape
    out = torch.zeros_like(srcs[0])
    for b in range(B):
        for t in range(T):
            if Wp is not None:
                u = srcs[-1][b, t]
                q = torch.tensor([float(w[c]) + float(Wp[c] @ u) for c in range(d)])
            else:
                q = w
            for h in range(H):
                c0, c1 = h * dh, (h + 1) * dh
                s = []
                for v in srcs:
                    vs = v[b, t, c0:c1]
                    if g is not None:
                        rstd = 1.0 / math.sqrt(float((vs ** 2).mean()) + eps)
                        s.append(float((q[c0:c1] * g[c0:c1]) @ vs) * rstd)
                    else:
                        s.append(float(q[c0:c1] @ vs))
                s = [cfg.attnres_temperature * si for si in s]
                if cfg.attnres_gate == "softmax":
                    m = max(s)
                    e = [math.exp(si - m) for si in s]
                    a = [ei / sum(e) for ei in e]
                else:
                    a = [1.0 / (1.0 + math.exp(-si)) for si in s]
                for ai, v in zip(a, srcs):
                    out[b, t, c0:c1] += ai * v[b, t, c0:c1]
    return out


def loop_static_mix(srcs, logits):
    z = [math.exp(float(x)) for x in logits]
    a = [zi / sum(z) for zi in z]
    B, T, _ = srcs[0].shape
    out = torch.zeros_like(srcs[0])
    for b in range(B):
        for t in range(T):
            for ai, v in zip(a, srcs):
                out[b, t] += ai * v[b, t]
    return out


def _sublayer(P, cfg, l, x):
    lp, eps = f"layers.{l // 2}.", cfg.norm_eps
    if l % 2 == 0:
        return rm.attention(rm.rms_norm(x, P[lp + "attention_norm.weight"], eps), P, lp + "attention.", cfg)
    return rm.mlp(rm.rms_norm(x, P[lp + "ffn_norm.weight"], eps), P, lp + "feed_forward.")


def forward_loops(P, cfg, tokens):
    """Second formulation of the whole residual path for every mode.  Sources are rebuilt from
    the list of raw outputs v_0..v_l at every sublayer with SPEC 3's block indexing (block
    j = sublayers jS..jS+S-1, partial sum of the current block, window by list slicing)."""
    L, eps = cfg.n_sublayer, cfg.norm_eps
    emb = P["tok_embeddings.weight"][tokens]
    if cfg.residual == "denseformer":
        X, z = [emb], emb
        for i in range(cfg.n_layer):
            h = z + _sublayer(P, cfg, 2 * i, z)
            h = h + _sublayer(P, cfg, 2 * i + 1, h)
            X.append(h)
            alpha = [float(a) for a in P[f"layers.{i}.dwa.weight"]]
            z = torch.zeros_like(emb)
            for b in range(emb.shape[0]):
                for t in range(emb.shape[1]):
                    for aj, Xj in zip(alpha, X):
                        z[b, t] += aj * Xj[b, t]
        final = z
    elif cfg.residual == "prenorm":
        x = emb
        for l in range(L):
            x = x + _sublayer(P, cfg, l, x)
        final = x
    else:
        S = cfg.block_size if cfg.residual == "block" else 1
        K = cfg.attnres_window if cfg.is_attnres else 0

        def mix(srcs, pre):
            if K > 0:
                srcs = srcs[:1] + srcs[1:][-K:]
            if cfg.residual == "static":
                return loop_static_mix(srcs, P[pre + "logits"])
            return loop_mix(srcs, P, pre, cfg)

        v = [emb]  # v[1 + l] = raw output of sublayer l
        for l in range(L):
            n, k = l // S, l % S
            srcs = [emb] + [sum(v[1 + j * S: 1 + (j + 1) * S]) for j in range(n)]
            if k > 0:
                srcs.append(sum(v[1 + n * S: 1 + l]))
            v.append(_sublayer(P, cfg, l, mix(srcs, rm.sublayer_prefix(l))))
        N = -(-L // S)
        srcs = [emb] + [sum(v[1 + j * S: min(1 + (j + 1) * S, L + 1)]) for j in range(N)]
        final = mix(srcs, "out_res.")
    h = rm.rms_norm(final, P["norm.weight"], eps)
    W = P["tok_embeddings.weight"] if cfg.tied else P["output.weight"]
    return h @ W.T


def _with(cfg, **kw):
    d = dict(cfg.__dict__)
    d.update(kw)
    return rm.Config(**d)


def _maxdiff(a, b):
    return float((a - b).abs().max())


def check_attnres():
    """Loop formulation for many mode/option combinations, identities, and the paper init."""
    base = dict(n_layer=3, n_head=4, n_kv_head=2, d_model=16, ffn_hidden=24, vocab_size=20, tied=False)
    L = 6
    tokens = torch.from_numpy(np.random.default_rng(11).integers(0, 20, (2, 5)))
    report = OrderedDict()

    # (1) loop formulation == vectorised forward
    combos = [dict(residual="prenorm"), dict(residual="static"), dict(residual="denseformer")]
    for mode, S in (("full", 0), ("block", 1), ("block", 2), ("block", 3), ("block", 4), ("block", L)):
        combos.append(dict(residual=mode, block_size=S))
    for opt in (dict(attnres_gate="sigmoid"), dict(attnres_key_norm="none"), dict(attnres_heads=2),
                dict(attnres_heads=4), dict(attnres_heads=16), dict(attnres_query="dynamic"),
                dict(attnres_window=1), dict(attnres_window=2), dict(attnres_window=3),
                dict(attnres_gate="sigmoid", attnres_key_norm="none", attnres_heads=2,
                     attnres_query="dynamic", attnres_window=2),
                dict(attnres_key_norm="none", attnres_query="dynamic"),
                dict(attnres_gate="sigmoid", attnres_heads=4, attnres_window=1)):
        for mode, S in (("full", 0), ("block", 2), ("block", 4)):
            combos.append(dict(residual=mode, block_size=S, **opt))
    worst = 0.0
    for j, kw in enumerate(combos):
        cfg = rm.Config(**base, **kw)
        P = rm.init_params(cfg, np.random.default_rng(100 + j), attnres_init="random")
        d = _maxdiff(rm.forward(P, cfg, tokens), forward_loops(P, cfg, tokens))
        assert d < 1e-11, (kw, d)
        worst = max(worst, d)
    report["loops"] = (len(combos), worst)

    # (2) identities, random router params
    cfg_f = rm.Config(**base, residual="full")
    Pr = rm.init_params(cfg_f, np.random.default_rng(13), attnres_init="random")
    lf = rm.forward(Pr, cfg_f, tokens)
    # block S=1 == full, exactly
    assert torch.equal(lf, rm.forward(Pr, _with(cfg_f, residual="block", block_size=1), tokens))
    # heads H=1 == default (explicit option), exactly
    assert torch.equal(lf, rm.forward(Pr, _with(cfg_f, attnres_heads=1), tokens))
    # window K >= L == no window, exactly (full and block S=2)
    for K in (L, L + 3):
        assert torch.equal(lf, rm.forward(Pr, _with(cfg_f, attnres_window=K), tokens))
        cb = _with(cfg_f, residual="block", block_size=2)
        assert torch.equal(rm.forward(Pr, cb, tokens), rm.forward(Pr, _with(cb, attnres_window=K), tokens))
    # a window smaller than the source count changes the result
    assert _maxdiff(lf, rm.forward(Pr, _with(cfg_f, attnres_window=2), tokens)) > 1e-3
    # sigmoid differs from softmax
    d_sig = _maxdiff(lf, rm.forward(Pr, _with(cfg_f, attnres_gate="sigmoid"), tokens))
    assert d_sig > 1e-2, d_sig
    # S = L has two sources, and differs from full
    assert _maxdiff(lf, rm.forward(Pr, _with(cfg_f, residual="block", block_size=L), tokens)) > 1e-2
    # dynamic with W = 0 == static query, exactly (full, block S=2 with heads 2, and key norm none)
    for kw in (dict(), dict(residual="block", block_size=2, attnres_heads=2), dict(attnres_key_norm="none")):
        cs = _with(cfg_f, **kw)
        cd = _with(cs, attnres_query="dynamic")
        Pd = rm.init_params(cd, np.random.default_rng(14), attnres_init="random")
        Ps = OrderedDict((n, t) for n, t in Pd.items() if not n.endswith("query_proj.weight"))
        assert list(Ps.keys()) == list(rm.param_shapes(cs).keys())
        ld = rm.forward(Pd, cd, tokens)
        assert _maxdiff(ld, rm.forward(Ps, cs, tokens)) > 1e-2  # random W matters ...
        P0 = OrderedDict((n, torch.zeros_like(t) if n.endswith("query_proj.weight") else t)
                         for n, t in Pd.items())
        assert torch.equal(rm.forward(P0, cd, tokens), rm.forward(Ps, cs, tokens))  # ... W = 0 does not
    report["sigmoid_vs_softmax"] = d_sig

    # (3) paper init (queries 0, gains 1, proj 0, logits 0, dwa one-hot): equal to prenorm with
    # the same weights, up to the epsilon effect (the mean of n sources normalised with eps equals
    # the sum normalised with n^2 eps); checked at the real eps (loose) and at eps = 1e-14 (tight).
    # Denseformer at its init is the plain residual exactly.
    modes = [("full", dict(residual="full"))]
    modes += [(f"block S={S}", dict(residual="block", block_size=S)) for S in (1, 2, 4, L)]
    modes += [("static", dict(residual="static")),
              ("full sigmoid", dict(residual="full", attnres_gate="sigmoid")),
              ("full nokeynorm", dict(residual="full", attnres_key_norm="none")),
              ("block S=2 heads 4", dict(residual="block", block_size=2, attnres_heads=4)),
              ("full dynamic", dict(residual="full", attnres_query="dynamic")),
              ("block S=2 all-but-window", dict(residual="block", block_size=2, attnres_gate="sigmoid",
                                                attnres_key_norm="none", attnres_heads=2,
                                                attnres_query="dynamic"))]
    paper = OrderedDict()
    for eps, tol in ((1e-5, 2e-3), (1e-14, 1e-10)):
        cfg_p = rm.Config(**base, residual="prenorm", norm_eps=eps)
        Pp = rm.init_params(cfg_p, np.random.default_rng(12))
        ref = rm.forward(Pp, cfg_p, tokens)
        for label, kw in modes + [("denseformer", dict(residual="denseformer"))]:
            cfg = rm.Config(**base, norm_eps=eps, **kw)
            P = rm.init_params(cfg, np.random.default_rng(12), attnres_init="paper")
            for n, t in Pp.items():
                assert torch.equal(P[n], t), n  # constant router params consume no random numbers
            lg = rm.forward(P, cfg, tokens)
            if label == "denseformer":
                assert torch.equal(lg, ref)
                continue
            d = _maxdiff(lg, ref)
            assert d < tol, (label, eps, d)
            paper.setdefault(label, {})[eps] = d
    report["paper"] = paper
    return report


def check_gradcheck(cfg, P, tokens, targets, names):
    for name in names:
        def f(t, name=name):
            Q = OrderedDict(P)
            Q[name] = t
            return rm.loss_fn(rm.forward(Q, cfg, tokens), targets)
        t = P[name].clone().requires_grad_(True)
        assert torch.autograd.gradcheck(f, (t,), eps=1e-6, atol=1e-7, rtol=1e-5), name


def check_train_manual(cfg, P0, tokens, targets, tr, losses, final):
    """Re-implements clip + schedule + AdamW by hand and compares with torch.optim.AdamW."""
    P = OrderedDict((n, t.clone()) for n, t in P0.items())
    m = {n: torch.zeros_like(t) for n, t in P.items()}
    v = {n: torch.zeros_like(t) for n, t in P.items()}
    b1, b2 = tr["beta1"], tr["beta2"]
    norms = []
    for s in range(tr["total_steps"]):
        Q = OrderedDict((n, t.clone().requires_grad_(True)) for n, t in P.items())
        loss = rm.loss_fn(rm.forward(Q, cfg, tokens), targets)
        assert abs(loss.item() - losses[s]) <= 1e-10 * max(1.0, abs(losses[s])), (s, loss.item(), losses[s])
        gs = torch.autograd.grad(loss, list(Q.values()))
        g = OrderedDict(zip(Q.keys(), gs))
        norm = math.sqrt(sum(float((x ** 2).sum()) for x in g.values()))
        norms.append(norm)
        coef = tr["grad_clip"] / (norm + 1e-6)
        if coef < 1.0:
            g = OrderedDict((n, x * coef) for n, x in g.items())
        lr = rm.lr_at(s, tr)
        step = s + 1
        for n in P:
            wd = tr["weight_decay"] if rm.is_decayed(n, P[n].shape) else 0.0
            p = P[n] * (1.0 - lr * wd)
            m[n] = b1 * m[n] + (1 - b1) * g[n]
            v[n] = b2 * v[n] + (1 - b2) * g[n] ** 2
            mhat = m[n] / (1 - b1 ** step)
            denom = (v[n] / (1 - b2 ** step)).sqrt() + tr["eps"]
            P[n] = p - lr * mhat / denom
    for n in P:
        assert torch.allclose(P[n], final[n], rtol=1e-10, atol=1e-12), n
    return norms


def check_float32_run(cfg, back, tokens, targets, tr):
    """Informational: the same reference run in float32 from the stored weights, compared
    with the float64 fixture values (a rough guide for C++ test tolerances).  Gradient errors
    are reported relative to each tensor's max |grad| (worst tensor named) and relative to
    max(tensor max, 1e-2 * global max |grad|), which is the better measure for tensors whose
    gradient is tiny by construction (e.g. the first mixer's under the sigmoid gate, pure eps
    effect)."""
    names = list(rm.param_shapes(cfg).keys())
    P32 = OrderedDict((n, torch.from_numpy(back[n].copy())) for n in names)
    Q = OrderedDict((n, t.clone().requires_grad_(True)) for n, t in P32.items())
    lg = rm.forward(Q, cfg, tokens)
    gs = torch.autograd.grad(rm.loss_fn(lg, targets), list(Q.values()))
    d_logit = float((lg.detach() - torch.from_numpy(back["logits"].copy())).abs().max())
    gmax = max(float(np.abs(back["grad." + n]).max()) for n in names)
    rel, rel_floor = [], []
    for n, g in zip(names, gs):
        ref = torch.from_numpy(back["grad." + n].copy())
        err = float((g - ref).abs().max())
        tmax = float(ref.abs().max())
        rel.append((err / max(tmax, 1e-30), n))
        rel_floor.append((err / max(tmax, 1e-2 * gmax), n))
    d_grad, w_grad = max(rel)
    d_gfl, w_gfl = max(rel_floor)
    losses, fin = rm.train_adamw(P32, cfg, tokens, targets, tr)
    d_loss = max(abs(a - float(b)) for a, b in zip(losses, back["adamw_losses"]))
    d_fin, w_fin = max((float((fin[n] - torch.from_numpy(back["final." + n].copy())).abs().max()), n)
                       for n in names)
    print(f"  float32 rerun vs fixture: logits {d_logit:.1e} abs, grads {d_grad:.1e} rel-to-tensor-max "
          f"({w_grad}), {d_gfl:.1e} rel-to-max(tensor max, 1e-2*global max) ({w_gfl}), "
          f"adamw losses {d_loss:.1e}, final weights {d_fin:.1e} abs ({w_fin})")
    assert d_logit < 1e-4 and d_gfl < 1e-4 and d_loss < 1e-4 and d_fin < 1e-3
    # conditioning of the training trajectory: float64 reruns from weights perturbed by a relative
    # 1e-7 (about float32 rounding) must stay close to the stored trajectory
    P64 = OrderedDict((n, torch.from_numpy(back[n].astype(np.float64))) for n in names)
    gen = torch.Generator().manual_seed(12345)
    d_pert = 0.0
    for _ in range(2):
        Pp = OrderedDict((n, t * (1 + 1e-7 * torch.randn(t.shape, generator=gen))) for n, t in P64.items())
        lp, fp = rm.train_adamw(Pp, cfg, tokens, targets, tr)
        d_pert = max(d_pert, max(abs(a - float(b)) for a, b in zip(lp, back["adamw_losses"])),
                     max(float((fp[n] - torch.from_numpy(back["final." + n].astype(np.float64))).abs().max())
                         for n in names))
    print(f"  perturbed (1e-7 rel) float64 reruns: max |dloss|, |dfinal| {d_pert:.1e}")
    assert d_pert < 1e-4, d_pert
    return dict(logits=d_logit, grad=d_grad, grad_floor=d_gfl, losses=d_loss, final=d_fin)


# --------------------------------------------------------------------------
# fixture generation
# --------------------------------------------------------------------------

def init_text(cfg, attnres_init: str, init_opts=None) -> str:
    """Metadata "init".  The prenorm text is unchanged from fixture version 1."""
    t = ("numpy PCG64 default_rng(seed); tokens then targets via rng.integers(0, V, (B,T)); then each "
         "parameter in file order: tok_embeddings N(0,1); 2-D linear weights (incl. output.weight) "
         "N(0, 1/sqrt(in_features)); RMSNorm gains U(0.5,1.5); drawn in float64, rounded to float32, "
         "the float32 values are the weights")
    if cfg.residual == "prenorm":
        return t
    names = list(rm.param_shapes(cfg).keys())
    has = lambda suffix: any(n.endswith(suffix) for n in names)  # noqa: E731
    parts = []
    if attnres_init == "random":
        if has(".query"):
            parts.append("attn-res query N(0, 1/sqrt(d_model))")
        if has("key_norm.weight"):
            parts.append("key_norm.weight U(0.5,1.5)")
        if has("query_proj.weight"):
            pstd = (init_opts or {}).get("query_proj_std", 0.5)
            parts.append(f"query_proj.weight N(0, {pstd}/sqrt(d_model))")
        if has(".logits"):
            parts.append("static-mix logits N(0,1)")
        if has("dwa.weight"):
            parts.append("layers.{i}.dwa.weight N(0,0.5) plus 1 on its last entry (i+1)")
        t += "; " + ", ".join(parts) + " (N(0,s): standard deviation s)"
    else:
        if has(".query"):
            parts.append("attn-res query 0")
        if has("key_norm.weight"):
            parts.append("key_norm.weight 1")
        if has("query_proj.weight"):
            parts.append("query_proj.weight 0")
        if has(".logits"):
            parts.append("static-mix logits 0")
        if has("dwa.weight"):
            parts.append("layers.{i}.dwa.weight one-hot on its last entry")
        t += "; paper init: " + ", ".join(parts) + " (constants, no random numbers drawn)"
    return t


def generate(name, cfg, B, T, seed, attnres_init, out_dir, do_checks, init_opts=None):
    init_opts = dict(init_opts or {})
    rng = np.random.default_rng(seed)
    tokens_np = rng.integers(0, cfg.vocab_size, (B, T))
    targets_np = rng.integers(0, cfg.vocab_size, (B, T))
    P0 = rm.init_params(cfg, rng, attnres_init=attnres_init, **init_opts)
    tokens = torch.from_numpy(tokens_np).long()
    targets = torch.from_numpy(targets_np).long()

    P = OrderedDict((n, t.clone().requires_grad_(True)) for n, t in P0.items())
    logits = rm.forward(P, cfg, tokens)
    loss = rm.loss_fn(logits, targets)
    grads = torch.autograd.grad(loss, list(P.values()))
    tr = dict(rm.DEFAULT_TRAIN)
    losses, final = rm.train_adamw(P0, cfg, tokens, targets, tr)
    assert abs(losses[0] - loss.item()) < 1e-12
    norms = None
    if do_checks:
        norms = check_train_manual(cfg, P0, tokens, targets, tr, losses, final)
        # second formulation of the forward (explicit per-token loops) on the fixture itself
        d_loop = float((forward_loops(P0, cfg, tokens) - logits.detach()).abs().max())
        assert d_loop < 1e-11, (name, d_loop)
        if cfg.attnres_temperature != 1.0:  # the option must matter on this fixture
            d_t = float((rm.forward(P0, _with(cfg, attnres_temperature=1.0), tokens) - logits.detach()).abs().max())
            assert d_t > 1e-3, (name, d_t)
            print(f"  temperature {cfg.attnres_temperature:g} vs 1: max |dlogit| {d_t:.2e}")
        if cfg.attnres_key_eps > 0:  # the option must matter on this fixture
            d_eps = float((rm.forward(P0, _with(cfg, attnres_key_eps=0.0), tokens) - logits.detach()).abs().max())
            assert d_eps > 1e-3, (name, d_eps)
            print(f"  key eps {cfg.attnres_key_eps:g} vs norm_eps: max |dlogit| {d_eps:.2e}")

    tensors = OrderedDict()
    tensors["tokens"] = ("I32", tokens_np)
    tensors["targets"] = ("I32", targets_np)
    for n, t in P0.items():
        tensors[n] = ("F32", t.numpy())
    tensors["logits"] = ("F32", logits.detach().numpy())
    tensors["loss"] = ("F32", np.array([loss.item()]))
    for n, g in zip(P.keys(), grads):
        tensors["grad." + n] = ("F32", g.numpy())
    tensors["adamw_losses"] = ("F32", np.array(losses))
    for n, t in final.items():
        tensors["final." + n] = ("F32", t.numpy())

    meta = OrderedDict()
    meta["fixture_version"] = FIXTURE_VERSION
    meta["generator"] = "tools/gen_fixtures.py"
    meta["torch_version"] = f"{torch.__version__} (Debian python3-torch)"
    meta["config"] = cfg.to_json()
    meta["batch"] = json.dumps({"B": B, "T": T})
    meta["train"] = json.dumps(tr)
    meta["init"] = init_text(cfg, attnres_init, init_opts) + f"; seed {seed}"
    path = os.path.join(out_dir, name + ".safetensors")
    write_safetensors(path, tensors, meta)

    # re-read with the independent parser and compare
    meta2, back = read_safetensors(path)
    assert meta2 == meta
    check_config_json(cfg, meta2["config"])
    assert os.path.getsize(path) < 300 * 1024 or cfg.residual == "prenorm", (path, os.path.getsize(path))
    assert list(back.keys()) == list(tensors.keys())
    for n, (tag, arr) in tensors.items():
        a = np.asarray(arr)
        assert back[n].shape == a.shape, n
        if tag == "I32":
            assert np.array_equal(back[n], a), n
        else:
            assert np.array_equal(back[n], a.astype(np.float32)), n
    for n, t in P0.items():  # weights are exactly float32-representable
        assert np.array_equal(back[n].astype(np.float64), t.numpy()), n
    gnorm = math.sqrt(sum(float((g ** 2).sum()) for g in grads))
    print(f"{path}: {os.path.getsize(path)} bytes, {len(tensors)} tensors, "
          f"loss {loss.item():.6f}, |grad| {gnorm:.4f}, losses {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"logit std {float(logits.std()):.3f}")
    if do_checks:
        print(f"  loop formulation vs forward: max |dlogit| {d_loop:.1e}; grad norm per step "
              f"{norms[0]:.3f} -> {norms[-1]:.3f} (clipped at steps "
              f"{[s for s, x in enumerate(norms) if x + 1e-6 > tr['grad_clip']]})")
        router = [(n, float(g.abs().max())) for n, g in zip(P.keys(), grads)
                  if rm.is_router_param(n)]
        if router:
            print("  router grads: max|g| per tensor in [%.1e, %.1e] over %d tensors (%s exactly 0)" % (
                min(x for _, x in router), max(x for _, x in router), len(router),
                ", ".join(n for n, x in router if x == 0.0) or "none"))
        check_float32_run(cfg, back, tokens, targets, tr)
    return cfg, P0, tokens, targets


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "tests", "fixtures"))
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--only", nargs="*", default=None, help="generate only these fixture names")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    do_checks = not args.skip_checks

    if do_checks:
        check_rmsnorm()
        print("check: RMSNorm hand computation OK")
        check_rope()
        print("check: RoPE hand computation / complex formulation / relative-position OK")
        check_attention_gqa()
        print("check: attention+GQA vs explicit loops OK (H/Hkv = 4/4, 6/2, 4/1)")
        rep = check_attnres()
        n, worst = rep["loops"]
        print(f"check: residual paths vs per-token loop formulation OK ({n} mode/option combinations, "
              f"max |dlogit| {worst:.1e})")
        print("check: identities OK: block S=1 == full, heads H=1 == default, window K>=L == no window, "
              "dynamic with W=0 == static query (all exact); sigmoid vs softmax differ by "
              f"{rep['sigmoid_vs_softmax']:.2f}; window K<L and S=L differ from full")
        print("check: paper init == prenorm up to the eps effect (max |dlogit| at eps 1e-5 / 1e-14); "
              "denseformer at init == prenorm exactly:")
        for label, d in rep["paper"].items():
            print(f"    {label:26s} {d[1e-5]:.2e} / {d[1e-14]:.2e}")

    for name, (cfg, B, T, seed, ainit, *opts) in FIXTURES.items():
        if args.only is not None and name not in args.only:
            continue
        cfg_, P0, tokens, targets = generate(name, cfg, B, T, seed, ainit, args.out, do_checks,
                                             opts[0] if opts else None)
        if do_checks and name in GRADCHECK:
            check_gradcheck(cfg_, P0, tokens, targets, GRADCHECK[name])
            print(f"  gradcheck (float64) OK: {', '.join(GRADCHECK[name])}")
    if do_checks:
        print("check: manual AdamW/clip/schedule re-implementation matches torch.optim.AdamW OK")


if __name__ == "__main__":
    main()

#!/usr/bin/python3
"""Generate the parity fixtures under tests/fixtures/ from tools/reference_model.py.

Usage (from the repository root):   /usr/bin/python3 tools/gen_fixtures.py
Options:  --out DIR   (default tests/fixtures)
          --skip-checks   (skip the self-checks: gradcheck, RoPE/GQA/RMSNorm/AttnRes checks)

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

# name -> (Config, B, T, seed, attnres_init)
FIXTURES = OrderedDict([
    ("parity_prenorm_a", (rm.Config(n_layer=2, n_head=4, n_kv_head=4, d_model=32, ffn_hidden=64,
                                    vocab_size=64, tied=True, residual="prenorm"), 2, 8, 1001, "paper")),
    ("parity_prenorm_b", (rm.Config(n_layer=3, n_head=6, n_kv_head=2, d_model=48, ffn_hidden=80,
                                    vocab_size=50, tied=False, residual="prenorm"), 3, 7, 1002, "paper")),
    # AttnRes fixtures: pseudo-queries / key-norm gains drawn at random ("random" init) so the
    # depth softmax is far from uniform and its gradients are nontrivial.
    ("parity_full_a", (rm.Config(n_layer=2, n_head=4, n_kv_head=4, d_model=32, ffn_hidden=64,
                                 vocab_size=64, tied=True, residual="full"), 2, 8, 1003, "random")),
    # L = 6 sublayers, S = 4: blocks {1..4}, {5,6} -> a shorter last block; GQA; untied.
    ("parity_block_s4", (rm.Config(n_layer=3, n_head=4, n_kv_head=2, d_model=24, ffn_hidden=40,
                                   vocab_size=40, tied=False, residual="block", block_size=4), 2, 6, 1004, "random")),
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


def read_safetensors(path: str):
    """Independent strict parser: returns (metadata, OrderedDict name -> numpy array)."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0, "header not padded to 8"
    header = json.loads(raw[8:8 + n].decode("utf-8"), object_pairs_hook=OrderedDict)
    data = raw[8 + n:]
    meta = header.pop("__metadata__")
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    out, expect = OrderedDict(), 0
    for name, info in header.items():
        npdt, sz = _DT[info["dtype"]]
        b, e = info["data_offsets"]
        assert b == expect, f"{name}: gap/overlap at {b} (expected {expect})"
        assert e - b == sz * int(np.prod(info["shape"], dtype=np.int64)), name
        out[name] = np.frombuffer(data[b:e], dtype=np.dtype(npdt).newbyteorder("<")).reshape(info["shape"])
        expect = e
    assert expect == len(data), "trailing bytes after last tensor"
    return meta, out


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


def attnres_loops(P, cfg, tokens):
    """Second AttnRes formulation: explicit per-token scalar loops over sources, using the
    inference identity s = (w*g).v * rstd(v) (SPEC 2), driven by SPEC 3's block indexing."""
    S = 1 if cfg.residual == "full" else cfg.block_size
    L = cfg.n_sublayer
    eps = cfg.norm_eps

    def mix(srcs, w, g):
        q = w * g
        B, T, _ = srcs[0].shape
        out = torch.zeros_like(srcs[0])
        for b in range(B):
            for t in range(T):
                s = [float(q @ v[b, t]) / math.sqrt(float((v[b, t] ** 2).mean()) + eps) for v in srcs]
                m = max(s)
                e = [math.exp(si - m) for si in s]
                for ei, v in zip(e, srcs):
                    out[b, t] += ei / sum(e) * v[b, t]
        return out

    emb = P["tok_embeddings.weight"][tokens]
    v = [emb]  # v_0 .. v_l (raw outputs)
    for l in range(L):
        n, i = l // S, l % S  # block n (0-based among sublayer blocks), position i inside it
        blocks = [emb] + [sum(v[1 + k * S: 1 + (k + 1) * S]) for k in range(n)]
        srcs = blocks + ([sum(v[1 + n * S: 1 + n * S + i])] if i > 0 else [])
        pre = rm.sublayer_prefix(l)
        x = mix(srcs, P[pre + "query"], P[pre + "key_norm.weight"])
        lp = f"layers.{l // 2}."
        if l % 2 == 0:
            out = rm.attention(rm.rms_norm(x, P[lp + "attention_norm.weight"], eps), P, lp + "attention.", cfg)
        else:
            out = rm.mlp(rm.rms_norm(x, P[lp + "ffn_norm.weight"], eps), P, lp + "feed_forward.")
        v.append(out)
    N = -(-L // S)
    blocks = [emb] + [sum(v[1 + k * S: min(1 + (k + 1) * S, L + 1)]) for k in range(N)]
    h = rm.rms_norm(mix(blocks, P["out_res.query"], P["out_res.key_norm.weight"]), P["norm.weight"], eps)
    W = P["tok_embeddings.weight"] if cfg.tied else P["output.weight"]
    return h @ W.T


def check_attnres():
    base = dict(n_layer=3, n_head=4, n_kv_head=2, d_model=16, ffn_hidden=24, vocab_size=20, tied=False)
    L = 6
    tokens = torch.from_numpy(np.random.default_rng(11).integers(0, 20, (2, 5)))
    # (1) at "paper" initialisation all modes equal prenorm up to epsilon effects: the mean of
    # n sources normalised with eps equals the sum normalised with n^2*eps.  Checked at the real
    # eps (loose) and at eps = 1e-14 (tight), which isolates the epsilon effect.
    worst = {}
    for eps, tol in ((1e-5, 2e-3), (1e-14, 1e-10)):
        cfg_p = rm.Config(**base, residual="prenorm", norm_eps=eps)
        Pp = rm.init_params(cfg_p, np.random.default_rng(12))
        ref = rm.forward(Pp, cfg_p, tokens)
        worst[eps] = 0.0
        for mode, S in (("full", 0), ("block", 1), ("block", 2), ("block", 4), ("block", 6)):
            cfg = rm.Config(**base, residual=mode, block_size=S, norm_eps=eps)
            P = rm.init_params(cfg, np.random.default_rng(12), attnres_init="paper")
            for n, t in Pp.items():
                assert torch.equal(P[n], t), n  # constant attn-res params consume no random numbers
            d = float((rm.forward(P, cfg, tokens) - ref).abs().max())
            worst[eps] = max(worst[eps], d)
            assert d < tol, (mode, S, eps, d)
    # (2) random queries/gains: block S=1 == full exactly (same sources), S=L has 2 sources
    cfg_f = rm.Config(**base, residual="full")
    Pr = rm.init_params(cfg_f, np.random.default_rng(13), attnres_init="random")
    lf = rm.forward(Pr, cfg_f, tokens)
    lb1 = rm.forward(Pr, rm.Config(**base, residual="block", block_size=1), tokens)
    assert torch.allclose(lf, lb1, rtol=0, atol=1e-12)
    # (3) loop formulation for full and several block sizes
    for mode, S in (("full", 0), ("block", 2), ("block", 4), ("block", L)):
        cfg = rm.Config(**base, residual=mode, block_size=S)
        a = rm.forward(Pr, cfg, tokens)
        b = attnres_loops(Pr, cfg, tokens)
        assert torch.allclose(a, b, atol=1e-11), (mode, S, float((a - b).abs().max()))
    # the random init really is far from prenorm
    assert float((lf - rm.forward(Pr, rm.Config(**base, residual="block", block_size=L), tokens)).abs().max()) > 1e-2
    return worst


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
    for s in range(tr["total_steps"]):
        Q = OrderedDict((n, t.clone().requires_grad_(True)) for n, t in P.items())
        loss = rm.loss_fn(rm.forward(Q, cfg, tokens), targets)
        assert abs(loss.item() - losses[s]) <= 1e-12 * max(1.0, abs(losses[s])), (s, loss.item(), losses[s])
        gs = torch.autograd.grad(loss, list(Q.values()))
        g = OrderedDict(zip(Q.keys(), gs))
        norm = math.sqrt(sum(float((x ** 2).sum()) for x in g.values()))
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


def check_float32_run(cfg, back, tokens, targets, tr):
    """Informational: the same reference run in float32 from the stored weights, compared
    with the float64 fixture values (a rough guide for C++ test tolerances)."""
    names = list(rm.param_shapes(cfg).keys())
    P32 = OrderedDict((n, torch.from_numpy(back[n].copy())) for n in names)
    Q = OrderedDict((n, t.clone().requires_grad_(True)) for n, t in P32.items())
    lg = rm.forward(Q, cfg, tokens)
    gs = torch.autograd.grad(rm.loss_fn(lg, targets), list(Q.values()))
    d_logit = float((lg.detach() - torch.from_numpy(back["logits"].copy())).abs().max())
    d_grad = max(float((g - torch.from_numpy(back["grad." + n].copy())).abs().max())
                 / max(float(np.abs(back["grad." + n]).max()), 1e-30) for n, g in zip(names, gs))
    losses, fin = rm.train_adamw(P32, cfg, tokens, targets, tr)
    d_loss = max(abs(a - float(b)) for a, b in zip(losses, back["adamw_losses"]))
    d_fin = max(float((fin[n] - torch.from_numpy(back["final." + n].copy())).abs().max()) for n in names)
    print(f"  float32 rerun vs fixture: logits {d_logit:.1e} abs, grads {d_grad:.1e} rel-to-max, "
          f"adamw losses {d_loss:.1e}, final weights {d_fin:.1e} abs")
    assert d_logit < 1e-4 and d_grad < 1e-4 and d_loss < 1e-4 and d_fin < 1e-3


# --------------------------------------------------------------------------
# fixture generation
# --------------------------------------------------------------------------

def init_text(attnres_init: str) -> str:
    # "paper" init has no attn-res params in prenorm fixtures; for full/block it would be
    # query = 0, key_norm.weight = 1 (no draws), but all shipped AttnRes fixtures use "random".
    t = ("numpy PCG64 default_rng(seed); tokens then targets via rng.integers(0, V, (B,T)); then each "
         "parameter in file order: tok_embeddings N(0,1); 2-D linear weights (incl. output.weight) "
         "N(0, 1/sqrt(in_features)); RMSNorm gains U(0.5,1.5); drawn in float64, rounded to float32, "
         "the float32 values are the weights")
    if attnres_init == "random":
        t += "; attn-res query N(0, 1/sqrt(d_model)), key_norm.weight U(0.5,1.5)"
    return t


def generate(name, cfg, B, T, seed, attnres_init, out_dir, do_checks):
    rng = np.random.default_rng(seed)
    tokens_np = rng.integers(0, cfg.vocab_size, (B, T))
    targets_np = rng.integers(0, cfg.vocab_size, (B, T))
    P0 = rm.init_params(cfg, rng, attnres_init=attnres_init)
    tokens = torch.from_numpy(tokens_np).long()
    targets = torch.from_numpy(targets_np).long()

    P = OrderedDict((n, t.clone().requires_grad_(True)) for n, t in P0.items())
    logits = rm.forward(P, cfg, tokens)
    loss = rm.loss_fn(logits, targets)
    grads = torch.autograd.grad(loss, list(P.values()))
    tr = dict(rm.DEFAULT_TRAIN)
    losses, final = rm.train_adamw(P0, cfg, tokens, targets, tr)
    assert abs(losses[0] - loss.item()) < 1e-12
    if do_checks:
        check_train_manual(cfg, P0, tokens, targets, tr, losses, final)

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
    meta["init"] = init_text(attnres_init) + f"; seed {seed}"
    path = os.path.join(out_dir, name + ".safetensors")
    write_safetensors(path, tensors, meta)

    # re-read with the independent parser and compare
    meta2, back = read_safetensors(path)
    assert meta2 == meta
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
    if do_checks:
        check_float32_run(cfg, back, tokens, targets, tr)
    gnorm = math.sqrt(sum(float((g ** 2).sum()) for g in grads))
    print(f"{path}: {os.path.getsize(path)} bytes, {len(tensors)} tensors, "
          f"loss {loss.item():.6f}, |grad| {gnorm:.4f}, losses {losses[0]:.4f} -> {losses[-1]:.4f}, "
          f"logit std {float(logits.std()):.3f}")
    return cfg, P0, tokens, targets


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "tests", "fixtures"))
    ap.add_argument("--skip-checks", action="store_true")
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
        worst = check_attnres()
        print(f"check: AttnRes loops (full, block S=2,4,L), S=1==full, init==prenorm "
              f"(max |dlogit| {worst[1e-5]:.2e} at eps 1e-5, {worst[1e-14]:.2e} at eps 1e-14) OK")

    for name, (cfg, B, T, seed, ainit) in FIXTURES.items():
        cfg_, P0, tokens, targets = generate(name, cfg, B, T, seed, ainit, args.out, do_checks)
        if do_checks and name == "parity_prenorm_a":
            check_gradcheck(cfg_, P0, tokens, targets,
                            ["norm.weight", "layers.0.attention_norm.weight", "layers.1.ffn_norm.weight",
                             "layers.0.attention.wq.weight", "layers.1.attention.wk.weight",
                             "layers.0.feed_forward.w2.weight"])
            print("check: gradcheck (float64) on config A params OK")
        if do_checks and name == "parity_full_a":
            check_gradcheck(cfg_, P0, tokens, targets,
                            ["layers.0.mlp_res.query", "layers.1.attn_res.key_norm.weight",
                             "out_res.query", "out_res.key_norm.weight"])
            print("check: gradcheck (float64) on full-AttnRes params OK")
    if do_checks:
        print("check: manual AdamW/clip/schedule re-implementation matches torch.optim.AdamW OK")


if __name__ == "__main__":
    main()

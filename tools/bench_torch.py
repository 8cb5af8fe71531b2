#!/usr/bin/env python3
"""PyTorch side of `attnres bench --torch PYTHON`: times training steps of the reference model
(tools/reference_model.py, float32) on exactly the weights and batch the C++ benchmark used, and
reports the loss at those weights so both sides are known to compute the same thing.

Usage: PYTHON tools/bench_torch.py WEIGHTS.safetensors [--steps N] [--warmup N] [--threads N] [--bf16]
Prints one JSON line: {"torch": version, "setups": [{"name", "tokens_per_s", "loss0"}, ...]}.
Setups: the reference model eager and torch.compile'd; when this torch has them (2.x), the same model with its
attention replaced by the fused F.scaled_dot_product_attention (what idiomatic PyTorch code uses),
eager and torch.compile'd. --bf16: every setup under CPU bf16 autocast (torch.autocast("cpu",
torch.bfloat16): the linear layers and attention products in bf16 through oneDNN, float32 master
weights and optimizer), as `attnres bench --precision bf16` is compared with.
"""
import contextlib
import argparse
import json
import os
import struct
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_model as ref  # noqa: E402


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    out = {}
    for name, h in header.items():
        b, e = h["data_offsets"]
        dt = {"F32": np.float32, "I32": np.int32}[h["dtype"]]
        out[name] = np.frombuffer(data[b:e], dtype=dt).reshape(h["shape"]).copy()
    return meta, out


def sdpa_attention(x, P, pre, cfg):
    """ref.attention with the (B,H,T,T) matmul-softmax-matmul replaced by the fused SDPA kernel."""
    B, T, d = x.shape
    H, Hkv, hd = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    q = (x @ P[pre + "wq.weight"].T).view(B, T, H, hd).transpose(1, 2)
    k = (x @ P[pre + "wk.weight"].T).view(B, T, Hkv, hd).transpose(1, 2)
    v = (x @ P[pre + "wv.weight"].T).view(B, T, Hkv, hd).transpose(1, 2)
    cos, sin = ref.rope_cos_sin(T, hd, cfg.rope_theta, x.dtype)
    q = ref.apply_rope(q, cos, sin)
    k = ref.apply_rope(k, cos, sin)
    n_rep = H // Hkv
    k = k.repeat_interleave(n_rep, dim=1)
    v = v.repeat_interleave(n_rep, dim=1)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(B, T, H * hd) @ P[pre + "wo.weight"].T


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("weights")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--bf16", action="store_true", help="CPU bf16 autocast")
    args = ap.parse_args()

    def autocast():
        if args.bf16:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()
    tag = " bf16 autocast" if args.bf16 else ""
    torch.set_num_threads(args.threads)
    meta, t = load_safetensors(args.weights)
    c = json.loads(meta["config"])
    cfg = ref.Config(n_layer=c["n_layer"], n_head=c["n_head"], n_kv_head=c["n_kv_head"],
                     d_model=c["d_model"], ffn_hidden=c["ffn_hidden"], vocab_size=c["vocab_size"],
                     norm_eps=c["norm_eps"], rope_theta=c["rope_theta"], tied=c["tied"],
                     residual=c["residual"])
    tokens = torch.from_numpy(t.pop("tokens").astype(np.int64))
    targets = torch.from_numpy(t.pop("targets").astype(np.int64))
    B, T = tokens.shape
    setups = []

    def run(name, fwd):
        # Fresh copies: the optimizer updates in place, and every setup must start alike.
        P = {k: torch.tensor(v).requires_grad_(True) for k, v in t.items()}
        opt = torch.optim.AdamW(list(P.values()), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)

        def step():
            with autocast():
                loss = ref.loss_fn(fwd(P, tokens).float(), targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(P.values()), 1.0)
            opt.step()
            return loss

        with torch.no_grad(), autocast():
            loss0 = float(ref.loss_fn(fwd(P, tokens).float(), targets))
        for _ in range(args.warmup):
            step()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        times.sort()
        setups.append({"name": name + tag, "tokens_per_s": B * T / times[len(times) // 2], "loss0": loss0})

    forward = lambda P, tok: ref.forward(P, cfg, tok)  # noqa: E731
    run("torch %s eager" % torch.__version__, forward)
    if hasattr(torch, "compile"):
        try:
            run("torch %s compile" % torch.__version__, torch.compile(forward))
        except Exception as e:  # a missing compiler toolchain, say
            print("torch.compile failed: %s" % e, file=sys.stderr)
    if hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        ref.attention = sdpa_attention  # ref.forward looks it up at call time
        run("torch %s eager+sdpa" % torch.__version__, forward)
        if hasattr(torch, "compile"):
            try:
                torch._dynamo.reset()  # recompile with the new attention
                run("torch %s compile+sdpa" % torch.__version__, torch.compile(forward))
            except Exception as e:  # a missing compiler toolchain, say
                print("torch.compile failed: %s" % e, file=sys.stderr)
    print(json.dumps({"torch": torch.__version__, "setups": setups}))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Independent check of LONG training: the same runs trained by PyTorch, from the same initial
weights, on the same token stream and batch order, with the same optimiser settings as attnres.

Issue 17: is Full AttnRes's deficit (and Block's gain) against PreNorm at 32 sublayers a property
of the method at this scale, or of the engine?  attnres's arithmetic matches tools/
reference_model.py over 10 AdamW steps (tests/test_parity.cpp); this trains for the whole run in
float32 with reference_model.forward (written from SPEC.md, sharing no code with the engine) and
torch.optim.AdamW, and reports both engines' validation curves and the AttnRes-minus-PreNorm gaps.

Subcommands (tools/long_check.sh drives them; see tools/README.md "Long-run check"):

  long_check.py init  --train-config RUN/train_config.json --modes prenorm,full,block
                      [--block-size S] --seed K --out DIR
      draws one set of initial weights (numpy, the engine's distributions: normal std 0.02,
      std 0.02/sqrt(2 n_layer) for wo and w2, RMSNorm gains 1, AttnRes queries 0 and key gains 1)
      and writes DIR/<mode>.safetensors for each mode: identical shared weights in every mode.
  long_check.py train --run ENGINE_RUN_DIR --init DIR/<mode>.safetensors --out FILE.jsonl
      trains with PyTorch using the settings in ENGINE_RUN_DIR/train_config.json and the tokens
      of ENGINE_RUN_DIR/tokens.bin; writes one JSON line per evaluation.
  long_check.py fixture [--out tests/fixtures]
      writes the short version used by tests/test_long_check.cpp: a synthetic corpus, initial
      weights, and PyTorch's validation curves of a 200-step run per mode.
  long_check.py table DIR [--baseline prenorm]
      reads DIR/engine_<mode>/metrics.jsonl and DIR/torch_<mode>.jsonl and prints the final
      validation losses, the gaps to the baseline in both engines, and their difference.

Data (the engine's documented definitions, tools/README.md): tokens.bin = 40-byte header ("ARTOKCCH",
u32 version, u32 reserved, u64 count, u64 vocab, u64 key) then count int32 ids; the first
floor(count * (1 - val_fraction)) tokens are the training split, the rest validation. Training
batch row r of (seed, step, micro) starts at splitmix64(base ^ r) % (n - T) with
base = splitmix64(splitmix64(splitmix64(seed) ^ step) ^ micro); validation batch i holds windows
i*B .. i*B+B-1 (window w = tokens [wT, wT+T], modulo the number of windows floor((n-1)/T)).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time
from collections import OrderedDict

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_model as rm  # noqa: E402
from gen_fixtures import read_safetensors, write_safetensors  # noqa: E402

MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def read_tokens(path: str) -> np.ndarray:
    with open(path, "rb") as f:
        head = f.read(40)
        if len(head) != 40 or head[:8] != b"ARTOKCCH":
            sys.exit(f"long_check: '{path}' is not an attnres token cache")
        count = struct.unpack("<Q", head[16:24])[0]
        ids = np.frombuffer(f.read(4 * count), dtype="<i4")
    if ids.size != count:
        sys.exit(f"long_check: '{path}' is truncated ({ids.size} of {count} tokens)")
    return ids.astype(np.int64)


def train_batch(train: np.ndarray, seed: int, step: int, micro: int, B: int, T: int):
    n = train.size
    base = splitmix64(splitmix64(splitmix64(seed) ^ step) ^ micro)
    starts = [splitmix64(base ^ r) % (n - T) for r in range(B)]
    x = np.stack([train[s:s + T] for s in starts])
    y = np.stack([train[s + 1:s + T + 1] for s in starts])
    return torch.from_numpy(x), torch.from_numpy(y)


def val_batch(val: np.ndarray, i: int, B: int, T: int):
    nw = (val.size - 1) // T
    ws = [(i * B + r) % nw for r in range(B)]
    x = np.stack([val[w * T:w * T + T] for w in ws])
    y = np.stack([val[w * T + 1:w * T + T + 1] for w in ws])
    return torch.from_numpy(x), torch.from_numpy(y)


def model_config(mj: dict) -> rm.Config:
    keys = [f for f in rm.Config.__dataclass_fields__]
    c = rm.Config(**{k: mj[k] for k in keys if k in mj})
    if c.residual == "full":
        c.block_size = 1
    c.validate()
    return c


# ------------------------------------------------------------------------------------------ init

def cmd_init(a):
    tc = json.load(open(a.train_config))
    mj = dict(tc["model"])
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    base = model_config({**mj, "residual": "prenorm"})
    L = base.n_layer
    shared = OrderedDict()
    for name, shape in rm.param_shapes(base).items():  # the core tensors, in a fixed order
        if name.endswith("norm.weight"):
            a_ = np.ones(shape)
        else:
            std = 0.02 / math.sqrt(2 * L) if name.endswith(("wo.weight", "w2.weight")) else 0.02
            a_ = std * rng.standard_normal(shape)
        shared[name] = a_.astype(np.float32)
    for mode in a.modes.split(","):
        m = dict(mj, residual=mode)
        if mode == "block":
            m["block_size"] = a.block_size
        cfg = model_config(m)
        tensors = OrderedDict()
        for name, shape in rm.param_shapes(cfg).items():
            if name in shared:
                tensors[name] = ("F32", shared[name])
            elif name.endswith(".query"):
                tensors[name] = ("F32", np.zeros(shape, np.float32))
            elif name.endswith("key_norm.weight"):
                tensors[name] = ("F32", np.ones(shape, np.float32))
            else:
                sys.exit(f"long_check init: no initialisation rule for '{name}' (mode {mode})")
        meta = {"format": "attnres-model/1", "config": engine_config_json(cfg, mj)}
        path = os.path.join(a.out, mode + ".safetensors")
        write_safetensors(path, tensors, meta)
        print(f"init: {path} ({len(tensors)} tensors, seed {a.seed})")


def engine_config_json(cfg: rm.Config, mj: dict) -> str:
    d = json.loads(cfg.to_json())
    d["max_seq_len"] = mj["max_seq_len"]
    return json.dumps(d)


# ----------------------------------------------------------------------------------------- train

class CachedFullAttnRes:
    """Full AttnRes (SPEC 2) as rm.FullAttnRes, computed faster for long runs: each source's
    normalised key v * rsqrt(mean(v^2) + eps) is computed once, when it is pushed, and every
    mixer folds its key gain into its query: q . (g * khat) = (q * g) . khat.  The same function
    in exact arithmetic; `check_same_function` compares it with rm.forward before training.
    Only the static-query softmax mix with RMS keys and no window (the engine's defaults)."""

    def __init__(self, P, cfg: rm.Config):
        self.P, self.cfg = P, cfg
        self.H = cfg.attnres_heads
        self.v, self.k = [], []

    @staticmethod
    def applies(cfg: rm.Config) -> bool:
        return (cfg.residual == "full" and cfg.attnres_query == "static" and
                cfg.attnres_gate == "softmax" and cfg.attnres_key_norm == "rms" and
                cfg.attnres_window <= 0)

    def _heads(self, x):
        return x.reshape(*x.shape[:-1], self.H, x.shape[-1] // self.H)

    def begin(self, emb):
        self.v, self.k = [], []
        self.push(-1, emb)

    def push(self, l, out):
        vh = self._heads(out)  # (B,T,H,dh)
        self.v.append(vh)
        self.k.append(vh * torch.rsqrt(vh.pow(2).mean(dim=-1, keepdim=True) + self.cfg.key_eps))

    def _mix(self, pre):
        qg = self._heads(self.P[pre + "query"] * self.P[pre + "key_norm.weight"])  # (H,dh)
        K, V = torch.stack(self.k), torch.stack(self.v)  # (n,B,T,H,dh)
        s = self.cfg.attnres_temperature * torch.einsum("nbthc,hc->nbth", K, qg)
        a = torch.softmax(s, dim=0)
        x = torch.einsum("nbth,nbthc->bthc", a, V)
        return x.reshape(*x.shape[:2], -1)

    def input(self, l):
        return self._mix(rm.sublayer_prefix(l))

    def final(self):
        return self._mix("out_res.")


def check_same_function(P, cfg: rm.Config, x, y):
    """The fast residual must compute rm.forward's loss and gradients: both in float64 on a copy
    of P whose queries and key gains are perturbed (at the initial zero queries the scores, and
    every term through them, vanish), on the first two rows of the batch."""
    gen = torch.Generator().manual_seed(1)
    Q = OrderedDict()
    for n, t in P.items():
        q = t.detach().to(torch.float64).clone()
        if n.endswith(".query"):
            q += 0.5 * torch.randn(q.shape, generator=gen, dtype=torch.float64)
        elif n.endswith("key_norm.weight"):
            q += 0.3 * torch.randn(q.shape, generator=gen, dtype=torch.float64)
        Q[n] = q.requires_grad_(True)
    x, y = x[:2], y[:2]

    def loss_and_grads(residual):
        loss = rm.loss_fn(rm.forward(Q, cfg, x, residual), y)
        grads = torch.autograd.grad(loss, list(Q.values()), allow_unused=True)
        return loss.item(), [torch.zeros_like(t) if g is None else g
                             for g, t in zip(grads, Q.values())]
    ref_loss, ref_g = loss_and_grads(None)
    fast_loss, fast_g = loss_and_grads(CachedFullAttnRes(Q, cfg))
    worst = max(((a - b).abs().max() / (b.abs().max() + 1e-300)).item()
                for a, b in zip(fast_g, ref_g))
    if abs(fast_loss - ref_loss) > 1e-12 * abs(ref_loss) or worst > 1e-10:
        sys.exit(f"long_check train: the cached Full mix differs from reference_model (loss "
                 f"{fast_loss!r} vs {ref_loss!r}, worst relative gradient difference {worst:.2e})")
    print(f"long_check: cached Full mix = reference_model in float64 (loss {fast_loss:.12f}, "
          f"gradients within {worst:.1e} relative)", flush=True)


def lr_at(s: int, tc: dict) -> float:
    tr = {"lr": tc["lr"], "warmup_steps": tc["warmup_steps"], "total_steps": tc["steps"],
          "min_lr_ratio": tc["min_lr_ratio"]}
    return rm.lr_at(s, tr)


def evaluate(P, cfg, val, tc) -> float:
    B, T = tc["batch_size"], tc["seq_len"]
    nw = (val.size - 1) // T
    batches = min(tc["eval_batches"], (nw + B - 1) // B)
    total = 0.0
    with torch.no_grad():
        for i in range(batches):
            x, y = val_batch(val, i, B, T)
            total += rm.loss_fn(rm.forward(P, cfg, x), y).item()
    return total / batches


def train_run(tc: dict, cfg: rm.Config, toks: np.ndarray, init: dict, log=None, tag="",
              fast=False):
    """Trains cfg from `init` (name -> array) with the settings tc (an attnres train_config);
    returns one record per evaluation.  fast: Full AttnRes through CachedFullAttnRes (checked
    against reference_model on the first batch)."""
    n_train = int(math.floor(toks.size * (1.0 - tc["val_fraction"])))
    train, val = toks[:n_train], toks[n_train:]
    P = OrderedDict((n, torch.tensor(np.asarray(init[n]), dtype=torch.float32).requires_grad_(True))
                    for n in rm.param_shapes(cfg))
    decay = [t for n, t in P.items() if rm.is_decayed(n, t.shape)]
    rest = [t for n, t in P.items() if not rm.is_decayed(n, t.shape)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc["weight_decay"]},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=tc["lr"], betas=(tc["beta1"], tc["beta2"]), eps=tc["adam_eps"],
                            foreach=False)
    B, T, K = tc["batch_size"], tc["seq_len"], tc["grad_accum"]
    steps, every, seed = tc["steps"], tc["eval_every"], tc["seed"]
    records = []
    residual = None
    if fast and CachedFullAttnRes.applies(cfg):
        check_same_function(P, cfg, *train_batch(train, seed, 0, 0, B, T))
        residual = lambda: CachedFullAttnRes(P, cfg)  # noqa: E731
    t0 = time.time()
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for k in range(K):
            x, y = train_batch(train, seed, s, k, B, T)
            loss = rm.loss_fn(rm.forward(P, cfg, x, residual() if residual else None), y) / K
            loss.backward()
            loss_sum += loss.item()
        if tc["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(list(P.values()), tc["grad_clip"])
        for g in opt.param_groups:
            g["lr"] = lr_at(s, tc)
        opt.step()
        if not math.isfinite(loss_sum):
            sys.exit(f"long_check train: non-finite loss at step {s + 1}")
        if (every > 0 and (s + 1) % every == 0) or s + 1 == steps:
            v = evaluate(P, cfg, val, tc)
            rec = {"step": s + 1, "val_loss": v, "train_loss": loss_sum,
                   "tokens": (s + 1) * B * T * K, "elapsed_s": time.time() - t0}
            records.append(rec)
            if log:
                log.write(json.dumps(rec) + "\n")
                log.flush()
            print(f"torch {tag or cfg.residual}: step {s + 1}/{steps} val {v:.4f} "
                  f"train {loss_sum:.4f} ({time.time() - t0:.0f} s)", flush=True)
    return records


def cmd_train(a):
    tc = json.load(open(os.path.join(a.run, "train_config.json")))
    if tc["schedule"] != "cosine":
        sys.exit("long_check train: only the cosine schedule is implemented here")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    cfg = model_config(tc["model"])
    toks = read_tokens(os.path.join(a.run, "tokens.bin"))
    _, init = read_safetensors(a.init)
    with open(a.out, "w") as log:
        train_run(tc, cfg, toks, init, log, fast=not a.plain)


# --------------------------------------------------------------------------------------- fixture

FIXTURE_SETTINGS = {
    "tokenizer": "byte", "val_fraction": 0.1, "batch_size": 4, "seq_len": 32, "grad_accum": 1,
    "steps": 200, "lr": 3e-3, "beta1": 0.9, "beta2": 0.95, "adam_eps": 1e-8,
    "weight_decay": 0.1, "schedule": "cosine", "warmup_steps": 5, "min_lr_ratio": 0.1,
    "grad_clip": 1.0, "eval_every": 50, "eval_batches": 4, "seed": 1337,
    "model": {"n_layer": 2, "n_head": 2, "n_kv_head": 2, "d_model": 32, "ffn_hidden": 96,
              "vocab_size": 256, "max_seq_len": 32, "norm_eps": 1e-5, "rope_theta": 10000.0,
              "tied": True, "residual": "prenorm"},
}
FIXTURE_MODES = {"prenorm": {}, "full": {}, "block": {"block_size": 2}}


def fixture_corpus() -> str:
    """A learnable synthetic text (a tiny grammar driven by an LCG), ~40 KB."""
    subj = ["the cat", "a dog", "my friend", "the king", "an old man", "the girl"]
    verb = ["sees", "likes", "finds", "follows", "calls", "keeps"]
    obj = ["the ball", "a red hat", "the river", "her book", "the small bird", "a green door"]
    tail = ["today", "at night", "again", "in the garden", "with care", "slowly"]
    x, lines = 12345, []
    while sum(len(s) + 1 for s in lines) < 40000:
        parts = []
        for words in (subj, verb, obj, tail):
            x = (x * 1103515245 + 12345) % (1 << 31)
            parts.append(words[(x >> 16) % len(words)])
        lines.append(" ".join(parts) + ".")
    return "\n".join(lines) + "\n"


def cmd_fixture(a):
    """tests/fixtures/long_check_{corpus.txt,init.safetensors,torch.json} for the C++ test."""
    torch.set_num_threads(1)
    text = fixture_corpus()
    corpus = os.path.join(a.out, "long_check_corpus.txt")
    with open(corpus, "w") as f:
        f.write(text)
    toks = np.frombuffer(text.encode("ascii"), dtype=np.uint8).astype(np.int64)  # byte tokens
    tc = dict(FIXTURE_SETTINGS)
    rng = np.random.default_rng(tc["seed"])
    base = model_config(tc["model"])
    init = OrderedDict()
    for name, shape in rm.param_shapes(base).items():
        if name.endswith("norm.weight"):
            init[name] = np.ones(shape, np.float32)
        else:
            std = 0.02 / math.sqrt(2 * base.n_layer) if name.endswith(("wo.weight", "w2.weight")) else 0.02
            init[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    write_safetensors(os.path.join(a.out, "long_check_init.safetensors"),
                      OrderedDict((n, ("F32", v)) for n, v in init.items()),
                      {"format": "attnres-model/1",
                       "config": engine_config_json(base, tc["model"])})
    curves = {}
    for mode, extra in FIXTURE_MODES.items():
        cfg = model_config(dict(tc["model"], residual=mode, **extra))
        full_init = OrderedDict(init)
        for name, shape in rm.param_shapes(cfg).items():
            if name not in full_init:
                full_init[name] = (np.zeros(shape, np.float32) if name.endswith(".query")
                                   else np.ones(shape, np.float32))
        curves[mode] = [r["val_loss"] for r in train_run(tc, cfg, toks, full_init, tag=mode)]
    out = {"generator": "tools/long_check.py fixture", "torch": torch.__version__,
           "settings": tc, "modes": FIXTURE_MODES,
           "eval_steps": list(range(tc["eval_every"], tc["steps"] + 1, tc["eval_every"])),
           "val_loss": curves}
    with open(os.path.join(a.out, "long_check_torch.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print("fixture: wrote long_check_corpus.txt, long_check_init.safetensors, "
          "long_check_torch.json in " + a.out)


# ----------------------------------------------------------------------------------------- table

def curve(path: str):
    pts = {}
    with open(path) as f:
        for line in f:
            j = json.loads(line)
            if "val_loss" in j:
                pts[j["step"]] = j["val_loss"]
    return pts


def cmd_table(a):
    modes = [m for m in a.modes.split(",")]
    eng = {m: curve(os.path.join(a.dir, f"engine_{m}", "metrics.jsonl")) for m in modes}
    tor = {m: curve(os.path.join(a.dir, f"torch_{m}.jsonl")) for m in modes}
    steps = sorted(set.intersection(*[set(eng[m]) & set(tor[m]) for m in modes]))
    if not steps:
        sys.exit("long_check table: no evaluation step common to every run")
    b = a.baseline
    rows = []
    print("| step | " + " | ".join(f"{m} attnres | {m} torch" for m in modes) +
          " | " + " | ".join(f"{m}-{b} attnres | {m}-{b} torch | difference" for m in modes if m != b) + " |")
    print("|---" * (1 + 2 * len(modes) + 3 * (len(modes) - 1)) + "|")
    for s in steps:
        cells = [str(s)]
        for m in modes:
            cells += [f"{eng[m][s]:.4f}", f"{tor[m][s]:.4f}"]
        row = {"step": s}
        for m in modes:
            if m == b:
                continue
            ge, gt = eng[m][s] - eng[b][s], tor[m][s] - tor[b][s]
            cells += [f"{ge:+.4f}", f"{gt:+.4f}", f"{ge - gt:+.4f}"]
            row[m] = {"gap_attnres": ge, "gap_torch": gt}
        rows.append(row)
        print("| " + " | ".join(cells) + " |")
    with open(os.path.join(a.dir, "long_check.json"), "w") as f:
        json.dump({"modes": modes, "baseline": b, "rows": rows,
                   "attnres": eng, "torch": tor}, f, indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("init")
    q.add_argument("--train-config", required=True)
    q.add_argument("--modes", default="prenorm,full,block")
    q.add_argument("--block-size", type=int, default=4)
    q.add_argument("--seed", type=int, default=1)
    q.add_argument("--out", required=True)
    q = sub.add_parser("train")
    q.add_argument("--run", required=True)
    q.add_argument("--init", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--threads", type=int, default=0)
    q.add_argument("--plain", action="store_true",
                   help="Full AttnRes through reference_model's own mix (slower) instead of the "
                        "cached one")
    q = sub.add_parser("table")
    q.add_argument("dir")
    q.add_argument("--modes", default="prenorm,full,block")
    q.add_argument("--baseline", default="prenorm")
    q = sub.add_parser("fixture")
    q.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "..", "tests", "fixtures"))
    a = p.parse_args()
    {"init": cmd_init, "train": cmd_train, "table": cmd_table, "fixture": cmd_fixture}[a.cmd](a)


if __name__ == "__main__":
    main()

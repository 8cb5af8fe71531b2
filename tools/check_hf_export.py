#!/usr/bin/env python3
"""Check an `attnres export-hf` directory with transformers itself (issue 20).

Usage: PYTHON tools/check_hf_export.py HF_DIR EXPECTED.safetensors

Loads HF_DIR with AutoModelForCausalLM (float32; trust_remote_code for the modeling_attnres.py a
Full/Block AttnRes export carries), runs it on the I32 "tokens" (B,T) of EXPECTED.safetensors and
compares its logits with the F32 "logits" (B,T,V) there (the engine's, written by
tests/test_interop.cpp), in one pass and token by token through the KV cache. When EXPECTED also holds "prompt" (1,P) and "greedy" (1,N), the engine's
greedy continuation, `generate` (with its KV cache) must produce the same N tokens. For a Block
export with Kimi K3's attn_res_block_size (layers per block), the logits are also computed by an
independent function written in K3's per-layer form (a block closes before the attention of
every layer i with i % attn_res_block_size == 0), from the weights alone: it must agree too, which
checks that K3's block size N is the engine's S = 2N.

Prints the largest differences; exits 0 when all are below 1e-4 (and the tokens agree), 1 when
not, 77 when transformers cannot be imported (the test then skips).
"""

import json
import os
import sys

try:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
except ImportError as e:  # pragma: no cover - environment without the venv
    print(f"skip: {e}")
    sys.exit(77)


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def k3_logits(sd, cfg, tokens):
    """Logits of the K3-layout weights `sd`, by K3's per-layer recurrence (float32)."""
    n_blk, eps, keps = cfg["attn_res_block_size"], cfg["rms_norm_eps"], cfg["attnres_key_norm_eps"]
    d, h, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, theta = d // h, cfg["rope_theta"]
    B, T = tokens.shape
    pos = torch.arange(T, dtype=torch.float32)
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    cos, sin = ang.cos(), ang.sin()

    def rot(x):
        a, b = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-b, a], dim=-1) * sin

    def attn_res(prefix_sum, block_residual, name):
        v = torch.stack(block_residual + [prefix_sum])
        score = (rms(v, sd[name + "_norm.weight"], keps) * sd[name + "_proj.weight"][0]).sum(-1)
        return (torch.softmax(score, dim=0).unsqueeze(-1) * v).sum(0)

    def attention(x, p):
        q = (x @ sd[p + "q_proj.weight"].t()).view(B, T, h, hd).transpose(1, 2)
        k = (x @ sd[p + "k_proj.weight"].t()).view(B, T, kv, hd).transpose(1, 2)
        v = (x @ sd[p + "v_proj.weight"].t()).view(B, T, kv, hd).transpose(1, 2)
        k, v = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
        y = F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True)
        return y.transpose(1, 2).reshape(B, T, d) @ sd[p + "o_proj.weight"].t()

    hidden = sd["model.embed_tokens.weight"][tokens.long()]
    block_residual = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        prefix_sum = hidden
        if block_residual:
            hidden = attn_res(prefix_sum, block_residual, p + "self_attention_res")
        if i % n_blk == 0:
            block_residual = block_residual + [prefix_sum]
            prefix_sum = None
        a = attention(rms(hidden, sd[p + "input_layernorm.weight"], eps), p + "self_attn.")
        prefix_sum = a if prefix_sum is None else prefix_sum + a
        hidden = attn_res(prefix_sum, block_residual, p + "mlp_res")
        x = rms(hidden, sd[p + "post_attention_layernorm.weight"], eps)
        m = (F.silu(x @ sd[p + "mlp.gate_proj.weight"].t()) * (x @ sd[p + "mlp.up_proj.weight"].t()))
        hidden = prefix_sum + m @ sd[p + "mlp.down_proj.weight"].t()
    out = attn_res(hidden, block_residual, "model.output_attn_res")
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    return rms(out, sd["model.norm.weight"], eps) @ head.t()


def main() -> int:
    hf_dir, expected = sys.argv[1], sys.argv[2]
    e = load_file(expected)
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                 trust_remote_code=True).eval()
    ok = True
    with torch.no_grad():
        logits = model(input_ids=e["tokens"].long()).logits
        diff = (logits - e["logits"]).abs().max().item()
        ok &= diff < 1e-4
        print(f"transformers vs attnres: largest logit difference {diff:.3g} "
              f"(largest logit {e['logits'].abs().max().item():.3g})")
        if "attn_res_block_size" in cfg:
            sd = load_file(os.path.join(hf_dir, "model.safetensors"))
            k3 = (k3_logits(sd, cfg, e["tokens"]) - e["logits"]).abs().max().item()
            ok &= k3 < 1e-4
            print(f"Kimi K3's per-layer recurrence (attn_res_block_size "
                  f"{cfg['attn_res_block_size']}) vs attnres (S = {cfg['attnres_block_size']}): "
                  f"largest logit difference {k3:.3g}")
        # Decoding token by token through the KV cache gives the full pass's logits.
        from transformers import DynamicCache
        row, cache, steps = e["tokens"][:1].long(), DynamicCache(), []
        for i in range(row.shape[1]):
            o = model(input_ids=row[:, i:i + 1], past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            steps.append(o.logits[:, -1])
        inc = (torch.stack(steps, dim=1) - e["logits"][:1]).abs().max().item()
        ok &= inc < 1e-4
        print(f"decoding one token at a time (KV cache) vs attnres: largest logit difference "
              f"{inc:.3g}")
        if "greedy" in e:
            prompt, want = e["prompt"].long(), e["greedy"].long()
            got = model.generate(prompt, max_new_tokens=want.shape[1], do_sample=False,
                                 attention_mask=torch.ones_like(prompt), pad_token_id=0)
            same = torch.equal(got[:, prompt.shape[1]:], want)
            ok &= same
            print(f"generate (greedy, KV cache): {'the' if same else 'NOT the'} engine's "
                  f"{want.shape[1]} tokens {got[0, prompt.shape[1]:].tolist()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

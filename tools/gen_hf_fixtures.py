#!/usr/bin/env python3
"""Write the Hugging Face interop fixtures under tests/fixtures/hf/ (issue 20).

Usage (from the repository root, in a venv with torch, transformers, safetensors and
sentencepiece from PyPI; see tools/README.md):

    python -m venv /work/venv-hf && /work/venv-hf/bin/pip install torch transformers \
        safetensors sentencepiece protobuf
    /work/venv-hf/bin/python tools/gen_hf_fixtures.py [--out tests/fixtures/hf]

Each fixture is a small random `LlamaForCausalLM` saved with `save_pretrained` (the oracle is
transformers itself, not this project's code), with every weight perturbed (the RMSNorm gains
too, so a gain read into the wrong place fails), a SentencePiece `tokenizer.model` of the
model's vocabulary trained on a fixed text, and `expected.safetensors`: fixed token ids
(I32 "tokens", (B,T)) and transformers' float32 logits on them (F32 "logits", (B,T,V)).

* `llama_gqa`: GQA (4 query heads, 2 key/value heads), untied head, rope_theta 500000,
  rms_norm_eps 1e-5, float32 weights in one model.safetensors.
* `llama_tied_bf16`: tied head, bfloat16 weights in shards (model.safetensors.index.json),
  rms_norm_eps 1e-12 (so Full/Block upcycles of it compute the PreNorm function to float
  rounding, docs/INTEROP.md); its logits are those of the bfloat16 weights widened to float32.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile

import sentencepiece as spm
import torch
from transformers import LlamaConfig, LlamaForCausalLM

FIXTURE_VERSION = "1"
VOCAB = 320
TEXT = (
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
    "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles "
    "and by opposing end them. To die, to sleep; no more; and by a sleep to say we end the "
    "heart-ache and the thousand natural shocks that flesh is heir to.\n"
)


def save_sorted(path: str, tensors: dict, metadata: dict) -> None:
    """safetensors with a sorted header (safetensors.torch orders metadata at random)."""
    names = {torch.float32: "F32", torch.int32: "I32"}
    header, blobs, off = {"__metadata__": dict(sorted(metadata.items()))}, [], 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        b = t.numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def train_tokenizer(path: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cwd = os.getcwd()
        os.chdir(tmp)  # relative names: the model records its trainer's paths
        try:
            with open("corpus.txt", "w", encoding="utf-8") as f:
                f.write(TEXT * 20)
            spm.SentencePieceTrainer.train(
                input="corpus.txt", model_prefix="sp", vocab_size=VOCAB,
                model_type="bpe", byte_fallback=True, character_coverage=1.0,
                num_threads=1, seed_sentencepiece_size=1000, minloglevel=2,
                # Llama's special pieces: <unk> 0, <s> 1, </s> 2.
                unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
        finally:
            os.chdir(cwd)
        shutil.copyfile(os.path.join(tmp, "sp.model"), path)


def perturb(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            else:
                p.copy_(0.08 * noise)


def write_fixture(out: str, name: str, cfg: LlamaConfig, dtype: torch.dtype,
                  shard: str | None, seed: int) -> None:
    d = os.path.join(out, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval()
    perturb(model, gen)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model = model.to(dtype)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(d, **kw)
    train_tokenizer(os.path.join(d, "tokenizer.model"))
    # The oracle's logits: transformers loading the saved directory in float32 (a model cast to
    # bfloat16 and back would keep RoPE's inverse frequencies rounded to bfloat16).
    model32 = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=gen, dtype=torch.int64)
    with torch.no_grad():
        logits = model32(input_ids=tokens).logits.float().contiguous()
    save_sorted(os.path.join(d, "expected.safetensors"),
                {"tokens": tokens.to(torch.int32), "logits": logits},
                {"fixture_version": FIXTURE_VERSION,
                 "transformers": __import__("transformers").__version__,
                 "torch": torch.__version__})
    files = sorted(os.listdir(d))
    print(f"{name}: {files}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/fixtures/hf")
    args = ap.parse_args()
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=80, num_hidden_layers=3,
                  num_attention_heads=4, max_position_embeddings=64, hidden_act="silu",
                  attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2)
    write_fixture(args.out, "llama_gqa",
                  LlamaConfig(**common, num_key_value_heads=2, rope_theta=500000.0,
                              rms_norm_eps=1e-5, tie_word_embeddings=False),
                  torch.float32, None, seed=20)
    write_fixture(args.out, "llama_tied_bf16",
                  LlamaConfig(**common, num_key_value_heads=4, rope_theta=10000.0,
                              rms_norm_eps=1e-12, tie_word_embeddings=True),
                  torch.bfloat16, "20KB", seed=21)
    with open(os.path.join(args.out, "VERSION"), "w") as f:
        json.dump({"fixture_version": FIXTURE_VERSION}, f)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

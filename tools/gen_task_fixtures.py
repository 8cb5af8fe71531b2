#!/usr/bin/python3
"""Write the task-scoring fixtures under tests/fixtures/tasks/ (issue 20, `attnres eval --task`).

Usage (from the repository root, Debian's python3-torch; scripts/setup.sh --python):

    /usr/bin/python3 tools/gen_task_fixtures.py

A random PreNorm model with the byte tokenizer (tools/reference_model.py, float64; weights
rounded to float32) saved as an attnres checkpoint, two task files (multiple choice and
minimal pairs, the formats docs/INTEROP.md defines) and `expected.json`: every choice's
log-likelihood computed here in float64 and the accuracies that follow from them. Scoring (the
definition the engine must match): the context's UTF-8 bytes ("\\n" when it is empty), then the
choice's; the log-likelihood is the sum of log p(token | everything before it) over the choice's
tokens; accuracy = share of items whose labelled choice has the highest log-likelihood (the
first on ties), acc_norm the same with the log-likelihood divided by the choice's byte count.
A minimal pair is a two-choice item with an empty context, the good sentence labelled.
"""

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_fixtures as gf  # noqa: E402
import reference_model as rm  # noqa: E402

torch.set_default_dtype(torch.float64)

FIXTURE_VERSION = "1"

MC = [
    {"context": "The cat sat on the", "choices": [" mat", " moon", " idea"], "label": 0},
    {"context": "Water boils at one hundred", "choices": [" degrees", " apples"], "label": 0},
    {"context": "She opened the", "choices": [" door", " sky", " seven", " because"], "label": 0},
    {"context": "Two plus two is", "choices": [" four", " blue"], "label": 0},
    {"context": "The sun rises in the", "choices": [" west", " east"], "label": 1},
    {"context": "", "choices": ["Hello there.", "Xq zzv kpt."], "label": 0},
    {"context": "A dog likes to", "choices": [" bark", " photosynthesize", " run"], "label": 2},
    {"context": "Ice is", "choices": [" cold", " hot"], "label": 0},
    {"context": "Un caf\u00e9, s'il vous", "choices": [" pla\u00eet", " chien"], "label": 0},
    {"context": "Birds can", "choices": [" fly", " fly"], "label": 1},
]
PAIRS = [
    {"sentence_good": "The cats sleep.", "sentence_bad": "The cats sleeps."},
    {"sentence_good": "She has eaten.", "sentence_bad": "She have eaten."},
    {"sentence_good": "Who did you see?", "sentence_bad": "Who did you saw?"},
    {"sentence_good": "They were here.", "sentence_bad": "They was here."},
    {"sentence_good": "A big red ball.", "sentence_bad": "A red big ball."},
    {"sentence_good": "He ran quickly.", "sentence_bad": "He ran quick."},
]


def loglik(P, cfg, context: str, choice: str) -> float:
    ctx = list((context or "\n").encode("utf-8"))
    cont = list(choice.encode("utf-8"))
    seq = ctx + cont
    x = torch.tensor([seq[:-1]], dtype=torch.int64)
    logits = rm.forward(P, cfg, x)[0]
    lp = torch.log_softmax(logits, dim=-1)
    total = 0.0
    for k, tok in enumerate(cont):
        pos = len(ctx) - 1 + k
        total += float(lp[pos, tok])
    return total


def accuracy(items, scores, norm=False):
    hits = 0
    for it, s in zip(items, scores):
        v = [x / len(c.encode("utf-8")) if norm else x for x, c in zip(s, it["choices"])]
        hits += int(int(np.argmax(v)) == it["label"])
    return hits / len(items)


def main() -> int:
    out = "tests/fixtures/tasks"
    os.makedirs(out, exist_ok=True)
    cfg = rm.Config(n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_hidden=64,
                    vocab_size=256, norm_eps=1e-5, tied=False)
    P = rm.init_params(cfg, np.random.default_rng(2026))
    tensors = {n: ("F32", P[n].numpy()) for n in P}
    gf.write_safetensors(os.path.join(out, "model.safetensors"), tensors,
                         {"format": "attnres-model/1", "config": cfg.to_json(),
                          "tokenizer": "byte", "fixture_version": FIXTURE_VERSION})
    with open(os.path.join(out, "mc.jsonl"), "w", encoding="utf-8") as f:
        for it in MC:
            f.write(json.dumps(it, ensure_ascii=False) + "\n")
    with open(os.path.join(out, "pairs.jsonl"), "w", encoding="utf-8") as f:
        for it in PAIRS:
            f.write(json.dumps(it, ensure_ascii=False) + "\n")
    mc_scores = [[loglik(P, cfg, it["context"], c) for c in it["choices"]] for it in MC]
    pair_items = [{"context": "", "choices": [p["sentence_good"], p["sentence_bad"]], "label": 0}
                  for p in PAIRS]
    pair_scores = [[loglik(P, cfg, "", c) for c in it["choices"]] for it in pair_items]
    # A pair counts only when the good sentence is strictly more likely.
    pair_acc = sum(int(s[0] > s[1]) for s in pair_scores) / len(PAIRS)
    expected = {
        "fixture_version": FIXTURE_VERSION,
        "mc": {"logliks": mc_scores, "acc": accuracy(MC, mc_scores),
               "acc_norm": accuracy(MC, mc_scores, norm=True)},
        "pairs": {"logliks": pair_scores, "acc": pair_acc},
    }
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "logliks"}
                      for k, v in expected.items() if k != "fixture_version"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

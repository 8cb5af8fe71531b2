#!/usr/bin/env python3
"""Check an `attnres export-hf` directory with transformers itself (issue 20).

Usage: PYTHON tools/check_hf_export.py HF_DIR EXPECTED.safetensors

Loads HF_DIR with AutoModelForCausalLM (float32), runs it on the I32 "tokens" (B,T) of
EXPECTED.safetensors and compares its logits with the F32 "logits" (B,T,V) there (the engine's,
written by tests/test_interop.cpp). Prints the largest difference; exits 0 when it is below 1e-4,
1 when it is not, 77 when transformers cannot be imported (the test then skips).
"""

import sys

try:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
except ImportError as e:  # pragma: no cover - environment without the venv
    print(f"skip: {e}")
    sys.exit(77)


def main() -> int:
    hf_dir, expected = sys.argv[1], sys.argv[2]
    e = load_file(expected)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=e["tokens"].long()).logits
    diff = (logits - e["logits"]).abs().max().item()
    print(f"transformers vs attnres: largest logit difference {diff:.3g} "
          f"(largest logit {e['logits'].abs().max().item():.3g})")
    return 0 if diff < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())

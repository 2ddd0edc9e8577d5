"""A causal LM folder with random weights, from another model's config and tokenizer, for throughput work only.

    python scripts/random_init_model.py SOURCE OUT [--shape smollm2-1.7b] [--dtype bfloat16]

Speed and memory depend on a model's shape, not on its weights, so a machine that cannot download a model (the
lent GPU machine reaches no hub) can still measure generation tokens/s and training MFU at that model's size:
SOURCE is a model folder (its config.json and tokenizer are copied; no weights are read), ``--shape`` changes the
architecture to a named size of the same family (default ``source``: SOURCE's own shape, e.g. the teacher's
converted folder). The outputs of such a model are noise: never evaluate with it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

# SOURCE's own shape, and published shapes of the SmolLM2 family (same tokenizer as the built-in 135M model)
SHAPES = {
    "source": {},
    "smollm2-1.7b": {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
                     "num_key_value_heads": 32, "num_hidden_layers": 24, "head_dim": 64},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("out")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="source")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    args = parser.parse_args()
    config = AutoConfig.from_pretrained(args.source)
    for key, value in SHAPES[args.shape].items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    out = Path(args.out)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(args.source).save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    (out / "random_init.json").write_text(json.dumps({"source": args.source, "shape": args.shape, "params": params,
                                                      "note": "random weights: for throughput only"}))
    print(f"{out}: {args.shape}, {params / 1e6:.1f}M parameters, random weights")


if __name__ == "__main__":
    main()

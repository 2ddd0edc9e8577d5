"""Time per decoding step on one GPU, float32 against bf16, for a model built on the GPU and for the same weights
built on the CPU and moved there (the engine loads with ``from_pretrained(dtype)`` then ``.to(device)``), through
plain transformers ``generate`` and through the embedded engine's batcher.

    python scripts/probe_bf16_decode.py --out runs/gpu_checks/decode_probe.json   (after pip install --no-deps -e .)

Why: ``bench generate`` measured bf16 1.4-3.8x slower than float32 on the engine. Taken apart on an H100, a model
built on the GPU decoded as fast in bf16 as in float32 on every path, while bf16 weights built on the CPU and moved
with ``.to(device, dtype)`` (which also casts the rotary embedding's float32 buffers) ran 3-4x slower per step in
plain ``generate`` as well as in the engine: the slowdown follows how the bf16 model reaches the GPU, not the
engine. The engine loads with ``from_pretrained(dtype)`` then ``.to(device)``, so the probe measures five builds side
by side (the three above, the engine's own load from a saved folder, and ``from_pretrained(device_map=device)``, which
never puts the weights on the CPU), and for each records where every tensor of the model lives (parameters, buffers,
and tensors kept as plain attributes, which ``.to()`` does not move) and a profile of one batched ``generate`` call
(the operators that take the most CPU and GPU time): the cause, not only the symptom. It needs torch and
transformers only (the GPU machine has no other dependency of the project); weights are random (the
SmolLM2 shapes: speed depends on the shape), and each row's token count is recorded (random weights rarely end a
row before ``max_tokens``), so tokens/s compare like with like.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from overstory.serving.batching import Batcher, Job, Sampling

SHAPES = {
    "smollm2-135m": ({}, [1, 8, 32], 128),
    "smollm2-1.7b": ({"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
                      "num_key_value_heads": 32, "num_hidden_layers": 24, "head_dim": 64}, [1, 32], 64),
}


BUILDS = ("on_device", "moved", "moved_and_cast", "from_pretrained", "from_pretrained_device_map")


def build(config, dtype: torch.dtype, device: str, where: str, folder: Path):
    """Random weights (seed 0) in ``dtype``: made on ``device`` directly; made on the CPU and moved; made on the CPU
    and moved with ``.to(device, dtype)``, which also casts the float32 rotary buffers; loaded from ``folder`` the
    engine's way (``models.registry.load_causal_lm``: ``from_pretrained(dtype)`` then ``.to(device)``); or loaded
    straight onto the device (``device_map``)."""
    torch.manual_seed(0)
    if where == "on_device":
        with torch.device(device):
            return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    if where == "from_pretrained":
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    if where == "from_pretrained_device_map":
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device).eval()
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return model.to(device) if where == "moved" else model.to(device=device, dtype=dtype)


def tensor_report(model) -> dict:
    """Counts of parameters and buffers per (device, dtype), and every tensor a module keeps as a plain attribute
    (``.to()`` moves parameters and buffers only, so such a tensor stays where it was made)."""
    counts: dict[str, int] = {}
    for kind, tensors in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for _, tensor in tensors:
            key = f"{kind} {tensor.device.type} {str(tensor.dtype).removeprefix('torch.')}"
            counts[key] = counts.get(key, 0) + 1
    attributes = sorted({f"{type(module).__name__}.{name} {value.device.type} {str(value.dtype).removeprefix('torch.')}"
                         for module in model.modules() for name, value in vars(module).items()
                         if isinstance(value, torch.Tensor)})
    return {"counts": counts, "plain_tensor_attributes": attributes}


def profile(model, tokenizer, rows: int, max_tokens: int) -> dict:
    """One plain ``generate`` call of ``rows`` prompts under torch.profiler: the top operators by self CPU time and
    by self device time, and the call's wall time."""
    prompts = chat_prompts(tokenizer, rows)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=activities) as prof:
        started = time.perf_counter()
        decode(model, tokenizer, None, prompts, max_tokens, "plain")
        _synchronize()
        wall = time.perf_counter() - started
    averages = prof.key_averages()

    def top(attribute: str) -> list[dict]:
        ranked = sorted(averages, key=lambda event: getattr(event, attribute, 0) or 0, reverse=True)[:12]
        return [{"op": event.key, "calls": event.count,
                 "self_cpu_ms": round(event.self_cpu_time_total / 1000, 1),
                 "self_device_ms": round((getattr(event, "self_device_time_total", 0) or 0) / 1000, 1)}
                for event in ranked]

    return {"rows": rows, "max_tokens": max_tokens, "wall_s": round(wall, 3),
            "by_self_cpu": top("self_cpu_time_total"), "by_self_device": top("self_device_time_total")}


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    questions = [f"In what year did the {who} of {city} first meet?" for who in ("council", "guild", "court", "army")
                 for city in ("Paris", "Rome", "Oslo", "Lima", "Cairo", "Quito", "Perth", "Kyiv")]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": questions[i % len(questions)]}],
                                               add_generation_prompt=True, return_dict=True)["input_ids"])
            for i in range(n)]


def decode(model, tokenizer, batcher: Batcher | None, prompts: list[list[int]], max_tokens: int,
           path: str) -> list[int]:
    """Each row's generated token count, up to and including an end-of-sequence token."""
    if path == "engine":
        jobs = [batcher.submit(Job([p], Sampling(max_tokens=max_tokens, temperature=0))) for p in prompts]
        return [len(job.wait(600)[0].tokens) for job in jobs]
    inputs = tokenizer.pad({"input_ids": prompts}, padding=True, padding_side="left", return_tensors="pt")
    with torch.inference_mode():
        output = model.generate(**inputs.to(model.device), max_new_tokens=max_tokens, do_sample=False,
                                pad_token_id=tokenizer.pad_token_id)
    rows = output[:, inputs["input_ids"].shape[1]:].tolist()
    eos = tokenizer.eos_token_id
    return [row.index(eos) + 1 if eos in row else len(row) for row in rows]


def measure(model, tokenizer, levels: list[int], max_tokens: int) -> list[dict]:
    batcher = Batcher(model, tokenizer, max_batch_size=128, max_batch_tokens=32768, name="probe")
    results = []
    try:
        decode(model, tokenizer, batcher, chat_prompts(tokenizer, 2), 4, "engine")  # warm-up
        for level in levels:
            for path in ("plain", "engine"):
                _synchronize()
                started = time.perf_counter()
                lengths = decode(model, tokenizer, batcher, chat_prompts(tokenizer, level), max_tokens, path)
                _synchronize()
                wall = time.perf_counter() - started
                results.append({"batch": level, "path": path, "wall_s": round(wall, 3),
                                "mean_tokens": round(sum(lengths) / level, 1),
                                "ms_per_step": round(1000 * wall / max(lengths), 2),
                                "tokens_per_s": round(sum(lengths) / wall, 1)})
    finally:
        batcher.stop()
    return results


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                        help="a folder or hub id with SmolLM2's config and tokenizer")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of: " + ", ".join(SHAPES))
    parser.add_argument("--max-tokens", type=int, help="instead of each shape's default (128 and 64)")
    parser.add_argument("--builds", default=",".join(BUILDS), help="comma-separated, of: " + ", ".join(BUILDS))
    parser.add_argument("--profile-rows", type=int, default=8, help="rows of the profiled generate call (0: none)")
    parser.add_argument("--sdpa", choices=["default", "no-cudnn"], default="default",
                        help="no-cudnn: torch.backends.cuda.enable_cudnn_sdp(False) before anything runs")
    parser.add_argument("--scratch", default="/tmp/probe_bf16_models", help="where the random models are saved")
    parser.add_argument("--out", default="runs/gpu_checks/decode_probe.json")
    args = parser.parse_args()
    if args.sdpa == "no-cudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    rows, diagnoses = [], []
    for shape in args.shapes.split(","):
        overrides, levels, max_tokens = SHAPES[shape]
        max_tokens = args.max_tokens or max_tokens
        config = AutoConfig.from_pretrained(args.tokenizer)
        for key, value in overrides.items():
            setattr(config, key, value)
        folder = Path(args.scratch) / shape
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
        for dtype in (torch.float32, torch.bfloat16):
            for where in args.builds.split(","):
                model = build(config, dtype, args.device, where, folder)
                case = {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "built": where, "sdpa": args.sdpa}
                diagnosis = {**case, "tensors": tensor_report(model)}
                if args.profile_rows:
                    diagnosis["profile"] = profile(model, tokenizer, args.profile_rows, min(max_tokens, 32))
                diagnoses.append(diagnosis)
                print(json.dumps(diagnosis), flush=True)
                for row in measure(model, tokenizer, levels, max_tokens):
                    rows.append({**case, **row})
                    print(json.dumps(rows[-1]), flush=True)
                del model
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"steps": rows, "diagnoses": diagnoses}, indent=1))


if __name__ == "__main__":
    main()

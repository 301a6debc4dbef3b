"""Verifiable accuracy of a toy-world model: deterministic-seeded samples over all conditions, scored by the
pixel verifier, plus a labelled image grid.

    python scripts/eval_model.py --model tiny-t2i --num-samples 256 --grid outputs/tiny_t2i_grid.png

A trained model on the held-out single-object conditions (8 seeds each): a run's export (a full fine-tune's model
folder, or a LoRA run's folder with pytorch_lora_weights.safetensors, whose export.json names the base model),
a checkpoint folder (its export/), or weights over a base model:

    python scripts/eval_model.py --model logs/<run>/export --split eval --objects single
    python scripts/eval_model.py --model tiny-t2i-noisy --weights logs/<run>/checkpoints/checkpoint_00036 --split eval
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpo_grpo.core.pipeline_with_logprob import pipeline_with_logprob  # noqa: E402
from ddpo_grpo.core.policy_step import SamplerSettings  # noqa: E402
from ddpo_grpo.models import load_pipeline  # noqa: E402
from ddpo_grpo.models.export import ExportError, apply_weights, export_info  # noqa: E402
from ddpo_grpo.trainer.run.reporting import labelled_grid  # noqa: E402
from ddpo_grpo.worlds.toyworld import all_conditions, balanced_weights, summarize, verify_batch  # noqa: E402

DEFAULT_STEPS = 10  # the tiny configs' sample.num_steps (an export's own export.json overrides it)
# What each number of the summary means (printed with it).
DEFINITIONS = {
    "strict_accuracy": "share of samples with colour, shape and position all right",
    "color_accuracy": "share of samples whose colour is fully right (both objects of a pair)",
    "shape_accuracy": "share of samples whose shape is fully right (both objects of a pair)",
    "position_accuracy": "share of samples whose place / relation is right",
    "accuracy": "mean reward: per sample the mean of its three attribute scores, where a pair's colour or shape "
                "scores 0.5 per right object (so it exceeds the mean of the three *_accuracy on pairs)",
}


def resolve_model(model: str, weights: str):
    """--model / --weights -> (base model to load, weights to apply or "", export.json or None). An export folder as
    --model: a full fine-tune's is a model folder itself; a LoRA run's names its base model."""
    info = export_info(model) if os.path.isdir(model) else None
    if info is not None:
        if weights:
            raise ExportError(f"--model {model!r} is a run's export: give it alone, or --weights over a base model")
        if info["lora"]:
            return info["base_model_path"] or info["base_model"], info["folder"], info
        return info["folder"], "", info
    return model, weights, export_info(weights) if weights and os.path.isdir(weights) else None


@torch.no_grad()
def evaluate_model(model: str, num_samples: int = 256, steps: int = DEFAULT_STEPS, guidance: float = 1.0, eta: float = 0.0,
                   seed: int = 0, batch_size: int = 64, noise_level: float = 0.7, weights: str = "",
                   split: str = "all", objects: str = "mixed"):
    """Returns (summary dict, images (N, 3, 32, 32), prompts, per-sample rewards). eta = 0: DDIM/ODE sampling.
    split "all": num_samples distinct conditions, half single-object, half two-object (the trainer's task mix);
    "train"/"eval": that split's conditions (`objects`: mixed, single or pair), each in turn, num_samples in all."""
    pipe = load_pipeline(model)
    if weights:
        apply_weights(pipe, weights)
    conds = all_conditions()
    if split == "all":
        idx = np.random.default_rng(seed).choice(len(conds), size=num_samples, replace=False,
                                                 p=balanced_weights(range(len(conds))))
    else:
        from ddpo_grpo.trainer.run.data import ToyWorldConditions

        ds = ToyWorldConditions(split, objects)
        pool = [ds[i]["index"] for i in range(len(ds))]
        idx = np.array([pool[i % len(pool)] for i in range(num_samples)])
    settings = SamplerSettings(family=pipe.family, guidance_scale=guidance, eta=eta or 1.0, noise_level=noise_level)
    images, prompts = [], []
    for lo in range(0, num_samples, batch_size):
        cs = [conds[i] for i in idx[lo:lo + batch_size]]
        ps = [c.prompt() for c in cs]
        emb = pipe.encode(ps)
        neg = pipe.encode([""] * len(ps)) if guidance != 1.0 else None
        gens = [torch.Generator().manual_seed(seed * 100003 + lo + j) for j in range(len(ps))]
        traj = pipeline_with_logprob(pipe.unet, pipe.scheduler, settings, emb, neg, num_inference_steps=steps,
                                     sample_shape=pipe.sample_shape, generator=gens, vae=pipe.vae,
                                     deterministic=eta == 0)
        images.append(traj.images)
        prompts += ps
    images = torch.cat(images)
    scores = verify_batch(images.numpy(), [conds[i] for i in idx])
    return summarize(scores), images, prompts, scores["reward"]


def main():
    d = "(default: %(default)s)"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-t2i", help="bundled model name, model folder, or a run's export folder " + d)
    ap.add_argument("--weights", default="", help="trained weights over --model: a checkpoint or export folder, a LoRA "
                    "file, a denoiser folder, or a .safetensors of denoiser tensors (none: the model as it is)")
    ap.add_argument("--num-samples", type=int, default=256, help="samples in all " + d)
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (default: the export's, else "
                    f"{DEFAULT_STEPS}, the tiny configs' sample.num_steps)")
    ap.add_argument("--guidance", type=float, default=1.0, help="classifier-free guidance scale; 1 = off " + d)
    ap.add_argument("--eta", type=float, default=0.0, help="DDIM eta / flow noise switch: 0 = deterministic DDIM / "
                    "flow ODE, as the trainer's eval " + d)
    ap.add_argument("--seed", type=int, default=0, help="seeds the conditions drawn and each sample's noise " + d)
    ap.add_argument("--grid", default="", help="save a labelled grid of the first 32 samples to this PNG")
    ap.add_argument("--json", default="", help="write the summary to this JSON file")
    ap.add_argument("--split", default="all", choices=["all", "train", "eval"],
                    help="all: distinct conditions from the whole world; train/eval: that split's conditions in turn " + d)
    ap.add_argument("--objects", default="mixed", choices=["mixed", "single", "pair"],
                    help="with --split train/eval: which conditions " + d)
    args = ap.parse_args()
    try:
        model, weights, info = resolve_model(args.model, args.weights)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:  # before loading anything
        if weights and not os.path.exists(weights):
            raise ExportError(f"{weights!r}: no such file or folder")
        steps = args.steps or (info or {}).get("num_inference_steps") or DEFAULT_STEPS
        summary, images, prompts, rewards = evaluate_model(model, args.num_samples, steps, args.guidance,
                                                           args.eta, args.seed, weights=weights,
                                                           split=args.split, objects=args.objects)
    except ExportError as e:
        print(f"error: --weights {e}", file=sys.stderr)
        sys.exit(2)
    summary.update(model=args.model, num_samples=args.num_samples, steps=steps, guidance=args.guidance,
                   eta=args.eta, seed=args.seed, weights=args.weights, split=args.split, objects=args.objects,
                   definitions=DEFINITIONS)
    print(json.dumps(summary, indent=1))
    if args.grid:
        os.makedirs(os.path.dirname(args.grid) or ".", exist_ok=True)
        labelled_grid(images[:32], [f"{p} | r={r:.2f}" for p, r in zip(prompts, rewards)]).save(args.grid)
        print(f"grid saved to {args.grid}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()

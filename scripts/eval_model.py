"""Verifiable accuracy of a toy-world model: deterministic-seeded samples over all conditions, scored by the
pixel verifier, plus a labelled image grid.

    python scripts/eval_model.py --model tiny-t2i --num-samples 256 --grid outputs/tiny_t2i_grid.png

A trained checkpoint on the held-out single-object conditions (8 seeds each), e.g. the demo's sampling policy:

    python scripts/eval_model.py --model tiny-t2i-noisy --split eval --objects single --steps 10 \
        --weights logs/<run>/checkpoints/checkpoint_00036/sampling_policy.safetensors
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpo_grpo.core.pipeline_with_logprob import encode_prompts, pipeline_with_logprob  # noqa: E402
from ddpo_grpo.core.policy_step import SamplerSettings  # noqa: E402
from ddpo_grpo.trainer.reporting import labelled_grid  # noqa: E402
from ddpo_grpo.models import load_pipeline  # noqa: E402
from ddpo_grpo.worlds.toyworld import all_conditions, balanced_weights, summarize, verify_batch  # noqa: E402


class WeightsError(ValueError):
    pass


def load_weights(unet: torch.nn.Module, path: str) -> None:
    """Trained UNet weights (model.safetensors, or a checkpoint's sampling_policy.safetensors, which holds only the
    trainable tensors) into `unet`; tensors it lacks keep the model's own values. Names it does not know are an error."""
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise WeightsError(f"--weights {path!r}: no such file")
    result = unet.load_state_dict(load_file(path), strict=False)
    if result.unexpected_keys:
        raise WeightsError(f"--weights {path!r} does not fit this model: unknown tensors, e.g. {result.unexpected_keys[:3]}")


@torch.no_grad()
def evaluate_model(model: str, num_samples: int = 256, steps: int = 20, guidance: float = 1.0, eta: float = 0.0,
                   seed: int = 0, batch_size: int = 64, noise_level: float = 0.7, weights: str = "",
                   split: str = "all", objects: str = "mixed"):
    """Returns (summary dict, images (N, 3, 32, 32), prompts, per-sample rewards). eta = 0: DDIM/ODE sampling.
    split "all": num_samples distinct conditions, half single-object, half two-object (the trainer's task mix);
    "train"/"eval": that split's conditions (`objects`: mixed, single or pair), each in turn, num_samples in all."""
    pipe = load_pipeline(model)
    if weights:
        load_weights(pipe.unet, weights)
    conds = all_conditions()
    if split == "all":
        idx = np.random.default_rng(seed).choice(len(conds), size=num_samples, replace=False,
                                                 p=balanced_weights(range(len(conds))))
    else:
        from ddpo_grpo.trainer.data import ToyWorldConditions

        ds = ToyWorldConditions(split, objects)
        pool = [ds[i]["index"] for i in range(len(ds))]
        idx = np.array([pool[i % len(pool)] for i in range(num_samples)])
    settings = SamplerSettings(family=pipe.family, guidance_scale=guidance, eta=eta or 1.0, noise_level=noise_level)
    images, prompts = [], []
    for lo in range(0, num_samples, batch_size):
        cs = [conds[i] for i in idx[lo:lo + batch_size]]
        ps = [c.prompt() for c in cs]
        emb = encode_prompts(pipe.text_encoder, pipe.tokenizer, ps)
        neg = encode_prompts(pipe.text_encoder, pipe.tokenizer, [""] * len(ps)) if guidance != 1.0 else None
        gens = [torch.Generator().manual_seed(seed * 100003 + lo + j) for j in range(len(ps))]
        traj = pipeline_with_logprob(pipe.unet, pipe.scheduler, settings, emb, neg, num_inference_steps=steps,
                                     sample_shape=pipe.sample_shape, generator=gens, deterministic=eta == 0)
        images.append(traj.images)
        prompts += ps
    images = torch.cat(images)
    scores = verify_batch(images.numpy(), [conds[i] for i in idx])
    return summarize(scores), images, prompts, scores["reward"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-t2i")
    ap.add_argument("--num-samples", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--guidance", type=float, default=1.0)
    ap.add_argument("--eta", type=float, default=0.0, help="0 = deterministic DDIM / flow ODE")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--grid", default="", help="save a labelled grid of the first 32 samples to this PNG")
    ap.add_argument("--json", default="", help="write the summary to this JSON file")
    ap.add_argument("--weights", default="", help="trained UNet weights (.safetensors) loaded over the model's")
    ap.add_argument("--split", default="all", choices=["all", "train", "eval"],
                    help="all: distinct conditions from the whole world; train/eval: that split's conditions in turn")
    ap.add_argument("--objects", default="mixed", choices=["mixed", "single", "pair"], help="with --split train/eval")
    args = ap.parse_args()
    if args.weights and not os.path.isfile(args.weights):  # before loading anything
        print(f"error: --weights {args.weights!r}: no such file", file=sys.stderr)
        sys.exit(2)
    try:
        summary, images, prompts, rewards = evaluate_model(args.model, args.num_samples, args.steps, args.guidance,
                                                           args.eta, args.seed, weights=args.weights,
                                                           split=args.split, objects=args.objects)
    except WeightsError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    summary.update(model=args.model, num_samples=args.num_samples, steps=args.steps, guidance=args.guidance,
                   eta=args.eta, seed=args.seed, weights=args.weights, split=args.split, objects=args.objects)
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

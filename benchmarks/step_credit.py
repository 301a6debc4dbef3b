"""Which denoising steps can a per-step policy gradient credit? Measure it before training.

GRPO/DDPO credit a sample's advantage to each step's sampled noise z_t through the log-probability. That carries
signal only where re-drawing z_t changes the reward. This script measures it directly, for the config's model,
sampler and rewards: for each of N conditions it fixes the initial noise x_T and every step's noise, then re-draws
the noise of ONE step (M times, every step in turn) and, as a comparison, x_T alone (M times), and reports per step

- `spread`: the reward's standard deviation over the M re-draws (mean over conditions),
- `flip`:   the share of re-draws whose "right" outcome differs from the reference sample's (toy world: strict
            accuracy; other rewards: reward >= 1),

plus the toy world's per-attribute flip shares. A step whose re-drawn noise never changes the reward contributes
only noise to the policy gradient (leave it out with `train.min_step_std` or a flow SDE window); an outcome that
x_T decides and no step flips cannot be raised by per-step credit at all (docs/efficacy.md).

    python benchmarks/step_credit.py --config config/grpo.py:tiny_colour --conditions 16 --redraws 8
"""
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
    """Command-line flags, defined only when run as a script (so tests can import the functions)."""
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", "config/grpo.py:tiny", "Training configuration (file:NAME).")
    flags.DEFINE_integer("conditions", 16, "conditions measured (the first ones of the eval split)")
    flags.DEFINE_integer("redraws", 8, "re-draws of each step's noise per condition")
    flags.DEFINE_string("json", "", "write the table to this JSON file")


def main(_):
    from ddpo_grpo.errors import ConfigError
    from ddpo_grpo.trainer.run.validate import validate_config

    config = FLAGS.config
    try:
        validate_config(config, 1)
        if config.data.name == "recam" or FLAGS.conditions < 1 or FLAGS.redraws < 2:
            raise ConfigError("step_credit needs a text-conditioned world (not recam), --conditions >= 1 and "
                              "--redraws >= 2")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    table = measure(config, FLAGS.conditions, FLAGS.redraws)
    print(format_table(table))
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(table, f, indent=1)


def measure(config, num_conditions: int, redraws: int) -> dict:
    """Per-step spread and flip shares (see the module docstring). Returns a JSON-able dict of lists, one entry
    per denoising step followed by one for x_T."""
    import numpy as np
    import torch

    from ddpo_grpo.core.policy_step import SamplerSettings, schedule_stds
    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.rewards import RewardComputer
    from ddpo_grpo.trainer.run.data import build_dataset
    from ddpo_grpo.trainer.epoch.evaluation import passed

    s = config.sample
    pipe = load_pipeline(config.pretrained.model, resolution=config.pretrained.resolution)
    settings = SamplerSettings(family=pipe.family, guidance_scale=s.guidance_scale, eta=s.eta,
                               noise_level=s.noise_level, sde_type=s.sde_type)
    rewards = RewardComputer(dict(config.reward.fns), fn_kwargs={k: dict(v) for k, v in config.reward.kwargs.items()})
    stds = schedule_stds(pipe.scheduler, settings, s.num_steps, tuple(pipe.sample_shape)).tolist()
    stochastic = [i for i, sd in enumerate(stds) if sd > 0]
    ds = build_dataset(config, "eval")
    items = [ds[i] for i in range(min(num_conditions, len(ds)))]
    n_cols = len(stochastic) + 1  # every stochastic step, then x_T
    spread, flip, attr_flip = np.zeros(n_cols), np.zeros(n_cols), {}
    shape = tuple(pipe.sample_shape)
    for ci, item in enumerate(items):
        g = torch.Generator().manual_seed(config.seed * 1000 + ci)
        x_T = torch.randn((1, *shape), generator=g)
        z = torch.randn((1, s.num_steps, *shape), generator=g)
        # Row 0 is the reference; then `redraws` rows per column, each with one noise re-drawn.
        xs, zs = [x_T], [z]
        for col in range(n_cols):
            for _ in range(redraws):
                zz, start = z.clone(), x_T
                if col < len(stochastic):
                    zz[:, stochastic[col]] = torch.randn((1, *shape), generator=g)
                else:
                    start = torch.randn((1, *shape), generator=g)
                xs.append(start)
                zs.append(zz)
        images = sample_with_noise(pipe, settings, s.num_steps, item["prompt"], torch.cat(xs), torch.cat(zs), stochastic)
        meta = [{k: v for k, v in item.items() if k != "cond_image"}] * len(images)
        res = rewards(images, [item["prompt"]] * len(images), meta)
        r = np.asarray(res.final, dtype=np.float64)
        right = passed(r, res.details)
        details = {k.split("/")[-1].replace("_accuracy", ""): np.asarray(v) >= 1.0 for k, v in res.details.items()
                   if k.endswith("_accuracy") and not k.endswith("strict_accuracy")}
        for col in range(n_cols):
            sl = slice(1 + col * redraws, 1 + (col + 1) * redraws)
            spread[col] += r[sl].std()
            flip[col] += np.mean(right[sl] != right[0])
            for name, v in details.items():
                attr_flip.setdefault(name, np.zeros(n_cols))[col] += np.mean(v[sl] != v[0])
    n = len(items)
    labels = [f"step {i}" for i in stochastic] + ["x_T"]
    return {"config": {"model": config.pretrained.model, "num_steps": s.num_steps, "eta": s.eta,
                       "noise_level": s.noise_level, "conditions": n, "redraws": redraws},
            "columns": labels, "std": [stds[i] for i in stochastic] + [1.0],
            "spread": (spread / n).round(4).tolist(), "flip": (flip / n).round(4).tolist(),
            "attribute_flip": {k: (v / n).round(4).tolist() for k, v in attr_flip.items()}}


def sample_with_noise(pipe, settings, num_steps: int, prompt: str, x_T, z, stochastic):
    """Images (R, 3, H, W) of R trajectories from x_T (R, C, H, W) with the given per-step noises z (R, T, C, H, W):
    each stochastic step is its policy mean + std * z, exactly the sampler's transition."""
    import torch

    from ddpo_grpo.core.pipeline_with_logprob import decode
    from ddpo_grpo.core.families import get_family
    from ddpo_grpo.core.policy_step import denoiser_output, policy_step

    R = x_T.shape[0]
    with torch.no_grad():
        emb = pipe.encode([prompt] * R)
        neg = pipe.encode([""] * R) if settings.guidance_scale != 1.0 else None
        sched, family = pipe.scheduler, get_family(settings.family)
        family.set_timesteps(sched, num_steps)
        x = x_T
        for i, t in enumerate(sched.timesteps):
            tt, idx = t.expand(R), torch.full((R,), i, dtype=torch.long)
            if i in stochastic:
                res = policy_step(pipe.unet, sched, settings, x, tt, idx, emb, neg, prev_sample=x)
                x = (res.mean + res.std * z[:, i]).to(x_T.dtype)
            else:  # a zero-variance step (flow CPS's last): the ODE, as the sampler runs it
                out = denoiser_output(pipe.unet, x, tt, emb, neg, settings.guidance_scale)
                x = family.ode_step(sched, out, tt, idx, x)
        return decode(pipe.vae, x)


def format_table(table: dict) -> str:
    cols = table["columns"]
    lines = [f"{table['config']}", "column     " + " ".join(f"{c:>8s}" for c in cols),
             "std        " + " ".join(f"{v:8.3f}" for v in table["std"]),
             "spread     " + " ".join(f"{v:8.3f}" for v in table["spread"]),
             "flip       " + " ".join(f"{v:8.3f}" for v in table["flip"])]
    for name, v in table["attribute_flip"].items():
        lines.append(f"{name[:10]:10s} " + " ".join(f"{x:8.3f}" for x in v))
    return "\n".join(lines)


if __name__ == "__main__":
    define_flags()
    app.run(main)

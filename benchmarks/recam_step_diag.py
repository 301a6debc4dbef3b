"""Per-timestep diagnosis of the clipped-ratio GRPO gradient on tiny-recam-video (issue 47, docs/recam_log.md).

    python benchmarks/recam_step_diag.py --conditions 8 --k 16 --compare /work/runs47/A/export --json out.json

Samples one epoch the way recam_video_tiny's trainer does (training conditions, k copies of each from one shared
x_T, Flow-GRPO's SDE at --noise-level on every step, cam_score, group-standardised advantages broadcast over the
steps) with the start model, then for every step t reports, at ratio 1 (the first optimizer step of an epoch):

- `std`:       the policy's std at t;
- `grad`:      |g_t|, the norm of the per-step policy gradient g_t = d/dtheta mean_i A_i log p_t(i) over the
               trainable set (ReCamMaster's: self-attention + camera layers), as the trainer's loss has it;
- `perm`:      the same with the advantages permuted inside each group (no signal; the noise floor), mean of 2;
- `half_cos`:  the cosine between g_t of one half of the conditions and of the other half (independent
               samples: > 0 when the step's gradient carries a direction shared across conditions);
- `cos_sum`:   the cosine between g_t and the sum over all steps (which steps set the direction of an all-steps update);
- `credit`:    the cam_score spread (std over --redraws re-draws, mean over conditions) when only step t's noise is
               re-drawn (x_T and every other step's noise fixed): how much of a clip's reward step t decides;
- `shift`:     with --compare MODEL: the Gaussian KL (mean over dims) between the start model's step-t policy and
               MODEL's on the sampled states: which steps a run moved (what train/policy_shift_kl and the
               clipped ratio see);
- `velocity_change`: with --compare, the RMS change of the denoiser's velocity at step t (what the deterministic
               eval sampler sees: at the noisy steps a large velocity change is a small KL).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpo_grpo.core.common import AntitheticNoise, mirrored_pairs  # noqa: E402
from ddpo_grpo.core.pipeline_with_logprob import decode, pipeline_with_logprob  # noqa: E402
from ddpo_grpo.core.policy_step import SamplerSettings, policy_step  # noqa: E402
from ddpo_grpo.models import load_pipeline, resolve_model_path  # noqa: E402
from ddpo_grpo.worlds.recam.cam_score import make_cam_score  # noqa: E402
from ddpo_grpo.worlds.recam.video_data import RecamVideoConditions  # noqa: E402

SIZE, FRAMES, STEPS = 32, 9, 10
FULL_TRAINABLE = ("attn1.", "cam_encoder.", "projector.")  # models.recam.RecamAdapter.full_trainable


def load(model_dir: str):
    """A model folder with its recammaster.ckpt; a LoRA run's export (the merged recammaster.ckpt beside the adapter
    weights, no pipeline folder) is read over the bundled model's folder."""
    folder = model_dir if os.path.isfile(os.path.join(model_dir, "model_index.json")) else \
        resolve_model_path("tiny-recam-video")
    return load_pipeline(folder, resolution=SIZE, num_frames=FRAMES,
                         recam_checkpoint=os.path.join(model_dir, "recammaster.ckpt"))


def inputs(pipe, items):
    cond = pipe.adapter.condition_channels(pipe, items, "cpu")
    emb = torch.cat([pipe.encode([it["prompt"]]) for it in items])
    return emb, cond


@torch.no_grad()
def sample_epoch(pipe, settings, items, k: int, seed: int, window=None, antithetic: bool = False):
    """k copies of each item from one shared x_T; returns trajectories' latents (N, T+1, ...), rewards (N,),
    stds (T,), emb, cond, the per-item index of each row. window: (start, size) of the SDE window (ODE elsewhere);
    antithetic: copies 2j and 2j + 1 of an item draw mirrored step noise (the trainer's sample.antithetic)."""
    rows = [it for it in items for _ in range(k)]
    emb, cond = inputs(pipe, rows)
    g = torch.Generator().manual_seed(seed)
    x_T = torch.randn((len(items), *pipe.sample_shape), generator=g).repeat_interleave(k, dim=0)
    noise = g
    if antithetic:
        keys = [i for i in range(len(items)) for _ in range(k)]
        pairs = mirrored_pairs(keys)
        noise = AntitheticNoise([int(np.random.default_rng((seed, key, pair, 29)).integers(2**62))
                                 for key, (pair, _) in zip(keys, pairs)], [sign for _, sign in pairs])
    traj = pipeline_with_logprob(pipe.unet, pipe.scheduler, settings, emb, None, num_inference_steps=STEPS,
                                 latents=x_T, generator=noise, vae=pipe.vae, cond_channels=cond, sde_window=window)
    reward = make_cam_score()
    s, _ = reward(traj.images, [it["prompt"] for it in rows], [dict(it) for it in rows])
    return traj, np.asarray(s, dtype=np.float64), emb, cond


def group_adv(r: np.ndarray, k: int) -> np.ndarray:
    g = r.reshape(-1, k)
    return ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-4)).reshape(-1)


def step_grad(pipe, settings, traj, emb, cond, adv, t: int, params, rows=None, chunk: int = 32) -> torch.Tensor:
    """Flat gradient of mean_i A_i log p_t(i) over `rows` (all by default)."""
    N = traj.latents.shape[0]
    rows = torch.arange(N) if rows is None else rows
    for p in params:
        p.grad = None
    a = torch.as_tensor(adv, dtype=torch.float32)
    for lo in range(0, len(rows), chunk):
        r = rows[lo:lo + chunk]
        tt = traj.timesteps[t].expand(len(r))
        idx = traj.step_indices[t].expand(len(r))
        res = policy_step(pipe.unet, pipe.scheduler, settings, traj.latents[r, t], tt, idx, emb[r], None,
                          prev_sample=traj.latents[r, t + 1], cond_channels=cond[r])
        ((a[r] * res.log_prob).sum() / len(rows)).backward()
    return torch.cat([p.grad.reshape(-1).clone() for p in params])


def cos(a, b) -> float:
    return float(torch.dot(a, b) / (a.norm() * b.norm() + 1e-30))


@torch.no_grad()
def step_shift(pipe, other, settings, traj, emb, cond, t: int, chunk: int = 32, with_scale: bool = False):
    out = []
    for lo in range(0, traj.latents.shape[0], chunk):
        r = slice(lo, lo + chunk)
        n = traj.latents[r].shape[0]
        tt, idx = traj.timesteps[t].expand(n), traj.step_indices[t].expand(n)
        a = policy_step(pipe.unet, pipe.scheduler, settings, traj.latents[r, t], tt, idx, emb[r], None,
                        prev_sample=traj.latents[r, t + 1], cond_channels=cond[r])
        b = policy_step(other.unet, pipe.scheduler, settings, traj.latents[r, t], tt, idx, emb[r], None,
                        prev_sample=traj.latents[r, t + 1], cond_channels=cond[r])
        kl = ((a.mean - b.mean) ** 2 / (2 * a.std ** 2)).reshape(n, -1).mean(1)
        dv = ((a.model_output - b.model_output) ** 2).reshape(n, -1).mean(1)
        v2 = (a.model_output ** 2).reshape(n, -1).mean(1)
        out.append(torch.stack([kl, dv, v2], 1))
    kl, dv, v2 = torch.cat(out).mean(0)
    return float(kl), float(dv.sqrt()) if not with_scale else (float(dv.sqrt()), float(v2.sqrt()))


@torch.no_grad()
def credit(pipe, settings, items, redraws: int, seed: int):
    """Per step: cam_score std over `redraws` trajectories that differ only in that step's noise (and x_T alone)."""
    fam = pipe.family
    from ddpo_grpo.core.families import get_family

    family = get_family(fam)
    reward = make_cam_score()
    shape = tuple(pipe.sample_shape)
    spread = np.zeros(STEPS + 1)
    for ci, it in enumerate(items):
        g = torch.Generator().manual_seed(seed * 1000 + ci)
        x_T = torch.randn((1, *shape), generator=g)
        z = torch.randn((1, STEPS, *shape), generator=g)
        xs, zs = [], []
        for col in range(STEPS + 1):
            for _ in range(redraws):
                zz, start = z.clone(), x_T
                if col < STEPS:
                    zz[:, col] = torch.randn((1, *shape), generator=g)
                else:
                    start = torch.randn((1, *shape), generator=g)
                xs.append(start)
                zs.append(zz)
        x, z_all = torch.cat(xs), torch.cat(zs)
        R = x.shape[0]
        emb, cond = inputs(pipe, [it] * R)
        sched = pipe.scheduler
        family.set_timesteps(sched, STEPS)
        for i, tv in enumerate(sched.timesteps):
            tt, idx = tv.expand(R), torch.full((R,), i, dtype=torch.long)
            res = policy_step(pipe.unet, sched, settings, x, tt, idx, emb, None, prev_sample=x, cond_channels=cond)
            x = res.mean + res.std * z_all[:, i]
        imgs = decode(pipe.vae, x)
        s, _ = reward(imgs, [it["prompt"]] * R, [dict(it)] * R)
        s = np.asarray(s, dtype=np.float64).reshape(STEPS + 1, redraws)
        spread += s.std(1)
    return (spread / len(items)).tolist()


def snr(pipe, settings, data, args) -> dict:
    """How much of one epoch's window gradient is signal: for each of --snr E independent epochs (new conditions,
    x_T and noise each) the policy gradient summed over the window's steps at ratio 1 (plain and, on the same
    conditions and x_T, with mirrored noise); the mean cosine between the gradients of two different epochs estimates
    |signal|^2 / (|signal|^2 + |noise|^2) of one epoch (their signals are the same direction, their noises
    independent). Also |g| and its noise floor (advantages permuted inside groups)."""
    for n, p in pipe.unet.named_parameters():
        p.requires_grad_(any(f in n for f in FULL_TRAINABLE))
    params = [p for p in pipe.unet.parameters() if p.requires_grad]
    window = (0, args.window)
    out = {}
    for mode in ("plain", "antithetic"):
        grads, norms, perms = [], [], []
        for e in range(args.snr):
            rng = np.random.default_rng((args.seed, e))
            items = [data[int(i)] for i in rng.choice(len(data), args.conditions, replace=False)]
            traj, r, emb, cond = sample_epoch(pipe, settings, items, args.k, 1000 + e, window, mode == "antithetic")
            adv = group_adv(r, args.k)
            pa = np.concatenate([rng.permutation(grp) for grp in adv.reshape(-1, args.k)])
            g = sum(step_grad(pipe, settings, traj, emb, cond, adv, t, params) for t in range(traj.log_probs.shape[1]))
            gp = sum(step_grad(pipe, settings, traj, emb, cond, pa, t, params) for t in range(traj.log_probs.shape[1]))
            grads.append(g)
            norms.append(float(g.norm()))
            perms.append(float(gp.norm()))
            print(f"{mode} epoch {e}: reward {r.mean():.4f} within-group std {r.reshape(-1, args.k).std(1).mean():.4f} "
                  f"|g| {norms[-1]:.3e} permuted {perms[-1]:.3e}", flush=True)
        pair_cos = [cos(grads[i], grads[j]) for i in range(len(grads)) for j in range(i + 1, len(grads))]
        out[mode] = {"grad": norms, "perm": perms, "pair_cos": pair_cos, "mean_pair_cos": float(np.mean(pair_cos)),
                     "sem_pair_cos": float(np.std(pair_cos) / np.sqrt(len(pair_cos)))}
        print(f"{mode}: mean cosine between epochs' gradients {np.mean(pair_cos):+.4f} "
              f"(+- {out[mode]['sem_pair_cos']:.4f}), |g| / permuted {np.mean(norms) / np.mean(perms):.3f}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conditions", type=int, default=8)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--noise-level", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--redraws", type=int, default=0, help="> 0: the per-step credit table (costly)")
    ap.add_argument("--compare", nargs="*", default=[], help="model folders (a run's export/) for the per-step shift")
    ap.add_argument("--no-grad", action="store_true", help="skip the gradient table")
    ap.add_argument("--snr", type=int, default=0, help="> 1: only the window gradient's signal share over this many "
                    "independent epochs, plain against mirrored noise (sample.antithetic)")
    ap.add_argument("--window", type=int, default=4, help="--snr: SDE window of the first W steps (ODE after)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    pipe = load(resolve_model_path("tiny-recam-video"))
    settings = SamplerSettings(family="flow", noise_level=args.noise_level, sde_type="sde")
    data = RecamVideoConditions("train", num_frames=FRAMES, size=SIZE)
    if args.snr > 1:
        out = {"conditions": args.conditions, "k": args.k, "window": args.window, "noise_level": args.noise_level,
               **snr(pipe, settings, data, args)}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return
    rng = np.random.default_rng(args.seed)
    items = [data[int(i)] for i in rng.choice(len(data), args.conditions, replace=False)]
    traj, r, emb, cond = sample_epoch(pipe, settings, items, args.k, args.seed)
    adv = group_adv(r, args.k)
    T = traj.log_probs.shape[1]
    out = {"noise_level": args.noise_level, "conditions": args.conditions, "k": args.k, "seed": args.seed,
           "reward_mean": float(r.mean()), "within_group_std": float(r.reshape(-1, args.k).std(1).mean()),
           "std": [float(s) for s in traj.step_std]}
    print(f"reward {r.mean():.4f}, within-group std {out['within_group_std']:.4f}", flush=True)
    if not args.no_grad:
        for n, p in pipe.unet.named_parameters():
            p.requires_grad_(any(f in n for f in FULL_TRAINABLE))
        params = [p for p in pipe.unet.parameters() if p.requires_grad]
        N = len(r)
        half = torch.arange(N)[: N // 2], torch.arange(N)[N // 2:]  # first / second half of the conditions
        perm_rng = np.random.default_rng(args.seed + 7)
        grads, norms, perm, half_cos = [], [], [], []
        for t in range(T):
            g = step_grad(pipe, settings, traj, emb, cond, adv, t, params)
            grads.append(g)
            norms.append(float(g.norm()))
            pn = []
            for _ in range(2):
                pa = np.concatenate([perm_rng.permutation(grp) for grp in adv.reshape(-1, args.k)])
                pn.append(float(step_grad(pipe, settings, traj, emb, cond, pa, t, params).norm()))
            perm.append(float(np.mean(pn)))
            ga = step_grad(pipe, settings, traj, emb, cond, adv, t, params, rows=half[0])
            gb = step_grad(pipe, settings, traj, emb, cond, adv, t, params, rows=half[1])
            half_cos.append(cos(ga, gb))
            print(f"step {t}: std {out['std'][t]:.4f} grad {norms[-1]:.3e} perm {perm[-1]:.3e} "
                  f"half_cos {half_cos[-1]:+.3f}", flush=True)
        total = torch.stack(grads).sum(0)
        out.update(grad=norms, perm=perm, half_cos=half_cos, cos_sum=[cos(g, total) for g in grads],
                   grad_share=[n ** 2 / sum(x ** 2 for x in norms) for n in norms])
        for p in params:
            p.requires_grad_(False)
            p.grad = None
    for model in args.compare:
        other = load(model)
        both = [step_shift(pipe, other, settings, traj, emb, cond, t, with_scale=True) for t in range(T)]
        out.setdefault("shift", {})[model] = [kl for kl, _ in both]
        out.setdefault("velocity_change", {})[model] = [dv for _, (dv, _) in both]
        out["velocity_rms"] = [v for _, (_, v) in both]
        print(f"shift {model}: " + " ".join(f"{kl:.2e}" for kl, _ in both), flush=True)
        print(f"velocity change (RMS) {model}: " + " ".join(f"{dv:.3f}" for _, (dv, _) in both), flush=True)
        print("velocity RMS (start model): " + " ".join(f"{v:.3f}" for _, (_, v) in both), flush=True)
    if args.redraws > 0:
        out["credit"] = credit(pipe, settings, items, args.redraws, args.seed)
        print("credit (cam_score std when one step's noise is re-drawn; last: x_T): "
              + " ".join(f"{v:.4f}" for v in out["credit"]), flush=True)
    for key in ("grad", "perm", "half_cos", "cos_sum", "grad_share"):
        if key in out:
            print(f"{key:10s} " + " ".join(f"{v:9.3g}" for v in out[key]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

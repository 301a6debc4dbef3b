"""The row-count fault's tiny training context, shared by the tests that drive train_epoch by hand
(test_old_logprobs.py: the ratio's old log-probs; test_step_weights.py: the per-step loss weights): a denoiser whose
output depends on how many rows a call has, as per-shape GPU kernels make it, an optimizer and a RunState, and N
samples of T steps with hand-set advantages."""
import types

import ml_collections
import torch
from accelerate import Accelerator

from ddpo_grpo.core.pipeline_with_logprob import pipeline_with_logprob
from ddpo_grpo.trainer.epoch.advantages import EpochAdvantages
from ddpo_grpo.trainer.epoch.sampling import EpochSamples, TrainingCallShape, sampler_settings
from ddpo_grpo.trainer.run.build import RunState, lr_factor

from helpers import ddim_scheduler, flow_scheduler, tiny_unet

N, T = 8, 4
# The row-count fault: output + SHIFT_PER_ROW * rows of the call. Its sampler gap (1.4e-4 flow .. 3.5e-3 DDIM) lies
# where the GPU's did (H100 bf16: 3.2e-5 .. 4.8e-3): above the bf16 on-policy tolerance (clip_range / 2 = 5e-5) and
# below the bf16 sampler-gap tolerance (2e-2).
SHIFT_PER_ROW = 1e-4


class RowCountDenoiser(torch.nn.Module):
    """The tiny UNet plus SHIFT_PER_ROW x (rows in this call): scored in the sampler's batch (8 samples, CFG: 16 rows)
    and in a training call of 4 (8 rows), one transition gets two log-probs, as per-shape GPU kernels give it."""

    def __init__(self, fault: float = SHIFT_PER_ROW):
        super().__init__()
        self.inner, self.fault = tiny_unet(), fault

    def forward(self, x, t, encoder_hidden_states=None):
        out = self.inner(x, t, encoder_hidden_states=encoder_hidden_states).sample
        return types.SimpleNamespace(sample=out + self.fault * x.shape[0])


def make_ctx(family="ddim", old_logprobs="rescore", lr=0.0, inner=1, fault=SHIFT_PER_ROW, cap=0.0, cfg=True,
             onpolicy_check="stop", verify_every=10):
    cfg = ml_collections.ConfigDict(dict(
        seed=0,
        sample=dict(guidance_scale=2.0, eta=1.0, noise_level=0.7, sde_type="sde"),
        train=dict(cfg=cfg, onpolicy_check=onpolicy_check, old_logprobs=old_logprobs, sampler_is_cap=cap, batch_size=4,
                   timestep_fraction=1.0, timesteps_per_call=1, num_inner_epochs=inner, gradient_accumulation_steps=1,
                   max_grad_norm=1.0, clip_range=1e-4, clip_range_high=-1.0, adv_clip_max=5.0, beta=0.0,
                   kl_type="gaussian", old_logprobs_verify_every=verify_every, objective="grpo"),
    ))
    unet = RowCountDenoiser(fault)
    unet.requires_grad_(True)
    opt = torch.optim.AdamW(unet.parameters(), lr=lr)
    state = RunState()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor("constant", 0, 1, state))
    pipe = types.SimpleNamespace(scheduler=ddim_scheduler() if family == "ddim" else flow_scheduler(), family=family)
    return types.SimpleNamespace(config=cfg, accelerator=Accelerator(cpu=True), unet=unet, optimizer=opt,
                                 lr_scheduler=sched, reference=None, supervised=None, state=state, pipe=pipe, tree=None)


def make_samples(ctx, branch=None, call_rows=0, seed=0):
    """N samples in one sampling batch (CFG: 2N rows per call), or in calls of call_rows samples laid out as the
    training calls are (sample_epoch's TrainingCallShape); the denoiser in train mode, as sample_epoch runs it."""
    g = torch.Generator().manual_seed(seed)
    emb, neg = torch.randn(N, 5, 8, generator=g), torch.randn(N, 5, 8, generator=g)
    settings = sampler_settings(ctx.config, ctx.pipe.family)
    ctx.unet.train()
    denoiser = TrainingCallShape(ctx.unet, call_rows, True) if call_rows else ctx.unet
    with torch.no_grad():
        traj = pipeline_with_logprob(denoiser, ctx.pipe.scheduler, settings, emb, neg, num_inference_steps=T,
                                     sample_shape=(3, 8, 8), generator=g, branch=branch)
    samples = EpochSamples(traj.latents, traj.log_probs, traj.timesteps, traj.step_indices, emb, neg, traj.images,
                           torch.arange(N) // 4, [""] * N, [{}] * N, transitions=traj.transitions, settings=settings,
                           call_rows=call_rows)
    if branch is None:
        adv = EpochAdvantages(torch.tensor([1.0, -1.0, 0.5, -0.5] * 2), torch.ones(N, dtype=torch.bool),
                              None, None, None, None, 0, 0)
    else:  # one advantage per owner cell (every cell of a tree's structure trained once)
        cells = torch.from_numpy(branch.owner_cells(N))
        a = torch.linspace(-1, 1, cells.numel()).reshape(cells.shape) * cells
        adv = EpochAdvantages(a, torch.ones(N, dtype=torch.bool), None, None, None, None, 0, 0, cell_mask=cells)
    return samples, adv

"""Schedulers as users' folders hold them (issue 36): every scheduler class diffusers offers for the two families,
saved with its class defaults and with released values, is read by models.base.load_scheduler, samples, and its
stochastic steps re-score to ratio exactly 1 through the library's policy_step; a step without noise for the
scheduler's settings (DDIM σ_t = 0, CPS's σ' = 0) is deterministic: no log-prob, not stored, not trained. A setting
no adapter can sample (use_dynamic_shifting without an image-token count) is one ConfigError line naming the key.
Two real trainer runs (DDIM from Euler class defaults, flow CPS) go through scripts/train.py."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, cpu_env, tiny_unet

from ddpo_grpo.core.loss import ONPOLICY_TOL_EXACT
from ddpo_grpo.core.families import DDIM_SCHEDULER_CLASSES, get_family
from ddpo_grpo.core.pipeline_with_logprob import pipeline_with_logprob
from ddpo_grpo.core.policy_step import SamplerSettings, policy_step
from ddpo_grpo.errors import ConfigError
from ddpo_grpo.models.base import DDIM_FILLED, load_scheduler

STEPS = 5
SD = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")  # SD 1.x / SDXL's betas

# (class name, constructor kwargs): class defaults, and released values (SD 1.5's PNDM, SDXL's Euler), and DDIM's own
# set_alpha_to_one / timestep_spacing / steps_offset grid.
DDIM_CASES = [(cls, {}) for cls in DDIM_SCHEDULER_CLASSES] + [
    ("PNDMScheduler", dict(SD, set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1)),  # SD 1.5's file
    ("EulerDiscreteScheduler", dict(SD, timestep_spacing="leading", steps_offset=1)),  # SDXL's (its own keys)
] + [("DDIMScheduler", dict(SD, set_alpha_to_one=a, timestep_spacing=sp, steps_offset=o))
     for a in (True, False) for sp in ("leading", "trailing", "linspace") for o in (0, 1)]
FLOW_CASES = [("FlowMatchEulerDiscreteScheduler", {}), ("FlowMatchEulerDiscreteScheduler", dict(shift=3.0)),
              ("UniPCMultistepScheduler", dict(use_flow_sigmas=True, prediction_type="flow_prediction",
                                               flow_shift=3.0))]  # Wan's file


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The steps here are tiny (8 x 8): several threads only contend (measured: 0.05 s a case on 1 thread, 5-15 s on
    a busy 2-core machine with the default count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def save_scheduler(tmp, cls: str, kw: dict) -> dict:
    """A folder holding only scheduler/ as `cls(**kw).save_pretrained` writes it; returns the file's dict."""
    import inspect

    import diffusers

    klass = getattr(diffusers, cls)
    try:
        klass(**kw).save_pretrained(os.path.join(tmp, "scheduler"))
    except ImportError:  # LMS needs scipy to be built, not to be read: write what save_pretrained would
        os.makedirs(os.path.join(tmp, "scheduler"))
        args = {k: p.default for k, p in inspect.signature(klass.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
        with open(os.path.join(tmp, "scheduler", "scheduler_config.json"), "w") as f:
            json.dump(dict(args, **kw, _class_name=cls), f)
    return json.load(open(os.path.join(tmp, "scheduler", "scheduler_config.json")))


def zero_noise_steps(sched, eta: float) -> list:
    """Independently of the library: the DDIM steps whose σ_t is 0, from diffusers' own variance formula."""
    sched.set_timesteps(STEPS)
    return [i for i, t in enumerate(sched.timesteps)
            if eta * sched._get_variance(int(t), int(t) - 1000 // STEPS) ** 0.5 == 0]


def sample_and_rescore(sched, settings, seed=0):
    """Sample 2 trajectories with a tiny UNet, then re-score every stored step with policy_step as training does."""
    unet = tiny_unet()
    emb = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(seed))
    traj = pipeline_with_logprob(unet, sched, settings, emb, num_inference_steps=STEPS, sample_shape=(3, 8, 8),
                                 generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for j, i in enumerate(traj.step_indices.tolist()):
            res = policy_step(unet, sched, settings, traj.latents[:, j], traj.timesteps[j].expand(2),
                              torch.full((2,), i), emb, prev_sample=traj.latents[:, j + 1])
            assert torch.equal(torch.exp(res.log_prob - traj.log_probs[:, j]), torch.ones(2))  # ratio exactly 1
    return traj


@pytest.mark.parametrize("cls,kw", DDIM_CASES, ids=lambda v: v if isinstance(v, str) else
                         "-".join(f"{k}={v[k]}" for k in ("set_alpha_to_one", "timestep_spacing", "steps_offset")
                                  if k in v) or ("released" if v else "defaults"))
def test_ddim_family_folders_keep_their_keys_and_train_only_steps_with_noise(tmp_path, cls, kw):
    folder = save_scheduler(tmp_path, cls, kw)
    sched, family = load_scheduler(str(tmp_path))
    assert family == "ddim" and type(sched).__name__ == "DDIMScheduler"
    for k, v in sched.config.items():  # the folder's keys as it says them; DDIM_FILLED only where it is silent
        if k.startswith("_"):
            continue
        if k in folder:
            assert v == folder[k], k
        elif k in DDIM_FILLED:
            assert v == DDIM_FILLED[k], k
    settings = SamplerSettings(family="ddim", eta=1.0)
    zero = zero_noise_steps(sched, 1.0)
    assert zero in ([], [STEPS - 1])  # only ever the last step (into ᾱ = 1, or from t = 0 onto ᾱ_0)
    n = get_family("ddim").stochastic_steps(sched, settings, STEPS)
    assert n == STEPS - len(zero)
    traj = sample_and_rescore(sched, settings)
    assert traj.log_probs.shape == (2, n) and traj.step_indices.tolist() == list(range(n))
    assert bool((traj.step_std > 0).all())  # a log-prob only where the step has variance
    assert traj.latents.shape[1] == n + 1 and torch.isfinite(traj.images).all()


@pytest.mark.parametrize("cls,kw", FLOW_CASES, ids=["defaults", "shift3", "unipc-flow-sigmas"])
@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_flow_folders_train_only_steps_with_noise(tmp_path, cls, kw, sde_type):
    folder = save_scheduler(tmp_path, cls, kw)
    sched, family = load_scheduler(str(tmp_path))
    assert family == "flow" and type(sched).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert sched.config.shift == folder.get("shift", folder.get("flow_shift"))
    settings = SamplerSettings(family="flow", noise_level=0.7, sde_type=sde_type)
    n = get_family("flow").stochastic_steps(sched, settings, STEPS)
    assert n == (STEPS - 1 if sde_type == "cps" else STEPS)  # CPS's last step: σ' = 0, no noise
    traj = sample_and_rescore(sched, settings)
    assert traj.log_probs.shape == (2, n) and bool((traj.step_std > 0).all())


@pytest.mark.parametrize("cls", ["EDMEulerScheduler", "FlowMatchHeunDiscreteScheduler", "ScoreSdeVeScheduler", None])
def test_unknown_scheduler_class_is_refused_naming_the_supported_ones(tmp_path, cls):
    """Another noise schedule (EDM sigmas, a VE SDE, a flow scheduler other than FlowMatchEuler) or no class name at
    all: one ConfigError line naming what each family reads, not a DDIM reading of a schedule it is not."""
    from ddpo_grpo.models.base import scheduler_family

    if cls is None:  # a config without `_class_name`
        folder = save_scheduler(tmp_path, "DDIMScheduler", {})
        folder.pop("_class_name")
        json.dump(folder, open(os.path.join(tmp_path, "scheduler", "scheduler_config.json"), "w"))
    else:
        save_scheduler(tmp_path, cls, {})
    for load in (load_scheduler, scheduler_family):
        with pytest.raises(ConfigError) as e:
            load(str(tmp_path))
        msg = str(e.value)
        assert "\n" not in msg and f"scheduler class {cls!r} is not supported" in msg and str(tmp_path) in msg
        assert "FlowMatchEulerDiscreteScheduler" in msg and all(c in msg for c in DDIM_SCHEDULER_CLASSES)


def test_dynamic_shifting_is_refused_naming_the_key_where_no_mu_exists(tmp_path):
    save_scheduler(tmp_path, "FlowMatchEulerDiscreteScheduler", dict(use_dynamic_shifting=True))
    with pytest.raises(ConfigError, match="use_dynamic_shifting=true") as e:
        load_scheduler(str(tmp_path))
    assert "\n" not in str(e.value)
    sched, _ = load_scheduler(str(tmp_path), dynamic_shift=True)  # models.sd3 / flux give it their mu
    assert sched.config.use_dynamic_shifting


def test_the_deterministic_last_step_is_ddims_eta_zero_step():
    """The zero-noise step is taken without noise: the final sample is ddim_step(eta 0) of the last stored state."""
    from diffusers import DDIMScheduler

    sched = DDIMScheduler(**SD, set_alpha_to_one=True, steps_offset=1)
    settings = SamplerSettings(family="ddim", eta=1.0)
    unet = tiny_unet()
    emb = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    traj = pipeline_with_logprob(unet, sched, settings, emb, num_inference_steps=STEPS, sample_shape=(3, 8, 8),
                                 generator=torch.Generator().manual_seed(1))
    assert traj.log_probs.shape == (2, STEPS - 1)
    x, t = traj.latents[:, -1], sched.timesteps[-1]
    with torch.no_grad():
        last = get_family("ddim").ode_step(sched, unet(x, t.expand(2), encoder_hidden_states=emb).sample,
                                           t.expand(2), torch.full((2,), STEPS - 1), x)
    torch.testing.assert_close((last / 2 + 0.5).clamp(0, 1), traj.images, atol=0, rtol=0)


def _folder(tmp, src: str, cls: str, kw: dict) -> str:
    """A copy of a bundled model whose scheduler/ is replaced by cls(**kw).save_pretrained's."""
    dst = os.path.join(tmp, "model")
    shutil.copytree(os.path.join(ROOT, "assets", src), dst, ignore=shutil.ignore_patterns("scheduler"))
    save_scheduler(dst, cls, kw)
    return dst


RUN = ["--config.num_epochs=1", "--config.sample.num_steps=4", "--config.sample.batch_size=8",
       "--config.sample.num_batches_per_epoch=1", "--config.sample.k=4", "--config.train.batch_size=8",
       "--config.train.min_step_std=0", "--config.train.timestep_fraction=1.0", "--config.eval_freq=0",
       "--config.save_freq=1", "--config.logging.wandb=False", "--config.logging.tensorboard=False",
       "--config.logging.image_freq=0"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("config_name,src,cls,kw,extra,trained", [
    # SD 1.x-style folder saved from code: Euler's class defaults (linspace, steps_offset 0, no set_alpha_to_one):
    # the last step starts at t = 0 and has no noise -> 3 of 4 steps trained
    ("tiny", "tiny-t2i", "EulerDiscreteScheduler", {}, ["--config.use_lora=False"], 3),
    ("tiny_flow", "tiny-flow", "FlowMatchEulerDiscreteScheduler", dict(shift=3.0), ["--config.sample.sde_type=cps"], 3),
], ids=["ddim-euler-defaults", "flow-cps"])
def test_a_folder_trains_one_epoch_on_policy(tmp_path, config_name, src, cls, kw, extra, trained):
    model = _folder(str(tmp_path), src, cls, kw)
    p = subprocess.run([sys.executable, "scripts/train.py", "--config", f"config/grpo.py:{config_name}",
                        f"--config.pretrained.model={model}", f"--config.logdir={tmp_path}", "--config.run_name=r",
                        *RUN, *extra], cwd=ROOT, env=cpu_env(), capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    notes = [line for line in p.stdout.splitlines() if line.startswith("note: scheduler:")]
    assert len(notes) == 1 and f"{trained} of 4 steps stochastic (trained)" in notes[0], p.stdout[-2000:]
    if src == "tiny-t2i":
        assert "EulerDiscreteScheduler sampled as DDIMScheduler" in notes[0]
        assert "set_alpha_to_one=False (filled: not in the folder)" in notes[0]
        assert "timestep_spacing='linspace'" in notes[0] and "steps_offset=0" in notes[0]
    h = json.load(open(tmp_path / "r" / "summary.json"))["history"][0]
    # the sampler's log-probs (float32 CPU, train.old_logprobs auto): 1 up to summation order, the stated tolerance
    assert h["train"]["onpolicy_ratio_max_dev"] < ONPOLICY_TOL_EXACT
    assert h["nfe_per_sample"]["sampling"] == 4  # the deterministic step runs the denoiser too, once
    exported = json.load(open(tmp_path / "r" / "export" / "scheduler" / "scheduler_config.json"))
    if src == "tiny-t2i":  # the full export samples as the run did: DDIM with the values the run used
        assert exported["_class_name"] == "DDIMScheduler" and exported["set_alpha_to_one"] is False
        assert exported["timestep_spacing"] == "linspace" and exported["clip_sample"] is False


def test_the_scheduler_note_says_what_a_window_or_a_tree_samples_with_noise():
    """The `note: scheduler:` line states the room (steps that can be stochastic) and then what this run samples with
    noise and trains: an SDE window's steps, or a tree's splits; without either, nothing more."""
    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.trainer.epoch.sampling import scheduler_note
    from helpers import named_config

    c = named_config("recam_video_tiny_grpo")
    video = load_pipeline(c.pretrained.model)
    note = scheduler_note(c, video)
    assert "an SDE window of 4 (steps 0-3) stochastic and trained" in note, note
    c.sample.sde_window_mode, c.sample.sde_window_size = "random", 2
    assert "an SDE window of 2 (placed random per epoch)" in scheduler_note(c, video)
    c = named_config("tiny_colour_branch")
    pipe = load_pipeline(c.pretrained.model)
    assert "the tree's splits [0] only" in scheduler_note(c, pipe)
    c = named_config("tiny_colour_grpo")
    assert "this run:" not in scheduler_note(c, pipe)

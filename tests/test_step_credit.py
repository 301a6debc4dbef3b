"""benchmarks/step_credit.py: its transitions are exactly the sampler's, and its table is well formed."""
import importlib.util
import os
import subprocess
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("step_credit", os.path.join(ROOT, "benchmarks", "step_credit.py"))
step_credit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_credit)


def test_sample_with_noise_replays_the_samplers_trajectory():
    """The noises recovered from a sampled trajectory, fed back, give the same images: the script re-draws one
    step's noise of the real policy, not of an approximation of it."""
    from ddpo_grpo.core.pipeline_with_logprob import encode_prompts, pipeline_with_logprob
    from ddpo_grpo.core.policy_step import SamplerSettings, policy_step
    from ddpo_grpo.models import load_pipeline

    pipe = load_pipeline("tiny-t2i")
    settings = SamplerSettings(family=pipe.family, eta=1.0)
    prompt, B, T = "a red circle on the left", 3, 6
    with torch.no_grad():
        emb = encode_prompts(pipe.text_encoder, pipe.tokenizer, [prompt] * B)
        traj = pipeline_with_logprob(pipe.unet, pipe.scheduler, settings, emb, num_inference_steps=T,
                                     sample_shape=pipe.sample_shape, generator=torch.Generator().manual_seed(3))
        z = []
        for i, t in enumerate(pipe.scheduler.timesteps):
            x, nxt = traj.latents[:, i], traj.latents[:, i + 1]
            res = policy_step(pipe.unet, pipe.scheduler, settings, x, t.expand(B), torch.full((B,), i), emb,
                              prev_sample=nxt)
            z.append((nxt - res.mean) / res.std)
    z = torch.stack(z, dim=1)
    assert z.std() > 0.5  # real noise, not a degenerate trajectory
    images = step_credit.sample_with_noise(pipe, settings, T, prompt, traj.latents[:, 0], z, list(range(T)))
    torch.testing.assert_close(images, traj.images, atol=1e-4, rtol=0)
    z[:, 0] = torch.randn(z[:, 0].shape, generator=torch.Generator().manual_seed(9))
    changed = step_credit.sample_with_noise(pipe, settings, T, prompt, traj.latents[:, 0], z, list(range(T)))
    assert (changed - traj.images).abs().max() > 0.05  # the first step's noise matters


def test_cli_table_is_well_formed_and_bad_input_is_one_line(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "credit.json"
    p = subprocess.run([sys.executable, "benchmarks/step_credit.py", "--config", "config/grpo.py:tiny_colour",
                        "--conditions", "2", "--redraws", "2", "--config.sample.num_steps", "4", "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    import json

    t = json.loads(out.read_text())
    assert t["columns"] == ["step 0", "step 1", "step 2", "step 3", "x_T"]
    assert sorted(t["attribute_flip"]) == ["color", "position", "shape"]
    for v in [t["flip"], *t["attribute_flip"].values()]:
        assert len(v) == 5 and all(0.0 <= x <= 1.0 and x * 4 == int(x * 4) for x in v)  # 2 conditions x 2 redraws
    assert np.all(np.asarray(t["spread"]) >= 0)
    assert t["std"][:4] == sorted(t["std"][:4], reverse=True)  # DDIM's std falls towards the data
    p = subprocess.run([sys.executable, "benchmarks/step_credit.py", "--config", "config/grpo.py:tiny", "--redraws", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("error: step_credit needs"), p.stderr

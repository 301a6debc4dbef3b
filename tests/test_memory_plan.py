"""The memory plan (trainer/checks/memory_plan.py, trainer/checks/meta_counts.py): its arithmetic against hand-computed numbers,
its static part against real modules' bytes, its counts against the real modules, and the plan a dry run prints
(the activation counts it reads: tests/test_byte_meters.py)."""
import os
import subprocess
import sys

import pytest
import torch

from ddpo_grpo.trainer.checks import memory_plan as mp
from ddpo_grpo.trainer.checks.meta_counts import count_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "config"))
import grpo  # noqa: E402
from helpers import fresh_process, heap_in_use, mid_unet_config  # noqa: E402

G = mp.GiB


def counts(**kw):
    base = dict(denoiser=1000, lora=10, full_trainable=1000, text_encoders={"text_encoder": 100}, vae=50,
                vae_bytes={"no": 4, "bf16": 2, "fp16": 4}, condition_elems=7, num_prompts=3, act_bytes=400,
                act_bytes_ckpt=40)
    base.update(kw)
    return mp.ModelCounts(**base)


def rows(c, s, e):
    return [b for _, b in mp.plan(c, s, e)]


# ------------------------------------------------------------------------------------------------ arithmetic
def test_full_fine_tune_ddp_one_process_fp32_by_hand():
    s = mp.Settings(precision="no", train_batch_size=2, train_cfg=2)
    got = rows(counts(), s, mp.Engine("ddp", 1))
    # frozen 0, trainable 1000 x 4, grads 4000, Adam 8000, ref 0, text encoder 400, vae 200, embeddings 3 x 7 x 4,
    # activations 400 B per row x 2 rows per sample (CFG) x 2 samples
    assert got == [0, 4000, 4000, 8000, 0, 400, 200, 84, 1600]


def test_training_call_rows_and_the_largest_phase_by_hand():
    """The training call's rows are b x S x 2 under CFG; only the largest phase (training call, sampling call, decode)
    is added, the others shown at 0. Hand numbers: 400 B per row."""
    c = counts(sampling_bytes=5000, decode_bytes=3000)
    s = mp.Settings(precision="no", train_batch_size=8, steps_per_call=3, train_cfg=2, sample_rows=16)
    labelled = mp.plan(c, s, mp.Engine())
    assert labelled[-3] == ("activations 0.00 GiB/row x 48 rows (8 x 3 steps x 2 CFG)", 400 * 48)  # 19200 B
    assert [b for _, b in labelled[-2:]] == [0.0, 0.0]  # sampling 5000 and decode 3000 are below 19200
    small = mp.plan(c, mp.Settings(precision="no", train_batch_size=1, sample_rows=16), mp.Engine())
    assert [b for _, b in small[-3:]] == [0.0, 5000.0, 0.0]  # 400 B of training: the sampling call is the peak
    # the decode counts its transient buffers per VAE kind: an image VAE's 4000 B live x 1.38 (the H100's measured
    # ratio) = 5520 > 5000; Wan's float32 3-D VAE's x 1.13 (its traced CPU ratio) = 4520 < 5000: the sampling call
    one = mp.Settings(precision="no", train_batch_size=1, sample_rows=16)
    big = mp.plan(counts(sampling_bytes=5000, decode_bytes=4000), one, mp.Engine())
    assert [b for _, b in big[-3:]] == [0.0, 0.0, 4000 * 1.38] and "x1.38 transient buffers, image VAE" in big[-1][0]
    video = mp.plan(counts(sampling_bytes=5000, decode_bytes=4000, decode_kind="video3d"), one, mp.Engine())
    assert [b for _, b in video[-3:]] == [0.0, 5000.0, 0.0] and "x1.13 transient buffers, video3d VAE" in video[-1][0]


def test_lora_plans_the_activations_counted_with_its_adapters_by_hand():
    """A LoRA plan reads the activations counted with the run's adapters the only trainable parameters (a frozen
    linear keeps no input for its weight's gradient), a full fine-tune the all-trainable count; counts without the
    LoRA figures (None) fall back to the all-trainable ones. Hand numbers, 2 rows."""
    c = counts(act_bytes=400, act_bytes_ckpt=40, act_bytes_lora=100, act_bytes_ckpt_lora=30)
    last = lambda s: mp.plan(c, s, mp.Engine())[-1][1]  # noqa: E731 (no phases in counts(): the training call)
    assert last(mp.Settings(precision="no", use_lora=True, train_batch_size=2)) == 200
    assert last(mp.Settings(precision="no", use_lora=True, train_batch_size=2, gradient_checkpointing=True)) == 60
    assert last(mp.Settings(precision="no", train_batch_size=2)) == 800
    assert mp.plan(counts(), mp.Settings(precision="no", use_lora=True, train_batch_size=2), mp.Engine())[-1][1] == 800


def test_lora_bf16_fsdp2_over_4_by_hand():
    s = mp.Settings(precision="bf16", use_lora=True, train_batch_size=1, reference_copies=1, cache_embeddings=True,
                    offload=True, gradient_checkpointing=True)
    got = rows(counts(), s, mp.Engine("fsdp2", 4))
    # base 1000 x 2 / 4, LoRA 10 x 4 / 4, grads 40 / 4, Adam 80 / 4, reference LoRA copy 40 / 4, text encoder and
    # VAE off the device, embeddings held on the host (trainer/run/embeddings.py), checkpointed activations 40 x 2/4 bytes
    assert got == [500, 10, 10, 20, 10, 0, 0, 0, 20]


def test_deepspeed_zero_stages_by_hand():
    s = mp.Settings(precision="bf16", train_batch_size=0)  # no activations: the static part alone
    c = counts(text_encoders={}, vae=0, num_prompts=0)
    z1, z2, z3 = (rows(c, s, mp.Engine(f"zero{k}", 4)) for k in (1, 2, 3))
    # ZeRO paper: 2 (bf16 params) + 2 (grads) + 12 (fp32 master + Adam) bytes per parameter, stage k shards more
    assert z1[:4] == [0, 2000, 2000, 12000 / 4]
    assert z2[:4] == [0, 2000, 2000 / 4, 12000 / 4]
    assert z3[:4] == [0, 2000 / 4, 2000 / 4, 12000 / 4]
    assert sum(z3) == 16000 / 4


def test_ddp_replicas_hold_buckets_and_full_bf16_autocast_casts():
    s = mp.Settings(precision="bf16", train_batch_size=0, reference_copies=1)
    labels = [lab for lab, _ in mp.plan(counts(), s, mp.Engine("ddp", 8))]
    got = dict(zip(labels, rows(counts(), s, mp.Engine("ddp", 8))))
    assert got["DDP gradient buckets (fp32)"] == 4000
    assert got["autocast weight casts (bf16/fp16)"] == 2000
    assert got["reference (EMA copies, fp32)"] == 4000  # full fine-tune: one fp32 copy, replicated under DDP
    assert "DDP gradient buckets (fp32)" not in dict(mp.plan(counts(), s, mp.Engine("ddp", 1)))


def test_fit_names_the_fewest_switches_and_plans_them():
    gib = int(G)
    c = counts(denoiser=gib // 16, full_trainable=gib // 16, lora=1000, text_encoders={"te": gib // 4}, vae=0,
               num_prompts=0, act_bytes=8 * gib, act_bytes_ckpt=gib // 8)
    s = mp.Settings(precision="no", train_batch_size=1)  # 1 GiB static + 0.25 x 4 text encoder + 8 GiB activations
    assert mp.total(mp.plan(c, s, mp.Engine())) / G == pytest.approx(10.0, abs=1e-6)
    names, s2, e2, nbytes = mp.fit(c, s, mp.Engine(), capacity_gib=4.0)
    assert names == ["gradient_checkpointing"] and s2.gradient_checkpointing and e2 == mp.Engine("ddp", 1)
    assert nbytes == mp.total(mp.plan(c, s2, e2)) and nbytes / G == pytest.approx(2.125)
    # 2 GiB: checkpointing alone leaves 2.125 > 1.8 usable; + the text encoders off the device fits
    assert mp.fit(c, s, mp.Engine(), capacity_gib=2.0)[0] == ["cache_embeddings", "gradient_checkpointing"]
    # a base too big for one device even under LoRA: FSDP2 over the fewest devices that make it fit
    big = counts(denoiser=gib // 2, full_trainable=gib // 2, lora=1000, text_encoders={}, vae=0, num_prompts=0,
                 act_bytes=0, act_bytes_ckpt=0)  # full: 8 GiB of state; LoRA: a 2 GiB fp32 base
    names, s2, e2, nbytes = mp.fit(big, s, mp.Engine(), capacity_gib=1.0)
    assert (names, e2) == (["fsdp2", "use_lora"], mp.Engine("fsdp2", 4))  # over 2: 1 GiB > 0.9 usable
    assert mp.describe(names, e2).startswith("FSDP2 over 4")
    assert mp.fit(counts(act_bytes=100 * gib, act_bytes_ckpt=100 * gib), s, mp.Engine(), 1.0) is None


def test_launch_engine_reads_accelerates_environment():
    env = {"WORLD_SIZE": "8", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    assert mp.launch_engine(env) == mp.Engine("fsdp2", 8)
    assert mp.launch_engine({"WORLD_SIZE": "4", "ACCELERATE_USE_DEEPSPEED": "true",
                             "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}) == mp.Engine("zero3", 4)
    assert mp.launch_engine({"WORLD_SIZE": "4", "ACCELERATE_USE_DEEPSPEED": "true"}) == mp.Engine("zero2", 4)
    assert mp.launch_engine({"WORLD_SIZE": "2"}) == mp.Engine("ddp", 2)
    assert mp.launch_engine({}) == mp.Engine("ddp", 1)
    assert mp.launch_engine({"WORLD_SIZE": "8", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
                             "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
                             "PARALLELISM_CONFIG_DP_SHARD_SIZE": "4"}) == mp.Engine("fsdp2", 4)


def test_fsdp2_plan_ignores_fsdp1s_sharding_strategy():
    """accelerate launch exports FSDP_SHARDING_STRATEGY for every FSDP launch (an FSDP1 YAML's
    fsdp_sharding_strategy, default FULL_SHARD), but FSDP2 does not read it, and scale.after_prepare makes every FSDP2
    group reshard after forward: an FSDP2 launch is full shard whatever that variable or FSDP_RESHARD_AFTER_FORWARD
    say. Planning NO_SHARD as DDP replicas would overstate the per-device bytes by the world size."""
    for extra in ({"FSDP_SHARDING_STRATEGY": "NO_SHARD"}, {"FSDP_SHARDING_STRATEGY": "SHARD_GRAD_OP"},
                  {"FSDP_SHARDING_STRATEGY": "2"}, {"FSDP_RESHARD_AFTER_FORWARD": "false"}):
        env = dict({"WORLD_SIZE": "8", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, **extra)
        assert mp.launch_engine(env) == mp.Engine("fsdp2", 8), extra


# ------------------------------------------------------------------------------------- weights counted once
def test_nograd_phase_counts_no_weight_by_hand():
    """A no-grad phase's working set holds activations only: two Linear(256, 256) layers (float32 parameters, as the
    meta builds hold them) on 4 rows under emulated bf16 autocast peak at 4 x 256 x 2 B x 2 = 4096 B (the input's
    bf16 cast and the first output, then the first output and the second); their bf16 weight casts (2 x 131 584 B)
    are the plan's static rows (a LoRA base already bf16, a full fine-tune's "autocast weight casts"), not counted
    a second time here (issue 61: FLUX.1-dev's 8-row sampling call counted its 22 GiB of weights again)."""
    from ddpo_grpo.trainer.checks.byte_meters import nograd_peak_bytes

    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
        x = torch.zeros(4, 256)
    assert nograd_peak_bytes(lambda: net(x), "bf16") == 4 * 256 * 2 * 2
    assert nograd_peak_bytes(lambda: net(x), "no") == 4 * 256 * 4 * 2  # float32: the two outputs


@pytest.mark.parametrize("name", ["flux_tiny", "wan_tiny"])
def test_phase_counts_are_a_traced_cpu_peak_and_hold_no_weights(name):
    """A tiny build's no-grad phases at its config's shapes: the float32 counts against the allocated peak that
    torch.profiler traces over the same calls of the real modules on this CPU (benchmarks.memory_table's
    traced_phases), within 10 % (the decode times its VAE kind's transient factor where that factor is this CPU's
    own: Wan's float32 3-D VAE, 1.13; an image VAE's count alone, its 1.38 is the H100's cuDNN). The bf16 counts hold
    no weight: at most the float32 ones, where the denoiser's (VAE's) bf16 weights counted again would break that."""
    from benchmarks.memory_table import traced_phases

    r = traced_phases(name)  # its counts: count_model(precision "no") of the config
    c16 = count_model(grpo.get_config(name), only_configured=True, precision="bf16")
    assert r["sampling_count"] == pytest.approx(r["sampling_traced"], rel=0.10)
    factor = mp.DECODE_TRANSIENTS["video3d"] if r["decode_kind"] == "video3d" else 1.0
    assert r["decode_count"] * factor == pytest.approx(r["decode_traced"], rel=0.10)
    assert r["decode_kind"] == c16.decode_kind == ("video3d" if name == "wan_tiny" else "image")
    # the bf16 sampling call holds no weight: at most the float32 count, where (tiny FLUX: weights heavier than one
    # call's working set, as the real one's) 2 bytes a denoiser parameter more would exceed it
    assert c16.sampling_bytes <= r["sampling_count"]
    if name == "flux_tiny":
        assert r["sampling_count"] < c16.sampling_bytes + 2 * c16.denoiser
    if c16.decode_kind == "video3d":  # decoded with autocast off, in its float32 (pipeline_with_logprob.decode)
        assert c16.decode_bytes == r["decode_count"]
    else:
        assert c16.decode_bytes <= r["decode_count"]


# ------------------------------------------------------------------------------------------ against real memory
@pytest.mark.parametrize("lora", [False, True])
def test_static_part_matches_real_modules_bytes(lora, request):
    """The plan's parameters + gradients + AdamW state against glibc's heap growth over building the 12.8 M-parameter
    UNet, (LoRA: its base in bf16, the adapters cast to fp32 as the trainer holds them) a backward and an AdamW step,
    within 15 %."""
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    if fresh_process(request):
        return
    used = heap_in_use()
    cfg = grpo.get_config("tiny")
    before = used()
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**mid_unet_config(8))
    n = sum(p.numel() for p in unet.parameters())
    if lora:
        unet.to(torch.bfloat16).requires_grad_(False)
        unet.add_adapter(LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_rank, init_lora_weights="gaussian",
                                    target_modules=["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"]))
        for p in unet.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    trainable = [p for p in unet.parameters() if p.requires_grad]
    n_lora = sum(p.numel() for p in trainable) if lora else 0
    for p in trainable:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(trainable, lr=1e-4)
    opt.step()
    measured = used() - before
    c = counts(denoiser=n, full_trainable=n, lora=n_lora, text_encoders={}, vae=0, num_prompts=0)
    s = mp.Settings(precision="bf16" if lora else "no", use_lora=lora, train_batch_size=0)
    planned = mp.total(mp.plan(c, s, mp.Engine()))
    assert planned == pytest.approx(measured, rel=0.15)
    assert planned == (2 * n + 16 * n_lora if lora else 16 * n)


def test_lora_activation_count_matches_the_memory_a_cpu_forward_keeps(request):
    """A LoRA run's activations per row (the slope between 1 and 2 rows, which cancels fixed costs) on the 12.8 M-
    parameter UNet at 16 x 16 latents, its base frozen and r8 adapters on the attention and resnet convolutions: the
    meta count with the adapters the only trainable parameters against glibc's heap growth over a real float32
    forward with grad, within 10 %; and below the all-trainable count (frozen layers keep less)."""
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    from ddpo_grpo.trainer.checks.byte_meters import activation_bytes

    if fresh_process(request):
        return
    used = heap_in_use()
    lora = LoraConfig(r=8, lora_alpha=8, init_lora_weights="gaussian",
                      target_modules=["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"])
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**mid_unet_config(16)).requires_grad_(False)
    unet.add_adapter(lora)
    with torch.device("meta"):
        meta = UNet2DConditionModel(**mid_unet_config(16))
    inputs = lambda rows, dev: (torch.randn(rows, 4, 16, 16).to(dev), torch.full((rows,), 500.0).to(dev),  # noqa
                                torch.randn(rows, 77, 64).to(dev))
    full = activation_bytes(meta, inputs(1, "meta"), False)
    meta.requires_grad_(False)
    meta.add_adapter(lora)
    est = [activation_bytes(meta, inputs(r, "meta"), False, all_trainable=False) for r in (1, 2)]
    assert est[0] < full

    def kept(rows):
        x, t, c = inputs(rows, "cpu")
        before = used()
        out = unet(x, t, encoder_hidden_states=c).sample
        nbytes = used() - before - out.numel() * out.element_size()
        del out
        return nbytes

    kept(1), kept(2)  # warm-up at each shape: oneDNN's primitive caches and the allocator's one-offs
    assert est[1] - est[0] == pytest.approx(kept(2) - kept(1), rel=0.10)


def test_meta_counts_are_the_real_modules_counts():
    """count_model on the meta device against the real tiny-t2i modules and a real LoRA of the config's rank."""
    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.models.base import inner_model
    from ddpo_grpo.trainer.run.build import make_trainable
    from ddpo_grpo.trainer.run.data import build_dataset

    cfg = grpo.get_config("tiny")
    got = count_model(cfg)
    pipe = load_pipeline("tiny-t2i", torch.float32, "cpu")
    numel = lambda m: sum(p.numel() for p in m.parameters()) if m is not None else 0  # noqa: E731
    n = numel(inner_model(pipe.unet))
    assert (got.denoiser, got.full_trainable, got.vae) == (n, n, numel(pipe.vae))
    assert got.text_encoders == {"text_encoder": numel(pipe.text_encoder)}
    assert got.condition_elems == pipe.encode([""])[0].numel()
    assert got.num_prompts == 1 + len(build_dataset(cfg, "train")) + len(build_dataset(cfg, "eval"))
    cfg.use_lora = True
    make_trainable(pipe.unet, cfg, pipe.adapter.lora_target_modules)
    assert got.lora == sum(p.numel() for p in pipe.unet.parameters() if p.requires_grad) > 0
    assert 0 < got.act_bytes_ckpt < got.act_bytes
    # LoRA saves less (frozen layers keep no input for a weight gradient); checkpointed, the adapters' own
    # intermediates in the recomputed block can outweigh that (tiny: 3.68 against 3.64 MB)
    assert 0 < got.act_bytes_lora < got.act_bytes and 0 < got.act_bytes_ckpt_lora < got.act_bytes_lora
    lean = count_model(grpo.get_config("tiny"), only_configured=True)  # a run without a verdict: no LoRA, no ckpt
    assert (lean.lora, lean.act_bytes_ckpt, lean.act_bytes, lean.denoiser) == (None, None, got.act_bytes, n)


# ---------------------------------------------------------------------------------------------- the dry run
def test_dry_run_prints_the_plan_for_the_launched_engine():
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", WANDB_MODE="offline", WORLD_SIZE="8",
               ACCELERATE_USE_FSDP="true", FSDP_VERSION="2")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train.py"), "--config",
                          os.path.join(ROOT, "config", "grpo.py") + ":tiny", "--config.dry_run=True",
                          "--config.device_memory_gb=0.01"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "memory plan per device: FSDP2 full shard over 8 process(es), precision no" in lines
    total = next(ln for ln in lines if ln.startswith("total per device: "))
    cfg = grpo.get_config("tiny")
    c = count_model(cfg)
    expected = mp.total(mp.plan(c, mp.settings_of(cfg, "no", c.trained_steps), mp.Engine("fsdp2", 8))) / G
    assert total == f"total per device: {expected:.2f} GiB"
    verdict = lines[lines.index(total) + 1]
    assert verdict.startswith("does not fit 0.0 GiB per device; ")


def test_meta_counts_of_a_recam_folder_with_its_checkpoint():
    """tiny-recam-video (a Wan folder + recammaster.ckpt): the camera layers counted without reading the checkpoint,
    equal to the real loaded model's, and a full fine-tune's trainable part is ReCamMaster's (adapter.full_trainable)."""
    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.models.base import inner_model
    from ddpo_grpo.models import recam_checkpoint_path

    cfg = grpo.get_config("recam_video_tiny")
    got = count_model(cfg, only_configured=True)
    pipe = load_pipeline(cfg.pretrained.model, torch.float32, "cpu", int(cfg.pretrained.resolution),
                         recam_checkpoint=recam_checkpoint_path(cfg))
    pipe.adapter.configure(pipe, cfg)  # the config's frames, as a run configures it
    named = list(inner_model(pipe.unet).named_parameters())
    frags = pipe.adapter.full_trainable
    assert got.denoiser == sum(p.numel() for _, p in named)
    assert got.full_trainable == sum(p.numel() for k, p in named if any(f in k for f in frags)) < got.denoiser
    assert got.sample_shape == tuple(pipe.sample_shape) and got.act_bytes > 0


@pytest.mark.parametrize("name", ["sdxl_tiny", "sd3_tiny", "flux_tiny", "wan_tiny", "recam_image_tiny"])
def test_meta_counts_of_each_family_are_its_real_modules(name):
    """A folder of each architecture counted from its config files on the meta device (meta_loading through the
    adapter's own load) against the real loaded components, and its training forward counted at its shapes."""
    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.models.base import inner_model

    cfg = grpo.get_config(name)
    got = count_model(cfg, only_configured=True)
    pipe = load_pipeline(cfg.pretrained.model, torch.float32, "cpu", int(cfg.pretrained.resolution))
    pipe.adapter.configure(pipe, cfg)
    numel = lambda m: sum(p.numel() for p in m.parameters()) if m is not None else 0  # noqa: E731
    encoders = {k: numel(m) for k, m in pipe.components.items() if k.startswith("text_encoder") and m is not None}
    assert got.denoiser == numel(inner_model(pipe.unet)) and got.vae == numel(pipe.vae)
    assert got.text_encoders == (encoders or ({"text_encoder": numel(pipe.text_encoder)} if pipe.text_encoder else {}))
    assert got.sample_shape == tuple(pipe.sample_shape)
    assert (got.act_bytes_ckpt if cfg.gradient_checkpointing else got.act_bytes) > 0


def test_settings_of_counts_the_runs_rows_and_copies():
    """settings_of against hand numbers for sd15_random_bench (train batch 8, sample batch 8, guidance 5, 20 steps,
    train.cfg on): 16 training rows with CFG, 8 without (train.cfg off, or guidance 1); timesteps_per_call = 0
    plans the auto probe's largest call, every trained step (20; 10 at timestep_fraction 0.5); reference copies."""
    cfg = grpo.get_config("sd15_random_bench")
    s = mp.settings_of(cfg, "bf16", 20)
    assert (s.train_batch_size, s.steps_per_call, s.train_cfg, s.train_rows, s.sample_rows) == (8, 1, 2, 16, 16)
    cfg.train.cfg = False
    assert mp.settings_of(cfg, "bf16", 20).train_rows == 8
    cfg.train.cfg, cfg.sample.guidance_scale = True, 1.0
    s = mp.settings_of(cfg, "bf16", 20)
    assert (s.train_rows, s.sample_rows) == (8, 8)
    cfg = grpo.get_config("sd15_random_bench")
    cfg.train.timesteps_per_call = 0
    assert mp.settings_of(cfg, "bf16", 20).train_rows == 8 * 20 * 2
    cfg.train.timestep_fraction = 0.5
    assert mp.settings_of(cfg, "bf16", 20).steps_per_call == 10
    cfg.train.timesteps_per_call = 4
    assert mp.settings_of(cfg, "bf16", 20).steps_per_call == 4
    assert mp.settings_of(cfg, "bf16", 20).reference_copies == 0
    cfg.train.beta = 0.01
    assert mp.settings_of(cfg, "bf16", 20).reference_copies == 1
    cfg.train.ema_decay = 0.95  # the eval EMA is one more copy
    assert mp.settings_of(cfg, "bf16", 20).reference_copies == 2


def test_host_memory_of_the_switches_by_hand():
    """What cache_embeddings / offload move off the device is held per process on the host: the cached embeddings
    in the denoiser's load dtype (LoRA bf16: 2 bytes; full: fp32), the parked text encoders and the VAE."""
    c = counts()
    assert mp.host(c, mp.Settings(precision="bf16")) == []
    got = dict(mp.host(c, mp.Settings(precision="bf16", use_lora=True, cache_embeddings=True)))
    assert got == {"prompt embeddings": 3 * 7 * 2, "text encoders": 100 * 2}
    got = dict(mp.host(c, mp.Settings(precision="bf16", cache_embeddings=True, offload=True)))
    assert got == {"prompt embeddings": 3 * 7 * 4, "text encoders": 100 * 2, "vae": 50 * 2}
    got = dict(mp.host(c, mp.Settings(precision="no", offload=True)))
    assert got == {"text encoders": 100 * 4, "vae": 50 * 4}

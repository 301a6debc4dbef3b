"""Config validation in isolation (trainer/run/validate.py): each mistake one ConfigError line before anything loads,
the SDE window settings, the named configs' geometry, and what a named config's settings make of the epoch."""
import pytest
import torch

from ddpo_grpo.errors import ConfigError
from helpers import named_config as _config


@pytest.mark.parametrize("edit,msg", [
    (lambda c: c.reward.fns.update({"nope": 1.0}), "unknown reward 'nope'"),
    (lambda c: setattr(c.sample, "k", 1), "at least 2 copies"),
    (lambda c: setattr(c.sample, "k", 5), "not divisible by sample.k=5"),
    (lambda c: setattr(c.sample, "eta", 0.0), "eta=0"),
    (lambda c: setattr(c.pretrained, "model", "/no/such/model"), "pretrained.model"),
    (lambda c: setattr(c.tracker, "std_mode", "median"), "tracker.std_mode"),
    (lambda c: setattr(c.reward, "per_step", "x1"), "reward.per_step"),
    (lambda c: setattr(c.eval, "split", "test"), "eval.split='test'"),
    (lambda c: setattr(c.data, "num_conditions", -1), "data.num_conditions=-1"),
    (lambda c: setattr(c.train, "objective", "dpo"), "train.objective='dpo'"),
    (lambda c: (setattr(c.train, "objective", "raft"), setattr(c.train, "beta", 0.01)), "set train.beta=0"),
    (lambda c: (setattr(c.train, "objective", "nft"), setattr(c.train, "nft_adv_scale", 0.0)), "nft_adv_scale=0.0"),
    (lambda c: (setattr(c.train, "objective", "nft"), setattr(c.train, "nft_old_decay", 1.0)), "nft_old_decay=1.0"),
    (lambda c: setattr(c.train, "nft_old_decay", 0.5), "needs train.objective='nft'"),
    (lambda c: setattr(c.train, "ema_decay", 1.0), r"train.ema_decay=1.0 must be in \[0, 1\)"),
    (lambda c: (setattr(c.train, "objective", "nft"), setattr(c.train, "nft_old_decay", 0.5),
                setattr(c.train, "ema_decay", 0.9)), "already an EMA of the policy"),
    (lambda c: (setattr(c.train, "ema_decay", 0.9), setattr(c.train, "ema_update_freq", 0)), "ema_update_freq=0"),
    (lambda c: setattr(c.eval, "also_policy", True), "eval.also_policy=True .* needs train.ema_decay > 0"),
    (lambda c: setattr(c.train, "target_shift_kl", -1e-3), "target_shift_kl=-0.001 must be >= 0"),
    (lambda c: (setattr(c.train, "objective", "nft"), setattr(c.train, "target_shift_kl", 1e-3)),
     "needs train.objective='grpo'"),
    (lambda c: setattr(c.train, "kl_steps", "some"), "train.kl_steps='some'"),
    (lambda c: setattr(c.train, "kl_steps", "all"), "needs train.beta > 0"),
    (lambda c: (setattr(c.train, "beta", 0.01), setattr(c.train, "kl_type", "k3"), setattr(c.train, "kl_steps", "all")),
     "kl_type='gaussian'"),
    (lambda c: setattr(c.train, "forward_noise_min", 1.0), "need 0 <= min < max <= 1"),
    (lambda c: setattr(c.eval, "pass_at_k", -1), "eval.pass_at_k=-1"),
    (lambda c: setattr(c.data, "objects", "triples"), "data.objects='triples'"),
    (lambda c: setattr(c.data, "kinds", "pan,tilt"), "needs data.name='room3d'"),
    (lambda c: (setattr(c.data, "name", "room3d"), setattr(c.data, "kinds", "pan,spin")),
     "data.kinds must name some of pan, tilt"),
    (lambda c: setattr(c, "mixed_precision", "fp8"), "mixed_precision='fp8'"),
    (lambda c: setattr(c.train, "lr_schedule", "cosine_with_restarts"), "train.lr_schedule='cosine_with_restarts'"),
    (lambda c: setattr(c.train, "lr_multipliers", "cam_encoder.:10"), "train.lr_multipliers: 'cam_encoder.:10'"),
    (lambda c: setattr(c.sample, "antithetic", True), "needs sample.shared_init_noise=True"),
    (lambda c: setattr(c.reward, "num_threads", -1), "reward.num_threads=-1"),
    (lambda c: setattr(c.train, "step_weight_power", float("nan")), "step_weight_power=nan must be a finite number"),
    (lambda c: setattr(c.train, "step_weight_power", -1.0), "step_weight_power=-1.0 must be a finite number >= 0"),
    (lambda c: (setattr(c.train, "objective", "nft"), setattr(c.train, "step_weight_power", 1.0)),
     "step_weight_power=1.0 weighs the clipped-ratio loss's steps: it needs train.objective='grpo'"),
    (lambda c: (setattr(c.sample, "antithetic", True), setattr(c.sample, "branch_steps", (0,)),
                setattr(c.sample, "branches", 2)), "cannot be combined with sample.antithetic"),
    (lambda c: setattr(c.train, "old_logprobs", "rescored"), "train.old_logprobs='rescored'; choose one of"),
    (lambda c: setattr(c.train, "old_logprobs_verify_every", -1), "train.old_logprobs_verify_every=-1 must be an integer"),
])
def test_config_validation_errors(edit, msg):
    from ddpo_grpo.trainer.run.validate import validate_config

    c = _config()
    edit(c)
    with pytest.raises(ConfigError, match=msg):
        validate_config(c, num_processes=1)


def _window(c, size, start=0, mode="fixed", sde_type="sde", steps=10):
    c.sample.sde_window_size, c.sample.sde_window_start, c.sample.sde_window_mode = size, start, mode
    c.sample.sde_type, c.sample.num_steps = sde_type, steps


@pytest.mark.parametrize("edit,msg", [
    (lambda c: setattr(c.sample, "sde_type", "ode"), r"sample.sde_type='ode'; choose one of \('sde', 'cps'\)"),
    (lambda c: setattr(c.sample, "sde_window_mode", "rolling"), "sample.sde_window_mode='rolling'; choose one of"),
    (lambda c: _window(c, 3, start=8), r"sde_window_start=8 \+ sample.sde_window_size=3 = 11 exceeds sample.num_steps=10"),
    (lambda c: _window(c, 3, start=-1), "sample.sde_window_start=-1 must be >= 0"),
    (lambda c: _window(c, 11), r"sample.sde_window_size=11 must be in \[0, num_steps=10\]"),
    # cps's last step has no noise (σ' = 0): deterministic, a window has 9 of the 10 steps
    (lambda c: _window(c, 3, start=7, sde_type="cps"), "= 10 exceeds the 9 stochastic steps"),
    (lambda c: _window(c, 10, mode="random", sde_type="cps"), "sample.sde_window_size=10 exceeds the 9 stochastic"),
    (lambda c: setattr(c.sample, "noise_pool", 0), r"sample.noise_pool=0 must be an int >= 1"),
    (lambda c: (setattr(c.sample, "noise_pool", 2), setattr(c.sample, "sde_type", "cps")),
     r"sample.noise_pool=2 is defined for sample.sde_type='sde', got 'cps'"),
])
def test_sde_settings_validation_errors(edit, msg):
    from ddpo_grpo.trainer.run.validate import validate_config

    c = _config("tiny_flow")
    edit(c)
    with pytest.raises(ConfigError, match=msg):
        validate_config(c, num_processes=1)


@pytest.mark.parametrize("size,start,mode,sde_type", [(0, 99, "fixed", "sde"), (3, 7, "fixed", "sde"),
                                                      (10, 0, "fixed", "sde"), (3, 6, "fixed", "cps"),
                                                      (9, 0, "sliding", "cps"), (4, 99, "random", "sde")])
def test_sde_windows_that_fit_validate_and_stay_inside(size, start, mode, sde_type):
    from ddpo_grpo.trainer.run.validate import validate_config
    from ddpo_grpo.trainer.epoch.sampling import sde_window, stochastic_steps

    c = _config("tiny_flow")
    _window(c, size, start, mode, sde_type)
    validate_config(c, num_processes=1)  # size 0 = no window: its start is not read
    for epoch in range(12):
        w = sde_window(c, epoch, "flow")
        assert w is None if size == 0 else (0 <= w[0] and w[0] + w[1] <= stochastic_steps(c, "flow"))


def test_a_ddim_window_ranges_over_every_step_whatever_sde_type_says():
    # DDIM has no CPS endpoint: its last step is stochastic, so a sliding window of 3 in 10 steps has 8 starts
    # (0..7) even when sample.sde_type is "cps" (a flow-only option that DDIM ignores); the flow CPS room is 9 steps.
    from ddpo_grpo.trainer.epoch.sampling import sde_window, stochastic_steps

    c, f = _config("tiny"), _config("tiny_flow")
    _window(c, 3, 0, "sliding", "cps")
    _window(f, 3, 0, "sliding", "cps")
    assert stochastic_steps(c, "ddim") == c.sample.num_steps == 10 and stochastic_steps(f, "flow") == 9
    assert sorted({sde_window(c, e, "ddim")[0] for e in range(16)}) == list(range(8))
    assert sorted({sde_window(f, e, "flow")[0] for e in range(16)}) == list(range(7))


def test_unknown_config_name_and_empty_prompt_file(tmp_path):
    from ddpo_grpo.trainer.run.validate import validate_config

    with pytest.raises(ValueError, match="unknown config name 'nope'"):
        _config("nope")
    c = _config()
    c.data.name = "prompt_file"
    c.data.path = str(tmp_path / "prompts.txt")
    (tmp_path / "prompts.txt").write_text("\n\n")
    with pytest.raises(ConfigError, match="is empty"):
        validate_config(c, num_processes=1)


def test_recam_geometry_validates_for_8_processes():
    from ddpo_grpo.trainer.run.data import KRepeatSampler

    c = _config("recam")
    s = KRepeatSampler(10**6, c.sample.batch_size, c.sample.num_batches_per_epoch, 8, c.sample.k, c.seed)
    assert s.num_conditions * c.sample.k == 64 and s.num_conditions == 16


def test_too_few_conditions_for_the_geometry_fails_in_validation():
    """recam_image_tiny keeps 8 conditions; 2 processes x 8 x 16 = 256 samples need 16 distinct ones at k=16. That must
    fail in validate_config (before any model is loaded), naming the knobs; 1 process (8 conditions) passes."""
    from ddpo_grpo.trainer.run.validate import validate_config

    c = _config("recam_image_tiny")
    assert validate_config(c, num_processes=1) == "ddim"
    with pytest.raises(ConfigError, match="needs 16 distinct conditions but the dataset has 8; .*data.num_conditions"):
        validate_config(c, num_processes=2)
    c.data.num_conditions = 16
    validate_config(c, num_processes=2)


@pytest.mark.parametrize("name", ["tiny", "tiny_colour", "tiny_colour_nft", "tiny_colour_grpo", "ddpo", "tiny_per_step",
                                  "tiny_raft", "tiny_nft", "tiny_kl", "tiny_flow", "tiny_flow_window", "recam_image_tiny", "recam", "recam_video_tiny", "tiny_hack",
                                  "tiny_colour_branch", "tiny_branch"])
def test_named_configs_validate(name):
    from ddpo_grpo.trainer.run.validate import validate_config

    validate_config(_config(name), 1)  # raises ConfigError on a broken named config


def test_tiny_colour_grpo_makes_one_step_per_epoch_on_the_conditioning_pathway():
    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.trainer.epoch.update import training_calls
    from ddpo_grpo.trainer.run.build import trainable_modules

    c = _config("tiny_colour_grpo")
    n = c.sample.batch_size * c.sample.num_batches_per_epoch
    calls, per_mb = training_calls(n, 10, c, epoch=0, inner=0, rank=0, per_call=1, columns=torch.tensor([0, 1]))
    assert n == 128 and n // c.sample.k == 16
    assert len(calls) == c.train.gradient_accumulation_steps * per_mb  # every call of the epoch in one step
    assert c.train.beta == 0.04 and c.train.reference_model_mixup_alpha == 1.0  # KL to the frozen start model
    # the text-conditioning pathway of the recipe's model: cross-attention and the pooled-text embedding, 87,040 of
    # 1,433,955 weights (a renamed module would train nothing and stop the build; a broader fragment, more)
    pipe = load_pipeline(c.pretrained.model)
    frags = trainable_modules(c, pipe.adapter)[1]
    chosen = {n: p.numel() for n, p in pipe.unet.named_parameters() if any(f in n for f in frags)}
    assert sum(chosen.values()) == 87_040
    assert {n.split(".")[0] for n in chosen} == {"add_embedding", "down_blocks", "mid_block", "up_blocks"}
    assert all(n.startswith("add_embedding.") or ".attn2." in n for n in chosen)


def _trainable(**over):
    from ml_collections import ConfigDict

    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.trainer.run.build import make_trainable

    pipe = load_pipeline("tiny-t2i")
    cfg = ConfigDict(dict(use_lora=False, lora_rank=2, train=dict(
        learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_weight_decay=0.0, adam_epsilon=1e-8)))
    cfg.update(over.pop("cfg", {}))
    opt = make_trainable(pipe.unet, cfg, **over)
    return pipe.unet, opt


def test_trainable_modules_train_exactly_the_named_parameters_and_a_name_that_matches_nothing_is_one_line():
    """train.trainable_modules reaches make_trainable as the full fine-tune's fragments (build.build_context): the
    optimizer holds exactly the parameters whose names hold a fragment; a fragment naming no parameter, or a LoRA target
    naming no module, is a ConfigError naming them, not an optimizer over nothing or peft's trace."""
    unet, opt = _trainable(full_trainable=("attn1.to_q",))
    named = {n for n, p in unet.named_parameters() if p.requires_grad}
    expected = {n for n, _ in unet.named_parameters() if "attn1.to_q" in n}
    assert named == expected and 0 < len(expected) < len(list(unet.parameters()))
    assert sum(len(g["params"]) for g in opt.param_groups) == len(expected)
    with pytest.raises(ConfigError, match="no_such_layer"):
        _trainable(full_trainable=("no_such_layer",))
    with pytest.raises(ConfigError, match="no_such_layer"):
        _trainable(cfg=dict(use_lora=True), target_modules=("no_such_layer",))


def test_lr_multipliers_give_the_named_parameters_their_multiple_of_the_lr_and_it_survives_the_shift_scaling():
    """train.lr_multipliers: each trainable parameter is in exactly one AdamW group; those whose names hold a fragment
    have lr * its multiplier (the first fragment that matches), the rest lr; scaling every group's lr alike (as
    target_shift_kl does) keeps the ratio; a malformed entry or a fragment matching no trainable parameter is one line."""
    unet, opt = _trainable(cfg=dict(train=dict(lr_multipliers="attn1.to_q=10, attn1.=3")))
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    names = dict(unet.named_parameters())
    assert len(lr_of) == sum(len(g["params"]) for g in opt.param_groups) == len(names)
    for n, p in names.items():
        want = 1e-2 if "attn1.to_q" in n else 3e-3 if "attn1." in n else 1e-3
        assert lr_of[id(p)] == pytest.approx(want, rel=1e-12), n
    assert {round(g["lr"] / 1e-3, 9) for g in opt.param_groups} == {1.0, 10.0, 3.0}
    for g in opt.param_groups:
        g["lr"] *= 0.25
    assert sorted(round(g["lr"] / 2.5e-4, 9) for g in opt.param_groups) == [1.0, 3.0, 10.0]
    _, plain = _trainable()
    assert len(plain.param_groups) == 1 and plain.param_groups[0]["lr"] == 1e-3
    for bad, word in (("attn1.=x", "attn1.=x"), ("attn1.", "attn1."), ("=2", "=2"), ("attn1.=0", "attn1.=0"),
                      ("no_such_layer=2", "no_such_layer")):
        with pytest.raises(ConfigError, match=word.replace(".", r"\.")):
            _trainable(cfg=dict(train=dict(lr_multipliers=bad)))


def test_the_config_s_trainable_modules_reach_the_run_s_optimizer(tmp_path):
    """config.trainable_modules through build_context (the trainer's own build): the run's optimizer holds exactly the
    named parameters; empty keeps the architecture's set (every parameter of the tiny UNet)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from ddpo_grpo.trainer.run.build import build_context

    counts = {}
    for chosen in ((), ("attn1.to_q",)):
        config = _config("tiny")
        config.logging.wandb = config.logging.tensorboard = False
        config.trainable_modules = chosen
        AcceleratorState._reset_state(reset_partial_state=True)
        acc = Accelerator(cpu=True, mixed_precision="no")
        ctx = build_context(config, acc, str(tmp_path / f"run{len(counts)}"))
        try:
            named = list(acc.unwrap_model(ctx.unet).named_parameters())
            trained = {n for n, p in named if p.requires_grad}
            in_opt = {id(p) for g in ctx.optimizer.param_groups for p in g["params"]}
            assert in_opt == {id(p) for n, p in named if p.requires_grad}
            counts[chosen] = (len(trained), len(named))
            if chosen:
                assert trained == {n for n, _ in named if "attn1.to_q" in n}
        finally:
            ctx.rewards.shutdown()
            AcceleratorState._reset_state(reset_partial_state=True)
    assert counts[()][0] == counts[()][1] and 0 < counts[("attn1.to_q",)][0] < counts[()][0]


def test_rewards_in_the_sampling_thread_with_num_threads_0(tmp_path):
    """reward.num_threads = 0: no pool; every batch's reward is computed when it is submitted (its Future is done
    before the next batch samples), and the epoch's rewards are all there."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from ddpo_grpo.rewards import collect_rewards
    from ddpo_grpo.trainer.epoch.sampling import sample_epoch
    from ddpo_grpo.trainer.run.build import build_context

    config = _config("tiny")
    config.logging.wandb = config.logging.tensorboard = False
    config.reward.num_threads = 0
    config.sample.num_batches_per_epoch = 2
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=True, mixed_precision="no")
    ctx = build_context(config, acc, str(tmp_path))
    try:
        assert ctx.rewards.executor is None
        samples = sample_epoch(ctx, 0)
        assert len(samples.reward_futures) == 2 and all(f.done() for f in samples.reward_futures)
        rewards = collect_rewards(samples.reward_futures, acc)
        assert rewards.avg.shape[0] == 2 * config.sample.batch_size
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_the_memory_plan_counts_what_trainable_modules_trains():
    """The plan's trainable parameters (checks.meta_counts, through build.trainable_modules like the run's build): a
    full fine-tune of ("attn1.to_q",) counts exactly those weights of the tiny UNet; LoRA on them counts rank x
    (in + out) per to_q layer, fewer than on the architecture's own targets."""
    from ddpo_grpo.models import load_pipeline
    from ddpo_grpo.trainer.checks.meta_counts import count_model

    config = _config("tiny")
    unet = load_pipeline(config.pretrained.model).unet
    to_q = [m for n, m in unet.named_modules() if n.endswith("attn1.to_q")]
    default = count_model(config, only_configured=False)
    config.trainable_modules = ("attn1.to_q",)
    chosen = count_model(config, only_configured=False)
    assert default.full_trainable == sum(p.numel() for p in unet.parameters())
    assert chosen.full_trainable == sum(p.numel() for m in to_q for p in m.parameters())
    assert chosen.lora == sum(config.lora_rank * (m.in_features + m.out_features) for m in to_q) < default.lora


def test_noise_pool_is_a_flow_option_and_reaches_the_sampler():
    """sample.noise_pool: a DDIM config with it is one ConfigError line; a flow config validates and its sampler
    settings carry it (what the sampling and the re-scoring steps read)."""
    from ddpo_grpo.trainer.epoch.sampling import sampler_settings
    from ddpo_grpo.trainer.run.validate import validate_config

    c = _config("tiny")
    c.sample.noise_pool = 2
    with pytest.raises(ConfigError, match="sample.noise_pool=2: low-frequency step noise is a flow SDE option"):
        validate_config(c, num_processes=1)
    f = _config("tiny_flow")
    f.sample.noise_pool = 2
    validate_config(f, num_processes=1)
    assert sampler_settings(f, "flow").noise_pool == 2 and sampler_settings(_config("tiny_flow"), "flow").noise_pool == 1

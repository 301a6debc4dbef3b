"""Scale-out: the accelerate configs in config/accelerate/ as accelerate reads them, their FSDP wrap classes on the
bundled and an SD-shaped UNet, the engine guards, and the trainer under FSDP2 on 2 CPU processes (gloo) against
DDP on the same seeds, with exact resume from a sharded checkpoint.

accelerate 1.15 runs FSDP only on GPU-like process groups (the trainer refuses an FSDP launch it ran as DDP);
tests/fsdp_cpu_train.py patches accelerate to keep it on for CPU (tests only), so torch's fully_shard really shards
the UNet over gloo here."""
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DistributedType
from accelerate.utils.dataclasses import get_module_class_from_name
from accelerate.utils.launch import prepare_multi_gpu_env
from helpers import cpu_env, launch_cmd

from ddpo_grpo.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "config", "accelerate", "*.yaml")))
EXPECTED = {"ddp.yaml", "npu8.yaml", "ddp_multinode.yaml", "fsdp2.yaml", "fsdp2_hybrid.yaml", "deepspeed_zero2.yaml",
            "deepspeed_zero3.yaml"}


def test_every_expected_config_is_there():
    assert {os.path.basename(c) for c in CONFIGS} == EXPECTED


def _launch_args(path):
    """accelerate launch's own parsing of a config file (what `accelerate launch --config_file path x.py` sees)."""
    args = launch_command_parser().parse_args(["--config_file", path, "x.py"])
    args, defaults, _ = _validate_launch_command(args)
    return args, defaults


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_config_is_read_by_accelerate(path):
    cfg = load_config_from_file(path)
    assert cfg.compute_environment.value == "LOCAL_MACHINE"
    assert cfg.mixed_precision == "bf16" and cfg.num_processes >= 1 and cfg.num_machines >= 1
    assert cfg.num_processes % cfg.num_machines == 0
    if cfg.num_machines > 1:
        assert cfg.main_process_ip and cfg.main_process_port and cfg.rdzv_backend == "static"
    if cfg.distributed_type == DistributedType.FSDP:
        f = cfg.fsdp_config
        assert f["fsdp_version"] == 2 and f["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
        assert f["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        args, _ = _launch_args(path)
        env = prepare_multi_gpu_env(args)  # the environment accelerate launch hands the trainer
        assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
        assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == f["fsdp_transformer_layer_cls_to_wrap"]
        assert env["FSDP_STATE_DICT_TYPE"] == "SHARDED_STATE_DICT"
        if cfg.parallelism_config:  # hybrid: replicate x shard must cover every process
            p = cfg.parallelism_config
            assert p["parallelism_config_dp_replicate_size"] == cfg.num_machines
            assert p["parallelism_config_dp_replicate_size"] * p["parallelism_config_dp_shard_size"] == cfg.num_processes
            assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
    elif cfg.distributed_type == DistributedType.DEEPSPEED:
        d = cfg.deepspeed_config
        assert d["zero_stage"] == (2 if "zero2" in path else 3) and d["gradient_clipping"] == 1.0
        args, _ = _launch_args(path)
        assert args.use_deepspeed and args.zero_stage == d["zero_stage"]
    else:
        assert cfg.distributed_type in (DistributedType.MULTI_GPU, DistributedType.MULTI_NPU)


def _wrap_names():
    names = {load_config_from_file(p).fsdp_config["fsdp_transformer_layer_cls_to_wrap"] for p in CONFIGS
             if load_config_from_file(p).distributed_type == DistributedType.FSDP}
    assert len(names) == 1
    return names.pop().split(",")


def _sd_shaped_unet():
    """SD 1.5's UNet layout (block types, layers_per_block=2, cross-attention) at a test size."""
    from diffusers import UNet2DConditionModel

    from ddpo_grpo.models.sd15_random import sd15_unet_config

    cfg = sd15_unet_config(8)
    cfg.update(block_out_channels=(32, 32, 64, 64), cross_attention_dim=32, norm_num_groups=8)
    return UNet2DConditionModel(**cfg)


@pytest.mark.parametrize("model", ["tiny-t2i", "tiny-flow", "tiny-recam", "sd-shaped"])
def test_wrap_classes_exist_in_the_models(model):
    """accelerate stops with 'Could not find the transformer layer class' for a name missing from the model."""
    from ddpo_grpo.models import load_pipeline

    unet = _sd_shaped_unet() if model == "sd-shaped" else load_pipeline(model).unet
    names = _wrap_names()  # once: it reads every config file (calling it per module took ~20 s on the SD layout)
    for name in names:
        cls = get_module_class_from_name(unet, name)
        assert cls is not None, f"{name} not in {model}"
        assert sum(isinstance(m, cls) for m in unet.modules()) >= 1
    # wrapped blocks hold most of the weights: the root keeps only conv_in/out, time embedding and norms
    blocks = [m for m in unet.modules() if type(m).__name__ in names]
    inside = sum(p.numel() for b in blocks for p in b.parameters())
    assert inside / sum(p.numel() for p in unet.parameters()) > 0.7


def _cfg(**train):

    from helpers import grpo_configs

    mod = grpo_configs()
    cfg = mod.tiny()
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def test_engine_guards(monkeypatch):
    from ddpo_grpo.trainer.run.validate import validate_config
    from ddpo_grpo.trainer.run.scale import backward_calls_per_step, check_engine, engine

    for k in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "FSDP_VERSION", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):
        monkeypatch.delenv(k, raising=False)
    assert engine() == "ddp"
    check_engine(_cfg(beta=0.05))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="FSDP1"):
        validate_config(_cfg(), 2)  # through the trainer's own validation
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert engine() == "fsdp2"
    check_engine(_cfg(beta=0.05))  # the EMA reference works on DTensor shards
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ConfigError, match="train.beta=0.05 with DeepSpeed"):
        check_engine(_cfg(beta=0.05))
    with pytest.raises(ConfigError, match="timesteps_per_call > 0"):
        check_engine(_cfg(timesteps_per_call=0, min_step_std=0.0))
    cfg = _cfg(timesteps_per_call=2, min_step_std=0.0, gradient_accumulation_steps=3)
    want = backward_calls_per_step(cfg)
    assert want == 3 * 5  # 10 steps, 2 per call
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    with pytest.raises(ConfigError, match=f"set gradient_accumulation_steps: {want}"):
        check_engine(cfg)
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", str(want))
    check_engine(cfg)
    # branched sampling: one call per micro-batch whatever timesteps_per_call / min_step_std say
    tree = _cfg(timesteps_per_call=0, min_step_std=0.3, gradient_accumulation_steps=3)
    tree.sample.branch_steps = (0, 1)
    assert backward_calls_per_step(tree) == 3


def test_deepspeed_launch_with_reference_is_refused_at_start(tmp_path):
    """DeepSpeed is not installed here: the trainer's start-up checks under the environment a ZeRO launch sets."""
    base = [sys.executable, "scripts/train.py", "--config", "config/grpo.py:tiny", "--config.dry_run=True",
            "--config.train.min_step_std=0", "--config.train.timesteps_per_call=5"]  # before any model loads
    env = cpu_env(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="3",
                  ACCELERATE_GRADIENT_ACCUMULATION_STEPS="2")
    p = subprocess.run(base + ["--config.train.beta=0.05"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2 and "train.beta=0.05 with DeepSpeed" in p.stderr.strip().splitlines()[-1]
    assert "Traceback" not in p.stderr  # accepted combinations: test_engine_guards, in process


def test_fsdp2_single_process_step_matches_plain(tmp_path):
    """One process, world size 1: fully_shard's step equals the plain module's; the EMA swap on DTensors and a
    full state-dict round trip are exact."""
    code = r'''
import os, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
import sys; sys.path.insert(0, "tests")
from helpers import tiny_unet
from ddpo_grpo.core.reference import EMAReference
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:%d" % (29900 + os.getpid() % 97))
plain, sharded = tiny_unet(), tiny_unet()
for m in sharded.modules():
    if type(m).__name__ in ("BasicTransformerBlock", "ResnetBlock2D"):
        fully_shard(m)
fully_shard(sharded, reshard_after_forward=True)
x, t, e = torch.randn(2, 3, 8, 8), torch.tensor([10, 500]), torch.randn(2, 4, 8)
ref = EMAReference(sharded.train(), alpha=0.5)
plain.train()
opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, sharded)]
for _ in range(2):
    for m, o in zip((plain, sharded), opts):
        m(x, t, e).sample.square().mean().backward(); o.step(); o.zero_grad()
    ref.step()
diff = max((p.full_tensor() - q).abs().max().item() for p, q in zip(sharded.parameters(), plain.parameters()))
assert diff < 1e-5, diff
before = {n: p.full_tensor().clone() for n, p in sharded.named_parameters()}
with ref.swapped():
    out_ref = sharded(x, t, e).sample
after = {n: p.full_tensor() for n, p in sharded.named_parameters()}
assert all(torch.equal(before[n], after[n]) for n in before)
state = ref.state_dict()
assert all(type(v) is torch.Tensor for v in state["tensors"].values())
ref2 = EMAReference(sharded, alpha=0.5); ref2.load_state_dict(state)
assert all(torch.equal(ref2.tensors[n].full_tensor(), ref.tensors[n].full_tensor()) for n in state["tensors"])
full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))
assert full.keys() == plain.state_dict().keys()
assert all(torch.equal(full[n], p.full_tensor()) for n, p in sharded.named_parameters())
other = tiny_unet(seed=1)
fully_shard(other)
set_model_state_dict(other, full, options=StateDictOptions(full_state_dict=True))
assert all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(other.parameters(), sharded.parameters()))
print("OK", diff, tuple(out_ref.shape))
'''
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cpu_env(PYTHONPATH=ROOT), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]


# --- the trainer, 2 processes: FSDP2 (sharded) vs DDP on the same seeds, and exact resume under FSDP2 ---

SMALL = ["--config.sample.num_steps=4", "--config.sample.batch_size=4", "--config.sample.num_batches_per_epoch=2",
         "--config.sample.k=4", "--config.train.batch_size=4", "--config.eval_freq=0", "--config.logging.wandb=False",
         "--config.logging.image_freq=0", "--config.logging.debug_dump=True", "--config.train.timestep_fraction=1.0",
         # the EMA reference (swapped into the sharded parameters) and a warmup the resume must restore
         "--config.train.beta=0.05", "--config.train.reference_model_mixup_alpha=0.5", "--config.save_freq=1",
         "--config.train.lr_warmup_steps=5"]


def _run(tmp, name, epochs, fsdp, extra=()):
    if fsdp:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "config/accelerate/fsdp2.yaml",
               "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(29700 + os.getpid() % 1000), "tests/fsdp_cpu_train.py"]
    else:
        cmd = [*launch_cmd(2, 29400), "scripts/train.py"]
    cmd += ["--config", "config/grpo.py:tiny", f"--config.num_epochs={epochs}", f"--config.logdir={tmp}",
            f"--config.run_name={name}", *SMALL, *extra]
    p = subprocess.run(cmd, cwd=ROOT, env=cpu_env(PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-4000:]
    return p.stdout + p.stderr


def _dumps(run_dir, epoch):
    return [json.load(open(f)) for f in sorted(glob.glob(os.path.join(run_dir, "debug", f"epoch_{epoch:04d}_rank_*.json")))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scale")
    _run(tmp, "ddp", 2, fsdp=False)
    _run(tmp, "fsdp", 2, fsdp=True)  # uninterrupted; it also leaves the sharded checkpoint of epoch 0 to resume from
    # Epoch 1 again, resumed from that checkpoint into a run of its own: it must repeat "fsdp"'s epoch 1 exactly.
    # (A separate 1-epoch run to make the checkpoint would only repeat "fsdp"'s epoch 0, a launch for no check.)
    ckpt = tmp / "fsdp" / "checkpoints" / "checkpoint_00001"
    out = _run(tmp, "fsdp_resumed", 2, fsdp=True, extra=[f"--config.resume_from={ckpt}"])
    assert f"resumed from {ckpt} at epoch 1" in out
    return tmp


def test_fsdp2_two_processes_match_ddp(runs):
    ckpt = runs / "fsdp" / "checkpoints" / "checkpoint_00002"
    assert (ckpt / "pytorch_model_fsdp_0").is_dir() and not (ckpt / "model.safetensors").exists()  # really sharded
    assert (runs / "ddp" / "checkpoints" / "checkpoint_00002" / "model.safetensors").exists()
    for epoch in (0, 1):
        f, d = _dumps(runs / "fsdp", epoch), _dumps(runs / "ddp", epoch)
        assert len(f) == len(d) == 2
        for a, b in zip(f, d):
            for key in ("keys", "rewards", "advantages", "keys_all", "rewards_all", "advantages_all"):
                assert a[key] == b[key], (epoch, a["rank"], key)
            _, counts = np.unique(a["keys_all"], return_counts=True)
            assert (counts == 4).all()  # exact k per condition
            # the update: same weights to float tolerance (sharded reductions sum in another order)
            np.testing.assert_allclose(a["weights_sum"], b["weights_sum"], rtol=1e-9)
            np.testing.assert_allclose(a["weights_abs_sum"], b["weights_abs_sum"], rtol=1e-9)
        assert f[0]["weights_sum"] == f[1]["weights_sum"]  # whole-model checksum, identical on both ranks


def test_fsdp2_resume_is_exact(runs):
    assert (runs / "fsdp" / "checkpoints" / "checkpoint_00001" / "custom_checkpoint_2.pkl").exists()  # EMA
    assert not _dumps(runs / "fsdp_resumed", 0)  # epoch 0 came from the checkpoint, not rerun
    resumed = _dumps(runs / "fsdp_resumed", 1)
    assert len(resumed) == 2 and resumed == _dumps(runs / "fsdp", 1)  # rewards, advantages, weights, both ranks
    assert (runs / "fsdp_resumed" / "checkpoints" / "checkpoint_00002" / "pytorch_model_fsdp_0").is_dir()

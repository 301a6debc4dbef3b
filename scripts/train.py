"""ddpo_grpo trainer: one script for every model and config.

    accelerate launch scripts/train.py --config config/grpo.py:tiny [--config.train.beta=0.01 ...]

config -> build -> epoch loop: sample, rewards, advantages, verify, train, log, eval, checkpoint.
"""
import datetime
import os
import sys
import time

os.environ.setdefault("WANDB_MODE", "offline")  # runs need no account or network unless the user says so
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", "config/grpo.py:tiny", "Training configuration (file:NAME).")


def main(_):
    from ddpo_grpo.errors import ConfigError, InvalidRewardError, VerificationError
    from ddpo_grpo.rewards import RewardError
    from ddpo_grpo.trainer.run.devices import lost_peer_line

    try:
        run(FLAGS.config)
    except (ConfigError, RewardError, VerificationError, InvalidRewardError) as e:
        sys.stderr.write(f"error: {e}\n")  # one write: processes stopping together do not splice their lines
        sys.stderr.flush()
        sys.exit(2)
    except Exception as e:  # a peer died or hung: one line, and no wait on it at exit
        line = lost_peer_line(e, FLAGS.config, int(os.environ.get("WORLD_SIZE", "1")))
        if line is None:
            raise
        sys.stdout.flush()
        sys.stderr.write(f"error: {line}\n")
        sys.stderr.flush()
        os._exit(1)  # not sys.exit: interpreter teardown would destroy the process group, waiting on the lost peer


def run(config):
    import torch
    from accelerate import Accelerator, PartialState
    from accelerate.utils import ProjectConfiguration, set_seed

    from ddpo_grpo.trainer.run import devices
    from ddpo_grpo.trainer.epoch.advantages import compute_advantages
    from ddpo_grpo.trainer.run.build import build_context
    from ddpo_grpo.trainer.run.validate import validate_config
    from ddpo_grpo.trainer.run.scale import check_engine_applied, use_architecture_blocks
    from ddpo_grpo.trainer.run.checkpointing import check_resume, export_run, load_checkpoint, save_checkpoint
    from ddpo_grpo.trainer.run.run_identity import agree_run
    from ddpo_grpo.trainer.checks.hacking import train_gold
    from ddpo_grpo.trainer.checks.memory_plan import print_plan
    from ddpo_grpo.trainer.run.reporting import PhaseTimer, evaluate_and_log, finish, log_epoch
    from ddpo_grpo.rewards import collect_rewards
    from ddpo_grpo.trainer.epoch.sampling import sample_epoch
    from ddpo_grpo.trainer.epoch.training import train_epoch
    from ddpo_grpo.trainer.checks.verification import verify_groups

    device = devices.setup()
    devices.check_launch(config, device)  # lone process of an N-process launch, mesh size; CPU runs fp32 unless bf16
    num_processes = int(os.environ.get("WORLD_SIZE", "1"))
    family = validate_config(config, num_processes)  # one clear line before any heavy work
    use_architecture_blocks(config)  # FSDP2 wraps the model's own blocks (its adapter's), whatever the YAML lists
    # A missing or damaged checkpoint is one line here, before any tracker or model starts.
    ckpt = check_resume(config, family) if config.resume_from else ""
    print_plan(config)  # memory per device for this launch's engine, and what would make it fit (memory_plan.py)
    if config.dry_run:
        print(f"config OK: {num_processes} processes x {config.sample.batch_size} x {config.sample.num_batches_per_epoch}"
              f" = {num_processes * config.sample.batch_size * config.sample.num_batches_per_epoch} samples/epoch, "
              f"k={config.sample.k}, model family {family}; dry run, stopping before loading models")
        return
    # After the dry run (which checks a launch meant for other machines): more GPU/NPU processes than devices
    # here would die inside NCCL/HCCL with an opaque trace; one line instead.
    devices.check_process_count(device, devices.local_process_count(), devices.visible_accelerators(device))
    trackers = [t for t, on in (("wandb", config.logging.wandb), ("tensorboard", config.logging.tensorboard)) if on]
    # cpu=True (no GPU/NPU, or ACCELERATE_USE_CPU) is what makes accelerate form a gloo group across CPU processes.
    # The process group forms first (gloo/NCCL/HCCL, config.collective_timeout_s): rank 0 names the run (run_name, a
    # resumed checkpoint's run folder, or <config>_<time>) for every machine; each finds its folder, shared or its own
    # (then each machine keeps its own checkpoints), and the newest checkpoint all hold, before anything is written.
    place = agree_run(PartialState(cpu=device == "cpu", timeout=devices.collective_timeout(config)), config, ckpt,
                      f"{config_name()}_{datetime.datetime.now():%Y%m%d_%H%M%S}", family)
    run_dir, ckpt = place.dir, place.ckpt
    accelerator = Accelerator(cpu=device == "cpu", mixed_precision=config.mixed_precision or None, log_with=trackers or None,
                              project_config=ProjectConfiguration(project_dir=run_dir, logging_dir=run_dir,
                                                                  save_on_each_node=not place.shared))
    check_engine_applied(accelerator)  # an FSDP launch that accelerate ran as DDP (CPU processes): one line
    torch.backends.cuda.matmul.allow_tf32 = config.allow_tf32
    devices.apply_cpu_settings(config, device)
    set_seed(config.seed, device_specific=True)
    if accelerator.is_main_process:
        accelerator.init_trackers(config.logging.wandb_project, config=flat_config(config),
                                  init_kwargs={"wandb": {"name": os.path.basename(run_dir), "dir": run_dir,
                                                         "id": place.wandb_id, "resume": "allow"}})
    ctx = build_context(config, accelerator, run_dir)
    if ckpt:
        load_checkpoint(ctx, ckpt)
        accelerator.print(f"resumed from {ckpt} at epoch {ctx.state.epoch}")
    t_start = time.time()
    for epoch in range(ctx.state.epoch, config.num_epochs):
        timer = PhaseTimer(accelerator.unwrap_model(ctx.unet))  # seconds and denoiser evaluations per phase
        ctx.stat_tracker.clear()
        eval_metrics = {}
        if config.eval_freq and epoch % config.eval_freq == 0:
            with timer("eval"):
                eval_metrics = evaluate_and_log(ctx, epoch)  # 7. the policy before this epoch's update
            if ctx.stop:  # train.hacking_guard = "stop" and an alarm fired: checkpoint this policy and end cleanly
                accelerator.print(f"epoch {epoch}: {ctx.stop}; saving a checkpoint and stopping")
                save_checkpoint(ctx, family)
                break
        with timer("sampling"):
            samples = sample_epoch(ctx, epoch)  # 1. trajectories + logprobs; rewards start in a thread pool
        with timer("reward"):
            rewards = collect_rewards(samples.reward_futures, accelerator)  # 2. weighted `avg` (B,) or (B, T), details, validity
        with timer("gold"):
            gold_metrics = train_gold(ctx, samples)  # reward.gold on a subsample: logged, never in the advantages
        with timer("advantages"):
            adv = compute_advantages(accelerator, ctx.stat_tracker, samples.keys, torch.from_numpy(rewards.avg),
                                     torch.from_numpy(rewards.valid), config.train.max_invalid_fraction, ctx.tree)  # 3.
        with timer("verification"):
            checks, table = verify_groups(adv.keys_all, adv.advantages_all, adv.mask_all, adv.rewards_all,
                                          config.sample.k, ctx.stat_tracker, ctx.tree, adv.cell_mask_all)
            accelerator.print(f"epoch {epoch}: " + table)  # 4. exact k per condition, group mean 0 / std 1
        with timer("training"):
            train_metrics = train_epoch(ctx, samples, adv, epoch)  # 5. clipped-ratio GRPO (+ KL, + sup)
        ctx.state.epoch = epoch + 1
        with timer("logging"):
            log_epoch(ctx, epoch, samples, rewards, adv, checks, train_metrics, eval_metrics, timer, gold_metrics)  # 6.
        timer.close()
        if config.save_freq and (ctx.state.epoch % config.save_freq == 0 or ctx.state.epoch == config.num_epochs):
            with timer("checkpoint"):
                save_checkpoint(ctx, family)  # 8. atomic; every process takes part; with export/ for diffusers
    export_run(ctx, family)  # 9. logs/<run>/export: the model in diffusers' formats (models/export.py)
    finish(ctx, time.time() - t_start, final_eval=bool(config.eval_freq) and not ctx.stop)  # + eval of the final policy


def flat_config(config) -> dict:
    """Dotted keys and scalar values: what TensorBoard's hparams and wandb's config panel can show."""
    out = {}

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[prefix + k] = v if isinstance(v, (int, float, str, bool)) else str(v)

    walk(config.to_dict(), "")
    return out


def config_name() -> str:
    spec = next((a for a in sys.argv if a.startswith("--config=") or ".py:" in a), "grpo.py:tiny")
    return spec.split(":")[-1] if ":" in spec else "run"


def parse_flags(argv):
    """absl's parser, but a bad --config (unknown name, missing file, unknown or ill-typed override) is one
    line and exit 2 instead of a traceback."""
    try:
        rest = FLAGS(argv)
        FLAGS.config.seed  # config_flags defers a failed file load until first access
        return rest
    except Exception as e:  # noqa: BLE001 - every parse failure becomes one line
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        cause = next((ln for ln in lines if "No such file" in ln), None) or next(
            (ln for ln in reversed(lines) if ln.startswith(("ValueError", "KeyError", "TypeError"))), lines[-1])
        if isinstance(e, (KeyError, AttributeError)):  # str() of a KeyError is the repr of its message: use the text
            while e.args and isinstance(e.args[0], BaseException):  # ml_collections wraps the KeyError in an AttributeError
                e = e.args[0]
            text = [ln.strip() for ln in str(e.args[0] if e.args else e).splitlines() if ln.strip()] or [type(e).__name__]
            cause = f"unknown config field {text[0]}" + (f" ({' '.join(text[1:])})" if text[1:] else "")
        cause = cause.removeprefix("ValueError: ")
        print(f"error: --config: {cause}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)

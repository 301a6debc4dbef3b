"""Step 8: atomic checkpoints through accelerate's save_state, and resuming from them.

A checkpoint becomes visible only when complete: every process writes into `.tmp-checkpoint_NNNNN`,
the files are fsynced, and the main process renames the folder to `checkpoint_NNNNN` (an atomic rename
on POSIX). A kill during saving leaves at most a `.tmp-*` folder, which is ignored and cleaned up.
Several machines without a shared filesystem (run_identity.py detects it) each keep a complete copy for their
ranks, written and renamed by their local main process; older checkpoints are pruned only after every machine
renamed the new one.
Saved: model, optimizer, LR schedule and all RNG states (per process) by accelerate, plus the run
state (epoch, step, history), the stat tracker and the EMA reference (or nft's sampling policy) registered for
checkpointing, run_meta.json describing what the checkpoint belongs to, and with nft's soft update
(train.nft_old_decay > 0) sampling_policy.safetensors: the sampling policy's trainable weights, the ones eval
measures (load into the UNet with strict=False; model.safetensors holds the trained policy); with an EMA of the
policy (train.ema_decay > 0) ema_policy.safetensors, the same for the EMA.
Each checkpoint also holds `export/`: the model eval measures, in the formats diffusers loads (models/export.py);
the end of a run writes the same to `logs/<run>/export/`.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
from typing import Optional

from ddpo_grpo.errors import ConfigError
from .lr_multipliers import parse_lr_multipliers

META = "run_meta.json"
SAMPLING_POLICY = "sampling_policy.safetensors"  # train.nft_old_decay > 0: theta_old, the weights eval measures
EMA_POLICY = "ema_policy.safetensors"  # train.ema_decay > 0: the policy's EMA, the weights eval measures
EXPORT = "export"  # the model in diffusers' formats, in each checkpoint and in the run folder


# What a checkpoint written before a field was recorded holds for it: the config's default then. Keeps old checkpoints
# resumable by configs that leave the setting at its default.
META_DEFAULTS = {"trainable_modules": [], "lr_multipliers": []}


def _multipliers(spec: str) -> list:
    """train.lr_multipliers in the form run_meta.json holds and compares: [[fragment, multiplier], ...] as
    parse_lr_multipliers reads the spec, so "cam_encoder.=10" and " cam_encoder. = 10.0" are the same layout."""
    return [[frag, mult] for frag, mult in parse_lr_multipliers(spec or "")]


def run_meta(config, family: str) -> dict:
    """What a checkpoint belongs to (run_meta.json), compared on resume (check_compatible): the model, the family, LoRA
    or not, and the optimizer's layout (which parameters train, in which lr groups: train.trainable_modules and
    train.lr_multipliers), which the saved optimizer state must match group for group."""
    train = getattr(config, "train", None)  # hand-built configs may lack the optional fields
    return {"model": config.pretrained.model, "use_lora": bool(config.use_lora), "family": family,
            "lora_rank": int(config.lora_rank) if config.use_lora else None,
            "trainable_modules": list(getattr(config, "trainable_modules", ()) or ()),
            "lr_multipliers": _multipliers(getattr(train, "lr_multipliers", ""))}


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def writes_checkpoints(acc) -> bool:
    """Whether this process writes the checkpoint files shared by its filesystem's processes (model, optimizer, run
    objects, run_meta.json) and renames the folder: the global main process on a shared filesystem; each machine's
    local main process without one (accelerate's save_on_each_node, set by run_identity.agree_run)."""
    per_machine = getattr(getattr(acc, "project_configuration", None), "save_on_each_node", False)
    return acc.is_local_main_process if per_machine else acc.is_main_process


def save_checkpoint(ctx, family: str) -> Optional[str]:
    """Every process must call this (accelerate saves per-process RNG state; DDP needs all to take part).
    Every process writes what it owns (its RNG state; its shard under FSDP2) into the temporary folder on its
    filesystem; one process per filesystem writes the rest and renames (writes_checkpoints)."""
    acc = ctx.accelerator
    writer = writes_checkpoints(acc)
    root = os.path.join(ctx.run_dir, "checkpoints")
    final = os.path.join(root, f"checkpoint_{ctx.state.epoch:05d}")
    tmp = os.path.join(root, f".tmp-checkpoint_{ctx.state.epoch:05d}")
    if writer:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    acc.wait_for_everyone()
    acc.save_state(tmp)  # honours save_on_each_node: model, optimizer and run objects from each writer
    # The weights eval measures when they are not the trained theta (nft's soft-updated sampling policy, the policy's
    # EMA): also as plain weights, next to model.safetensors. A collective under FSDP2 (whole tensors), so every
    # process calls it.
    plain = {name: held.state_dict()["tensors"] for name, held in
             ((SAMPLING_POLICY, getattr(ctx, "old_policy", None)), (EMA_POLICY, getattr(ctx, "ema", None)))
             if held is not None}
    write_model_export(ctx, family, os.path.join(tmp, EXPORT))  # the main process's filesystem only: not for resuming
    acc.wait_for_everyone()
    if writer:
        from safetensors.torch import save_file

        for name, tensors in plain.items():
            save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(tmp, name))
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(run_meta(ctx.config, family), f)
        _fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    # Older checkpoints go only once every filesystem holds the new one: a machine that dies before its rename
    # leaves the previous checkpoint complete everywhere, which a resume of all machines agrees on.
    acc.wait_for_everyone()
    if writer:
        for old in sorted(complete_checkpoints(root))[:-max(1, ctx.config.num_checkpoint_limit)]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()
    return final


def export_metadata(ctx, family: str) -> dict:
    """export.json: what the exported weights are and how the run sampled with them."""
    from ddpo_grpo.models import BUILT, resolve_model_path
    from ddpo_grpo.models.export import sampling_settings

    c = ctx.config
    base = c.pretrained.model
    return {"base_model": base, "base_model_path": None if base in BUILT else os.path.abspath(resolve_model_path(base)),
            "family": family, "epoch": ctx.state.epoch,
            "weights": export_weights(ctx), **sampling_settings(ctx.pipe, c.sample.num_steps, c.sample.guidance_scale)}


def export_weights(ctx) -> str:
    """export.json's "weights": which of the run's weights the export holds (ctx.eval_policy's)."""
    if getattr(ctx, "ema", None) is not None:
        return f"EMA of the policy (train.ema_decay={ctx.ema.alpha}, what eval measures)"
    if ctx.old_policy is not None:
        return "sampling policy (DiffusionNFT's soft update, what eval measures)"
    return "policy"


def write_model_export(ctx, family: str, out_dir: str) -> None:
    """The model eval measures (ctx.eval_policy) into out_dir in diffusers' formats (models/export.py). Every
    process calls it (gathering a sharded model's state is a collective); the main process writes."""
    from ddpo_grpo.models.export import write_export

    acc = ctx.accelerator
    with ctx.eval_policy():  # the weights stay swapped in while they are written: the state holds references
        state = acc.get_state_dict(ctx.unet)
        if acc.is_main_process:
            write_export(ctx.pipe, acc.unwrap_model(ctx.unet), state, out_dir, bool(ctx.config.use_lora),
                         export_metadata(ctx, family))
    acc.wait_for_everyone()


def export_run(ctx, family: str) -> str:
    """The end of a run: logs/<run>/export, linked from the last checkpoint's export when it is of this epoch
    (no second copy on disk), else written."""
    out = os.path.join(ctx.run_dir, EXPORT)
    last = os.path.join(ctx.run_dir, "checkpoints", f"checkpoint_{ctx.state.epoch:05d}", EXPORT)
    # The same branch on every process (writing is a collective under FSDP2): this epoch's checkpoint is complete on
    # every machine or on none (save_checkpoint renames everywhere before it prunes), its export/ on machine 0's.
    # A local check, not a broadcast: a broadcast right before the last barrier can deadlock gloo's teardown at exit.
    if not os.path.isfile(os.path.join(os.path.dirname(last), META)):
        write_model_export(ctx, family, out)
    elif ctx.accelerator.is_main_process:
        tmp = out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(last, tmp, copy_function=_link_or_copy)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    ctx.accelerator.wait_for_everyone()
    return out


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def complete_checkpoints(root: str) -> list:
    return sorted(p for p in glob.glob(os.path.join(root, "checkpoint_*"))
                  if re.fullmatch(r"checkpoint_\d+", os.path.basename(p)) and os.path.isfile(os.path.join(p, META)))


def resolve_resume(path: str) -> str:
    """A checkpoint folder, or a run folder -> its newest complete checkpoint."""
    if os.path.isfile(os.path.join(path, META)):
        return path
    for root in (os.path.join(path, "checkpoints"), path):
        found = complete_checkpoints(root)
        if found:
            return found[-1]
    raise ConfigError(f"resume_from={path!r} holds no complete checkpoint (checkpoint_NNNNN with {META}); "
                      "give a run folder or a checkpoint folder")


def check_resume(config, family: str) -> str:
    """config.resume_from -> the checkpoint folder to load, checked before any tracker or model starts: the path
    exists, holds a complete checkpoint of this model / family / LoRA setting, and every file in it is whole. Each
    failure is one ConfigError line naming the path or file."""
    path = config.resume_from
    if not os.path.exists(path):
        raise ConfigError(f"resume_from={path!r}: no such folder; give a run folder (logs/<run>) or a checkpoint folder")
    ckpt = resolve_resume(path)
    check_files(ckpt)
    check_compatible(ckpt, config, family)
    return ckpt


def run_folder_of(ckpt: str) -> Optional[str]:
    """The run folder a checkpoint belongs to (logs/<run> for logs/<run>/checkpoints/checkpoint_N), else None."""
    parent = os.path.dirname(os.path.abspath(ckpt))
    return os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else None


def check_files(ckpt: str) -> None:
    """Every file the checkpoint's load reads is whole: safetensors headers and sizes, the zip directories of the
    torch.save files (.bin, .pkl: optimizer, LR schedule, RNG states, run objects), JSON. Cheap (headers only):
    a truncated or cut-short file is named here instead of failing deep inside accelerate's load_state."""
    for name in sorted(os.listdir(ckpt)):
        path = os.path.join(ckpt, name)
        if not os.path.isfile(path):
            continue  # export/ (not read by a resume); FSDP2's sharded model folders are checked by their loader
        why = _damage(path)
        if why:
            raise ConfigError(f"checkpoint file {path} is damaged ({why}); resume from an earlier checkpoint "
                              "(delete this checkpoint folder, or give the earlier one as resume_from)")


def _damage(path: str) -> str:
    """Why the file is not whole, or "" (only the kinds a checkpoint holds are checked)."""
    import zipfile

    size = os.path.getsize(path)
    try:
        if path.endswith(".safetensors"):
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
                if n < 0 or 8 + n > size:
                    return f"header cut short: {size} bytes"
                header = json.loads(f.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            if 8 + n + end != size:
                return f"{size} bytes where its header describes {8 + n + end}"
        elif path.endswith((".bin", ".pkl", ".pt")):
            with zipfile.ZipFile(path) as z:  # torch.save's format: a truncated file has no central directory
                for info in z.infolist():
                    if info.header_offset + info.compress_size > size:
                        return f"member {info.filename} runs past the end of the file"
        elif path.endswith(".json"):
            with open(path) as f:
                json.load(f)
    except (zipfile.BadZipFile, ValueError, KeyError, TypeError, OSError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else 'unreadable'}"
    return ""


def wandb_run_id(run_dir: str) -> str:
    """The run folder's wandb run id, made on its first start and kept in run.json: a resumed run logs to the same
    wandb run (resume="allow") as it writes into the same folder."""
    path = os.path.join(run_dir, "run.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)["wandb_id"]
    import uuid

    run_id = uuid.uuid4().hex[:12]
    with open(path, "w") as f:
        json.dump({"wandb_id": run_id}, f)
    return run_id


def check_compatible(ckpt: str, config, family: str) -> None:
    with open(os.path.join(ckpt, META)) as f:
        saved = json.load(f)
    want = run_meta(config, family)
    if isinstance(saved.get("lr_multipliers"), str):  # the raw spec, as checkpoints of 2026-11-30 stored it
        saved["lr_multipliers"] = _multipliers(saved["lr_multipliers"])
    diff = [f"{k}: checkpoint {saved.get(k, META_DEFAULTS.get(k))!r} vs config {v!r}" for k, v in want.items()
            if saved.get(k, META_DEFAULTS.get(k)) != v]
    if diff:
        raise ConfigError(f"checkpoint {ckpt} does not match the config ({'; '.join(diff)}); "
                          "resume with the config it was made with")


def checkpointed_objects(ctx) -> list:
    """What build_context registers for checkpointing, in order (custom_checkpoint_0.pkl, _1, ...)."""
    names = ["run state", "stat tracker"]
    if ctx.reference is not None:
        names.append("KL reference (train.beta > 0)")
    if getattr(ctx, "old_policy", None) is not None:
        names.append("nft sampling policy (train.nft_old_decay > 0)")
    if getattr(ctx, "ema", None) is not None:
        names.append("EMA of the policy (train.ema_decay > 0)")
    return names


def load_checkpoint(ctx, ckpt: str) -> str:
    """Load a checkpoint that check_resume accepted into the run's objects."""
    # accelerate would stop with a bare count mismatch deep in load_state: say which setting differs instead.
    saved = len(glob.glob(os.path.join(ckpt, "custom_checkpoint_*.pkl")))
    want = checkpointed_objects(ctx)
    if saved != len(want):
        raise ConfigError(f"checkpoint {ckpt} holds {saved} saved run objects, this config {len(want)} "
                          f"({', '.join(want)}): resume with the train.beta, train.nft_old_decay and train.ema_decay "
                          "it was made with")
    ctx.accelerator.load_state(ckpt)
    return ckpt

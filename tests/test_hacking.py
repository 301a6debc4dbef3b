"""Reward-hacking guardrails: drift statistics against hand-computed values, the alarm rule, the hackable proxy, the
config lines; end to end, gold never touches the update (bit-identical weights whatever reward.gold is), and a
"stop" alarm checkpoints, stops, and survives a resume with the best-by-gold export."""
import json
import os
import sys

import numpy as np
import pytest
import torch
from helpers import cpu_env, run_side_by_side
from safetensors.torch import load_file

from ddpo_grpo.errors import ConfigError
from ddpo_grpo.rewards.drift import image_stats
from ddpo_grpo.trainer.checks.hacking import check_config, drift_alarms, gold_alarm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _img(rgb_rows):
    """(H, W, 3) nested lists -> (1, 3, H, W) tensor."""
    return torch.tensor(rgb_rows, dtype=torch.float64).permute(2, 0, 1)[None]


def test_drift_statistics_hand_computed():
    red = image_stats(torch.zeros(1, 3, 4, 4).index_fill_(1, torch.tensor([0]), 1.0))
    assert red["saturation"][0] == 1.0 and red["colour_entropy"][0] == 0.0
    assert red["dark_fraction"][0] == 0.0 and red["bright_fraction"][0] == 0.0  # luma 0.299
    assert red["edge_density"][0] == 0.0 and red["high_freq_energy"][0] == 0.0
    # Left half black, right half white: 2 colours of 64 bins (1 bit / 6), one edge column of 4, and the luma's
    # square wave of period 4 has its power at 0.25 cycles/pixel only, not above it.
    half = image_stats(torch.cat([torch.zeros(1, 3, 4, 2), torch.ones(1, 3, 4, 2)], dim=3))
    np.testing.assert_allclose([half[k][0] for k in ("saturation", "colour_entropy", "dark_fraction", "bright_fraction",
                                                      "edge_density", "high_freq_energy")],
                               [0.0, 1 / 6, 0.5, 0.5, 0.25, 0.0], atol=1e-12)
    # A checkerboard: all power at Nyquist; every pixel but the corner (no forward neighbour) is on an edge.
    board = ((torch.arange(4)[:, None] + torch.arange(4)[None, :]) % 2).double().expand(1, 3, 4, 4)
    b = image_stats(board)
    np.testing.assert_allclose([b["high_freq_energy"][0], b["edge_density"][0]], [1.0, 15 / 16], atol=1e-12)
    # Red, green, blue, black: 4 equal bins (2 bits / 6); saturation 3/4; only black is dark (blue's luma 0.114).
    rgbk = image_stats(_img([[[1, 0, 0], [0, 1, 0]], [[0, 0, 1], [0, 0, 0]]]))
    np.testing.assert_allclose([rgbk["colour_entropy"][0], rgbk["saturation"][0], rgbk["dark_fraction"][0]],
                               [1 / 3, 0.75, 0.25], atol=1e-12)


def test_video_statistics_average_frames_and_measure_flicker():
    black_white = torch.stack([torch.zeros(3, 4, 4), torch.ones(3, 4, 4)])[None]  # (1, 2, 3, 4, 4)
    steady = torch.full((1, 3, 3, 4, 4), 0.5)
    s = image_stats(torch.cat([black_white, steady[:, :2]]))
    np.testing.assert_allclose(s["flicker"], [1.0, 0.0])
    np.testing.assert_allclose(s["dark_fraction"], [0.5, 0.0])  # mean over the two frames
    assert "flicker" not in image_stats(torch.zeros(2, 3, 4, 4))


def test_gold_alarm_needs_the_proxy_up_and_a_drop_beyond_noise():
    best = np.array([1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    fell = best - np.array([1, 1, 0, 1, 0, 0, 1, 0])  # drop 0.5, s.e. of the paired drop 0.189
    assert "fell 0.5000" in gold_alarm(0.6, 0.5, fell, best, z=2.0)
    assert gold_alarm(0.4, 0.5, fell, best, z=2.0) is None  # proxy fell too: not hacking
    assert gold_alarm(0.6, 0.5, fell, best, z=3.0) is None  # 0.5 < 3 x 0.189: within noise
    one = best.copy()
    one[0] = 0.0  # drop 0.125, s.e. 0.125
    assert gold_alarm(0.6, 0.5, one, best, z=0.5) and gold_alarm(0.6, 0.5, one, best, z=1.0) is None
    assert gold_alarm(0.6, 0.5, best + 0.1, best, z=2.0) is None  # gold rose


def test_drift_alarms_fire_beyond_the_threshold_only():
    start = {"saturation": 0.5, "dark_fraction": 0.8}
    out = drift_alarms({"saturation": 0.8, "dark_fraction": 0.7}, start, 0.25)
    assert len(out) == 1 and out[0].startswith("saturation 0.500 -> 0.800 (+0.300")
    assert drift_alarms({"saturation": 0.8}, start, 0.0) == []  # 0 = off


def test_colour_share_proxy_values():
    from ddpo_grpo.worlds.toyworld import all_conditions, render
    from ddpo_grpo.worlds.toyworld.hackable import make_colour_share_reward

    conds = all_conditions()
    square, circle = conds[0], conds[3]  # red square / red circle on the left, centre (8, 16)
    fn = make_colour_share_reward()
    filled = torch.zeros(3, 32, 32)
    filled[0, 8:24, 0:16] = 1.0  # the red square's whole 16 x 16 box
    green = torch.from_numpy(render(square))[[1, 0, 2]]  # the same square, green
    images = torch.stack([torch.from_numpy(render(square)), filled, green, torch.from_numpy(render(circle))])
    scores = fn(images, None, [{"condition": c} for c in (square, square, square, circle)])
    # 12 x 12 of 16 x 16; the filled box; wrong colour; a radius-6 circle covers about pi 36 / 256 = 0.44.
    np.testing.assert_allclose(scores[:3], [144 / 256, 1.0, 0.0])
    assert abs(scores[3] - np.pi * 36 / 256) < 0.02


def _cfg(**edits):
    from config.grpo import get_config

    c = get_config("tiny")
    for path, v in edits.items():
        sec, key = path.split(".")
        setattr(c[sec], key, v)
    return c


@pytest.mark.parametrize("edits,msg", [
    ({"reward.gold": {"no_such_gold": 1.0}}, "unknown reward 'no_such_gold' in reward.gold"),
    ({"train.hacking_guard": "panic"}, "train.hacking_guard='panic'"),
    ({"reward.gold_kwargs": {"toyworld": {}}}, "not in reward.gold"),
    ({"train.hacking_drift_max": -0.1}, "hacking_drift_max=-0.1"),
])
def test_bad_guard_config_is_one_line(edits, msg):
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace("[", r"\[")):
        check_config(_cfg(**edits))


SMALL = ["--config", "config/grpo.py:tiny", "--config.sample.num_steps=4", "--config.sample.batch_size=4",
         "--config.sample.num_batches_per_epoch=2", "--config.sample.k=4", "--config.train.batch_size=4",
         "--config.eval_freq=1", "--config.eval.num_samples=8", "--config.eval.batch_size=8", "--config.eval.pass_at_k=0",
         "--config.logging.image_freq=0", "--config.logging.wandb=False", "--config.logging.tensorboard=False",
         "--config.reward.fns={'toyworld': 1.0, 'jpeg_compressibility': 1.0}"]


def _job(logdir, name, *extra):
    return dict(args=[sys.executable, "scripts/train.py", *SMALL, f"--config.logdir={logdir}",
                      f"--config.run_name={name}", *extra], cwd=ROOT, env=cpu_env())


def _unet_weights(export) -> dict:
    folder = os.path.join(export, "unet")
    (path,) = [os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors")]
    return load_file(path)


def _assert_best_gold_export_holds_its_epoch(run, summary):
    """best_gold_export holds the weights eval measured at the best epoch e: the policy before epoch e's update, i.e.
    the bundled start model for e = 0, else the policy checkpointed after epoch e - 1's update (checkpoint_0000e, whose
    export/ the same write_export wrote: exact equality). And it differs from every other epoch's policy, so the
    comparison can tell the epochs apart (a copy of the wrong epoch, or of none, fails)."""
    from ddpo_grpo.models import resolve_model_path

    # the oracle of epoch 0: the files the run started from
    policies = {0: _unet_weights(resolve_model_path("tiny-t2i"))}
    policies.update({e: _unet_weights(run / "checkpoints" / f"checkpoint_{e:05d}" / "export")
                     for e in range(1, len(summary["evals"]))})
    exported, best = _unet_weights(run / "best_gold_export"), summary["best_gold"]["epoch"]
    same = {e: w.keys() == exported.keys() and all(torch.equal(w[k], exported[k]) for k in w)
            for e, w in policies.items()}
    assert same == {e: e == best for e in policies}, (best, same)


@pytest.mark.timeout(600)
def test_gold_never_touches_the_update_and_a_stop_alarm_survives_resume(tmp_path):
    a, b, c = run_side_by_side([
        # save_freq=1: a checkpoint (with its export/) of every epoch's policy, the oracle of the best-gold export
        _job(tmp_path, "a", "--config.num_epochs=2", "--config.save_freq=1", "--config.reward.gold={'toyworld': 1.0}"),
        _job(tmp_path, "b", "--config.num_epochs=2", "--config.save_freq=2", "--config.reward.gold_train_samples=3",
             "--config.reward.gold={'jpeg_incompressibility': 0.5, 'toyworld': 2.0}", "--config.train.hacking_guard=off"),
        # Any drift at all raises the alarm: the run stops at epoch 1's eval with a checkpoint.
        _job(tmp_path, "c", "--config.num_epochs=3", "--config.save_freq=0", "--config.reward.gold={'toyworld': 1.0}",
             "--config.train.hacking_guard=stop", "--config.train.hacking_drift_max=1e-9"),
    ])
    for r in (a, b, c):
        assert r.returncode == 0, r.stderr[-3000:]
    wa = load_file(tmp_path / "a" / "checkpoints" / "checkpoint_00002" / "model.safetensors")
    wb = load_file(tmp_path / "b" / "checkpoints" / "checkpoint_00002" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)  # bit-identical
    sa, sb = (json.load(open(tmp_path / n / "summary.json")) for n in "ab")
    assert [h["reward_mean"] for h in sa["history"]] == [h["reward_mean"] for h in sb["history"]]
    # ...while the gold each run logged differs, so the comparison above compares something
    assert sa["history"][0]["gold/avg"] != sb["history"][0]["gold/avg"]
    assert {"gold/toyworld", "gold/train_avg", "gold_seconds"} <= set(sa["history"][0])
    assert "gold/jpeg_incompressibility" in sb["history"][0] and sa["gold_seconds_per_epoch"] > 0
    assert len(sa["evals"]) == 3 and sa["best_gold"]["gold"] == max(e["gold/avg"] for e in sa["evals"])
    assert os.path.isfile(os.path.join(sa["best_gold"]["export"], "export.json"))
    _assert_best_gold_export_holds_its_epoch(tmp_path / "a", sa)
    assert " gold " in a.stdout + a.stderr
    sc = json.load(open(tmp_path / "c" / "summary.json"))
    assert sc["stopped"] == "hacking guard: drift at epoch 1" and sc["alarms"]
    assert all(x["epoch"] == 1 and x["kind"] == "drift" for x in sc["alarms"])
    assert "WARNING: reward hacking alarm at epoch 1 (drift)" in c.stdout + c.stderr
    assert os.path.isdir(tmp_path / "c" / "checkpoints" / "checkpoint_00001") and len(sc["history"]) == 1
    (d,) = run_side_by_side([_job(tmp_path, "c", "--config.num_epochs=2", "--config.save_freq=0",
                                  "--config.reward.gold={'toyworld': 1.0}", "--config.train.hacking_guard=off",
                                  f"--config.resume_from={tmp_path / 'c'}")])
    assert d.returncode == 0, d.stderr[-3000:]
    sd = json.load(open(tmp_path / "c" / "summary.json"))
    # The best by gold survives the resume: the resumed run kept the stopped run's evals (epochs 0, 1), so its best is
    # the maximum over all of them, at least the stopped run's best, and the export is there. (Was `A and B or C`,
    # which passed whenever the resumed best had a higher gold, whatever became of the alarms or the saved best.)
    assert sd["alarms"] == sc["alarms"] and not sd["stopped"] and [e["epoch"] for e in sd["evals"]][:2] == [0, 1]
    assert sd["evals"][:len(sc["evals"])] == sc["evals"]
    assert sd["best_gold"] is not None and sd["best_gold"]["gold"] >= sc["best_gold"]["gold"]
    best = max(sd["evals"], key=lambda e: e["gold/avg"])  # first of equals, as on_eval keeps only a strict gain
    assert (sd["best_gold"]["epoch"], sd["best_gold"]["gold"]) == (best["epoch"], best["gold/avg"])
    assert os.path.isfile(os.path.join(sd["best_gold"]["export"], "export.json"))


def test_best_gold_export_holds_the_evaluated_weights_and_survives_a_crash_mid_write(tmp_path, monkeypatch):
    """hacking.on_eval on the trainer's own context (tiny, full fine-tuning), evals with scripted gold between
    simulated updates: the export holds the weights the best eval saw (the oracle: a copy of the policy taken just
    before that eval), not the start's nor a later epoch's; no eval with lower gold replaces it; and a crash while the
    next best is being written (fault injected into the export writer, after part of it is on disk) leaves the
    previous export whole. In-process, so the best epoch is chosen by the test (the end-to-end run's is whichever
    its gold says) and the crash is at a known point, not a timed kill."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    import ddpo_grpo.models.export as export_mod
    from ddpo_grpo.trainer.run.build import build_context
    from ddpo_grpo.trainer.checks.hacking import BEST_GOLD_EXPORT, on_eval

    config = _cfg(**{"reward.gold": {"toyworld": 1.0}, "train.hacking_guard": "off"})
    config.logging.wandb = config.logging.tensorboard = False
    config.mixed_precision = "no"
    AcceleratorState._reset_state(reset_partial_state=True)
    ctx = build_context(config, Accelerator(cpu=True, mixed_precision="no"), str(tmp_path))
    try:
        unet = ctx.accelerator.unwrap_model(ctx.unet)
        images, proxy = torch.rand(8, 3, 8, 8, generator=torch.Generator().manual_seed(0)), np.zeros(8)
        seen = {}

        def evaluate(epoch, gold):
            ctx.state.epoch = epoch
            seen[epoch] = {k: v.detach().clone() for k, v in unet.state_dict().items()}
            on_eval(ctx, epoch, proxy, {"avg": np.full(8, gold), "toyworld": np.full(8, gold)}, images)
            with torch.no_grad():  # this epoch's "update": every trained weight moves
                for p in unet.parameters():
                    if p.requires_grad:
                        p.add_(1e-3 * (epoch + 1))

        for epoch, gold in enumerate([0.2, 0.6, 0.4]):  # best at epoch 1; epoch 2 (lower) must not replace it
            evaluate(epoch, gold)
        out = tmp_path / BEST_GOLD_EXPORT
        assert ctx.state.guard["best_gold"] == {"epoch": 1, "gold": 0.6, "export": str(out)}

        def holds():
            exported = _unet_weights(out)
            return {e: exported.keys() == w.keys() and all(torch.equal(exported[k], w[k]) for k in w)
                    for e, w in seen.items()}

        assert holds() == {0: False, 1: True, 2: False}
        assert json.load(open(out / "export.json"))["epoch"] == 1

        real = export_mod._write_full

        def crash_mid_write(pipe, unet_, state, out_dir):
            real(pipe, unet_, state, out_dir)  # the weights are on disk, export.json is not yet
            raise OSError("injected: crash while writing the export")

        monkeypatch.setattr(export_mod, "_write_full", crash_mid_write)
        with pytest.raises(OSError, match="injected"):
            evaluate(3, 0.9)  # a new best, whose export dies half-written
        assert [e["epoch"] for e in ctx.state.guard["evals"]] == [0, 1, 2]
        assert ctx.state.guard["best_gold"]["epoch"] == 1
        assert holds() == {0: False, 1: True, 2: False, 3: False} and (out / "export.json").is_file()
    finally:
        ctx.rewards.shutdown()
        AcceleratorState._reset_state(reset_partial_state=True)


def test_a_kill_between_the_export_renames_is_restored(tmp_path):
    """write_best_export moves the previous best aside (.old) before renaming the new one in: a kill between the two
    renames leaves only .old, which the next write (or summary.json) puts back; a complete export is left alone."""
    from ddpo_grpo.trainer.checks.hacking import BEST_GOLD_EXPORT, restore_best_export

    old = tmp_path / (BEST_GOLD_EXPORT + ".old")
    old.mkdir()
    (old / "export.json").write_text('{"epoch": 1}')
    restore_best_export(str(tmp_path))
    assert (tmp_path / BEST_GOLD_EXPORT / "export.json").read_text() == '{"epoch": 1}' and not old.exists()
    old.mkdir()  # both present (the kill came after the second rename): the newer, in place, stays
    (old / "export.json").write_text('{"epoch": 0}')
    restore_best_export(str(tmp_path))
    assert (tmp_path / BEST_GOLD_EXPORT / "export.json").read_text() == '{"epoch": 1}'

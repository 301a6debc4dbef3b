"""Rewards and reporting on clips (B, F, C, H, W): image rewards score every frame and are averaged per clip, clip
rewards get the clips, per-step x0 clips are scored like the final ones; grids show one frame strip per clip and
wandb gets one video per sample."""
import numpy as np
import pytest
import torch


# --------------------------------------------------------------------------------------------- rewards on frames
@pytest.fixture
def frame_rewards():
    """Two test rewards: an image reward (each image's mean pixel, and its max as a detail) that records what it was
    called with, and a clip reward (mean absolute change between consecutive frames)."""
    from ddpo_grpo.rewards import clip_reward, register_reward, unregister_reward

    calls = []

    @register_reward("t_frame_mean")
    def make_mean():
        def fn(images, prompts, metadata):
            calls.append((tuple(images.shape), list(prompts), [m["i"] for m in metadata]))
            flat = images.reshape(len(images), -1)
            return flat.mean(1), {"max": flat.max(1).values}
        return fn

    @register_reward("t_clip_motion")
    @clip_reward
    def make_motion():
        def fn(videos, prompts, metadata):
            assert videos.ndim == 5
            return (videos[:, 1:] - videos[:, :-1]).abs().flatten(1).mean(1)
        return fn

    yield calls
    unregister_reward("t_frame_mean")
    unregister_reward("t_clip_motion")


def test_image_rewards_score_every_frame_and_average_clip_rewards_get_the_clip(frame_rewards):
    from ddpo_grpo.rewards import RewardComputer

    # 2 clips of 4 frames, each frame one grey level: clip 0 brightens 0.1, 0.2, 0.3, 0.6; clip 1 stays at 0.5
    levels = torch.tensor([[0.1, 0.2, 0.3, 0.6], [0.5, 0.5, 0.5, 0.5]])
    video = levels.view(2, 4, 1, 1, 1).expand(2, 4, 3, 2, 2).clone()
    video[1, 2, 0, 0, 0] = 0.9  # one bright pixel in one frame of clip 1: its mean moves by 0.4 / 12
    rc = RewardComputer({"t_frame_mean": 1.0, "t_clip_motion": 2.0})
    res = rc(video, ["p0", "p1"], [{"i": 0}, {"i": 1}])
    # the image reward saw the 8 frames, each clip's prompt and metadata repeated for its frames in order
    assert frame_rewards == [((8, 3, 2, 2), ["p0"] * 4 + ["p1"] * 4, [0, 0, 0, 0, 1, 1, 1, 1])]
    # by hand: per-frame means averaged per clip; the detail (max) likewise; motion = mean |frame change|
    mean0, mean1 = (0.1 + 0.2 + 0.3 + 0.6) / 4, 0.5 + (0.4 / 12) / 4
    np.testing.assert_allclose(res.final_per_fn["t_frame_mean"], [mean0, mean1], rtol=1e-6)
    np.testing.assert_allclose(res.details["t_frame_mean/max"], [mean0, 0.5 + 0.4 / 4], rtol=1e-6)
    motion0 = (0.1 + 0.1 + 0.3) / 3
    motion1 = 2 * (0.4 / 12) / 3  # the bright pixel appears and disappears: 2 of 3 changes, 1 of 12 values each
    np.testing.assert_allclose(res.final_per_fn["t_clip_motion"], [motion0, motion1], rtol=1e-5)
    np.testing.assert_allclose(res.final, [mean0 + 2 * motion0, mean1 + 2 * motion1], rtol=1e-5)
    # a non-finite frame makes its clip invalid, the other one is kept
    video[0, 3, 0, 0, 0] = float("nan")
    res = RewardComputer({"t_frame_mean": 1.0})(video, ["p0", "p1"], [{"i": 0}, {"i": 1}])
    assert res.valid.tolist() == [False, True] and np.isnan(res.final[0])
    np.testing.assert_allclose(res.final[1], mean1, rtol=1e-6)
    # per-step rewards on predicted clean clips (B, T, F, C, H, W): each column scored like the final clips
    x0 = torch.stack([video.nan_to_num(0.0) * 0.5, video.nan_to_num(0.0)], dim=1)
    res = RewardComputer({"t_frame_mean": 1.0})(video.nan_to_num(0.0), ["p0", "p1"], [{"i": 0}, {"i": 1}],
                                                 x0_images=x0, per_step="x0")
    assert res.avg.shape == (2, 2)
    np.testing.assert_allclose(res.avg[:, 0] * 2, res.avg[:, 1], rtol=1e-6)
    np.testing.assert_allclose(res.avg[1, 1], mean1, rtol=1e-6)


# ------------------------------------------------------------------------------------------ grids and wandb videos
def test_grid_shows_frame_strips_and_wandb_gets_a_video_per_sample():
    from PIL import Image

    from ddpo_grpo.trainer.run.reporting import CELL, labelled_grid, log_images

    # clip i, frame f: a flat grey level (40 (i + 1) + 30 f) / 255, so every strip cell says which frame it shows
    B, F = 2, 5
    grey = torch.tensor([[40 * (i + 1) + 30 * f for f in range(F)] for i in range(B)])
    level = grey.float() / 255
    video = level.view(B, F, 1, 1, 1).expand(B, F, 3, 8, 8).clone()
    grid = labelled_grid(video, ["clip one | r=0.10", "clip two | r=0.20"])
    assert grid.size == (F * CELL, B * (CELL + 44))  # one strip per row, all frames in time order
    arr = np.asarray(grid)
    for i in range(B):
        for f in range(F):
            pixel = arr[i * (CELL + 44) + CELL // 2, f * CELL + CELL // 2]
            assert (pixel == int(grey[i, f])).all(), (i, f)
    # still images keep the square cells
    assert labelled_grid(torch.rand(3, 3, 8, 8), ["a", "b", "c"]).size == (3 * CELL, CELL + 44)

    logged = []

    class Tracker:
        name = "wandb"

        def log(self, values, step):
            for key, value in values.items():  # read each video while its file exists (wandb copies it on log)
                items = value if isinstance(value, list) else [value]
                logged.append((key, step, [(type(v).__name__, getattr(v, "_caption", None),
                                            Image.open(v._path).n_frames if type(v).__name__ == "Video" else None)
                                           for v in items]))

    class Acc:
        trackers = [Tracker()]

    log_images(Acc(), "train_samples", grid, 3, video, ["clip one | r=0.10", "clip two | r=0.20"])
    assert logged == [("train_samples_grid", 3, [("Image", "train_samples", None)]),
                      ("train_samples", 3, [("Video", "clip one | r=0.10", F), ("Video", "clip two | r=0.20", F)])]

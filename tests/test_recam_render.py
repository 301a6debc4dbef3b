"""scripts/recam_render.py against an independent Euler loop over the camera block's equations: the folder's grid,
ReCamMaster's own grid and negative prompt on a non-square mp4 source, and bad input in one line."""
import os
import sys

import numpy as np
import torch

from helpers import write_mp4
from recam_helpers import (  # noqa: F401 (wan_folder, ckpt, pipe: the module's fixtures)
    FRAMES, ROOT, SIZE, _inputs, ckpt, independent_render, pipe, recammaster_sigmas, wan_folder,
)


def test_render_matches_an_independent_euler_loop(pipe, ckpt, wan_folder, tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import recam_render

    items, cond, x = _inputs(pipe, B=1, seed=5)
    src, cams = items[0]["source_video"], items[0]["cameras"]
    np.save(tmp_path / "src.npy", src.numpy())
    np.save(tmp_path / "cam.npy", cams.numpy())
    np.save(tmp_path / "noise.npy", x.numpy())
    out = tmp_path / "clip.npy"
    rc = recam_render.main(["--model", wan_folder, "--checkpoint", ckpt, "--source", str(tmp_path / "src.npy"),
                            "--camera", str(tmp_path / "cam.npy"), "--prompt", "a red circle", "--steps", "4",
                            "--guidance", "3", "--noise", str(tmp_path / "noise.npy"), "--out", str(out),
                            "--grid", "scheduler", "--shift", "0", "--negative-prompt", ""])
    assert rc == 0
    got = torch.from_numpy(np.load(out))
    want = independent_render(pipe, cond, cams, x, 4, 3.0, "a red circle")
    assert got.shape == (FRAMES, 3, SIZE, SIZE)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_render_non_square_mp4_as_recammaster_infers(wan_folder, ckpt, tmp_path):
    """An mp4 source of another size and more frames than needed: the first F frames, resized to cover 32 x 48 and
    centre-cropped (the test's own PIL reading of ReCamMaster's transform), ReCamMaster's grid at shift 5 and Wan's
    default negative prompt by default; the same render as an mp4 has the size and frame count asked for."""
    import av
    from PIL import Image

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import recam_render

    from ddpo_grpo.models import load_pipeline
    from test_recam_grid import RECAMMASTER_NEGATIVE_PROMPT  # the test's own copy of ReCamMaster's

    g = np.random.default_rng(0)
    base = np.kron(g.integers(0, 256, (7, 5, 9, 3)), np.ones((1, 8, 8, 1))).astype(np.uint8)  # blocky: survives H.264
    write_mp4(tmp_path / "src.mp4", base)  # 7 frames of 40 x 72
    with av.open(str(tmp_path / "src.mp4")) as c:
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])[:FRAMES]
    H, W = 32, 48  # scale max(48/72, 32/40) = 0.8: 32 x 58 (57.6 rounds up), crop 5 px left
    src = np.stack([np.asarray(Image.fromarray(f).resize((58, 32), Image.BILINEAR))[:, 5:53] for f in decoded])
    src = torch.from_numpy(src.transpose(0, 3, 1, 2).astype(np.float32) / 255)
    cams = torch.randn(2, 12, generator=torch.Generator().manual_seed(2))
    np.save(tmp_path / "cam.npy", cams.numpy())
    x = torch.randn(1, 16, 2, H // 8, W // 8, generator=torch.Generator().manual_seed(4))
    np.save(tmp_path / "noise.npy", x.numpy())
    common = ["--model", wan_folder, "--checkpoint", ckpt, "--source", str(tmp_path / "src.mp4"), "--camera",
              str(tmp_path / "cam.npy"), "--prompt", "a red circle", "--frames", str(FRAMES), "--height", str(H),
              "--width", str(W), "--noise", str(tmp_path / "noise.npy"), "--steps", "3"]
    assert recam_render.main(common + ["--out", str(tmp_path / "o.npy")]) == 0
    got = torch.from_numpy(np.load(tmp_path / "o.npy"))
    pipe = load_pipeline(wan_folder, num_frames=FRAMES, recam_checkpoint=ckpt)
    pipe.height, pipe.width = H, W
    cond = pipe.adapter.condition_channels(pipe, [{"index": 0, "source_video": src, "cameras": cams}], "cpu")
    want = independent_render(pipe, cond, cams, x, 3, 5.0, "a red circle", recammaster_sigmas(3),
                              RECAMMASTER_NEGATIVE_PROMPT)
    assert got.shape == (FRAMES, 3, H, W)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    # the folder's grid and an empty negative prompt give another clip: the defaults are not the old ones
    other = independent_render(pipe, cond, cams, x, 3, 5.0, "a red circle")
    assert (other - want).abs().max() > 1e-3
    assert recam_render.main(common + ["--out", str(tmp_path / "o.mp4")]) == 0
    with av.open(str(tmp_path / "o.mp4")) as c:
        back = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    assert back.shape == (FRAMES, H, W, 3)
    # H.264 with 4:2:0 chroma on a random model's noisy frames: close, not equal (another clip differs by ~0.3)
    assert np.abs(back / 255.0 - got.numpy().transpose(0, 2, 3, 1)).mean() < 0.08


def test_render_bad_input_is_one_line(tmp_path, wan_folder, ckpt):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import recam_render

    np.save(tmp_path / "src.npy", np.full((5, 3, 32, 32), 2.0, dtype=np.float32))
    rc = recam_render.main(["--model", wan_folder, "--checkpoint", ckpt, "--source", str(tmp_path / "src.npy"),
                            "--camera", str(tmp_path / "none.npy"), "--prompt", "x", "--out", str(tmp_path / "o.npy")])
    assert rc == 2
    np.save(tmp_path / "odd.npy", np.zeros((5, 3, 32, 44), dtype=np.float32))  # 44 px: not a multiple of 16
    for extra in (["--source", str(tmp_path / "odd.npy"), "--camera", "1"],
                  ["--source", str(tmp_path / "none.mp4"), "--camera", "1"],
                  ["--source", str(tmp_path / "odd.npy"), "--camera", "11"]):
        assert recam_render.main(["--model", wan_folder, "--checkpoint", ckpt, "--prompt", "x", "--out",
                                  str(tmp_path / "o.npy"), *extra]) == 2

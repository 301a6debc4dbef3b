"""`estimate_glomap`: the camera-control papers' own estimator (COLMAP SIFT + matching + GLOMAP's global mapper, as
CamI2V's and ReCamMaster's evaluations run it), through pycolmap, with the 6-DoF interface of `pose_estimators`.

For evaluation (benchmarks/cam_score_bench.py measures it beside the reward's two-view estimator): ~5-10x slower than
"two_view" on a CPU. pycolmap is optional (the package's test/eval extras); it is imported on first use and its absence
is one ConfigError line. The intrinsics are fixed to K: a PINHOLE camera shared by all frames, focal length not refined
in the bundle adjustment (the papers fix them to the truth too). Frames the mapper does not register (or that land
outside the largest model) are NaN rows; when frame 0 is not registered every row is NaN (nothing is relative to it).
"""
from __future__ import annotations

import os
import tempfile

import numpy as np

from ddpo_grpo.errors import ConfigError


def _pycolmap():
    try:
        import pycolmap
    except ImportError:
        raise ConfigError("pose estimator 'glomap' needs pycolmap: pip install pycolmap") from None
    return pycolmap


def estimate_glomap(frames, K, max_side: int = 832, matching: str = "sequential", overlap: int = 10,
                    max_features: int = 4096, ba_iterations: int = 3, retriangulate: bool = True,
                    max_tracks: int = -1, num_threads: int = 1, seed: int = 0) -> np.ndarray:
    """Camera-to-world poses relative to frame 0 (F, 4, 4) float64 from frames (F, 3, H, W) in [0, 1] and K (3, 3)
    (OpenCV pixels), by pycolmap's SIFT extraction, `matching` ("sequential": each frame with its `overlap` successors
    and quadratic ones, as the papers' runs; "exhaustive": all pairs) and its global mapper (GLOMAP). max_side: the
    longer side SIFT sees (COLMAP's max_image_size); ba_iterations, retriangulate, max_tracks (-1: all): the global
    mapper's bundle adjustment rounds, retriangulation and track budget (1 / False / 1000 is ~3x cheaper on 21 frames
    at 416 x 240, the benchmark's setting for many clips); num_threads: for extraction, matching and mapping (1: one core,
    as a reward worker gets). NaN rows for frames not registered."""
    pycolmap = _pycolmap()
    if hasattr(frames, "detach"):  # torch
        frames = frames.detach().float().cpu().numpy()
    x = np.asarray(frames, dtype=np.float32)
    K = np.asarray(K.detach().cpu() if hasattr(K, "detach") else K, dtype=np.float64)
    if x.ndim != 4 or x.shape[1] != 3 or K.shape != (3, 3):
        raise ConfigError(f"glomap: frames must be (F, 3, H, W) and K (3, 3), got {tuple(x.shape)} and {K.shape}")
    if matching not in ("sequential", "exhaustive"):
        raise ConfigError(f"glomap: matching must be 'sequential' or 'exhaustive', got {matching!r}")
    F = len(x)
    out = np.full((F, 4, 4), np.nan)
    if F == 0:
        return out
    out[0] = np.eye(4)
    if F < 2 or not np.isfinite(x).all() or min(x.shape[2:]) < 16:
        return out
    import cv2
    with tempfile.TemporaryDirectory(prefix="glomap_") as tmp:
        img_dir, db, rec_dir = os.path.join(tmp, "images"), os.path.join(tmp, "db.db"), os.path.join(tmp, "sparse")
        os.makedirs(img_dir)
        os.makedirs(rec_dir)
        names = [f"{j:04d}.png" for j in range(F)]
        for j, name in enumerate(names):
            rgb = (np.clip(x[j].transpose(1, 2, 0), 0, 1) * 255 + 0.5).astype(np.uint8)
            cv2.imwrite(os.path.join(img_dir, name), rgb[:, :, ::-1])
        # COLMAP puts the top-left pixel's centre at (0.5, 0.5); OpenCV at (0, 0)
        params = f"{K[0, 0]},{K[1, 1]},{K[0, 2] + 0.5},{K[1, 2] + 0.5}"
        reader = pycolmap.ImageReaderOptions(camera_model="PINHOLE", camera_params=params)
        extract = pycolmap.FeatureExtractionOptions(num_threads=num_threads, max_image_size=int(max_side))
        extract.sift.max_num_features = int(max_features)
        pycolmap.extract_features(db, img_dir, camera_mode=pycolmap.CameraMode.SINGLE, reader_options=reader,
                                  extraction_options=extract, device=pycolmap.Device.cpu)
        match = pycolmap.FeatureMatchingOptions(num_threads=num_threads)
        if matching == "sequential":
            pycolmap.match_sequential(db, matching_options=match, device=pycolmap.Device.cpu,
                                      pairing_options=pycolmap.SequentialPairingOptions(overlap=int(overlap)))
        else:
            pycolmap.match_exhaustive(db, matching_options=match, device=pycolmap.Device.cpu)
        opts = pycolmap.GlobalPipelineOptions(num_threads=num_threads, random_seed=seed)
        opts.mapper.ba_num_iterations = int(ba_iterations)
        opts.mapper.skip_retriangulation = not retriangulate
        if max_tracks > 0:
            opts.mapper.keep_max_num_tracks = int(max_tracks)
        ba = opts.mapper.bundle_adjustment
        ba.refine_focal_length = ba.refine_principal_point = ba.refine_extra_params = False  # intrinsics are K
        try:
            models = pycolmap.global_mapping(db, img_dir, rec_dir, opts)
        except Exception:  # noqa: BLE001 - a clip GLOMAP cannot reconstruct is NaN rows, as for the other estimators
            models = {}
    if not models:
        return out
    rec = max(models.values(), key=lambda r: r.num_reg_images())
    w2c = {}
    for img in rec.images.values():
        if img.has_pose:
            m = np.eye(4)
            m[:3] = np.asarray(img.cam_from_world().matrix(), dtype=np.float64)
            w2c[names.index(img.name)] = m
    if 0 not in w2c:
        out[0] = np.nan
        return out
    for j, m in w2c.items():
        out[j] = w2c[0] @ np.linalg.inv(m)  # inv(c2w_0) @ c2w_j
    return out

"""cam_score's camera estimators on held-out renders: time per clip at the user's shape, accuracy per preset, and
agreement with the papers' tool (GLOMAP).

    python benchmarks/cam_score_bench.py                 # the default run (docs/cam_score_bench.json)
    python benchmarks/cam_score_bench.py --quick         # ~1-2 minutes: a smoke run (not saved unless --out)

Clips are room3d scenes (procedural textured rooms, exact pinhole ray casting, ReCamMaster's 24 mm lens) filmed along
ReCamMaster's ten presets; the estimator gets the 21 latent frames (clip frames 0, 4, ..., 80 of 81), as cam_score
does, and only those are rendered. Every process runs OpenCV and pycolmap on one thread (cv2.setNumThreads(1),
num_threads=1): times are CPU seconds per clip per core (time.process_time).

  1. user shape: the ten presets at 480 x 832 (scene --scene), "two_view" (cam_score's default): CPU seconds per clip,
     and the accuracy per preset against the true path: rotation error (degrees, mean / max over frames 1-20),
     translation-direction error (degrees, frames whose true translation is non-zero), RotErr / TransErr / CamMC
     (pose_score.camera_metrics, the papers' definitions), the failed-frame fraction, and the reward's score of the
     true clip (pose_score.PoseScore).
  2. agreement: one clip per --scenes seed and preset at 240 x 416, the camera at one of VARIANTS of the preset
     (amplitude 0.5 / 0.75 / 1 / 1.5 or mirrored: a generator that under- or overshoots or turns the wrong way), each estimated by "two_view" and by "glomap" (pycolmap's global mapper,
     the cheaper setting: 1 bundle-adjustment round, no retriangulation, 1000 tracks, sequential matching overlap 5);
     per clip RotErr / TransErr / CamMC of each estimate against the REQUEST (the preset at amplitude 1) as the papers
     report them, and against the truth. Spearman rank correlations across clips: two_view vs glomap, and each vs the
     metric of the true path (what a perfect estimator would report).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpo_grpo.worlds import room3d  # noqa: E402
from ddpo_grpo.worlds.recam.pose_estimators import POSE_ESTIMATORS  # noqa: E402
from ddpo_grpo.worlds.recam.pose_score import PoseScore, camera_metrics, rotation_angle, vector_angle  # noqa: E402
from ddpo_grpo.worlds.recam.recammaster_cameras import CAM_TYPES  # noqa: E402
from ddpo_grpo.worlds.room3d.paths import preset_path  # noqa: E402

# what the generator did, against the preset it was asked for: (amplitude, mirrored)
VARIANTS = [(1.0, False), (0.5, False), (1.0, True), (1.5, False), (0.75, False)]
GLOMAP_CHEAP = dict(max_side=416, max_features=2048, overlap=5, ba_iterations=1, retriangulate=False, max_tracks=1000)


def _one_thread():
    import cv2
    cv2.setNumThreads(1)


def frame_errors(est: np.ndarray, true: np.ndarray) -> dict:
    """Per-frame rotation error and translation-direction error (degrees) of est against true (both relative to
    frame 0), over the measured frames 1 ... F-1; directions where the true translation is non-zero."""
    ok = np.isfinite(est).all(axis=(1, 2))
    ok[0] = False
    rot = np.degrees(rotation_angle(est[ok, :3, :3], true[ok, :3, :3]))
    moving = ok & (np.linalg.norm(true[:, :3, 3], axis=1) > 1e-6)
    te = est[moving, :3, 3]
    d = np.where(np.linalg.norm(te, axis=1) > 0, np.degrees(vector_angle(te, true[moving, :3, 3])), 90.0)
    f = lambda v, g: float(g(v)) if len(v) else None  # noqa: E731
    return {"rot_deg_mean": f(rot, np.mean), "rot_deg_max": f(rot, np.max),
            "dir_deg_mean": f(d, np.mean), "dir_deg_max": f(d, np.max)}


def _job(job: dict) -> dict:
    """Render one clip and run the estimators on it (in a worker process)."""
    _one_thread()
    h, w = job["shape"]
    scene = room3d.make_scene(job["scene"])
    K = room3d.intrinsics(h, w)
    true = preset_path(job["preset"], 81, amplitude=job["amplitude"], mirror=job["mirror"])[::4][:: job["step"]]
    req = preset_path(job["preset"], 81)[::4][:: job["step"]]
    frames = room3d.render_clip(scene, room3d.source_pose(scene) @ true, K, h, w)
    out = dict(job, preset_name=CAM_TYPES[job["preset"]], frames=len(frames),
               truth_vs_request={k: camera_metrics(true, req)[k] for k in ("RotErr", "TransErr", "CamMC")})
    for name in job["estimators"]:
        kw = GLOMAP_CHEAP if name == "glomap" else {}
        t = time.process_time()
        est = POSE_ESTIMATORS[name](frames, K, **kw)
        cpu = time.process_time() - t
        m_true, m_req = camera_metrics(est, true), camera_metrics(est, req)
        out[name] = {"cpu_s": cpu, "vs_truth": {**m_true, **frame_errors(est, true)},
                     "vs_request": {k: m_req[k] for k in ("RotErr", "TransErr", "CamMC")},
                     "score_vs_request": PoseScore().clip(est, req), "score_vs_truth": PoseScore().clip(est, true)}
    return out


def spearman(a, b) -> float:
    """Spearman rank correlation of two sequences (average ranks for ties), over pairs where both are finite."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    if len(a) < 3:
        return float("nan")

    def rank(v):
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for x in np.unique(v):  # ties share their average rank
            r[v == x] = r[v == x].mean()
        return r
    ra, rb = rank(a), rank(b)
    return float(np.corrcoef(ra, rb)[0, 1]) if ra.std() > 0 and rb.std() > 0 else float("nan")


def _fmt(v, p=3):
    return "-" if v is None or (isinstance(v, float) and not np.isfinite(v)) else f"{v:.{p}f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a ~1-2 minute smoke run")
    ap.add_argument("--scene", type=int, default=1000, help="scene seed of the user-shape clips (held out)")
    ap.add_argument("--scenes", type=int, nargs="+", default=[1001, 1002, 1003, 1004, 1005],
                    help="scene seeds of the agreement clips (one clip per scene and preset)")
    ap.add_argument("--no-glomap", action="store_true", help="skip GLOMAP (pycolmap)")
    ap.add_argument("--workers", type=int, default=2, help="processes (each one thread)")
    ap.add_argument("--out", default=None, help="JSON path (default docs/cam_score_bench.json; --quick: none)")
    a = ap.parse_args(argv)
    glomap = not a.no_glomap
    if glomap:
        try:
            import pycolmap  # noqa: F401
        except ImportError:
            print("pycolmap missing (pip install pycolmap): GLOMAP skipped")
            glomap = False
    presets = list(CAM_TYPES)
    user = [dict(scene=a.scene, preset=p, amplitude=1.0, mirror=False, shape=(480, 832), step=1,
                 estimators=["two_view"], part="user_shape") for p in (presets if not a.quick else [1, 9])]
    est = ["two_view"] + (["glomap"] if glomap else [])
    scenes = a.scenes[:2] if a.quick else a.scenes
    agree = []
    for i, s in enumerate(scenes):
        for p in (presets if not a.quick else [1, 5, 8, 9, 10]):
            amp, mirror = VARIANTS[(i + p) % len(VARIANTS)]  # each preset meets every variant across the scenes
            agree.append(dict(scene=s, preset=p, amplitude=amp, mirror=mirror, shape=(240, 416),
                              step=(4 if a.quick else 1), estimators=est, part="agreement"))
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=max(1, a.workers)) as pool:
        rows = list(pool.map(_job, user + agree))
    wall = time.time() - t0
    users = [r for r in rows if r["part"] == "user_shape"]
    agreements = [r for r in rows if r["part"] == "agreement"]

    print(f"cam_score_bench: {len(rows)} clips in {wall:.0f} s wall ({a.workers} workers, one thread each)")
    cpu = [r["two_view"]["cpu_s"] for r in users]
    print(f"\n1. two_view at 21 latent frames of 81 x 480 x 832 (scene {a.scene}): CPU s per clip mean "
          f"{np.mean(cpu):.2f}, max {np.max(cpu):.2f} (goal <= 5)")
    print(f"{'preset':15s} {'rot mean':>8s} {'rot max':>8s} {'dir mean':>8s} {'dir max':>8s} {'RotErr':>7s} "
          f"{'TransErr':>8s} {'CamMC':>7s} {'failed':>6s} {'score':>6s} {'cpu s':>6s}")
    for r in users:
        v = r["two_view"]["vs_truth"]
        print(f"{r['preset_name']:15s} {_fmt(v['rot_deg_mean']):>8s} {_fmt(v['rot_deg_max']):>8s} "
              f"{_fmt(v['dir_deg_mean'], 2):>8s} {_fmt(v['dir_deg_max'], 2):>8s} {_fmt(v['RotErr'], 4):>7s} "
              f"{_fmt(v['TransErr']):>8s} {_fmt(v['CamMC']):>7s} {v['failed_fraction']:6.2f} "
              f"{r['two_view']['score_vs_truth']:6.3f} {r['two_view']['cpu_s']:6.2f}")

    summary = {"user_shape": {"shape": [81, 480, 832], "latent_frames": 21, "scene": a.scene,
                              "two_view_cpu_s_mean": float(np.mean(cpu)), "two_view_cpu_s_max": float(np.max(cpu))}}
    print(f"\n2. {len(agreements)} clips at 240 x 416 (scenes {scenes}, variants (amplitude, mirrored) {VARIANTS}, "
          f"{agreements[0]['frames']} latent frames): accuracy against the truth per preset")
    per_preset = {}
    for name in est:
        print(f"  {name}: {'preset':15s} {'rot mean':>8s} {'rot max':>8s} {'dir mean':>8s} {'dir max':>8s} "
              f"{'failed':>6s} {'cpu s':>6s}")
        for p in sorted({r["preset"] for r in agreements}):
            rs = [r for r in agreements if r["preset"] == p]
            g = lambda k: [r[name]["vs_truth"][k] for r in rs if r[name]["vs_truth"][k] is not None]  # noqa: E731
            row = {"rot_deg_mean": float(np.mean(g("rot_deg_mean"))) if g("rot_deg_mean") else None,
                   "rot_deg_max": float(np.max(g("rot_deg_max"))) if g("rot_deg_max") else None,
                   "dir_deg_mean": float(np.mean(g("dir_deg_mean"))) if g("dir_deg_mean") else None,
                   "dir_deg_max": float(np.max(g("dir_deg_max"))) if g("dir_deg_max") else None,
                   "failed_fraction": float(np.mean(g("failed_fraction"))),
                   "cpu_s": float(np.mean([r[name]["cpu_s"] for r in rs]))}
            per_preset.setdefault(name, {})[CAM_TYPES[p]] = row
            print(f"  {'':{len(name)}s}  {CAM_TYPES[p]:15s} {_fmt(row['rot_deg_mean']):>8s} "
                  f"{_fmt(row['rot_deg_max']):>8s} {_fmt(row['dir_deg_mean'], 2):>8s} "
                  f"{_fmt(row['dir_deg_max'], 2):>8s} {row['failed_fraction']:6.2f} {row['cpu_s']:6.2f}")
    corr = {}
    for metric in ("RotErr", "TransErr", "CamMC"):
        truth = [r["truth_vs_request"][metric] for r in agreements]
        two = [r["two_view"]["vs_request"][metric] for r in agreements]
        c = {"two_view_vs_truth": spearman(two, truth)}
        if glomap:
            glo = [r["glomap"]["vs_request"][metric] for r in agreements]
            c.update(two_view_vs_glomap=spearman(two, glo), glomap_vs_truth=spearman(glo, truth))
        corr[metric] = c
    print(f"\n   Spearman rank correlation over {len(agreements)} clips of the metric against the request:")
    for metric, c in corr.items():
        print(f"   {metric:8s} " + "  ".join(f"{k} {_fmt(v)}" for k, v in c.items()))
    for name in est:
        print(f"   {name}: CPU s per clip mean {np.mean([r[name]['cpu_s'] for r in agreements]):.2f}, "
              f"failed frames {np.mean([r[name]['vs_truth']['failed_fraction'] for r in agreements]):.3f}")
    summary["agreement"] = {"clips": len(agreements), "shape": [240, 416], "frames": agreements[0]["frames"],
                            "scenes": scenes, "variants": VARIANTS, "glomap_settings": GLOMAP_CHEAP if glomap else None,
                            "spearman": corr, "per_preset_vs_truth": per_preset,
                            "cpu_s_mean": {n: float(np.mean([r[n]["cpu_s"] for r in agreements])) for n in est}}
    out = a.out or (None if a.quick else os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       "docs", "cam_score_bench.json"))
    if out:
        with open(out, "w") as f:
            json.dump({"command": "python benchmarks/cam_score_bench.py" + (" --quick" if a.quick else ""),
                       "wall_s": wall, "workers": a.workers, "summary": summary, "clips": rows}, f, indent=1,
                      default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x))
        print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

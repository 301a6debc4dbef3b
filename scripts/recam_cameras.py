"""Print the camera numbers the trainer feeds for one (source, target) pair of a MultiCamVideo scene, as JSON: a list
of F' rows of 12 numbers (the target camera's poses at frames 0, 4, ..., 80 relative to the source camera's frame 0,
ReCamMaster's conversion: ddpo_grpo/worlds/recam/recammaster_cameras.py), so that you can check your data.

    python scripts/recam_cameras.py MultiCamVideo-Dataset/train/f18_aperture10/scene1 1 3
    python scripts/recam_cameras.py SCENE_DIR 1 3 --num-frames 9     # a 9-frame model: every 10th frame's pose

SOURCE and TARGET are camera numbers (cam01 = 1). Bad input is one line, exit 2.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ddpo_grpo.errors import ConfigError  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scene", help="a scene folder (with cameras/camera_extrinsics.json)")
    ap.add_argument("source", type=int, help="source camera number (cam01 = 1)")
    ap.add_argument("target", type=int, help="target camera number")
    ap.add_argument("--num-frames", type=int, default=81, help="the model's frames (1 + 4k, 5 to 81)")
    args = ap.parse_args(argv)
    try:
        from ddpo_grpo.worlds.recam.multicam import frame_stride
        from ddpo_grpo.worlds.recam.recammaster_cameras import pair_numbers

        path = os.path.join(args.scene, "cameras", "camera_extrinsics.json")
        if not os.path.isfile(path):
            raise ConfigError(f"{path!r} is missing (SCENE_DIR must hold cameras/camera_extrinsics.json)")
        try:
            with open(path) as f:
                extr = json.load(f)
        except ValueError as e:
            raise ConfigError(f"{path!r} is not JSON ({e})") from None
        if args.source < 1 or args.target < 1:
            raise ConfigError("SOURCE and TARGET are camera numbers >= 1 (cam01 = 1)")
        stride = frame_stride(args.num_frames)
        nums = pair_numbers(extr, args.source, args.target, (args.num_frames - 1) // 4 + 1, stride, where=path)
    except ConfigError as e:
        print(f"recam_cameras: {e}", file=sys.stderr)
        return 2
    print(json.dumps([[float(v) for v in row] for row in nums]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

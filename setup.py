import os
import runpy

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))

# assets/<name>: the models named in ddpo_grpo.models.BUNDLED (not pretraining snapshots next to them).
BUNDLED_MODELS = ("tiny-t2i", "tiny-t2i-noisy", "tiny-flow", "tiny-recam", "tiny-recam-video", "tiny-recam3d")

setup(
    name="ddpo_grpo",
    version="0.1.0",
    description="GRPO fine-tuning for diffusion and flow-matching models (DDPO-style, group-relative advantages)",
    # The bundled tiny models live in the top-level assets/ folder; a wheel (or a non-editable install) carries
    # them as the data of a package "ddpo_grpo.assets" mapped onto that folder, i.e. in ddpo_grpo/assets/<name>/,
    # which is where an installed copy's models.ASSETS_DIR points. An editable install reads assets/ in place.
    packages=find_packages(include=["ddpo_grpo", "ddpo_grpo.*"]) + ["ddpo_grpo.assets"],
    package_dir={"ddpo_grpo.assets": "assets"},
    package_data={"ddpo_grpo.assets": [f"{name}/{pattern}" for name in BUNDLED_MODELS
                                       for pattern in ("*.json", "*/*.json", "*/*.safetensors", "*.ckpt")],
                  # ReCamMaster's ten inference trajectories, converted (MIT notice inside: worlds/recam/recammaster_cameras.py)
                  "ddpo_grpo.worlds.recam": ["recammaster_trajectories.json"]},
    python_requires=">=3.10",
    # Every range admits the CPU wheel torch==2.13.0, so pip never swaps in a multi-GB CUDA build.
    install_requires=[
        "torch>=2.1,<2.14",
        # The versions tested (the camera hooks of models.recam, the Wan / SD3 / Flux classes): 0.42.x.
        "diffusers>=0.42.1,<0.43",
        "accelerate>=0.30",
        "transformers>=4.40",
        "peft>=0.10",
        "wandb>=0.16",
        "tensorboard>=2.12",
        "ml_collections>=0.1.1",
        "absl-py>=1.0",
        "pillow>=9.0",
        "tqdm>=4.60",
        "numpy>=1.24",
        "safetensors>=0.4",
        "matplotlib>=3.6",
        # mp4 in / out for ReCamMaster data (worlds/recam/video_io.py: why PyAV); the version tested
        "av>=18.1,<19",
        # cam_score's default camera estimator on real video (two-view geometry: SIFT, MAGSAC; worlds/recam)
        "opencv-python-headless>=4.8",
    ],
    extras_require={
        # pycolmap: GLOMAP (its global mapper), the papers' own camera estimator, for cam_score's evaluation
        "test": ["pytest>=7", "pytest-timeout>=2.1", "pytest-xdist>=3.0", "hypothesis>=6.0", "pycolmap>=3.11"],
        "eval": ["pycolmap>=3.11"],
        # Ascend NPU: torch_npu is pinned to the torch release; it also needs Huawei's CANN libraries.
        "npu": ["torch_npu==2.13.0"],
    },
    # ddpo_grpo/plugins.py: the one list (its registries read it there too when ddpo_grpo is not installed)
    entry_points=runpy.run_path(os.path.join(HERE, "ddpo_grpo", "plugins.py"))["setup_entry_points"](),
)

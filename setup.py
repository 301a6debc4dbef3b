from setuptools import find_packages, setup

# ddpo_grpo/assets/<name>: the models named in ddpo_grpo.models.BUNDLED (not pretraining snapshots next to them).
BUNDLED_MODELS = ("tiny-t2i", "tiny-t2i-noisy", "tiny-flow", "tiny-recam")

setup(
    name="ddpo_grpo",
    version="0.1.0",
    description="GRPO fine-tuning for diffusion and flow-matching models (DDPO-style, group-relative advantages)",
    packages=find_packages(include=["ddpo_grpo", "ddpo_grpo.*"]),
    # The bundled tiny models (ddpo_grpo/assets/<name>/<part>/...), so that a wheel or a non-editable install
    # finds them too (models.ASSETS_DIR is relative to the package).
    package_data={"ddpo_grpo": [f"assets/{name}/{pattern}" for name in BUNDLED_MODELS
                                for pattern in ("*.json", "*/*.json", "*/*.safetensors")]},
    python_requires=">=3.10",
    # Every range admits the CPU wheel torch==2.13.0, so pip never swaps in a multi-GB CUDA build.
    install_requires=[
        "torch>=2.1,<2.14",
        "diffusers>=0.30",
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
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout>=2.1", "hypothesis>=6.0"],
        # Ascend NPU: torch_npu is pinned to the torch release; it also needs Huawei's CANN libraries.
        "npu": ["torch_npu==2.13.0"],
    },
    entry_points={
        "ddpo_grpo.rewards": [
            # The worlds' rewards are plugins, as a user's would be (ddpo_grpo.rewards imports no world).
            "toyworld = ddpo_grpo.worlds.toyworld.reward:make_toyworld_reward",
            "cam_score = ddpo_grpo.worlds.recam.cam_score:make_cam_score",
            "unifiedscore = ddpo_grpo.worlds.recam.unifiedscore:make_unifiedscore",
        ],
    },
)

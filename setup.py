from setuptools import find_packages, setup

setup(
    name="ddpo_grpo",
    version="0.1.0",
    description="GRPO fine-tuning for diffusion and flow-matching models (DDPO-style, group-relative advantages)",
    packages=find_packages(include=["ddpo_grpo", "ddpo_grpo.*"]),
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
            "toyworld = ddpo_grpo.rewards.toyworld:make_toyworld_reward",
            "cam_score = ddpo_grpo.recam.cam_score:make_cam_score",
            "unifiedscore = ddpo_grpo.recam.unifiedscore:make_unifiedscore",
        ],
    },
)

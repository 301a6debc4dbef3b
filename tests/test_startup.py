"""Start-up visible (issue 50): a run prints, after its first sampling step, one line with the phases of its start
(trainer/run/startup.py), measured in build_context, the prompt-embedding cache and a one-shot hook on the denoiser."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"^startup: load (\d+\.\d) s, move (\d+\.\d) s, embeddings (\d+\.\d) s \((\d+) prompts\), "
                  r"first sampling step (\d+\.\d) s$")


def test_a_tiny_run_prints_the_startup_line_once_with_numbers(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, "scripts/train.py", "--config", "config/grpo.py:tiny", "--config.num_epochs=1",
                        f"--config.logdir={tmp_path}", "--config.run_name=r", "--config.sample.num_steps=2",
                        "--config.sample.batch_size=4", "--config.sample.num_batches_per_epoch=1",
                        "--config.sample.k=2", "--config.train.batch_size=4", "--config.eval_freq=0",
                        "--config.save_freq=0", "--config.logging.wandb=False", "--config.logging.image_freq=0",
                        "--config.data.cache_embeddings=True"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [line for line in p.stdout.splitlines() if line.startswith("startup:")]
    assert len(lines) == 1, p.stdout[-3000:]  # once: the hook removes itself after the first call
    m = LINE.match(lines[0])
    assert m, lines[0]
    load, move, embeddings, prompts, first = m.groups()
    # data.cache_embeddings: the whole prompt set is encoded in build_context (train and eval prompts and the CFG
    # negative ""), each once
    sys.path.insert(0, os.path.join(ROOT, "config"))
    import grpo
    from ddpo_grpo.trainer.run.data import build_dataset
    from ddpo_grpo.trainer.run.embeddings import dataset_prompts

    config = grpo.get_config("tiny")
    expected = set(dataset_prompts(build_dataset(config, "train")) + dataset_prompts(build_dataset(config, "eval"))
                   + [""])
    assert int(prompts) == len(expected) and float(embeddings) > 0
    assert float(load) > 0  # building the tiny pipeline takes measurable time; the others may round to 0.0

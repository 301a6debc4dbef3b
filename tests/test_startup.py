"""Start-up visible (issue 50): a run prints, after its first sampling step, one line with the phases of its start
(trainer/run/startup.py), measured in build_context, the prompt-embedding cache and a one-shot hook on the denoiser;
a line of its own beside the progress bar it is printed under (issue 61)."""
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
                       cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:]
    # stdout and stderr in one stream, as in a log written with 2>&1: the line starts a line of the log (split at
    # newlines only), not glued to the sampling bar's (stderr) line, which it is printed in the middle of
    lines = [line for line in p.stdout.split("\n") if line.startswith("startup:")]
    assert len(lines) == 1, p.stdout[-3000:]  # once: the hook removes itself after the first call
    assert p.stdout.count("startup:") == 1
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


BAR_AND_LINE = r"""
from tqdm.auto import tqdm
from ddpo_grpo.trainer.run.startup import write_line
print("before", flush=True)
bar = tqdm(range(4), desc="epoch 0: sampling", leave=False)  # drawn on stderr at once: "epoch 0: sampling:   0%|..."
write_line("startup: load 1.0 s")
bar.update(1)
bar.close()
print("after", flush=True)
"""


def test_the_startup_line_starts_a_line_of_a_log_beside_a_drawn_bar(tmp_path):
    """write_line while a bar is drawn, stdout and stderr into one file (`> log 2>&1`): the line starts a line of the
    file and one of what a terminal shows of it (where a carriage return goes back to the line's start), and the bar
    is drawn again after it. A plain print here gave "epoch 0: sampling:   0%|          | 0/4 [...]startup: ..."."""
    log = tmp_path / "log"
    env = dict(os.environ, PYTHONPATH=ROOT)
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-c", BAR_AND_LINE], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                       check=True, timeout=120)
    text = log.read_text()
    lines = text.split("\n")
    assert [line for line in lines if "startup:" in line] == ["startup: load 1.0 s"], text
    shown = [part for line in lines for part in line.split("\r")]
    assert "startup: load 1.0 s" in shown, text
    start = text.index("startup:")
    assert "epoch 0: sampling" in text[:start] and "epoch 0: sampling" in text[start:], text  # cleared, redrawn
    assert lines[0] == "before" and "after" in lines

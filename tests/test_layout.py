"""The package layout: the math in ddpo_grpo.core imports without accelerate; ddpo-pytorch's public paths still
work; `import ddpo_grpo` stays light; the generic rewards package imports no world (worlds are plugins)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ("common", "ddim_with_logprob", "sde_with_logprob", "policy_step", "pipeline_with_logprob", "stat_tracking",
        "loss", "reference", "forward_loss")


def run_py(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_core_imports_without_accelerate():
    # None in sys.modules makes `import accelerate` (and any accelerate.x) raise ImportError.
    code = ("import sys; sys.modules['accelerate'] = None\n"
            + "".join(f"import ddpo_grpo.core.{m}\n" for m in CORE)
            + "import ddpo_grpo.diffusers_patch.ddim_with_logprob, ddpo_grpo.diffusers_patch.pipeline_with_logprob\n"
            + "import ddpo_grpo.stat_tracking\n"
            + "assert not any(m == 'ddpo_grpo.trainer' or m.startswith('ddpo_grpo.trainer.') for m in sys.modules)\n"
            + "print('ok')")
    p = run_py(code)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_public_ddpo_pytorch_names():
    p = run_py(
        "import sys, ddpo_grpo\n"
        "assert 'torch' not in sys.modules and 'accelerate' not in sys.modules  # the package root is light\n"
        "from ddpo_grpo.diffusers_patch.ddim_with_logprob import ddim_step_with_logprob\n"
        "from ddpo_grpo.diffusers_patch.pipeline_with_logprob import pipeline_with_logprob\n"
        "from ddpo_grpo.stat_tracking import PerPromptStatTracker\n"
        "from ddpo_grpo.core import ddim_with_logprob, pipeline_with_logprob as pipe, stat_tracking\n"
        "assert ddim_step_with_logprob is ddim_with_logprob.ddim_step_with_logprob is ddpo_grpo.ddim_step_with_logprob\n"
        "assert pipeline_with_logprob is pipe.pipeline_with_logprob is ddpo_grpo.pipeline_with_logprob\n"
        "assert PerPromptStatTracker is stat_tracking.PerPromptStatTracker is ddpo_grpo.PerPromptStatTracker\n"
        "assert 'accelerate' not in sys.modules\n"
        "print('ok')")
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_rewards_import_no_world_and_find_world_rewards_by_entry_point():
    p = run_py(
        "import sys\n"
        "import ddpo_grpo.rewards as r\n"
        "assert not [m for m in sys.modules if m.startswith('ddpo_grpo.worlds')], 'rewards imported a world'\n"
        "assert {'toyworld', 'cam_score', 'unifiedscore'} <= set(r.available_rewards())\n"
        "from ddpo_grpo.worlds.toyworld.reward import make_toyworld_reward\n"
        "from ddpo_grpo.worlds.recam.cam_score import make_cam_score\n"
        "from ddpo_grpo.worlds.recam.unifiedscore import make_unifiedscore\n"
        "assert r.get_reward_factory('toyworld') is make_toyworld_reward\n"
        "assert r.get_reward_factory('cam_score') is make_cam_score\n"
        "assert r.get_reward_factory('unifiedscore') is make_unifiedscore\n"
        "print('ok')")
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]


def test_benchmarks_are_outside_the_library():
    assert not any(f.startswith("bench") for f in os.listdir(os.path.join(ROOT, "ddpo_grpo")))
    import benchmarks.bench_plots  # noqa: F401  (the repo root is on sys.path: tests/conftest.py)

"""Golden values of the named configs (tests/test_config_names.py): one JSON per name in tests/golden/configs/NAME.json,
the config's every field as config/grpo.py's get_config(NAME) builds it (sorted keys). A change of a default or of a
named config fails the test, naming the config and the field; when the change is meant, regenerate them all with

    python tests/golden/update.py

and name the change in the commit (git diff tests/golden shows it)."""
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(ROOT, "config", "grpo.py")
FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def grpo_module():
    spec = importlib.util.spec_from_file_location("grpo_configs_golden", GRPO)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def config_values(name: str) -> dict:
    """get_config(name) as plain JSON values (tuples become lists), through the same JSON text the golden file holds."""
    return json.loads(grpo_module().get_config(name).to_json_best_effort(sort_keys=True))


def golden_path(name: str) -> str:
    return os.path.join(FOLDER, f"{name}.json")


def write(name: str) -> str:
    path = golden_path(name)
    with open(path, "w") as f:
        json.dump(config_values(name), f, indent=1, sort_keys=True)
        f.write("\n")
    return path


def flat(d, prefix=""):
    """{"a": {"b": 1}} -> {"a.b": 1}; an empty dict stays a value (so {} and a missing section differ)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def differences(name: str) -> list:
    """One line per field whose value differs from the golden file's (or is in only one of them)."""
    with open(golden_path(name)) as f:
        want = flat(json.load(f))
    got = flat(config_values(name))
    missing = object()
    return [f"config {name!r}: field {k}: golden {want.get(k, '(absent)')!r}, now {got.get(k, '(absent)')!r}"
            for k in sorted(set(want) | set(got)) if want.get(k, missing) != got.get(k, missing)]

"""GRPO's reward functions: the user's plain Python callables, named in `grpo.rewards` as
"module:function" (imported) or "path/to/file.py:function" (loaded from the file, relative to the
current directory), and called as TRL calls them:

    fn(prompts, completions, **columns) -> one number (or None) per completion

`prompts[i]` is the prompt completion i answers (as its row gives it: text or messages),
`completions[i]` the completion's text, and each extra column of the prompt rows a keyword list
with completion i's value at i (None where that row lacks the column).

None means "this function does not apply to this completion" (TRL's convention): it is kept as
NaN in the function's own values (so its mean and std are taken over the completions it scored,
with nanmean) and left out of the weighted sum, as TRL's nansum leaves it; a completion no
function applies to is rewarded 0. A NaN or an infinity *returned* is a bug in the function and
is refused, as are a raise and a wrong number of values: `RewardFailed`, one sentence naming the
function.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import math
import numbers
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import ConfigError


class RewardFailed(ConfigError):
    """A reward function raised or returned what is not one finite number (or None) per
    completion: a mistake in the user's code, so it exits with status 2 like a config error.
    Raised in a training worker, its class reaches the launcher (`details`: launch.worker_entry),
    which then names the function and the resume instead of pointing at a traceback."""

    @property
    def details(self) -> dict:
        return {}


@dataclass
class Reward:
    name: str  # the function's __name__, made unique among the run's rewards: the name its figures are logged under
    fn: Callable
    weight: float


def load_rewards(specs: list[str], weights: list[float]) -> list[Reward]:
    """The functions `specs` name, with their weights (empty: 1.0 each)."""
    if weights and len(weights) != len(specs):
        raise ConfigError(f"grpo.reward_weights has {len(weights)} weights for {len(specs)} grpo.rewards; give one "
                          f"weight per reward function, or none (each 1.0)")
    rewards: list[Reward] = []
    for spec, weight in zip(specs, weights or [1.0] * len(specs)):
        fn, attr = _load(spec)
        name = getattr(fn, "__name__", None) or attr  # a callable object or a partial has no __name__
        taken, n = {r.name for r in rewards}, 2
        unique = name
        while unique in taken:  # two functions called "reward" from two files: reward, reward_2
            unique, n = f"{name}_{n}", n + 1
        rewards.append(Reward(unique, fn, float(weight)))
    return rewards


def check_rewards(grpo) -> None:
    """Load the [grpo] section's reward functions, so a bad entry stops the run (exit 2) before
    any worker starts."""
    load_rewards(grpo.rewards, grpo.reward_weights)


def _load(spec: str) -> tuple[Callable, str]:
    """(the callable `spec` names, its attribute name)."""
    where, _, attr = spec.rpartition(":")  # the last colon: a Windows path has one of its own
    if not where or not attr:
        raise ConfigError(f"grpo.rewards entry {spec!r} does not name a function after a colon; write it "
                          f"\"module:function\" or \"path/to/file.py:function\"")
    module = _load_file(spec, where) if where.endswith(".py") else _import(spec, where)
    if not hasattr(module, attr):
        functions = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        close = difflib.get_close_matches(attr, functions, n=1)
        listed = ", ".join(functions[:8]) + (", ..." if len(functions) > 8 else "")
        hint = f"did you mean {close[0]!r}?" if close else f"name one of its functions ({listed})"
        raise ConfigError(f"grpo.rewards entry {spec!r}: {where!r} has no {attr!r}; {hint}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise ConfigError(f"grpo.rewards entry {spec!r} names an object of type {type(fn).__name__}, not a function; "
                          f"name a function (prompts, completions, **columns) -> a number per completion")
    return fn, attr


def _import(spec: str, name: str):
    try:
        return importlib.import_module(name)
    except (Exception, SystemExit) as e:
        hint = "fix the module or the import path"
        if isinstance(e, ModuleNotFoundError) and e.name == name.split(".")[0]:
            # The `llmsplit` command does not put the current directory on the import path.
            hint = "give its file instead (\"path/to/file.py:function\") or add its folder to PYTHONPATH"
        raise ConfigError(f"grpo.rewards entry {spec!r}: importing {name!r} failed ({_first_line(e)}); "
                          f"{hint}") from None


def _load_file(spec: str, where: str):
    path = Path(where)
    if not path.is_file():
        # "a.py:f,b.py:g" from a shell: several entries typed as one.
        fix = "give each function its own entry: grpo.rewards=[\"a.py:f\", \"b.py:g\"]" if "," in spec \
            else "fix the path"
        raise ConfigError(f"grpo.rewards entry {spec!r}: the file {where!r} does not exist (relative paths start at "
                          f"{os.getcwd()!r}); {fix}")
    path = path.resolve()
    # One module per file (keyed by its path, so two rewards.py elsewhere stay apart), registered
    # in sys.modules as an import would be: dataclasses and pickling look a module up there, and
    # two functions from one file share it instead of running the file twice.
    name = f"llmsplit_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))  # its sibling modules import, as when the file is run itself
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        del sys.modules[name]
        raise ConfigError(f"grpo.rewards entry {spec!r}: loading {where!r} failed ({_first_line(e)}); fix the "
                          f"file") from None
    finally:
        if str(path.parent) in sys.path:  # unless the file took it off itself
            sys.path.remove(str(path.parent))
    return module


def score(rewards: list[Reward], prompts: list, completions: list[str],
          columns: list[dict]) -> tuple[list[float], dict[str, list[float]]]:
    """(each completion's reward: the weighted sum of the functions that apply to it, {function
    name: its values, NaN where it returned None}). `prompts`, `completions` and `columns` hold
    one entry per completion."""
    n = len(completions)
    assert len(prompts) == n and len(columns) == n, (len(prompts), n, len(columns))
    keys = list(dict.fromkeys(k for row in columns for k in row))  # every row's columns, first seen first
    total, per = [0.0] * n, {}
    for reward in rewards:
        # Copies: a function that changes its lists in place must not change what the next one sees.
        kwargs = {k: [row.get(k) for row in columns] for k in keys}
        try:
            out = reward.fn(list(prompts), list(completions), **kwargs)
        except Exception as e:
            raise RewardFailed(f"reward function {reward.name!r} raised {_first_line(e)}; fix the function") from e
        values = _values(reward.name, out, n)
        per[reward.name] = values
        total = [t if math.isnan(v) else t + reward.weight * v for t, v in zip(total, values)]
    return total, per


def _values(name: str, out, n: int) -> list[float]:
    """The function's output as floats (None: NaN), or refused."""
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
        raise RewardFailed(f"reward function {name!r} returned {type(out).__name__}, not a list of numbers; return "
                           f"one number (or None) per completion")
    if len(out) != n:
        raise RewardFailed(f"reward function {name!r} returned {len(out)} values for {n} completions; return one "
                           f"number (or None) per completion")
    values = []
    for i, v in enumerate(out):
        if v is not None and getattr(v, "ndim", None) == 0:
            v = v.item()  # a numpy or torch scalar, as from a function that returns an array
        if v is not None and not isinstance(v, numbers.Real):
            raise RewardFailed(f"reward function {name!r} returned {v!r} ({type(v).__name__}) for completion {i}; "
                               f"return a number, or None where the function does not apply")
        if v is not None and not math.isfinite(v):
            raise RewardFailed(f"reward function {name!r} returned {v} for completion {i}; return a finite number, "
                               f"or None where the function does not apply")
        values.append(math.nan if v is None else float(v))
    return values


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__

"""Rules every value of a config obeys, whatever its dialect, checked where the value is read (the YAML, a `--set`,
a DeepSpeed JSON) so that no later arithmetic or file-system call meets what no setting can mean:

* keys are names: a mapping key that YAML reads as a number, a boolean or null (`7: 1`, `on:`) is refused;
* nesting is at most MAX_DEPTH levels (the deepest real key, a DeepSpeed override or a dataset's roles, is ~5);
* numbers are finite: `.nan`, `.inf` are refused wherever they appear (no setting means them, and one reaching a
  learning rate or a scale trains nothing);
* whole numbers are at most MAX_INT (2**53, the largest a float holds exactly: the plan's arithmetic runs in
  floats) and a world is at most MAX_WORLD GPUs;
* a file path fits the file system: components of at most NAME_MAX bytes, at most PATH_MAX in all, no NUL byte.

The schema declares its fields with the types at the end (Float, Int, Size, PathStr, Jinja).
"""
from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, StrictInt, TypeAdapter, ValidationError

from adapter.errors import UserError, bad

MAX_DEPTH = 32
MAX_INT = 2**53
# The largest world nd-adapter plans or runs: the plan lists every rank and group (its time and JSON grow with the
# world), and no training cluster is larger than this.
MAX_WORLD = 65_536
NAME_MAX, PATH_MAX = 255, 4096  # bytes in one path component / a whole path (Linux file systems)
_BOOL = TypeAdapter(bool)
ID_KEYED = {"added_tokens_overrides"}  # Axolotl's token id -> name (refused by axolotl_scope, with its reason)


def _where(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def check_tree(value: Any, where: str = "") -> None:
    """Refuse, naming the key, a non-string mapping key, nesting deeper than MAX_DEPTH, or a non-finite number.
    Each container is walked once per remaining depth it is met at, so YAML aliases that repeat a subtree cost
    little."""
    budget: dict[int, int] = {}  # id(container) -> the largest depth budget it was already checked with
    stack = [(value, where, MAX_DEPTH)]
    while stack:
        v, path, left = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise bad(path or "config", v, "not a finite number", "give a finite number")
        if not isinstance(v, (dict, list, tuple)):
            continue
        if left <= 0:
            raise UserError(f"{path or 'config'}: nested deeper than {MAX_DEPTH} levels (no config key nests more "
                            "than a few). Fix: correct the YAML's indentation or brackets")
        if budget.get(id(v), -1) >= left:
            continue
        budget[id(v)] = left
        if isinstance(v, dict):
            for k, item in v.items():
                if not isinstance(k, str) and not (path in ID_KEYED and isinstance(k, int) and not isinstance(k, bool)):
                    kind = "null" if k is None else "true/false" if isinstance(k, bool) else "a number"
                    raise bad(_where(path, k), item, f"a key must be a name, and YAML reads this one as {kind}",
                              f"quote it (\"{k}\": ...) if it is meant, or remove it")
                stack.append((item, _where(path, k), left - 1))
        else:
            stack.extend((item, f"{path}[{i}]", left - 1) for i, item in enumerate(v))


def lax_bool(value: Any) -> bool | None:
    """`value` as pydantic (v2, lax) reads a bool: true/false, 0/1, and the strings "true", "false", "yes", "no",
    "on", "off", "t", "f", "y", "n", "1", "0" in any case; None for anything else. What Axolotl's schema and
    DeepSpeed's config models make of a flag."""
    try:
        return _BOOL.validate_python(value)
    except ValidationError:
        return None


def path_problem(value: str) -> str | None:
    """Why `value` cannot name a file (too long for the file system, a NUL byte), or None."""
    if "\x00" in value:
        return "holds a NUL byte, which no file name can"
    size = len(value.encode(errors="surrogateescape"))
    if size >= PATH_MAX:
        return f"is {size} bytes long; a path holds at most {PATH_MAX - 1}"
    longest = max((len(part.encode(errors="surrogateescape")) for part in value.split("/")), default=0)
    if longest > NAME_MAX:
        return f"has a name of {longest} bytes; file systems allow at most {NAME_MAX} per name"
    return None


def check_path(key: str, value: Any) -> None:
    """A path read before the schema validates it (base_model, a DeepSpeed JSON, `--config`): refused in one line."""
    problem = path_problem(value) if isinstance(value, str) else None
    if problem:
        raise bad(key, value, problem, "give the path of an existing file or directory")


def _number(value: Any) -> Any:
    if isinstance(value, bool):  # pydantic would read `lr: true` as 1.0
        raise ValueError("a number is expected, not true/false")
    return value


def _at_most(limit: int, why: str) -> AfterValidator:
    def check(value: int) -> int:
        if value > limit:
            raise ValueError(why)
        return value
    return AfterValidator(check)


def _path(value: str) -> str:
    problem = path_problem(value)
    if problem:
        raise ValueError(problem)
    return value


# The schema's types (config/schema.py, whose models also refuse non-finite numbers): numbers are never true/false;
# whole numbers at most 2**53, sizes of the world at most MAX_WORLD; paths fit the file system.
Float = Annotated[float, BeforeValidator(_number)]
Int = Annotated[StrictInt, _at_most(MAX_INT, f"larger than any setting can be (at most 2**53 = {MAX_INT:,}). Fix: "
                                             "give a smaller number")]
Size = Annotated[StrictInt, _at_most(MAX_WORLD, f"nd-adapter plans and runs at most {MAX_WORLD:,} GPUs (the plan "
                                     f"lists every rank and group). Fix: give at most {MAX_WORLD:,}")]
PathStr = Annotated[str, AfterValidator(_path)]
Jinja = Annotated[str, AfterValidator(lambda v: v if "{" in v else _path(v))]  # a template, or a file holding one


__all__ = ["MAX_DEPTH", "MAX_INT", "MAX_WORLD", "NAME_MAX", "PATH_MAX", "check_tree", "lax_bool", "path_problem",
           "check_path", "Float", "Int", "Size", "PathStr", "Jinja"]


class Strict(BaseModel):
    """Every config section's base: unknown keys refused (a typo never silently changes a run), frozen, and numbers
    finite (Float, Int, Size, PathStr above bound the rest)."""
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

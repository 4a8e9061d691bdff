"""Reading and rewriting a training script's own arguments, as lists (never a shell string)."""

from __future__ import annotations

from autotuner.core.errors import UsageError

CONFIG_FLAGS = ("--deepspeed", "--deepspeed_config")


def find_flag(args: tuple[str, ...], flag: str) -> tuple[int, str | None] | None:
    """Where `flag` is given: (index, value) for `--flag V` or `--flag=V`; value None if bare. Given
    twice, the last: the one argparse keeps (`--deepspeed a.json ... --deepspeed b.json` trains on b)."""
    found = None
    for index, arg in enumerate(args):
        if arg == flag:
            nxt = args[index + 1] if index + 1 < len(args) else None
            found = index, (nxt if nxt is not None and not nxt.startswith("--") else None)
        elif arg.startswith(flag + "="):
            found = index, arg[len(flag) + 1:]
    return found


def config_path(args: tuple[str, ...]) -> str | None:
    """The config file the script will be given (--deepspeed PATH, --deepspeed_config PATH, or = forms)."""
    for flag in reversed(CONFIG_FLAGS):  # --deepspeed_config wins over a bare --deepspeed
        found = find_flag(args, flag)
        if found and found[1] is not None:
            return found[1]
    return None


def set_flag(args: tuple[str, ...], flag: str, value: str) -> tuple[str, ...]:
    """Set every occurrence of `flag` to `value`, in both `--flag V` and `--flag=V` forms
    (argparse keeps the last one, so all must agree); append it when absent."""
    out: list[str] = []
    index, found = 0, False
    while index < len(args):
        arg = args[index]
        if arg.startswith(flag + "="):
            out.append(f"{flag}={value}")
            found = True
        elif arg == flag:
            out += [flag, value]
            found = True
            has_value = index + 1 < len(args) and not args[index + 1].startswith("--")
            index += 1 if has_value else 0
        else:
            out.append(arg)
        index += 1
    return tuple(out) if found else (*args, flag, value)


def replace_config(args: tuple[str, ...], path: str) -> tuple[str, ...]:
    """Point the script at another config, keeping whichever config flag the user used."""
    for flag in reversed(CONFIG_FLAGS):
        found = find_flag(args, flag)
        if found and found[1] is not None:
            return set_flag(args, flag, path)
    raise UsageError("no config among the script's arguments: pass --deepspeed PATH after the script")

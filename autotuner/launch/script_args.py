"""Reading and rewriting a training script's own arguments, as lists (never a shell string)."""

from __future__ import annotations

from autotuner.core.errors import UsageError

CONFIG_FLAGS = ("--deepspeed", "--deepspeed_config")
# What Hugging Face's bool flags (`string_to_bool`, an optional value) read as a value; any other
# token after a bare bool flag is the script's next argument, not the flag's.
BOOLEAN_WORDS = frozenset({"yes", "no", "true", "false", "t", "f", "y", "n", "1", "0"})


def _is_value(token: str | None, boolean: bool) -> bool:
    """Whether the token after a flag given as `--flag TOKEN` is the flag's value. An option (`-v`,
    `--x`) never is, a negative number is (as argparse reads it); after a bool flag only a bool word is."""
    if token is None:
        return False
    if token == "-":  # stdin, as argparse reads it
        return not boolean
    if boolean:
        return token.lower() in BOOLEAN_WORDS
    if token.startswith("-"):
        try:
            float(token)
        except ValueError:
            return False
    return True


def find_flag(args: tuple[str, ...], flag: str, *, boolean: bool = False) -> tuple[int, str | None] | None:
    """Where `flag` is given: (index, value) for `--flag V` or `--flag=V`; value None if bare. Given
    twice, the last: the one argparse keeps (`--deepspeed a.json ... --deepspeed b.json` trains on b).
    `boolean`: the flag is a bool flag, whose value is optional (see BOOLEAN_WORDS)."""
    found = None
    for index, arg in enumerate(args):
        if arg == flag:
            nxt = args[index + 1] if index + 1 < len(args) else None
            found = index, (nxt if _is_value(nxt, boolean) else None)
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


def set_flag(args: tuple[str, ...], flag: str, value: str, *, boolean: bool = False) -> tuple[str, ...]:
    """Set every occurrence of `flag` to `value`, in both `--flag V` and `--flag=V` forms
    (argparse keeps the last one, so all must agree); append it when absent. A bare occurrence
    gets the value inserted; the token after it stays the script's (`boolean`: see find_flag)."""
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
            has_value = _is_value(args[index + 1] if index + 1 < len(args) else None, boolean)
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


def without_flag(args: tuple[str, ...], flag: str) -> tuple[str, ...]:
    """`args` with every `--flag V`, `--flag=V` and bare `--flag` of a valued flag taken out."""
    out: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == flag:
            index += 2 if _is_value(args[index + 1] if index + 1 < len(args) else None, False) else 1
            continue
        if not arg.startswith(flag + "="):
            out.append(arg)
        index += 1
    return tuple(out)

"""Optional dependencies (pyproject.toml's extras): what needs one says which extra installs it, before any work."""
from __future__ import annotations

from importlib.util import find_spec


class MissingExtra(ModuleNotFoundError):
    """An optional dependency is not installed; the message is one line naming the extra that installs it."""


def require_extra(extra: str, user: str, *modules: str):
    """Raise MissingExtra if any of `modules` (top-level import names) is not installed; `user` names what needs
    them (a command, a task)."""
    missing = [name for name in modules if find_spec(name) is None]
    if missing:
        raise MissingExtra(f"{user} needs the {extra} extra: pip install 'flash-dllm[{extra}]' "
                           f"(missing: {', '.join(missing)})")

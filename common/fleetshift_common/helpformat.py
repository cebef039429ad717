"""One ``--help`` style for FleetShift's command lines: plain text with each option's default.

argparse's ``ArgumentDefaultsHelpFormatter`` appends "(default: X)" to every option, also
where the help already says what the default means ("default: a new temporary directory")
or where X says nothing (None, False, an empty string or list); this one leaves those out.
"""

from __future__ import annotations

import argparse
import re


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, "", []):
            return text
        return super()._get_help_string(action)


_ROLE = re.compile(r":[a-z]+:`([^`]*)`")


def plain_description(doc: str | None) -> str:
    """A module docstring as a ``--help`` description: reST literals (````x````) and roles
    (``:func:`x```) become plain text, and a leading "``fleetshift x``: " title (the usage
    line above already names the command) is left out."""
    text = _ROLE.sub(r"\1", (doc or "").strip()).replace("``", "")
    head, sep, rest = text.partition(": ")
    if sep and head.startswith("fleetshift ") and "\n" not in head:
        text = rest[:1].upper() + rest[1:]
    return text

"""One ``--help`` style for FleetShift's command lines: plain text with each option's default.

argparse's ``ArgumentDefaultsHelpFormatter`` appends "(default: X)" to every option, also
where the help already says what the default means ("default: a new temporary directory")
or where X says nothing (None, False, an empty string or list); this one leaves those out.
"""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, "", []):
            return text
        return super()._get_help_string(action)

"""A griffe extension for the API reference: Cadence's `Example:` sections are doctests.

Google style reads a singular `Example:` as an admonition (markdown, where
`>>>` lines become quotes); Cadence's docstrings use it for runnable examples,
so render it as an `Examples:` section (highlighted code).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)


class ExampleSections(griffe.Extension):
    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)

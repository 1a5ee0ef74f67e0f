"""A griffe extension (mkdocstrings, mkdocs.yml): our docstrings name code with Sphinx roles
(:func:`name`, :class:`~pkg.Name`); in the API reference each becomes inline code, as Markdown writes it."""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|obj|exc|const|term|ref):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(r"`\1`", obj.docstring.value)

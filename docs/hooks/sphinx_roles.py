"""MkDocs hook: render Sphinx-style roles left in docstrings as inline code.

The package's docstrings use reST roles such as ``:class:`GraphifyError``` and
``:func:`graphify```. mkdocstrings renders those as ``:class:<code>...</code>``;
this hook drops the role prefix so the page shows ``GraphifyError`` as code.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc|obj|data):(?=<code>)")


def on_page_content(html: str, **kwargs: Any) -> str:
    """Strip the role prefix in front of inline code in a page's HTML."""
    return _ROLE.sub("", html)

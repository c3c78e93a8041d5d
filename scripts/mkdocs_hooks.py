"""MkDocs hook: render the Sphinx cross-reference roles and doc-builder links of the docstrings as code.

The package's docstrings follow TRL's and transformers' conventions: Sphinx roles (``:class:`NoiseTable```,
``:func:`~trl_es.replay```) and doc-builder links (``[`ESTrainer`]``). mkdocstrings renders the Google sections but
leaves those markers as text (``:class:NoiseTable``); this hook turns them into the plain code they name.
"""

import re

_ROLE = re.compile(r":(?:class|func|meth|data|attr|mod|exc|obj|py:\w+):(<code>)~?")
_TILDE = re.compile(r"<code>~(?=[A-Za-z_])")
_BRACKETED = re.compile(r"\[(<code>[^<\]]+</code>)\]")


def on_page_content(html: str, **kwargs) -> str:
    """``:role:<code>x</code>`` -> ``<code>x</code>``; ``<code>~a.b</code>`` -> ``<code>a.b</code>``;
    ``[<code>X</code>]`` -> ``<code>X</code>``."""
    html = _ROLE.sub(r"\1", html)
    html = _TILDE.sub("<code>", html)
    return _BRACKETED.sub(r"\1", html)

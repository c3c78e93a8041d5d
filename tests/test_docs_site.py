"""The docs site builds strictly, every page of the nav is in it, and the API reference renders its docstrings
(Google sections as tables, no raw Sphinx roles). The page-by-page browser check is ``scripts/check_docs_site.py``
(Chromium; not run here)."""

import os
import re
import subprocess
import sys

import pytest
import yaml
from paths import REPO

ROOT = REPO
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from check_docs_site import _Loader, nav_pages  # noqa: E402

pytest.importorskip("mkdocs")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    folder = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ,
                                                                                          NO_MKDOCS_2_WARNING="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return folder


def test_every_nav_page_is_built_and_every_doc_is_in_the_nav(site):
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        pages = nav_pages(yaml.load(f, Loader=_Loader))
    assert pages[0] == "index.md" and len(pages) == len(set(pages))
    on_disk = sorted(n for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    assert sorted(pages) == on_disk  # no page left out of the nav, none missing
    for md in pages:
        stem = md[: -len(".md")]
        assert (site / ("index.html" if stem == "index" else f"{stem}/index.html")).is_file(), md


def test_api_reference_renders_docstring_sections_and_no_raw_roles(site):
    html = (site / "api" / "index.html").read_text()
    assert html.count("doc-section-title") > 100  # Args / Returns / Raises as sections
    text = re.sub(r"<[^>]+>", "", html)
    assert not re.search(r":(class|func|meth|data|attr|mod|exc):", text)
    assert not re.search(r"<p>(Args|Returns|Raises|Attributes):\s", html)  # a section left as a paragraph
    assert "learning_rate" in text and "population_size" in text  # ESConfig's fields, as a parameter table


def test_the_config_entries_list_their_generated_parameters(site):
    """mkdocstrings reads the source, which has no ``Parameters:`` for a config: ``document_parameters`` writes it
    from the fields' help at import time, and scripts/griffe_generated_docstrings.py puts it in the API reference."""
    from trl_es import ESConfig, ESParallelAveragingConfig, HyperESConfig, ParallelAveragingConfig

    html = (site / "api" / "index.html").read_text()
    for cls in (ESConfig, HyperESConfig, ParallelAveragingConfig, ESParallelAveragingConfig):
        start = html.index(f'id="trl_es.{cls.__name__}"')
        following = re.compile(r'id="trl_es\.[\w.]+"').search(html, start + 1)
        entry = html[start:following.start() if following else len(html)]
        documented = re.findall(r"^        (\w+) \(", cls.__doc__, flags=re.M)
        assert len(documented) >= 7, cls.__name__
        missing = [name for name in documented if not re.search(rf"<code>{name}</code>\s*</td>", entry)]
        assert missing == [], (cls.__name__, missing)
    text = " ".join(re.sub(r"<[^>]+>", "", html).split())
    assert "Training only: evaluate() scores every completion." in text  # a help text, rendered

"""Open every page of the built docs site in headless Chromium and report what a reader would trip on.

Builds the site (``mkdocs build --strict``) into a temporary folder, serves it on localhost, and for every page of
``mkdocs.yml``'s nav, at a desktop (1280 px) and a phone (390 px) width:

- takes a full-page screenshot (``--screenshots DIR``; keep them out of the repository);
- finds elements wider than the page (tables, code blocks, images: the page scrolls sideways at that width unless the
  element sits in its own scrolling box);
- finds images that did not load and images without a caption or alt text;
- finds raw-rendered Markdown or mkdocstrings directives (``:::``, a literal ``|---|`` table rule, unrendered
  ```` ``` ```` fences, a list that became a paragraph) in the visible text;
- follows every link to another page of the site and reports those that answer 404, and anchors that do not exist.

Needs Chromium (Debian: ``apt-get install chromium``) and Playwright (``pip install playwright``; the system browser
is used, nothing is downloaded)::

    python scripts/check_docs_site.py --chromium /usr/bin/chromium --screenshots /tmp/docs-shots

Prints one JSON report (per page and width: the findings) and exits 1 when there are findings.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading

import yaml

WIDTHS = {"desktop": (1280, 900), "phone": (390, 844)}

FINDINGS_JS = """
() => {
  const out = {wide: [], images: [], raw: [], links: []};
  const page = document.documentElement.clientWidth;
  const scrolls = (el) => {
    for (let p = el.parentElement; p; p = p.parentElement) {
      const s = getComputedStyle(p).overflowX;
      if ((s === 'auto' || s === 'scroll') && p.clientWidth <= page) return true;
    }
    return false;
  };
  for (const el of document.querySelectorAll('article table, article pre, article img, article .katex-display')) {
    const r = el.getBoundingClientRect();
    if ((r.right > page + 1 || r.left < -1) && !scrolls(el)) {
      out.wide.push({tag: el.tagName.toLowerCase(), width: Math.round(r.width), page: page,
                     text: (el.innerText || el.getAttribute('src') || '').slice(0, 60)});
    }
  }
  for (const img of document.querySelectorAll('article img')) {
    if (!img.complete || img.naturalWidth === 0) out.images.push({src: img.getAttribute('src'), problem: 'not loaded'});
    const fig = img.closest('figure');
    const caption = fig && fig.querySelector('figcaption');
    const next = img.parentElement && img.parentElement.nextElementSibling;
    const hasText = caption || (img.getAttribute('alt') || '').trim().length > 3 ||
                    (next && /^(figure|plot|the plot|above|\\*)/i.test(next.innerText.trim()));
    if (!hasText) out.images.push({src: img.getAttribute('src'), problem: 'no caption or alt text'});
  }
  const text = document.querySelector('article') ? document.querySelector('article').innerText : '';
  for (const marker of [':::', '|---|', '```']) {
    const i = text.indexOf(marker);
    if (i >= 0) out.raw.push({marker: marker, context: text.slice(Math.max(0, i - 40), i + 40)});
  }
  for (const p of document.querySelectorAll('article p')) {  // a Markdown list that became a paragraph
    if (p.closest('li, td')) continue;
    for (const line of p.innerText.split(String.fromCharCode(10))) {
      if (/^(- |\\d+\\. )\\S/.test(line)) out.raw.push({marker: 'list in a paragraph', context: line.slice(0, 60)});
    }
  }
  for (const a of document.querySelectorAll('article a[href]')) {
    const url = new URL(a.getAttribute('href'), location.href);
    if (url.origin === location.origin) out.links.push(url.href);
  }
  return out;
}
"""


def nav_pages(config: dict) -> list[str]:
    """The Markdown files of the nav, in order."""
    pages = []

    def walk(items):
        for item in items:
            value = item if isinstance(item, str) else next(iter(item.values()))
            if isinstance(value, list):
                walk(value)
            else:
                pages.append(value)

    walk(config["nav"])
    return pages


def page_url(base: str, md: str) -> str:
    """The served URL of ``md`` with mkdocs' directory URLs (``index.md`` -> ``/``, ``x.md`` -> ``/x/``)."""
    stem = md[: -len(".md")]
    return base + ("" if stem == "index" else stem + "/")


def serve(folder: str) -> tuple[str, http.server.ThreadingHTTPServer]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):  # one line per request would bury the report
            pass

    handler = functools.partial(Quiet, directory=folder)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/", server


class _Loader(yaml.SafeLoader):
    """mkdocs.yml may hold ``!!python/name:`` tags (e.g. for extensions): read them as plain strings."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chromium", default="/usr/bin/chromium", help="The Chromium executable.")
    parser.add_argument("--screenshots", default=None, help="Folder for the PNG screenshots (outside the repo).")
    parser.add_argument("--site", default=None, help="A built site folder (default: build one now, strict).")
    args = parser.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "mkdocs.yml")) as f:
        config = yaml.load(f, Loader=_Loader)
    site = args.site
    if site is None:
        site = tempfile.mkdtemp(prefix="trl_es_site_")
        subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", site], cwd=root, check=True)
    base, server = serve(site)
    from playwright.sync_api import sync_playwright

    report, problems = {}, 0
    pages = nav_pages(config)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        checked_links: dict[str, str | None] = {}
        for n, md in enumerate(pages, 1):
            for width_name, (width, height) in WIDTHS.items():
                page = browser.new_page(viewport={"width": width, "height": height})
                errors = []
                page.on("pageerror", lambda error, errors=errors: errors.append(str(error)))
                response = page.goto(page_url(base, md), wait_until="load")
                found = page.evaluate(FINDINGS_JS)
                links = found.pop("links")
                if args.screenshots:
                    os.makedirs(args.screenshots, exist_ok=True)
                    page.screenshot(path=os.path.join(args.screenshots, f"{md[:-3]}-{width_name}.png"), full_page=True)
                if width_name == "desktop":
                    for link in links:
                        target, _, anchor = link.partition("#")
                        key = link
                        if key not in checked_links:
                            probe = browser.new_page()
                            answer = probe.goto(target, wait_until="domcontentloaded")
                            problem = None
                            if answer is None or answer.status >= 400:
                                problem = f"HTTP {answer.status if answer else 'no answer'}"
                            elif anchor and not probe.evaluate("(a) => !!document.getElementById(a)", anchor):
                                problem = f"no anchor #{anchor}"
                            probe.close()
                            checked_links[key] = problem
                        if checked_links[key]:
                            found.setdefault("broken_links", []).append({"link": link, "problem": checked_links[key]})
                found["status"] = response.status if response else None
                if errors:
                    found["script_errors"] = errors
                entry = {k: v for k, v in found.items() if v and k != "status"}
                if found["status"] != 200:
                    entry["status"] = found["status"]
                problems += sum(len(v) if isinstance(v, list) else 1 for v in entry.values())
                report.setdefault(md, {})[width_name] = entry
                page.close()
            print(f"[{n}/{len(pages)}] {md}: {sum(bool(v) for v in report[md].values())} widths with findings",
                  file=sys.stderr)
        browser.close()
    server.shutdown()
    print(json.dumps({"pages": len(pages), "findings": problems, "report": report}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

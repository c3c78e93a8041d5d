"""scripts/docstring_shares.py counts docstring lines, comment lines, definitions and long docstrings as issue 59
measured them: checked on small files whose counts are known line by line."""

import os
import subprocess
import sys

from paths import REPO


sys.path.insert(0, os.path.join(REPO, "scripts"))

from docstring_shares import Shares, measure, measure_source, table  # noqa: E402


# 58 lines. Docstrings: module 1-2, short 10, essay 15-22, Holder 28-35 (its body ends at 43), fetch 42, seven 47-53.
# Comments: lines 4, 6, 23; a "#" inside a string or a docstring is not a comment.
SOURCE = '''"""Module docstring,
two lines."""

import os  # beside code

# on its own line


def short(x):
    """One line."""
    return x


def essay(x):
    """1: essay docstring, 8 lines, 2 lines of code below: long.
    2 # inside a docstring: not a comment
    3
    4
    5
    6
    7
    8."""
    y = x + 1  # why
    return y


class Holder:
    """1: 8 lines, and exactly 8 lines below (blank ones counted): long.
    2
    3
    4
    5
    6
    7
    8"""

    def method(self):
        value = "# a string, not a comment"
        return value

    async def fetch(self):
        """Nested, one line."""
        return os.sep


def seven(x):
    """1: 7 lines: not long, however short the code.
    2
    3
    4
    5
    6
    7"""
    return x


def undocumented():
    pass
'''


def test_counts_of_a_file_known_line_by_line():
    shares = measure_source(SOURCE)
    # docstrings: 2 (module) + 1 + 8 + 8 + 1 + 7; definitions: short, essay, Holder, method, fetch, seven,
    # undocumented; long: essay (8 >= 2) and Holder (8 >= 8)
    assert shares == Shares(files=1, lines=58, docstring_lines=27, comment_lines=3, definitions=7, long_docstrings=2)


def test_one_more_line_of_code_makes_a_docstring_not_long():
    # Holder's body gets a ninth line below its 8-line docstring; a module docstring is never a definition
    source = SOURCE.replace("        return value\n", "        value = value.strip()\n        return value\n")
    assert measure_source(source) == Shares(files=1, lines=59, docstring_lines=27, comment_lines=3, definitions=7,
                                            long_docstrings=1)
    assert measure_source('"""1\n2\n3\n4\n5\n6\n7\n8"""\nx = 1\n') == Shares(files=1, lines=9, docstring_lines=8)


def test_a_folder_is_summed_per_top_level_entry(tmp_path):
    (tmp_path / "sub" / "deep").mkdir(parents=True)
    (tmp_path / "top.py").write_text(SOURCE)
    (tmp_path / "sub" / "a.py").write_text("x = 1  # one\n")
    (tmp_path / "sub" / "deep" / "b.py").write_text('def f():\n    """Doc."""\n\n    # why\n    return 1\n')
    (tmp_path / "notes.txt").write_text("# not python\n")
    groups = measure(str(tmp_path))
    assert groups == {
        ".": Shares(files=1, lines=58, docstring_lines=27, comment_lines=3, definitions=7, long_docstrings=2),
        "sub": Shares(files=2, lines=6, docstring_lines=1, comment_lines=2, definitions=1),
    }
    rows = table(groups).splitlines()
    assert [row.split() for row in rows[1:]] == [
        [".", "1", "58", "27", "46.6", "3", "5.2", "7", "2"],
        ["sub", "2", "6", "1", "16.7", "2", "33.3", "1", "0"],
        ["total", "3", "64", "28", "43.8", "5", "7.8", "8", "2"],
    ]


def test_the_script_takes_a_file(tmp_path):
    path = tmp_path / "one.py"
    path.write_text(SOURCE)
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "docstring_shares.py"), str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert [row.split() for row in out.splitlines()[1:]] == [
        ["one.py", "1", "58", "27", "46.6", "3", "5.2", "7", "2"],
        ["total", "1", "58", "27", "46.6", "3", "5.2", "7", "2"],
    ]

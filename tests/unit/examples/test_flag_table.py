"""docs/gpt_example.md's flag table names every flag of the GPT example, and no other.

The table is the one description of the example's flags; README.md shows a few of them and
points to it. Both are read as text and checked against the example's own parser.
"""

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
FLAG = re.compile(r"`(--[a-z][a-z0-9-]*)")


def _parser_flags():
    if str(REPO / "examples") not in sys.path:
        sys.path.insert(0, str(REPO / "examples"))
    from gpt.arguments import _build_parser

    options = {opt for action in _build_parser()._actions for opt in action.option_strings}
    return {opt for opt in options if opt.startswith("--")} - {"--help"}


def _table_flags(markdown_path: Path):
    """The flags named in the first column of the markdown tables in ``markdown_path``."""
    flags = set()
    for line in markdown_path.read_text().splitlines():
        if line.startswith("| `--"):
            first_cell = line.split("|")[1]
            flags |= set(FLAG.findall(first_cell))
    return flags


def test_the_docs_table_and_the_parser_name_the_same_flags():
    table = _table_flags(REPO / "docs" / "gpt_example.md")
    parser = _parser_flags()
    omitted, unknown = sorted(parser - table), sorted(table - parser)
    assert not omitted, f"flags the example accepts but docs/gpt_example.md omits: {omitted}"
    assert not unknown, f"flags in docs/gpt_example.md the example does not accept: {unknown}"


def test_the_readme_shows_only_flags_the_example_accepts():
    readme = _table_flags(REPO / "README.md")
    assert {"--async-save", "--save"} <= readme
    assert not readme - _parser_flags(), sorted(readme - _parser_flags())

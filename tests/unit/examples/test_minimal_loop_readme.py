"""The README's "In a training loop" code is examples/minimal_loop.py's own lines.

The example runs at 2 ranks in tests/functional/test_minimal_loop.py; this check keeps
the README from drifting away from it: every line of code of the README's block (its
comments may differ) is a line of the example.
"""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _code(line):
    """The code of a line, stripped, without its comment ('' for none)."""
    return line.split("#")[0].strip()


def readme_loop_block():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## In a training loop", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "the README's training-loop section has no python block"
    return blocks[0]


def test_every_code_line_of_the_readme_loop_is_in_the_example():
    example = {_code(line) for line in (REPO / "examples" / "minimal_loop.py").read_text().splitlines()}
    readme_lines = [_code(line) for line in readme_loop_block().splitlines()]
    code = [line for line in readme_lines if line]
    assert len(code) >= 20, code  # the loop, its saves and the resume, not a fragment
    missing = [line for line in code if line not in example]
    assert not missing, f"README lines not in examples/minimal_loop.py: {missing}"


def test_the_readme_loop_saves_per_iteration_and_at_the_last_step():
    block = readme_loop_block()
    for needed in ("manager.prepare_save(iteration)", "manager.attach_commit(request, iteration)",
                   "iteration == args.train_iters", "range(start + 1, args.train_iters + 1)",
                   "AsyncCallsQueue(persistent=True)", "maybe_finalize_async_calls",
                   'getLogger("megatron_async").setLevel(logging.INFO)'):
        assert needed in block, needed

"""Tasks: seeded, disjoint splits; the MATH loader reads the Sanity-Test schema."""

import pytest

from app.tasks.problems import load_math, make_arithmetic
from tests.support import REPO

FIXTURE = REPO / "tests" / "data" / "math_sanity_sample.jsonl"


def test_arithmetic_splits_are_seeded_and_disjoint():
    a = make_arithmetic(2, 500, 100, seed=7)
    b = make_arithmetic(2, 500, 100, seed=7)
    assert [p.prompt for p in a.train] == [p.prompt for p in b.train]
    assert not {p.prompt for p in a.train} & {p.prompt for p in a.heldout}
    p = a.heldout[0]
    x, y = p.prompt.removeprefix("Compute ").split(".")[0].split("+")
    assert int(p.answer) == int(x) + int(y)
    assert make_arithmetic(2, 500, 100, seed=8).heldout != a.heldout


def test_arithmetic_refuses_impossible_splits():
    with pytest.raises(ValueError):
        make_arithmetic(1, 100, 10, seed=0)


def test_math_loader_reads_sanity_schema(tmp_path):
    splits = load_math(str(FIXTURE), num_heldout=2, seed=0)
    assert len(splits.train) == 4 and len(splits.heldout) == 2
    problem = splits.heldout[0]
    assert problem.prompt[0]["role"] == "user" and "boxed" in problem.prompt[0]["content"]
    golds = {p.answer for p in splits.train + splits.heldout}
    assert "\\frac{1}{2}" in golds and "81" in golds

    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [line for line in FIXTURE.read_text().splitlines() if line]
    import json

    pq.write_table(pa.Table.from_pylist([json.loads(r) for r in rows]), tmp_path / "m.parquet")
    assert len(load_math(str(tmp_path / "m.parquet"), 2, 0).train) == 4

    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n{"prompt": "y"}\n')
    with pytest.raises(ValueError, match="ground_truth"):
        load_math(str(tmp_path / "bad.jsonl"), 1, 0)

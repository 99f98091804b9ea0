"""docs/training.md's learning curve comes from a committed file: it must stay readable and ordered."""

from benchmarks.learning_curve import DEFAULT_POINTS, main


def test_the_committed_curve_prints_a_row_per_drafter_in_order_of_data(capsys):
    main(["--points", str(DEFAULT_POINTS)])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "M |" in line]
    tokens = [float(row.split("|")[2].strip().rstrip("M")) for row in rows]
    assert len(rows) >= 3 and tokens == sorted(tokens)

"""The house rules, held against the code: short functions, few parameters, imports one way."""

from pathlib import Path

from benchmarks.house import MAX_LINES, MAX_PARAMS, read

ROOT = Path(__file__).resolve().parent.parent


def test_no_function_is_too_long_or_takes_too_many_parameters_and_no_imports_run_in_a_circle():
    house = read(ROOT)
    assert house.long == [], f"functions over {MAX_LINES} lines"
    assert house.wide == [], f"functions over {MAX_PARAMS} parameters"
    assert house.cycles == []


def test_the_lower_floors_import_nothing_from_the_upper_ones():
    rooms = {(a, b) for a, b in read(ROOT).arrows}
    assert not {b for a, b in rooms if a == "protocol"}, "protocol knows nothing of the rest"
    assert {b for a, b in rooms if a == "dflash_kernels"} <= {"basics"}  # its cache is everyone's (basics.cache)
    assert not {b for a, b in rooms if a == "basics"}, "what every package stands on stands on nothing"
    assert {b for a, b in rooms if a == "draft_node"} <= {"protocol", "dflash_kernels", "basics"}, (
        "the drafter knows only the wire"
    )
    assert not {a for a, b in rooms if b in ("launch", "benchmarks") and a not in ("launch", "benchmarks")}
    two_way = sorted((a, b) for a, b in rooms if (b, a) in rooms and a < b)
    assert two_way == [], "floors that import each other (target_node.drafting and .decoding did, over DraftTree)"

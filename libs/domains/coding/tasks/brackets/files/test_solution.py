from solution import is_balanced


def test_simple():
    assert is_balanced("()")
    assert not is_balanced("(")

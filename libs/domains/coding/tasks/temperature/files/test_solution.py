from solution import convert


def test_boiling():
    assert convert(100, "C") == 212

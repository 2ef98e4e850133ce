from solution import from_roman


def test_small():
    assert from_roman("III") == 3

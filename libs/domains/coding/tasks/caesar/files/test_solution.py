from solution import decode, encode


def test_round_trip():
    assert decode(encode("hello", 3), 3) == "hello"

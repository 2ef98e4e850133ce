from solution import rle_decode, rle_encode


def test_encode():
    assert rle_encode("aaab") == "3a1b"


def test_decode():
    assert rle_decode("2x1y") == "xxy"

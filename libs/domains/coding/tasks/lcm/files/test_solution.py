from solution import gcd


def test_gcd():
    assert gcd(12, 18) == 6

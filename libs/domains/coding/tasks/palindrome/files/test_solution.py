from solution import is_palindrome


def test_simple():
    assert is_palindrome("level")
    assert not is_palindrome("python")

from solution import word_count


def test_repeat():
    assert word_count("the cat the") == {"the": 2, "cat": 1}
